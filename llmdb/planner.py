"""The query planner: every query of an llmdb.Connection passes through plan().

For now a pass-through: DuckDB runs the query as written. The optimizer (minimal LLM calls,
EXPLAIN LLM, prefix-aware ordering) rewrites here, and must return SQL whose results equal
those of the input.
"""

from __future__ import annotations


def plan(sql: str) -> str:
    return sql
