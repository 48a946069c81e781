"""Tables from the caller's Python scope: `SELECT ... FROM df` with a pandas, polars or Arrow
table named df, as plain DuckDB allows.

DuckDB finds such a table (a "replacement scan") in the frame that called execute or sql,
which under llmdb is llmdb's own code, or its query thread. So the connection looks the names
up in the first frame outside llmdb, before the query runs, and registers them. It does so as
DuckDB would: only for names that are not tables or views of the database (those win), the
frame's locals before its globals, and only objects DuckDB can scan.

The registrations outlive the query: a relation from sql() binds its tables again each time it
is fetched. Each later query that names one looks it up again, so it follows the variable.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

import duckdb
import sqlglot
from sqlglot import exp
from sqlglot.errors import SqlglotError


def caller_frame() -> FrameType | None:
    """The innermost frame outside the llmdb package: the user's code."""
    frame = sys._getframe(1)
    while frame is not None and _in_llmdb(frame):
        frame = frame.f_back
    return frame


def _in_llmdb(frame: FrameType) -> bool:
    module = frame.f_globals.get("__name__", "")
    return module == "llmdb" or module.startswith("llmdb.")


def unqualified_tables(sql: str) -> set[str]:
    """Names a query reads as tables with no schema or catalog, less its CTEs' names.
    A query sqlglot cannot parse names none (DuckDB then reports what it cannot find)."""
    try:
        statements = sqlglot.parse(sql, read="duckdb")
    except SqlglotError:
        return set()
    names: set[str] = set()
    ctes: set[str] = set()
    for statement in statements:
        if statement is None:
            continue
        names |= {t.name for t in statement.find_all(exp.Table)
                  if t.name and not t.db and not t.catalog}
        ctes |= {c.alias_or_name.lower() for c in statement.find_all(exp.CTE)}
    return {n for n in names if n.lower() not in ctes}


class ScopeTables:
    """The caller's tables registered on one DuckDB connection."""

    def __init__(self, con: duckdb.DuckDBPyConnection):
        self._con = con
        self.registered: set[str] = set()  # lower-cased: DuckDB's names ignore case

    def register_referenced(self, sql: str, frame: FrameType | None) -> None:
        """Register the objects of `frame` that `sql` reads as tables and the database
        lacks; drop an earlier registration whose variable is gone or no longer a table."""
        if frame is None:
            return
        found = {name: _lookup(frame, name) for name in unqualified_tables(sql)}
        if not any(obj is not None or name.lower() in self.registered
                   for name, obj in found.items()):
            return  # the usual case: only the database's tables (no catalog query)
        catalog = self._catalog_names()
        for name, obj in found.items():
            key = name.lower()
            if key not in catalog and obj is not None and self._register(name, obj):
                self.registered.add(key)
            elif key in self.registered:  # the database's now, or the variable's gone
                self.forget(name)
                self._con.unregister(name)

    def forget(self, name: str) -> None:
        """`name` is no longer llmdb's to manage (the user registered or dropped it)."""
        self.registered.discard(name.lower())

    def _register(self, name: str, obj: Any) -> bool:
        try:
            self._con.register(name, obj)
        except duckdb.InvalidInputException:  # not a table DuckDB can scan
            return False
        return True

    def _catalog_names(self) -> set[str]:
        """Tables and views an unqualified name can mean (the current database's and the
        temporary ones), less the views llmdb registered."""
        rows = self._con.execute(
            "SELECT lower(table_name), false FROM duckdb_tables() "
            "WHERE database_name IN (current_database(), 'temp') "
            "UNION ALL SELECT lower(view_name), temporary FROM duckdb_views() "
            "WHERE NOT internal AND database_name IN (current_database(), 'temp')").fetchall()
        return {name for name, temporary in rows
                if not (temporary and name in self.registered)}


def _lookup(frame: FrameType, name: str) -> Any:
    for scope in (frame.f_locals, frame.f_globals):
        if name in scope:
            return scope[name]
    return None
