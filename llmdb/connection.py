"""llmdb.connect() -> Connection: a DuckDB connection whose queries go through the planner.

DuckDB runs Python UDFs on worker threads and on the thread that called execute or fetch
(results stream: later vectors are computed while fetching), where a KeyboardInterrupt cannot
reach a UDF stuck waiting for the model. So execute and the fetch methods run DuckDB on a
helper thread and wait on it; Ctrl-C (or interrupt()) sets the query's cancel token, which
the UDFs check every 100 ms, and interrupts DuckDB. The query's model requests are aborted
and their blocks freed; rows that completed stay in the result cache.
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import duckdb

from . import functions, relation, samples
from .batch import LLMError
from .planner import Planner, Report, explain
from .planner.callsites import draws_per_row
from .planner.run import Prepared, bind_as_written
from .scope import ScopedConnection, caller_frame, tables_named
from .session import Options, QueryCancelled, Session

# `EXPLAIN LLM <query>`: the planner's report on the query's model calls (not DuckDB syntax),
# after any comments (a job file's header).
EXPLAIN_LLM = re.compile(r"^(?:\s|--[^\n]*(?:\n|$)|/\*.*?\*/)*EXPLAIN\s+LLM\s+(?P<query>.*?)"
                         r"\s*;?\s*$", re.I | re.S)
_EXPLAIN_VIEW = "__llmdb_explain"
# A query that reads llm_stats() or llm_errors(): they report the query before it.
_INSPECTS = re.compile(r"\bllm_(?:stats|errors)\s*\(", re.I)


def check_one_statement(query: str) -> None:
    """EXPLAIN LLM's query: one statement that DuckDB parses (else the report would be of
    the first one only, or say that a query which cannot run "runs as written")."""
    count = len(duckdb.extract_statements(query))  # (a syntax error: DuckDB's own)
    if count != 1:
        raise ValueError(f"EXPLAIN LLM explains one statement, not {count}; run the others "
                         "apart")


class RowCallError(LLMError, duckdb.InvalidInputException):
    """A row's model call failed inside a query: an llmdb.LLMError, and the
    duckdb.InvalidInputException DuckDB raises for a failing UDF (the message is the row's)."""


class ArgumentTypeError(duckdb.InvalidInputException):
    """A wrong argument type to an llm_* function: the duckdb.InvalidInputException DuckDB
    raises for it, with llmdb's message alone (naming the function and the parameter)."""


class QueryInterrupted(QueryCancelled, duckdb.InterruptException):
    """The query was cancelled: an llmdb.QueryCancelled, and still DuckDB's interrupt."""


# How DuckDB reports an exception raised in a Python UDF.
_UDF_ERROR = re.compile(r"executing the UDF: (?P<kind>LLMError|QueryCancelled): (?P<msg>.*)",
                        re.S)


def _as_llmdb_error(e: BaseException) -> BaseException:
    """A failed row or a cancel as the llmdb type users catch, also the DuckDB error it is
    inside a query: raised by the planner's prefetch as itself, or by DuckDB around the
    exception of a UDF. A wrong argument type: its message without DuckDB's prefix."""
    if isinstance(e, RowCallError | QueryInterrupted | ArgumentTypeError):
        return e
    if isinstance(e, LLMError):
        return RowCallError(str(e))
    if isinstance(e, QueryCancelled | duckdb.InterruptException):
        return QueryInterrupted("the query was cancelled")
    if (message := functions.argument_error(e)) is not None:
        return ArgumentTypeError(message)
    if isinstance(e, duckdb.Error) and (m := _UDF_ERROR.search(str(e))):
        if m["kind"] == "QueryCancelled":
            return QueryInterrupted(m["msg"])
        return RowCallError(m["msg"])
    return e


class Connection:
    """A DuckDB connection with the llm_* functions; other methods pass through to DuckDB.
    A failed row raises llmdb.LLMError and a cancelled query llmdb.QueryCancelled (both
    also the DuckDB exception they used to be)."""

    def __init__(self, database: str = ":memory:", model: str = "smollm2-135m", *,
                 read_only: bool = False, config: dict | None = None, planner: bool = True,
                 **options: Any):
        self._setup(duckdb.connect(database, read_only=read_only, config=config or {}),
                    Session(Options.from_kwargs(model=model, **options)), planner)
        if self.session.options.engine:
            self.session.backend()  # start now: contradicting options fail at connect
        else:
            self.session.check_model()

    def _setup(self, con: duckdb.DuckDBPyConnection, session: Session, planner: bool) -> None:
        self.session = session
        self._con = ScopedConnection(con)
        # DuckDB's own bar writes to stdout even into a pipe, mixing with the results; llmdb
        # shows its bar for model work on stderr instead (SET enable_progress_bar reverts).
        self._con.execute("SET enable_progress_bar = false")
        self._udfs = functions.register(self._con, self.session)
        # planner=False runs every query as written (DuckDB decides where the calls run).
        self.planner = Planner(self._con, self.session) if planner else None
        if self.planner is not None:
            self._udfs += self.planner.udfs

    def cursor(self) -> Connection:
        """Another connection to the same database (DuckDB's cursor, for another thread or a
        second open result), with the llm_* functions and this connection's options and
        model. Its queries, stats and errors are its own."""
        cur = Connection.__new__(Connection)
        cur._setup(self._con.con.cursor(), Session(self.session.options), self.planner is not None)
        return cur

    # ---- queries -------------------------------------------------------------------------

    @contextmanager
    def _tables(self, query: str, frame: FrameType | None) -> Iterator[None]:
        """While the query is planned and bound: the tables it names that DuckDB would not
        find on its own. llmdb's sample tables (attached), and the pandas/polars/Arrow
        tables of the user's frame (see scope.py; not kept past the query)."""
        names = samples.referenced(query)
        if names:
            samples.attach(self._con, names, self.session.options.sample_rows)
        # (A query without LLM calls runs as written, once: a stream is left to DuckDB.)
        self._con.tables = tables_named(query, frame, read_streams="llm_" in query.lower())
        try:
            yield
        except duckdb.CatalogException as e:
            named = samples.unknown_table(self._con, query, e)
            if named is None:
                raise
            raise named from e
        finally:
            self._con.tables = {}

    def _planned(self, query: str, parameters: Any = None) -> str:
        """The SQL to run: the planner's rewrite, its calls prefetched (on the query thread);
        else the query as written (draws_per_row)."""
        prepared = self.planner.rewrite(query, parameters) if self.planner else None
        if prepared is None:
            return self._as_written(query, parameters)
        self.planner.prefetch(prepared)
        return prepared.sql

    def _as_written(self, query: str, parameters: Any = None) -> str:
        """The statement run unplanned: its calls that draw per row renamed (draws_per_row:
        sqlglot's text), where DuckDB takes the statement as written (else DuckDB's error)."""
        renamed = draws_per_row(query)
        if renamed != query:
            bind_as_written(self._con, query, parameters)
        return renamed

    def execute(self, query: str, parameters: Any = None) -> Connection:
        explained = EXPLAIN_LLM.match(query)
        if explained:
            self._con.register(_EXPLAIN_VIEW, self.explain_report(explained["query"]).table())
            self._con.execute(f"SELECT * FROM {_EXPLAIN_VIEW}")
            return self
        with self._tables(query, caller_frame()):
            self.session.begin_query(bool(_INSPECTS.search(query)))
            self._run(lambda: self._con.execute(self._planned(query, parameters), parameters))
        return self

    def executemany(self, query: str, parameters: Iterable[Any] | None = None) -> Connection:
        """DuckDB's executemany: the statement once per parameter set, each as execute runs
        it (planned, cancellable, a query of llm_stats()); the last set's rows are left to
        fetch. An interrupt stops the sets after the cancelled one."""
        sets = list(parameters or [])
        if not sets:  # (DuckDB's own error: it wants a non-empty list)
            self._con.executemany(query, sets)
        for values in sets:
            self.execute(query, values)
        return self

    def sql(self, query: str, **kwargs: Any) -> duckdb.DuckDBPyRelation | None:
        """A lazy DuckDB relation: the planner plans the query now, and makes its model calls
        when the relation's rows are read (see relation.py; with DuckDB 1, now). A statement
        that is not a query (CREATE TABLE AS, INSERT) runs now, as DuckDB runs it."""
        # DuckDB refuses to run a relation while an execute() result is unread; llmdb's
        # preparatory queries would throw that result away instead. A trivial one asks DuckDB.
        self._con.sql("SELECT 1").fetchall()
        explained = EXPLAIN_LLM.match(query)
        if explained:
            # A relation of its own: not an execute() result (DuckDB 2 refuses other work on
            # a connection while one is unread), nor a shared view (relations run again on
            # each fetch, and would show the latest report).
            return self._con.from_arrow(self.explain_report(explained["query"]).table())
        with self._tables(query, caller_frame()):
            self.session.begin_query(bool(_INSPECTS.search(query)))
            prepared = self._run(lambda: self.planner.rewrite(query, kwargs.get("params"))) \
                if self.planner else None
            if prepared is None:
                return self._con.sql(self._as_written(query, kwargs.get("params")), **kwargs)
            if prepared.plan.writes or not relation.LAZY_READS:
                self._run(lambda: self.planner.prefetch(prepared))
                return self._con.sql(prepared.sql, **kwargs)
            rel = self._con.sql(prepared.sql, **kwargs)
            tables = self._con.tables
        return relation.planned(rel, {functools.partial(self._read_calls, prepared, tables): True})

    def _read_calls(self, prepared: Prepared, tables: dict[str, Any], whole: bool) -> None:
        """Before a read of a relation of sql(): its query's calls (whole: the relation's
        own read, else a read of one built on it; see relation.py). Under the tables of
        the user's frame that sql() found, which its driver queries name."""
        self._con.sql("SELECT 1").fetchall()  # (an unread execute() result: as in sql())
        outer, self._con.tables = self._con.tables, tables
        try:
            self.session.begin_query(bool(_INSPECTS.search(prepared.plan.written_sql)))
            self._run(lambda: self.planner.prefetch(prepared, whole))
        finally:
            self._con.tables = outer

    query = sql

    # ---- EXPLAIN LLM ---------------------------------------------------------------------

    def explain_report(self, query: str) -> Report:
        """Per call site: estimated rows, prompts, cache hits, tokens, model time and
        priority; next to what the query did when it last ran on this connection. A query
        DuckDB cannot parse raises DuckDB's error, several statements a ValueError."""
        check_one_statement(query)
        if self.planner is None:
            return Report(query, notes=["the planner is off on this connection"])
        with self._tables(query, caller_frame()):
            return self._run(lambda: explain(self.planner, query))

    def explain(self, query: str) -> str:
        """explain_report as text (what `llmdb explain` prints)."""
        return self.explain_report(query).text()

    def _run(self, work: Any) -> Any:
        result: list[Any] = []
        failure: list[BaseException] = []
        # Waited on instead of Thread.join: a join interrupted by Ctrl-C marks the thread as
        # stopped while it still runs (CPython < 3.12), so a second join would not wait.
        done = threading.Event()

        def target() -> None:
            try:
                with self.session.remembering():
                    result.append(work())
            except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
                failure.append(e)
            finally:
                done.set()

        worker = threading.Thread(target=target, name="llmdb-query", daemon=True)
        worker.start()
        try:
            while not done.wait(0.1):
                pass
        except KeyboardInterrupt:
            self.interrupt()
            done.wait()
            raise
        finally:
            self.session.end_query()
        if failure:
            raise _as_llmdb_error(failure[0]) from failure[0]
        return result[0]

    def interrupt(self) -> None:
        """Cancel the running query: abort its model requests and interrupt DuckDB."""
        self.session.cancel.set()
        self._con.interrupt()

    # ---- results and the rest of DuckDB's API --------------------------------------------

    def _fetch(name: str) -> Any:  # noqa: N805 - builds methods
        def method(self: Connection, *args: Any, **kwargs: Any) -> Any:
            return self._run(lambda: getattr(self._con, name)(*args, **kwargs))
        method.__name__ = name
        method.__doc__ = f"DuckDB's {name}, cancellable with Ctrl-C."
        return method

    fetchall = _fetch("fetchall")
    fetchone = _fetch("fetchone")
    fetchmany = _fetch("fetchmany")
    fetchdf = _fetch("fetchdf")
    fetch_df = _fetch("fetch_df")
    df = _fetch("df")
    fetchnumpy = _fetch("fetchnumpy")
    to_arrow_table = _fetch("to_arrow_table")
    del _fetch

    def stats(self) -> dict[str, Any]:
        return self.session.stats()

    def close(self) -> None:
        # The database may outlive this connection (a cursor's, a file's other connections):
        # its functions would keep this session alive.
        try:
            self._con.abort()  # an unread result: DuckDB would refuse the removals
            for name in self._udfs:
                self._con.remove_function(name)
        except duckdb.ConnectionException:  # closed already
            pass
        self._con.close()
        self.session.release_cache()

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._con, name)


