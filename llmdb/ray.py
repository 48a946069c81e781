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
"""

from __future__ import annotations

import inspect
from typing import Any

import pyarrow as pa
import ray
import ray.data

from . import dataframe
from .session import Options, Session

FUNCTIONS = ("complete", "filter", "classify")


class RowMapper:
    """One worker: a session (its engine loads on the first batch) and the DataFrame function
    its batches go through. Ray constructs it in the worker process."""

    def __init__(self, function: str, args: tuple, options: dict[str, Any]):
        if function not in FUNCTIONS:
            raise ValueError(f"function must be one of {FUNCTIONS}, got {function!r}")
        self.function = getattr(dataframe, function)
        self.args = args
        self.call, session_options = _split_options(function, options)
        # Ray Data shows the job's progress; a bar per worker would interleave with it.
        session_options.setdefault("progress", False)
        self.session = Session(Options.from_kwargs(**session_options))

    def __call__(self, batch: pa.Table) -> pa.Table:
        return self.function(batch, *self.args, session=self.session, **self.call)


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


def map_rows(rows: ray.data.Dataset | pa.Table, function: str, *args: Any,
             num_workers: int = 1, batch_size: int = 256, num_cpus: float | None = None,
             num_gpus: float | None = None, mapper: type[RowMapper] = RowMapper,
             **options: Any) -> ray.data.Dataset:
    """`llmdb.<function>(batch, *args, **options)` over the rows, on num_workers actors.

    function: "complete", "filter" or "classify", with the arguments and options of the
    DataFrame function of that name; options that are not a call's configure each worker's
    session (model, cache_path, engine options such as device or max_num_seqs). num_cpus
    and num_gpus are each worker's Ray resources; mapper, a RowMapper subclass, adds work per
    batch (logging, metrics). Lazy, like every Ray Dataset: the work runs
    when the result is consumed (written, iterated or converted)."""
    if function not in FUNCTIONS:
        raise ValueError(f"function must be one of {FUNCTIONS}, got {function!r}")
    Options.from_kwargs(**_split_options(function, options)[1])  # fail here, not in a worker
    if isinstance(rows, pa.Table):
        rows = _dataset(rows, batch_size)
    resources = {k: v for k, v in (("num_cpus", num_cpus), ("num_gpus", num_gpus))
                 if v is not None}
    return rows.map_batches(mapper, fn_constructor_args=(function, args, options),
                            batch_size=batch_size, batch_format="pyarrow",
                            compute=ray.data.ActorPoolStrategy(size=num_workers), **resources)


def to_arrow(ds: ray.data.Dataset) -> pa.Table:
    """The whole dataset as one Arrow table on the driver (for DuckDB: con.register)."""
    tables = ray.get(ds.to_arrow_refs())
    return pa.concat_tables(tables) if tables else pa.table({})
