"""Tables from the caller's Python scope: `SELECT ... FROM df` with a pandas, polars or Arrow
table named df, as plain DuckDB allows.

DuckDB finds such a table (a "replacement scan", tried only for names the catalog lacks) in
the locals and globals of the Python frame that called execute or sql. Under llmdb that is
llmdb's own code, or its query thread. So the connection collects, before a query, the
objects of the user's frame that the query's text names, and calls DuckDB from a frame whose
variables are those objects. DuckDB then resolves them as it would have in the user's frame:
the database's tables win, and a relation keeps the object it was made with. Nothing is
registered, so nothing outlives the query or shadows a table created later.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import duckdb

# Identifiers as a query may write them: plain, or in double quotes ("" escapes a quote).
_WORD = re.compile(r'"((?:[^"]|"")+)"|([A-Za-z_][A-Za-z0-9_$]*)')
# Packages of the objects DuckDB scans: DataFrames, Arrow tables, datasets and readers,
# relations, NumPy arrays (their subclasses too: a GeoDataFrame is a pandas DataFrame).
_SCANNABLE = {"pandas", "polars", "pyarrow", "duckdb", "_duckdb", "numpy"}
# Run in a frame whose variables are the tables (and the call): DuckDB looks there.
_CALL = compile("__llmdb_out = __llmdb_call(*__llmdb_args, **__llmdb_kwargs)",
                "<llmdb scope>", "exec")


def caller_frame() -> FrameType | None:
    """The innermost frame outside the llmdb package: the user's code."""
    frame = sys._getframe(1)
    while frame is not None and _in_llmdb(frame):
        frame = frame.f_back
    return frame


def _in_llmdb(frame: FrameType) -> bool:
    module = frame.f_globals.get("__name__", "")
    return module == "llmdb" or module.startswith("llmdb.")


def tables_named(sql: str, frame: FrameType | None, read_streams: bool = True
                 ) -> dict[str, Any]:
    """The objects of `frame` (its locals before its globals, as DuckDB looks) that DuckDB
    can scan and whose names are words of `sql`. A word that is a column or a string is
    harmless: DuckDB only looks up names it reads as tables and cannot find. read_streams:
    readers are read into tables (the planner will read them before the query does)."""
    if frame is None:
        return {}
    scopes = (frame.f_locals, frame.f_globals)  # f_locals is a copy: taken once
    found = {}
    for quoted, plain in _WORD.findall(sql):
        name = quoted.replace('""', '"') if quoted else plain
        for scope in scopes:
            if name in scope:
                if _scannable(scope[name]):
                    found[name] = _readable_twice(scope[name]) if read_streams else scope[name]
                break
    return found


def _readable_twice(obj: Any) -> Any:
    """A pyarrow RecordBatchReader is a stream that DuckDB can read once, and the planner
    reads a query's tables before the query does: such a stream is read into a table, in
    memory, as the planner's reads would need anyway. (The user's reader is used up, as a
    plain DuckDB query would use it up.)"""
    pyarrow = sys.modules.get("pyarrow")  # (an object of pyarrow's means it is imported)
    return obj.read_all() if pyarrow and isinstance(obj, pyarrow.RecordBatchReader) else obj


def _scannable(obj: object) -> bool:
    return any(c.__module__.split(".")[0] in _SCANNABLE for c in type(obj).__mro__)


class ScopedConnection:
    """A DuckDB connection whose execute and sql find `tables` as DuckDB finds a caller's
    variables; everything else is the connection's own."""

    def __init__(self, con: duckdb.DuckDBPyConnection):
        self.con = con
        self.tables: dict[str, Any] = {}  # set by the llmdb connection around each query

    def execute(self, *args: Any, **kwargs: Any) -> Any:
        return self._in_scope(self.con.execute, args, kwargs)

    def sql(self, *args: Any, **kwargs: Any) -> Any:
        return self._in_scope(self.con.sql, args, kwargs)

    query = sql

    def _in_scope(self, method: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if not self.tables:
            return method(*args, **kwargs)
        frame = {**self.tables, "__llmdb_call": method, "__llmdb_args": args,
                 "__llmdb_kwargs": kwargs}
        exec(_CALL, frame)  # noqa: S102 - a fixed statement: the call, in the tables' frame
        return frame["__llmdb_out"]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.con, name)
