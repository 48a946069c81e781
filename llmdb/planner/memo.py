"""The lookups a rewritten query calls instead of the LLM functions, and the query's memo.

`__llmdb_site_<session>_<function>(qid, tag, args...)` has the LLM function's parameters plus
the query run and the site (tag: 'llmdb site <id> <role>', the role telling the site itself
from a copy of it inside another site's guard; guards.tag). It answers from the run's memo:
argument tuple -> value, filled by the planner's driver queries in one batch per site. A miss
computes the value through the same row-level function the SQL function uses (so dedup, the
result cache, errors and stats all apply) and remembers it: identical calls are computed
once per query. A site in "strict" mode answers a miss with NULL instead (ORDER BY ... LIMIT
evaluation, where rows past the first k passing ones are never computed and cannot reach
the result).

A run in dry mode (EXPLAIN) never calls a model: it answers with values drawn from what the
site returned in earlier queries (or a neutral default) and counts what would be computed.
"""

from __future__ import annotations

import inspect
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import duckdb
import pyarrow as pa

from llmdb.batch import Call
from llmdb.functions import (
    FUNCTIONS,
    PRIORITY,
    RT_MAX_CALLS,
    SqlFunction,
    passes,
    unmeasured_priors,
)
from llmdb.session import Session, Stats

from .callsites import SIGNATURES, Site
from .guards import MAIN, lookup_name, parse_tag
from .learned import LEARNED, PRIOR_WEIGHT, Learned, stable_hash

_FILTER, _SCORE = "llm_filter", "llm_filter_score"

ARROW_TYPES = {"BOOLEAN": pa.bool_(), "DOUBLE": pa.float64(), "VARCHAR": pa.string(),
               "INTEGER": pa.int32()}
KEPT_RUNS = 16  # runs whose lookups may still execute (a lazy relation fetched later)
SAMPLED_KEYS = 64  # argument tuples kept per site for token and cache estimates


@dataclass
class SiteCounts:
    """What a site did (or, in a dry run, would do) in one run of a query."""

    rows: int = 0  # rows it was evaluated on (its guard TRUE)
    distinct: int = 0  # distinct argument tuples among them without a NULL (those are prompts)
    computed: int = 0  # tuples sent to the model path (not already in the query's memo)
    calling: int = 0  # of those, the tuples that call the model (no NULL argument)
    # Model requests those take before the result cache (NULLs take none), and the priors'.
    requests: int = 0
    # The content-free priors of filter and classify templates first needed here that this
    # process had not measured yet, by key (functions.unmeasured_priors): the query's calls
    # too, made before its rows (unless the result cache holds them).
    priors: dict[str, Call] = field(default_factory=dict)
    batches: list[int] = field(default_factory=list)  # sizes of those sends
    calls: int = 0  # model requests (stats of the row functions)
    calibration_calls: int = 0  # of those, the priors'
    cache_hits: int = 0
    dedup_hits: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the engine's prefix cache served
    errors: int = 0  # rows that failed
    model_s: float = 0.0
    sampled: list[tuple] = field(default_factory=list)  # a uniform sample of computed tuples


