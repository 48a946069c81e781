"""From a dry run's counts to the numbers EXPLAIN LLM prints: cache hits, tokens, model time.

The dry run (Planner.dry_run) knows, per call site, the rows it would be evaluated on, the
distinct argument tuples it would compute, in which batches, and a uniform sample of those
tuples. Here the sample becomes the calls the SQL functions would make (llmdb.functions.
row_call: the same requests and cache keys), tokenized by the backend, and is looked up in
the result cache. The batches then become requests for the engine's simulator (engine/sim.py:
the engine's own scheduler, limits and prefix caching, the cost model as its clock, as the
backend describes them), with the sampled prompts' token ids, all arriving at once, one batch
after the other as the planner submits them; the simulator's pool starts with the prompt
blocks the backend's prefix cache holds now, so a shared chat template or instruction counts
once, prompts an earlier query computed count as cached, and a suffix after a cached prefix
pays its attention over it.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any

from llmdb.backends import Backend, GenerationRequest
from llmdb.batch import Call
from llmdb.engine.costmodel import CostModel, load_cost_model
from llmdb.functions import row_call
from llmdb.session import Session

from .callsites import Site
from .learned import Learned, stable_hash
from .memo import SiteCounts, learn_key, thaw


@dataclass(frozen=True)
class Request:
    """One model request of a row, as the engine sees it."""

    ids: tuple[int, ...] | None  # prompt token ids (None: the backend gave a count only)
    tokens: int  # prompt tokens (a scored continuation included)
    output: int  # tokens generated (prefill-only requests: 1, as the engine counts steps)
    cacheable: int  # tokens a prefix hit may cover (the engine computes the rest)


@dataclass
class Row:
    requests: list[Request]
    cache_key: str | None


@dataclass
class SiteEstimate:
    rows: int = 0
    distinct: int = 0
    cache_hits: int = 0
    calls: int = 0  # model requests
    calibration_calls: int = 0  # of those, content-free priors (see SiteCounts.priors)
    prompt_tokens: int = 0
    output_tokens: int = 0
    model_s: float | None = None
    batches: list[int] = field(default_factory=list)


_override: CostModel | None = None  # set by use_cost_model
_default: CostModel | None = None  # the default engine's, loaded once


def cost_model(backend: Backend | None = None) -> CostModel:
    """The cost model estimates are timed with: one set by use_cost_model (tests,
    bench/explain.py), else the backend's (its engine's calibration for its model, dtype and
    device, or its labelled estimate), else that of the default engine on this CPU."""
    global _default
    if _override is not None:
        return _override
    sim = backend.simulation() if backend is not None else None
    if sim is not None:
        return sim.cost_model
    if _default is None:
        _default = load_cost_model()
    return _default


def use_cost_model(model: CostModel | None) -> None:
    """Estimate with `model`, e.g. a calibration file, whatever the engine; None: the
    engine's own again (and the default reloaded)."""
    global _override, _default
    _override, _default = model, None


def calibrated(model: CostModel) -> bool:
    return any(v > 0 for v in model.coefficients.values()) or model.floor_s > 0


def row_requests(site: Site, key: tuple, backend: Backend, lengths: list[int]) -> Row | None:
    """The requests and result-cache key of one row, as the SQL function would send them;
    None where the row makes no call, or fails when it runs (with its cause)."""
    args = dict(zip(site.signature.names, thaw(site.signature, key), strict=True))
    try:
        call = row_call(site.function, backend, args, "BE")
    except ValueError:
        return None
    if call is None:
        return None
    return Row(call_requests(call, backend, lengths[stable_hash(key) % len(lengths)]
                             if lengths else None), call.key)


def call_requests(call: Call, backend: Backend, length: int | None = None) -> list[Request]:
    """The call's requests as the engine sees them; a generation makes `length` tokens (a
    learned output length), else its max_tokens (no early end of turn)."""
    requests = []
    for r in call.requests:
        t = backend.tokenize(r)
        out = 1  # a scored or choice request computes its prompt only
        if isinstance(r, GenerationRequest):
            out = r.params.max_tokens if length is None else max(1, min(length,
                                                                        r.params.max_tokens))
        requests.append(Request(t.ids, t.count, out, t.cacheable))
    return requests


