"""con.sql()'s relations: a query's model calls are made when its rows are read.

A DuckDB relation is a query built a step at a time, run by a method that reads its rows
(fetchall, df, arrow, pl, show, create, to_parquet, ...), again at every read. con.sql()
plans the query and binds its rewrite, and the calls wait for a read, so that a relation
never read, or read through .limit(5), does not pay for every row:
- reading the relation itself makes them as execute() does: the planner's steps first, each
  call site's distinct arguments in one batch;
- reading a relation built on it (limit, filter, join, order, aggregate, show's first rows)
  runs its ORDER BY ... LIMIT steps alone (their calls stop at the rows that query keeps,
  which any read of its rows needs, where DuckDB alone would evaluate its WHERE on every
  row), and leaves the other calls to the rows DuckDB reads, a vector at a time.
Read again, a relation answers from its query's memo. Read by name from another query, or
through a relation that another one is built on (other.join(rel)), its calls are made on
the rows DuckDB reads.

DuckDB 2's relations are Python: every read goes through the relation's _submit (rows, Arrow,
the displays) or _write (create, insert_into, to_csv, to_parquet), and every relation built
on one through its _derive. A relation of con.sql() becomes a PlannedRelation, which reads
its calls before those.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import duckdb

# DuckDB 1's relations are C++ objects, which cannot be made PlannedRelations: there
# con.sql() makes a query's calls when it is called (connection.py), as it did before.
LAZY_READS = all(hasattr(duckdb.DuckDBPyRelation, m) for m in ("_derive", "_submit", "_write"))

# Per relation: how to make the calls of each con.sql() query it reads ahead of a read (the
# function takes whole: True for the query's own relation, False for one built on it).
_READS: weakref.WeakKeyDictionary[duckdb.DuckDBPyRelation, dict[Callable[[bool], None], bool]] \
    = weakref.WeakKeyDictionary()


class PlannedRelation(duckdb.DuckDBPyRelation):
    """A DuckDB relation that makes the model calls of the con.sql() queries it reads before
    its rows are read."""

    __slots__ = ()  # (a relation of con.sql() becomes one in place: the same layout)

    def _derive(self, step: Any, *others: duckdb.DuckDBPyRelation, **kwargs: Any
                ) -> duckdb.DuckDBPyRelation:
        reads: dict[Callable[[bool], None], bool] = {}
        for relation in (self, *others):
            reads.update(dict.fromkeys(_READS.get(relation, {}), False))
        return planned(super()._derive(step, *others, **kwargs), reads)

    def _submit(self, *args: Any, **kwargs: Any) -> Any:
        _make_calls(self)
        return super()._submit(*args, **kwargs)

    def _write(self, *args: Any, **kwargs: Any) -> Any:
        _make_calls(self)
        return super()._write(*args, **kwargs)


def planned(relation: duckdb.DuckDBPyRelation,
            reads: dict[Callable[[bool], None], bool]) -> PlannedRelation:
    """`relation` as a PlannedRelation that calls each of `reads` (with its `whole`) before
    its rows are read."""
    relation.__class__ = PlannedRelation
    _READS[relation] = reads
    return relation


def _make_calls(relation: duckdb.DuckDBPyRelation) -> None:
    for make, whole in _READS.get(relation, {}).items():
        make(whole)
