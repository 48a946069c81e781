"""Jobs that outgrow one machine: llmdb's row functions over a Ray Dataset (Ray Data).

    import llmdb, llmdb.ray
    con = llmdb.connect()
    rows = llmdb.ray.from_query(con, "SELECT product, review FROM samples.reviews")
    out = llmdb.ray.map_rows(rows, "complete", "Summarize: {review}", output="summary",
                             num_workers=4, max_tokens=64)
    out.write_parquet("/data/summaries")                 # or, back into DuckDB:
    con.register("summaries", llmdb.ray.to_arrow(out))

Any Ray Dataset works as input (`ray.data.read_parquet(...)` for data that does not fit the
driver). Each worker is a Ray actor holding one llmdb session, and with it one engine loaded
once, and maps batches of rows through the same DataFrame functions as a single process
(llmdb.complete / filter / classify): batching, dedup, the result cache and the error policy
are llmdb's, not re-implemented here; Ray does the distribution, scheduling and recovery.
Ray Data restarts a worker that dies and retries its batches (its default for actor pools).
Every row's answer goes to the result cache the moment it is computed, so a retried batch,
or a rerun of a job that failed, recomputes only the rows that were lost; on a cluster that
needs `cache_path` on storage every node reaches, else each node keeps its own cache.

Failed rows. Under on_error='null' a failed row's answer is NULL (filter drops the row), and
its error stays in its worker's session: the driver's llmdb.errors() never lists it, and a
worker only logs that rows failed. `error_column="error"` keeps each row's error in the output
(the text llm_errors() shows; NULL for the other rows; filter then keeps its failed rows):

    out = llmdb.ray.map_rows(rows, "complete", "Summarize: {review}", on_error="null",
                             error_column="error")
    failed = out.filter(lambda row: row["error"] is not None)

The errors are a column of the rows, so whatever consumes the dataset gets them, computed
when it is (the dataset is lazy), and a retried batch replaces its rows, errors included:
none is lost or listed twice. Under on_error='raise' (the default) the job stops at the first
failed row: to_arrow raises llmdb.LLMError naming the row and the cause, as one process does.
Ray's own consumers (out.write_parquet, iter_batches, take_all, materialize) raise Ray's
RayTaskError(LLMErrorInWorker): `except llmdb.LLMError` catches it, and its message, the
worker's traceback, ends with llmdb's error (then Ray's advice on retrying map tasks).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import pyarrow as pa
import ray
import ray.data
from ray.exceptions import UserCodeException

from . import dataframe
from .backends.standin import STANDIN_MODEL
from .batch import LLMError
from .session import Options, Session

FUNCTIONS = ("complete", "filter", "classify")
log = logging.getLogger(__name__)


class _ToTheDriver(UserCodeException):
    """An llmdb error as a worker raises it, to reach the driver as the error it is.

    Ray Data wraps what a map function raises in a UserCodeException of its own ("UDF failed
    to process a data block"), and the original, its __cause__, does not survive pickling on
    the way to the driver: the error was left as lines of a traceback. Raised as it is
    (RowMapper asks Ray to), a subclass reaches the driver as Ray's RayTaskError(subclass),
    which is an instance of the llmdb error too; being a UserCodeException, Ray reports it as
    the user's error, not as a fault of Ray's own. (First among its bases: its __init__.)"""

    def __init__(self, message: str):
        super().__init__(message)
        # Ray appends its retry advice to args[0] on the way; this copy arrives as written.
        self.message = message


class LLMErrorInWorker(_ToTheDriver, LLMError):
    """A row's LLMError, to reach the driver as an llmdb.LLMError naming the row."""


class ColumnsMissingInWorker(_ToTheDriver, KeyError):
    """A column the call reads that a batch lacks (map_rows finds it on the driver unless
    the rows' schema is not known there), to reach the driver as the single-process call's
    KeyError."""


class ColumnTakenInWorker(_ToTheDriver, ValueError):
    """A column the call adds (output, error_column) that a batch has already: as for
    ColumnsMissingInWorker, the single-process call's ValueError naming it, where Ray's
    wrapper of it said only that the UDF failed."""


class RowMapper:
    """One worker: a session (its engine loads on the first batch) and the DataFrame function
    its batches go through. Ray constructs it in the worker process."""

    def __init__(self, function: str, args: tuple, options: dict[str, Any]):
        if function not in FUNCTIONS:
            raise ValueError(f"function must be one of {FUNCTIONS}, got {function!r}")
        self.function = getattr(dataframe, function)
        self.args = args
        self.call, session_options = _split_options(function, options)
        self.columns = dataframe.columns_read(function, args, options)
        self.added = dataframe.columns_added(function, args, options)
        # Ray Data shows the job's progress; a bar per worker would interleave with it.
        session_options.setdefault("progress", False)
        self.session = Session(Options.from_kwargs(**session_options))
        self.warned = False

    def __call__(self, batch: pa.Table) -> pa.Table:
        try:
            dataframe.check_columns(self.columns, batch.column_names)
        except KeyError as e:
            _raise_as_is()
            raise ColumnsMissingInWorker(e.args[0]) from e
        try:
            dataframe.check_new_columns(self.added, batch.column_names)
        except ValueError as e:
            _raise_as_is()
            raise ColumnTakenInWorker(str(e)) from e
        failed_before = self.session.total.errors
        try:
            out = self.function(batch, *self.args, session=self.session, **self.call)
        except LLMError as e:
            _raise_as_is()
            raise LLMErrorInWorker(str(e)) from e
        self._warn_of_failed_rows(self.session.total.errors - failed_before)
        return out

    def _warn_of_failed_rows(self, failed: int) -> None:
        """Without error_column a failed row is a NULL whose error stays in this worker's
        session, out of the driver's reach: say so once per worker (Ray shows a worker's
        log on the driver)."""
        if failed and not self.warned and self.call.get("error_column") is None:
            self.warned = True
            log.warning("%d row(s) of a batch failed under on_error='null' (NULL answers; "
                        "filter drops them), e.g. %s; map_rows(..., error_column='error') "
                        "keeps each row's error in the output", failed,
                        self.session.errors[-1].error)


def _raise_as_is() -> None:
    """Asks Ray Data not to wrap the exception being raised (see _ToTheDriver). The flag is
    this task's copy of the job's DataContext, which Ray reads as the exception leaves the
    call."""
    ray.data.DataContext.get_current().raise_original_map_exception = True


def _split_options(function: str, options: dict[str, Any]) -> tuple[dict, dict]:
    """(the call's options: the function's own keywords and the per-call ones, the session's)."""
    own = set(inspect.signature(getattr(dataframe, function)).parameters) | set(
        dataframe.ALL_CALL_OPTIONS)
    return ({k: v for k, v in options.items() if k in own},
            {k: v for k, v in options.items() if k not in own})


def from_query(con: Any, query: str, rows_per_block: int = 256) -> ray.data.Dataset:
    """The rows of a DuckDB / llmdb query as a Ray Dataset (materialized on the driver)."""
    return _dataset(con.sql(query).to_arrow_table(), rows_per_block)


def _dataset(table: pa.Table, rows_per_block: int) -> ray.data.Dataset:
    """Blocks of rows_per_block rows: a block is the unit Ray hands to a worker (and
    retries), so one block would keep every worker but one idle."""
    n = table.num_rows
    return ray.data.from_arrow([table.slice(i, rows_per_block)
                                for i in range(0, n, rows_per_block)] or [table])


def _spread(rows: ray.data.Dataset | pa.Table, num_workers: int,
            batch_size: int) -> tuple[ray.data.Dataset, int]:
    """The rows in blocks, and the batch size, that give every worker a share: Ray hands a
    worker a whole block at a time, so 64 rows in one block kept one of two workers busy
    and the other idle. Up to num_workers full batches of rows are cut into one batch a
    worker, in a block each. A Dataset's row count is taken only where Ray knows it without
    running anything (an in-memory table, Parquet metadata); otherwise, or where there are
    more rows, its blocks are left as they are."""
    if isinstance(rows, pa.Table):
        count = rows.num_rows
    else:  # _meta_count: Dataset.count() without its fallback of executing the plan
        count = getattr(rows, "_meta_count", lambda: None)()
    if count and count <= num_workers * batch_size:
        batch_size = -(-count // num_workers)
        batches = -(-count // batch_size)
        if not isinstance(rows, pa.Table) and rows.num_blocks() < batches:
            # Re-blocked before the workers start: once they hold the CPUs, Ray may have
            # none left for the repartition's tasks (on two CPUs and two workers it hung).
            rows = rows.repartition(batches).materialize()
    if isinstance(rows, pa.Table):
        rows = _dataset(rows, batch_size)
    return rows, batch_size


def map_rows(rows: ray.data.Dataset | pa.Table, function: str, *args: Any,
             num_workers: int = 1, batch_size: int = 256, num_cpus: float | None = None,
             num_gpus: float | None = None, mapper: type[RowMapper] = RowMapper,
             **options: Any) -> ray.data.Dataset:
    """`llmdb.<function>(batch, *args, **options)` over the rows, on num_workers actors.

    function: "complete", "filter" or "classify", with the arguments and options of the
    DataFrame function of that name; options that are not a call's configure each worker's
    session (model, cache_path, engine options such as device or max_num_seqs). num_cpus
    and num_gpus are each worker's Ray resources; on the CPU a worker's engine computes with
    num_cpus threads (Ray's default: one; Ray gives a worker OMP_NUM_THREADS = its CPUs unless
    it was set where Ray started, and then that), so give it the cores it should use. Fewer
    rows than num_workers x batch_size are shared out evenly (a Dataset whose row count Ray
    knows is then re-blocked here, which reads it). mapper, a RowMapper subclass, adds work
    per batch (logging, metrics). Lazy, like every Ray Dataset: the model's work runs when the
    result is consumed (written, iterated or converted); a wrong option, or a column the
    rows lack, raises here what the same call raises in one process.

    error_column="error" (an option of the DataFrame functions) adds a column with the error
    of each row that failed under on_error='null', NULL for the others: the only way the
    driver sees why a row is NULL, as each worker's llmdb.errors() stays in the worker."""
    if function not in FUNCTIONS:
        raise ValueError(f"function must be one of {FUNCTIONS}, got {function!r}")
    Options.from_kwargs(**_split_options(function, options)[1])  # fail here, not in a worker
    schema = rows.schema if isinstance(rows, pa.Table) else rows.schema(fetch_if_missing=False)
    _check_call(function, args, options, None if schema is None else list(schema.names))
    rows, batch_size = _spread(rows, num_workers, batch_size)
    resources = {k: v for k, v in (("num_cpus", num_cpus), ("num_gpus", num_gpus))
                 if v is not None}
    # One batch in flight a worker: with Ray's default of four, the first worker whose
    # engine had loaded was handed the batches meant for the others, which were still loading.
    pool = ray.data.ActorPoolStrategy(size=num_workers, max_tasks_in_flight_per_actor=1)
    return rows.map_batches(mapper, fn_constructor_args=(function, args, options),
                            batch_size=batch_size, batch_format="pyarrow", compute=pool,
                            **resources)


def _check_call(function: str, args: tuple, options: dict[str, Any],
                columns: list[str] | None) -> None:
    """The call's own checks, here: a wrong option, or a column the rows lack, fails as the
    same call in one process does, not in every worker after its model loads, where Ray
    wraps the error in a traceback of its own. The call runs on no rows, on the model-free
    stand-in. columns None: a dataset whose schema is not known without running it (the
    workers find a column it lacks)."""
    call = _split_options(function, options)[0]
    dataframe.check_option_types(function, call)
    call.pop("model", None)  # (a model named per call would load here)
    if columns is None:
        columns = dataframe.columns_read(function, args, options)
    no_rows = pa.Table.from_arrays([pa.array([], pa.string()) for _ in columns], columns)
    standin = Session(Options(model=STANDIN_MODEL, cache=False, progress=False))
    getattr(dataframe, function)(no_rows, *args, session=standin, **call)


def to_arrow(ds: ray.data.Dataset) -> pa.Table:
    """The whole dataset as one Arrow table on the driver (for DuckDB: con.register).

    A row that fails under on_error='raise' raises llmdb.LLMError naming the row and the
    cause, as the same call in one process does (Ray's own consumers raise Ray's error
    around it: see the module's docstring)."""
    try:
        tables = ray.get(ds.to_arrow_refs())
    except LLMErrorInWorker as e:  # Ray's RayTaskError(LLMErrorInWorker)
        raise LLMError(e.message) from None  # (Ray's traceback: the worker's, not the row's)
    except ColumnsMissingInWorker as e:
        raise KeyError(e.message) from None
    except ColumnTakenInWorker as e:
        raise ValueError(e.message) from None
    return pa.concat_tables(tables) if tables else pa.table({})