def pool_prefixes(requests: list[Request], backend: Backend) -> list[int]:
    """Prompt tokens of each request whose blocks the backend's prefix cache holds now
    (left by earlier queries)."""
    return [backend.cached_prefix(r.ids[:r.cacheable + 1]) if r.ids is not None else 0
            for r in requests]


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def shared_prefixes(requests: list[Request], block_size: int, held: list[int]) -> list[int]:
    """Prompt tokens of each request that other rows can share: the leading full blocks held
    in the pool or also leading another sampled request (a template, a system prompt)."""
    ids = [(r.ids or ())[:r.cacheable] for r in requests]
    # In sorted order, a sequence's longest common prefix with any other is with a neighbour.
    common = [0] * len(ids)
    for a, b in itertools.pairwise(sorted(range(len(ids)), key=ids.__getitem__)):
        n = _common_prefix(ids[a], ids[b])
        common[a], common[b] = max(common[a], n), max(common[b], n)
    return [max(h, c // block_size * block_size) for h, c in zip(held, common, strict=True)]


def _model_name(session: Session, site: Site, args: list[Any]) -> str | None:
    return args[site.signature.index("model")] or session.options.model


def estimate_site(session: Session, site: Site, counts: SiteCounts, learned: Learned, *,
                  observed: bool = False) -> SiteEstimate:
    """The estimate for a dry run's counts; with observed=True, the cost model's time for
    what a real run did (its cache hits, unscaled), to learn the time scale from."""
    est = SiteEstimate(rows=counts.rows, distinct=counts.distinct, batches=list(counts.batches))
    sample = [k for k in counts.sampled if k[0] is not None]
    if not sample or not counts.computed:
        est.model_s = 0.0
        return est
    backend = session.backend(_model_name(session, site, thaw(site.signature, sample[0])))
    lengths = learned.output_lengths(learn_key(session, site))
    rows = [r for r in (row_requests(site, k, backend, lengths) for k in sample) if r]
    if not rows:
        return est
    cache = None if observed else session.cache()
    keys = [r.cache_key for r in rows if r.cache_key is not None] + list(counts.priors)
    hits = cache.get_many(keys) if cache is not None and keys else {}
    hit_rate = sum(r.cache_key in hits for r in rows) / len(rows)
    if observed:
        hit_rate = min(1.0, counts.cache_hits / counts.calling)
    live = counts.calling  # (rows with a NULL argument make no call)
    est.cache_hits = round(live * hit_rate)
    requests = [q for r in rows for q in r.requests]
    per_row = len(requests) / len(rows)
    est.calls = round((live - est.cache_hits) * per_row)
    est.prompt_tokens = round(est.calls * sum(q.tokens for q in requests) / len(requests))
    if site.function == "llm_complete":  # prefill-only requests generate nothing counted
        est.output_tokens = round(est.calls * sum(q.output for q in requests) / len(requests))
    share = (live - est.cache_hits) / counts.computed
    # What a real run found in the prefix cache is known; replaying the pool after it would
    # find its own blocks.
    cached = [round(counts.cached_tokens / counts.calls)] * len(requests) \
        if observed and counts.calls else None
    est.model_s = model_time(backend, counts.batches, share, per_row, requests, cached)
    _add_calibration(est, backend, [c for k, c in counts.priors.items() if k not in hits])
    if est.model_s is not None and not observed:
        est.model_s *= learned.time_scale(backend.name)[0]
    return est


def _add_calibration(est: SiteEstimate, backend: Backend, priors: list[Call]) -> None:
    """The content-free priors the query measures: their requests, tokens and time, as a
    batch of their own before the rows' (as the SQL functions send them)."""
    requests = [q for c in priors for q in call_requests(c, backend)]
    if not requests:
        return
    est.calibration_calls = len(requests)
    est.calls += len(requests)
    est.prompt_tokens += sum(q.tokens for q in requests)
    if est.model_s is not None:
        more = model_time(backend, [1], 1.0, len(requests), requests)
        est.model_s = None if more is None else est.model_s + more


def model_time(backend: Backend, batches: list[int], share: float, per_row: float,
               requests: list[Request], cached: list[int] | None = None) -> float | None:
    """Simulated seconds for the batches (of rows), each submitted when the previous one is
    done; `share` of the rows miss the result cache, each sending `per_row` requests like
    the sampled ones (cycled through in order).

    The simulator gets the sampled prompts' own token ids and the engine's prefix caching, so
    a shared template is computed once and a suffix after a cached prefix pays attention over
    it, as in the engine. Its pool starts with the prefixes the backend's cache holds now,
    or, for a run already made, with each request's first `cached` tokens (what it found). A
    sampled request used again stands for another row: it keeps only its shareable prefix."""
    sim, cm = backend.simulation(), cost_model(backend)
    if sim is None or not calibrated(cm):
        return None
    from llmdb.engine.research.sim import simulate
    from llmdb.engine.research.workloads import RequestSpec

    block = sim.config.block_size
    caching = sim.config.prefix_caching and all(r.ids is not None for r in requests)
    held = [0] * len(requests)
    if caching:
        held = cached if cached is not None else pool_prefixes(requests, backend)
    shared = shared_prefixes(requests, block, held) if caching else held
    # Prefixes in the pool when a batch starts (an ordered set): what the engine holds now,
    # then what earlier batches computed that later rows share.
    seeds = dict.fromkeys(tuple(r.ids[:h]) for r, h in zip(requests, held, strict=True) if h)
    total, j = 0.0, 0
    for b in batches:
        specs, used = [], set()
        for _ in range(round(b * share * per_row)):
            k, cycle = j % len(requests), j // len(requests)
            r = requests[k]
            ids = None
            if caching:
                ids = list(r.ids)
                if cycle:  # another row: distinct tokens after its shareable prefix
                    ids[shared[k]:] = [-(cycle * 1_000_000 + t) for t in ids[shared[k]:]]
                used.add(k)
            specs.append(RequestSpec(0.0, r.tokens, r.output, "BE", f"e{j}",
                                     prompt_ids=None if ids is None else tuple(ids)))
            j += 1
        if not specs:
            continue
        cfg = dataclasses.replace(sim.config, prefix_caching=caching,
                                  cached_prefixes=list(seeds))
        total += simulate(specs, sim.policy, cm, cfg).end_time
        seeds.update(dict.fromkeys(tuple(requests[k].ids[:shared[k]]) for k in sorted(used)
                                   if shared[k]))
    return total
