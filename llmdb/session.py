"""What a connection (or a DataFrame call) carries: options, counters, errors, the current
query's cancel token and progress bar.

Stats have two scopes: the whole session, and the last query that reached an LLM function.
A query scope begins at Connection.execute; its counters reset on the first LLM work in it,
so `SELECT llm_stats()` reports the query before it.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import sys
import threading
from collections import OrderedDict, deque
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from .backends import Backend
from .backends.endpoints import base_urls
from .backends.standin import STANDIN_MODEL, standin_backend
from .result_cache import DEFAULT_MAX_BYTES, ResultCache, open_cache

# Options of the openai backend (OpenAIBackend's, and ReplicaLimits' in replicas.py), besides
# endpoints and api_key_env.
REMOTE_OPTIONS = ("served_model", "max_concurrency", "requests_per_minute", "tokens_per_minute",
                  "timeout_s", "max_retries", "send_priority", "base_model", "stall_s",
                  "stall_factor")
ON_ERROR = ("raise", "null")
PROGRESS_MIN_ROWS = 32  # smaller jobs finish before a bar would be worth reading
# The bar is redrawn at most this often, as rows finish. (By time alone: tqdm's default
# waits for as many rows as its last step brought, which after a batch finishing together
# held the bar still for dozens of single rows.)
PROGRESS_REFRESH_S = 0.25
MAX_KEPT_ERRORS = 10_000
KEPT_DUCKDB_QUERIES = 8  # queries of one session that DuckDB may be running at once (cursors)


@dataclass
class Options:
    model: str = "smollm2-135m"
    on_error: str = "raise"  # raise: fail the query naming the row; null: NULL + llm_errors
    cache: bool = True  # False: no result cache; answers are reused within a query only
    cache_path: str | None = None  # None: the user cache dir (LLMDB_CACHE_DIR overrides)
    cache_max_bytes: int = DEFAULT_MAX_BYTES
    progress: bool | None = None  # None: a bar when stderr is a terminal
    priority: str | None = None  # RT or BE for every call; None: chosen per query
    sample_rows: int | None = None  # cap on the rows of samples.* tables (tests, demos)
    engine: dict[str, Any] = field(default_factory=dict)
    # Which backend runs the calls: None, the in-process engine (or what the model registry
    # names); "openai", the OpenAI-compatible `endpoints` (API key in the environment
    # variable api_key_env); or a Backend object for the connection's model.
    backend: Any = None
    endpoints: list[str] | None = None
    api_key_env: str | None = None
    remote: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> Options:
        """The session's options, the openai backend's; the others are the engine's
        (LLMEngine's arguments)."""
        names = {f.name for f in dataclasses.fields(cls)} - {"engine", "remote"}
        remote = {k: kwargs.pop(k) for k in list(kwargs) if k in REMOTE_OPTIONS}
        engine = {k: kwargs.pop(k) for k in list(kwargs) if k not in names}
        unknown = set(engine) - set(engine_options()) if engine else set()
        if unknown:
            raise TypeError(f"unknown llmdb option(s): {', '.join(sorted(unknown))}; engine "
                            f"options are {', '.join(engine_options())}; openai backend "
                            f"options are endpoints, api_key_env, {', '.join(REMOTE_OPTIONS)}")
        opts = cls(**kwargs, engine=engine, remote=remote)
        if opts.backend is None and opts.endpoints:
            opts.backend = "openai"
        if opts.backend == "openai" and not opts.endpoints:
            raise ValueError("backend='openai' needs endpoints=[URL, ...]")
        if isinstance(opts.endpoints, str):
            opts.endpoints = [opts.endpoints]
        if opts.endpoints:
            base_urls(opts.endpoints)  # checked here, not by the first query's rows
        if isinstance(opts.backend, str) and opts.backend not in ("local", "openai"):
            raise ValueError(f"backend must be 'local', 'openai' or a Backend object, got "
                             f"{opts.backend!r}")
        if (opts.endpoints or remote) and opts.backend != "openai":
            raise ValueError("endpoints and the openai backend's options need backend='openai'")
        if opts.on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {opts.on_error!r}")
        if opts.priority not in (None, "RT", "BE"):
            raise ValueError(f"priority must be 'RT', 'BE' or None, got {opts.priority!r}")
        size = opts.cache_max_bytes  # (checked here: a bad one would fail the first write)
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"cache_max_bytes must be a whole number of bytes above 0, got "
                             f"{size!r}")
        return opts