def freeze(v: Any) -> Any:
    if isinstance(v, list | tuple):
        return tuple(freeze(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((k, freeze(x)) for k, x in v.items()))
    return v


def thaw(sig: SqlFunction, key: tuple) -> list[Any]:
    return [list(v) if p.sql_type.endswith("[]") and v is not None else v
            for p, v in zip(sig.params, key, strict=True)]


class QueryRun:
    """One execution (or dry run) of a planned query: its memo, modes and counts."""

    def __init__(self, qid: int, sites: list[Site], session: Session, *, dry: bool = False,
                 learned: Learned = LEARNED):
        self.qid = qid
        self.sites = {s.id: s for s in sites}
        self.session = session
        self.dry = dry
        self.learned = learned
        self.modes = {s.id: "lazy" for s in sites}
        self.memo: dict[tuple, Any] = {}
        self.counts = {s.id: SiteCounts() for s in sites}
        self._seen: dict[int, set[tuple]] = {s.id: set() for s in sites}
        self._priors: set[str] = set()  # keys of the priors some site's counts hold
        self._lock = threading.Lock()
        # Tuples being computed, by memo key: DuckDB evaluates a query's pipelines on
        # several threads, and a lookup that misses a tuple another thread is computing
        # waits for it rather than computing it again (a scalar subquery that is also the
        # ORDER BY key of a top-rows QUALIFY ran twice at once: 180 calls for 90).
        self._pending: dict[tuple, threading.Event] = {}
        self.prefetched: set[int] = set()  # sites a driver computed (it counts their rows)

    # ---- the memo ------------------------------------------------------------------------

    def _memo_key(self, site: Site, key: tuple) -> tuple:
        return (site.function, key)

    def _known(self, site: Site, key: tuple) -> tuple[bool, Any]:
        """(whether the memo answers this tuple, the answer); the lock is held. llm_filter
        is llm_filter_score >= 0.5 over the same arguments: a score answers a filter."""
        mk = self._memo_key(site, key)
        if mk in self.memo:
            return True, self.memo[mk]
        if site.function == _FILTER and (_SCORE, key) in self.memo:
            return True, passes(self.memo[(_SCORE, key)])
        return False, None

    def lookup(self, site_id: int, role: str, keys: list[tuple]) -> list[Any]:
        """Values for a vector of rows (the UDF path)."""
        site = self.sites[site_id]
        out: list[Any] = [None] * len(keys)
        missing: dict[tuple, list[int]] = {}
        with self._lock:
            if role == MAIN and site_id not in self.prefetched:  # else its driver counted
                self._count_rows(site, keys)
            for i, k in enumerate(keys):
                known, value = self._known(site, k)
                if known:
                    out[i] = value
                else:
                    missing.setdefault(k, []).append(i)
        if missing and self.modes[site_id] != "strict":  # a dry run as a real one would
            for k, v in self._compute_once(site, list(missing)).items():
                for i in missing[k]:
                    out[i] = v
        return out

    def _compute_once(self, site: Site, keys: list[tuple]) -> dict[tuple, Any]:
        """Values for tuples the memo lacked: those no other thread is computing are
        computed here; the others are waited for (and computed here after all where that
        thread failed)."""
        with self._lock:
            known = {k: v for k in keys for ok, v in [self._known(site, k)] if ok}
            mine = [k for k in keys if k not in known and
                    self._memo_key(site, k) not in self._pending]
            theirs = [self._pending[self._memo_key(site, k)] for k in keys
                      if k not in known and k not in mine]
            for k in mine:
                self._pending[self._memo_key(site, k)] = threading.Event()
        try:
            if mine:
                known.update(zip(mine, self.compute(site, mine), strict=True))
        finally:
            with self._lock:
                for k in mine:
                    self._pending.pop(self._memo_key(site, k)).set()
        for event in theirs:
            event.wait()
        with self._lock:
            for k in keys:
                if k not in known:
                    ok, v = self._known(site, k)
                    if ok:
                        known[k] = v
        rest = [k for k in keys if k not in known]
        if rest:  # (the thread computing them failed: this one meets its error too)
            known.update(zip(rest, self.compute(site, rest), strict=True))
        return known

    def fill(self, site: Site, rows: Sequence[tuple[tuple, int]], count_rows: bool = True
             ) -> None:
        """Compute a driver query's (argument tuple, row count) rows in one batch."""
        with self._lock:
            self.prefetched.add(site.id)
            self._count(site, rows, count_rows)
            missing = [k for k, _ in rows if not self._known(site, k)[0]]
        if missing:
            self.compute(site, missing)

    def _count_rows(self, site: Site, keys: list[tuple]) -> None:
        self._count(site, [(k, 1) for k in keys], True)

    def _count(self, site: Site, rows: Sequence[tuple[tuple, int]], count_rows: bool) -> None:
        """Rows per argument tuple (the lock is held). Rows repeating a tuple are answered
        from the memo, and the row functions see each tuple once, so the repeats are counted
        in the session's stats here: rows, and dedup_hits."""
        c, seen, repeats = self.counts[site.id], self._seen[site.id], 0
        for key, n in rows:
            if count_rows:
                c.rows += n
            first = key not in seen
            if first:
                seen.add(key)
            if _null(site, key):  # (no prompt, no call)
                continue
            c.distinct += first
            repeats += n - first
        if repeats and count_rows and not self.dry:
            self.session.record(Stats(rows=repeats, dedup_hits=repeats))

    # ---- computing -----------------------------------------------------------------------

    def compute(self, site: Site, keys: list[tuple]) -> list[Any]:
        counts = self.counts[site.id]
        sig = site.signature
        priors = unmeasured_priors(self.session, site.function, [
            dict(zip(sig.names, thaw(sig, k), strict=True)) for k in keys]) if sig.prior else {}
        with self._lock:
            new = {k: c for k, c in priors.items() if k not in self._priors}
            self._priors.update(new)
            counts.priors.update(new)
            counts.computed += len(keys)
            counts.calling += sum(not _null(site, k) for k in keys)
            counts.requests += sum(requests_per_call(site, k) for k in keys) + sum(
                len(c.requests) for c in new.values())
            counts.batches.append(len(keys))
            self._sample(counts, keys)
            priority = site.priority or self.session.options.priority or self._query_class()
        if self.dry:
            values = self._pseudo(site, keys)
        else:
            values = self._call(site, keys, counts, priority)
        with self._lock:
            for k, v in zip(keys, values, strict=True):
                self.memo[self._memo_key(site, k)] = v
        return values

    def total_requests(self) -> int:
        """Model requests the computed tuples take (a classify scores every label)."""
        with self._lock:
            return sum(c.requests for c in self.counts.values())

    def _query_class(self) -> str:
        """RT while the query's requests so far, the batch being sent included, stay within
        RT_MAX_CALLS; BE from the batch that goes past. A driver sends each site's rows as
        one batch, so a bulk query is BE from its first large batch (the lock is held)."""
        return "RT" if sum(c.requests for c in self.counts.values()) <= RT_MAX_CALLS else "BE"

    def _sample(self, counts: SiteCounts, keys: list[tuple]) -> None:
        """Reservoir sampling over the tuples this site computed (counts.computed of them,
        the last len(keys) being these), with a hash of the tuple as the random draw."""
        first = counts.computed - len(keys)
        for i, k in enumerate(keys):
            seen = first + i + 1
            if len(counts.sampled) < SAMPLED_KEYS:
                counts.sampled.append(k)
            else:
                j = stable_hash((k, seen)) % seen
                if j < SAMPLED_KEYS:
                    counts.sampled[j] = k

    def _call(self, site: Site, keys: list[tuple], counts: SiteCounts, priority: str
              ) -> list[Any]:
        # A filter asks for the scores (the same model call) and keeps them: a score site
        # over the same rows (SELECT llm_filter_score(p) ... WHERE llm_filter(p)) reuses them.
        fn = FUNCTIONS[_SCORE].rows if site.function == _FILTER else site.signature.rows
        columns = [list(col) for col in zip(*(thaw(site.signature, k) for k in keys),
                                            strict=True)]
        before = self.session.stats()["total"]
        token = PRIORITY.set(priority)
        try:
            values = fn(self.session, *columns)
        finally:
            PRIORITY.reset(token)
            after = self.session.stats()["total"]
            with self._lock:
                counts.calls += after["calls"] - before["calls"]
                counts.calibration_calls += (after["calibration_calls"]
                                             - before["calibration_calls"])
                counts.cache_hits += after["cache_hits"] - before["cache_hits"]
                counts.dedup_hits += after["dedup_hits"] - before["dedup_hits"]
                counts.prompt_tokens += after["prompt_tokens"] - before["prompt_tokens"]
                counts.generated_tokens += after["generated_tokens"] - before["generated_tokens"]
                counts.cached_tokens += after["cached_tokens"] - before["cached_tokens"]
                counts.errors += after["errors"] - before["errors"]
                counts.model_s += after["engine_s"] - before["engine_s"]
        if site.function == _FILTER:
            with self._lock:
                self.memo.update(((_SCORE, k), v) for k, v in zip(keys, values, strict=True))
            values = [passes(v) for v in values]
        key = self.learn_key(site)
        self.learned.observe_values(key, [v for v in values if v is not None])
        if site.function == "llm_complete":
            self._learn_lengths(site, key, values, before, after)
        return values

    def _learn_lengths(self, site: Site, key: str, values: list[Any], before: dict,
                       after: dict) -> None:
        """Output lengths per call, from the answers' tokens, scaled so that they add up to
        the tokens the model generated (an end of turn is generated but not returned)."""
        texts = [v for v in values if v is not None]
        if not texts:
            return
        backend = self.session.backend(key.split("\x1f", 1)[0])
        lengths = backend.count_tokens(texts)
        generated = (after["generated_tokens"] - before["generated_tokens"]
                     + after["resumed_tokens"] - before["resumed_tokens"])
        served = (after["cache_hits"] - before["cache_hits"]) + (after["dedup_hits"]
                                                                 - before["dedup_hits"])
        scale = generated / sum(lengths) if not served and sum(lengths) else 1.0
        self.learned.observe_output_lengths(key, [max(1, round(n * scale)) for n in lengths])

    def learn_key(self, site: Site) -> str:
        return learn_key(self.session, site)

    def _pseudo(self, site: Site, keys: list[tuple]) -> list[Any]:
        """Stand-in values for a dry run: what the site returned before, else a default."""
        sample = self.learned.value_sample(self.learn_key(site))
        # A small sample (a predicate seen on a few rows) is mixed with the neutral default.
        trust = len(sample) / (len(sample) + PRIOR_WEIGHT)
        out = []
        for k in keys:
            h = stable_hash(k)
            if k[0] is None:
                out.append(None)  # a NULL prompt gives NULL without a call
            elif sample and (h >> 20) % 1000 < trust * 1000:
                out.append(sample[h % len(sample)])
            else:
                out.append(_default_value(site, k, h))
        return out


def _null(site: Site, key: tuple) -> bool:
    """A NULL in a required argument: NULL without a model call."""
    return site.signature.null_row(dict(zip(site.signature.names, key, strict=True)))


def requests_per_call(site: Site, key: tuple) -> int:
    if key[0] is None:
        return 0
    if site.function == "llm_classify":  # each label under each rotation of the labels
        labels = key[site.signature.index("labels")]
        return len(labels) ** 2 if labels else 0
    if site.function in ("llm_filter", "llm_filter_score"):  # both answer orders
        return 2
    return 1


def learn_key(session: Session, site: Site) -> str:
    model = site.arg("model")
    name = model.this if getattr(model, "is_string", False) else session.options.model
    return f"{name}\x1f{site.key}"


def _default_value(site: Site, key: tuple, h: int) -> Any:
    u = (h % 1_000_003) / 1_000_003
    if site.function == "llm_filter":
        return u < 0.5
    if site.function == "llm_filter_score":
        return u
    if site.function == "llm_classify":
        labels = key[site.signature.index("labels")] or ("",)
        return labels[h % len(labels)]
    return f"~{h % 10_000}"


# ---- the registry of runs and the UDFs ---------------------------------------------------

class Runs:
    """The connection's recent runs by query id (lookups name theirs by id)."""

    def __init__(self) -> None:
        self._runs: OrderedDict[int, QueryRun] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, run: QueryRun) -> None:
        with self._lock:
            self._runs[run.qid] = run
            self._runs.move_to_end(run.qid)
            while len(self._runs) > KEPT_RUNS:
                self._runs.popitem(last=False)

    def get(self, qid: int) -> QueryRun | None:
        with self._lock:
            return self._runs.get(qid)