def connect(database: str = ":memory:", model: str = "smollm2-135m", **options: Any) -> Connection:
    """A DuckDB connection with the llm_* functions on `model` (a registered name).

    Options: on_error ('raise' | 'null'), cache (bool: False reads and writes no result
    cache, so no answer outlives its query, while identical calls within one query still run
    once), cache_path, cache_max_bytes, progress (None = when stderr is a terminal),
    priority ('RT' | 'BE'), sample_rows, and
    the engine's (LLMEngine's arguments: device 'auto' | 'cpu' | 'cuda' | 'cuda:N', dtype,
    kv_cache_bytes, max_num_batched_tokens, max_num_seqs, threads, policy, ...).
    All connections of a process share one engine per model.
    backend='openai' with endpoints=[URL, ...] (OpenAI-compatible servers: llmdb serve, vLLM,
    hosted APIs, as replicas) and api_key_env='VAR' (the variable holding the key) runs the
    calls there instead; its options: served_model, max_concurrency (per endpoint),
    requests_per_minute, tokens_per_minute, timeout_s, max_retries, send_priority (vLLM's
    priority field on bulk rows; interactive rows take free slots first either way),
    base_model (a model without a chat template: llm_complete's prompt is continued as
    plain text through /completions; the chat functions are refused), stall_s and
    stall_factor (a row held by an endpoint that has answered nothing for stall_factor x
    the slowest recent answer, at least stall_s, is sent to an idle one too; stall_s=None:
    never).
    backend may also be a
    Backend object (for `model`). Connections of a process with the same model, endpoints
    and options share their HTTP clients, concurrency and rate limits. Without backend=, a
    model registered with `llmdb models add NAME --endpoint URL` runs on its endpoints.
    planner=False runs queries as written (no minimal-calls rewrite, no EXPLAIN LLM)."""
    return Connection(database, model, **options)


def register(con: duckdb.DuckDBPyConnection, model: str = "smollm2-135m",
             **options: Any) -> Session:
    """Add the llm_* functions to an existing DuckDB connection (no query rewriting).

    Returns the session that holds the connection's stats and errors. Without the wrapper
    there are no query boundaries: llm_stats()'s last_query then covers every call so far.
    A query still pays for a call once (see session.QueryMemory), the queries told apart by
    their DuckDB transactions: inside an explicit BEGIN ... COMMIT a failed call is tried
    again only after the transaction.
    Nor does DuckDB's con.interrupt() reach the model: the rows sent finish before DuckDB
    stops. session.cancel.set() aborts them, and stays set until cleared (no query ends
    here to clear it); llmdb.connect's interrupt() does both per query."""
    session = Session(Options.from_kwargs(model=model, **options))
    session.check_model()
    functions.register(con, session)
    return session