def engine_options() -> list[str]:
    """LLMEngine's keyword arguments. Asked only of a session given options that are not its
    own: importing the engine loads torch, which the hash stand-in never needs."""
    from llmdb.engine.engine import LLMEngine

    return [p for p in inspect.signature(LLMEngine).parameters if p != "model"]


@dataclass
class Stats:
    rows: int = 0  # non-NULL rows that reached an LLM function
    calls: int = 0  # model requests sent to the backend
    # Of those, the content-free priors of filter and classify templates (once per template
    # and process: functions.py's calibration), which belong to no row.
    calibration_calls: int = 0
    model_rows: int = 0  # rows the model computed (a row may take several requests)
    cache_hits: int = 0  # rows answered by the result cache
    dedup_hits: int = 0  # rows answered by an identical row of the query or in flight
    errors: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served by the engine's prefix cache
    # Answer tokens an earlier, cut-short run generated, that this one went on from.
    resumed_tokens: int = 0
    engine_s: float = 0.0  # wall time spent waiting for the model

    def add(self, other: Stats) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclass
class RowError:
    query_id: int
    function: str
    prompt: str  # the start of the row's prompt, to find the row
    error: str


class QueryCancelled(Exception):
    pass


@dataclass
class QueryMemory:
    """What one query's calls came to, by call key. DuckDB evaluates a call as often as the
    query names it per row (each item of an IN list, each branch of a WHERE's CASE), a
    failing constant call once per constant-folding attempt, and hands a UDF 2,048 rows at a
    time; the planner's lookups follow a failed driver. None of that reaches the model again:
    a failed call fails again with its error (counted and listed once), and with the result
    cache off an answer is reused. Only for the rest of the query: the next query tries a
    failed call again (the failure may have been transient), and cache=False asks afresh."""

    failed: dict[str, str] = field(default_factory=dict)
    answered: dict[str, Any] = field(default_factory=dict)  # with the result cache off


# The DuckDB query whose rows the SQL functions are computing, set around each call of their
# UDFs: its transaction's number, which the functions' macros pass as txid_current(). That is
# constant within a query and not volatile (current_query_id() is: DuckDB then evaluated a
# call that a SELECT list names twice twice, and an ORDER BY ... LIMIT's calls on every row),
# so the queries of one explicit transaction (BEGIN ... COMMIT) share it: a failure is tried
# again after the transaction, not in its next query.
DUCKDB_QUERY: ContextVar[int | None] = ContextVar("llmdb_duckdb_query", default=None)


_SESSION_IDS = itertools.count(1)