def _site_udf(sig: SqlFunction, runs: Runs, session: Session):
    fn = sig.rows
    out_type = ARROW_TYPES[sig.returns]

    def udf(qid: pa.Array, tag: pa.Array, *arrays: pa.Array) -> pa.Array:
        n = len(qid)
        if n == 0:
            return pa.array([], out_type)
        columns = [a.to_pylist() for a in arrays]
        run = runs.get(qid[0].as_py())
        if run is None:  # a run no longer kept: compute as the plain function would
            return pa.array(fn(session, *columns), out_type)
        site_id, role = parse_tag(tag[0].as_py())
        keys = [freeze(row) for row in zip(*columns, strict=True)]
        return pa.array(run.lookup(site_id, role, keys), out_type)

    names = ["qid", "tag", *sig.names]
    udf.__signature__ = inspect.Signature(
        [inspect.Parameter(n, inspect.Parameter.POSITIONAL_ONLY) for n in names])
    return udf


def register(con: duckdb.DuckDBPyConnection, runs: Runs, session: Session) -> list[str]:
    """The site lookups of the session's planner, as UDFs of `con`; their names."""
    names = []
    for sig in SIGNATURES.values():
        names.append(lookup_name(sig.name, session.id))
        con.create_function(names[-1], _site_udf(sig, runs, session),
                            ["INTEGER", "VARCHAR", *(p.udf_type for p in sig.params)],
                            sig.returns, type="arrow", null_handling="special",
                            side_effects=False)
    return names
