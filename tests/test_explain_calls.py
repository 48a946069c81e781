"""EXPLAIN LLM's model calls are the calls the query then makes (llm_stats()): a NULL row is
no prompt and no call. The model is the hash stand-in, the result cache is off."""

from __future__ import annotations

import pytest

import llmdb
from llmdb.planner import LEARNED

STANDIN = "hash-standin"
FILTER = "SELECT llm_filter(x) FROM t"


def _connect(rows: int, **options) -> llmdb.Connection:
    LEARNED.clear()
    con = llmdb.connect(model=STANDIN, **{"cache": False, **options})
    con.execute(f"CREATE TABLE t AS SELECT 'text ' || i AS x FROM range({rows}) r(i)")
    return con


def _total(con: llmdb.Connection, sql: str) -> dict:
    """The total row of EXPLAIN LLM's table."""
    con.execute(f"EXPLAIN LLM {sql}")
    cols = [d[0] for d in con.description]
    return dict(zip(cols, con.fetchall()[-1], strict=True))


def _calls_made(con: llmdb.Connection, sql: str) -> dict:
    con.execute(sql).fetchall()
    return con.stats()["last_query"]


@pytest.mark.parametrize("rows", [6, 300])
def test_null_rows_are_no_prompts_and_no_calls(rows):
    """A third of the rows NULL: with few rows and with more distinct prompts than the
    estimate samples."""
    con = _connect(0)
    con.execute(f"CREATE OR REPLACE TABLE t AS SELECT CASE WHEN i % 3 = 0 THEN NULL "
                f"ELSE 'text ' || i END AS x FROM range({rows}) r(i)")
    _calls_made(con, "SELECT llm_filter('warm up the prior')")
    live = sum(1 for i in range(rows) if i % 3)
    est = _total(con, FILTER)
    made = _calls_made(con, FILTER)
    assert est["rows_est"] == rows
    assert est["distinct_est"] == made["rows"] == live
    assert est["calls_est"] == made["calls"] == 2 * live
    assert _total(con, FILTER)["distinct_actual"] == live