class Session:
    def __init__(self, options: Options | None = None):
        self.options = options or Options()
        # Process-unique: names this session's UDFs, which connections to one database share.
        self.id = next(_SESSION_IDS)
        self.total = Stats()
        self.last = Stats()
        self.errors: deque[RowError] = deque(maxlen=MAX_KEPT_ERRORS)
        self.query_id = 0
        self.cancel = threading.Event()
        self._fresh_query = False
        # What the calls of the query being run came to (see QueryMemory): while the
        # connection runs a query (execute, its fetches, sql's planning), its own; otherwise,
        # where DuckDB alone runs the functions (llmdb.register, a relation fetched later),
        # each DuckDB query's, by its transaction (see DUCKDB_QUERY).
        self._memory = QueryMemory()
        self._remembering = False
        self._duckdb_queries: OrderedDict[int, QueryMemory] = OrderedDict()
        self._lock = threading.Lock()
        self._cache: ResultCache | None = None
        self._bar: tqdm | None = None
        self._bar_total = 0
        self._bar_done = 0

    # ---- resources -----------------------------------------------------------------------

    def backend(self, model: str | None = None) -> Backend:
        """The backend for a registered model name (SQL never opens arbitrary paths)."""
        from .backends.remote_models import remote_models

        opts = self.options
        name = model or opts.model
        if name == STANDIN_MODEL:
            return standin_backend()
        if self._given_backend(name):
            return opts.backend
        if opts.backend == "openai":
            return self._openai(name, endpoints=opts.endpoints, api_key_env=opts.api_key_env,
                                **opts.remote)
        remote = remote_models()
        if name in remote:
            return self._openai(name, **remote[name])
        self.check_model(name)
        from .backends.local import local_backend

        return local_backend(name, **opts.engine)

    def _given_backend(self, name: str) -> bool:
        """Whether `name` runs on the Backend object passed as backend=."""
        backend = self.options.backend
        return backend is not None and not isinstance(backend, str) and \
            name == self.options.model

    def check_model(self, model: str | None = None) -> None:
        """Raises ValueError naming the registered models unless the model has a backend,
        without loading it: a misspelt name given to connect() failed every row of the
        first query instead (each one NULL under on_error='null')."""
        from llmdb.engine.registry import registered_models

        from .backends.remote_models import remote_models

        name = model or self.options.model
        if name == STANDIN_MODEL or self._given_backend(name) or \
                self.options.backend == "openai" or name in registered_models():
            return
        remote = remote_models()
        if name not in remote:
            raise ValueError(f"unknown model {name!r}; registered models: "
                             f"{', '.join(sorted({*registered_models(), *remote}))}")

    def _openai(self, name: str, **config: Any) -> Backend:
        try:
            from .backends.openai import openai_backend
        except ImportError as e:
            raise ValueError(f"the openai backend needs {e.name}: "
                             f"pip install 'llmdb[remote]'") from e

        return openai_backend(name, **config)

    def cache(self) -> ResultCache | None:
        """The result cache, held until release_cache (the process shares one per file)."""
        if not self.options.cache:
            return None
        if self._cache is None:
            self._cache = open_cache(self.options.cache_path, self.options.cache_max_bytes)
        return self._cache

    def release_cache(self) -> None:
        """The connection is closed: its cache file closes too unless another session
        (or a batch under way) uses it."""
        self._cache = None

    # ---- query scope ---------------------------------------------------------------------

    def begin_query(self, inspects: bool = False) -> None:
        """A query starts: last_query's counters are its own from now on (zero for a query
        that makes no model call), except in a query that reads llm_stats() or llm_errors()
        (inspects), which report the query before it until it makes a call of its own."""
        with self._lock:
            self.query_id += 1
            self._fresh_query = inspects
            if not inspects:
                self.last = Stats()
            self._memory = QueryMemory()
            self.cancel.clear()
            self._bar_total = self._bar_done = 0  # one progress bar per query

    @contextmanager
    def query(self) -> Iterator[None]:
        """One query's scope: last_query's counters and the progress bar are its own."""
        self.begin_query()
        try:
            yield
        finally:
            self.end_query()

    def end_query(self) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.close()
                self._bar = None

    def record(self, delta: Stats) -> None:
        with self._lock:
            if self._fresh_query:
                self.last, self._fresh_query = Stats(), False
            self.last.add(delta)
            self.total.add(delta)

    @contextmanager
    def remembering(self) -> Iterator[None]:
        """Within: the connection's query (since begin_query) remembers what its calls came
        to, across the statements it runs (the planner's driver queries, then the query)."""
        self._remembering = True
        try:
            yield
        finally:
            self._remembering = False

    def _query_memory(self, key: str | None) -> QueryMemory | None:
        """Where the query whose calls are being made remembers the call `key`; None: it
        does not (a call without a key, or outside a query). The lock is held."""
        if key is None:
            return None
        if self._remembering:
            return self._memory
        query = DUCKDB_QUERY.get()
        if query is None:
            return None
        memory = self._duckdb_queries.get(query)
        if memory is None:
            memory = self._duckdb_queries[query] = QueryMemory()
            while len(self._duckdb_queries) > KEPT_DUCKDB_QUERIES:
                self._duckdb_queries.popitem(last=False)
        return memory

    def failed_before(self, key: str | None) -> str | None:
        """The error of an identical call that failed earlier in this query."""
        with self._lock:
            memory = self._query_memory(key)
            return None if memory is None else memory.failed.get(key)

    def note_failure(self, key: str | None, error: str) -> str | None:
        """Remember the call's failure for the rest of the query. Returns the error noted
        first where a thread of the query failed the same call before (a copy of that call,
        counted and listed there), else None. (Checked and noted at once: two DuckDB threads
        failing one call both found no failure before theirs, and both listed it.)"""
        with self._lock:
            memory = self._query_memory(key)
            if memory is None:
                return None
            earlier = memory.failed.get(key)
            if earlier is None:
                memory.failed[key] = error
            return earlier

    def answered_before(self, key: str | None) -> tuple[bool, Any]:
        """(whether an identical call was answered earlier in this query, its answer), as far
        as the query remembers answers: with the result cache off (else the cache does)."""
        with self._lock:
            memory = self._query_memory(key)
            if memory is None or key not in memory.answered:
                return False, None
            return True, memory.answered[key]

    def note_answer(self, key: str | None, value: Any) -> None:
        if self.options.cache:
            return
        with self._lock:
            memory = self._query_memory(key)
            if memory is not None:
                memory.answered[key] = value

    def record_error(self, function: str, prompt: str, error: str) -> None:
        with self._lock:
            self.errors.append(RowError(self.query_id, function, prompt[:200], error))

    def absorb(self, other: Session) -> None:
        """Count `other`'s one finished query (a session made for one DataFrame call's
        options) as a query of this session: its counters and failed rows."""
        with other._lock:
            delta = Stats() if other._fresh_query else dataclasses.replace(other.last)
            errors = list(other.errors)
        with self._lock:
            self.query_id += 1
            self.last = delta
            self._fresh_query = False
            self.total.add(delta)
            self.errors.extend(dataclasses.replace(e, query_id=self.query_id) for e in errors)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"last_query": dataclasses.asdict(self.last),
                    "total": dataclasses.asdict(self.total)}

    # ---- progress ------------------------------------------------------------------------

    def progress_add(self, rows: int) -> None:
        """`rows` more model calls are on their way (the bar appears past a few dozen)."""
        with self._lock:
            self._bar_total += rows
            show = self.options.progress
            if show is None:
                show = sys.stderr.isatty() or _in_notebook()
            if self._bar is None and show and self._bar_total - self._bar_done > \
                    PROGRESS_MIN_ROWS:
                self._bar = tqdm(total=self._bar_total, initial=self._bar_done, unit="row",
                                 desc="llm", file=sys.stderr, leave=False, miniters=0,
                                 mininterval=PROGRESS_REFRESH_S)
            elif self._bar is not None:
                self._bar.total = self._bar_total
                self._bar.refresh()

    def progress_done(self, rows: int = 1) -> None:
        with self._lock:
            self._bar_done += rows
            if self._bar is not None:
                self._bar.update(max(0.0, self._bar_done - self._bar.n))
                if self._bar_done >= self._bar_total:
                    self._bar.close()
                    self._bar = None

    def progress_partial(self, rows: float) -> None:
        """The rows in flight amount to `rows` rows' work (their share of tokens generated)."""
        with self._lock:
            if self._bar is not None:
                self._bar.update(max(0.0, self._bar_done + rows - self._bar.n))


def _in_notebook() -> bool:
    """Run by a Jupyter kernel, whose stderr is not a terminal but shows a bar's updates."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return type(shell).__name__ == "ZMQInteractiveShell"
