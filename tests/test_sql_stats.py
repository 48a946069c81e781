"""llm_stats()'s last_query is the last query's, also when that query made no model call;
reading llm_stats() or llm_errors() is not a query it reports. The reference is the total: what a
query adds to it is what last_query says. The model is the hash stand-in."""

from __future__ import annotations

import json

import pytest

import llmdb

QUERIES = [
    "SELECT p, llm_complete(p, max_tokens := 2) FROM t",
    "SELECT 42",  # no call at all
    "SELECT p, a FROM v",
    "SELECT count(*) FROM v",  # DuckDB drops the call that nothing reads
    "SELECT llm_filter(p) FROM t WHERE p IS NULL",  # the call sees no row
    "CREATE TABLE copy AS SELECT * FROM t",
]


def _sql_stats(con: llmdb.Connection) -> dict:
    return json.loads(con.execute("SELECT llm_stats()").fetchall()[0][0])


@pytest.mark.parametrize("planner", [True, False], ids=["planned", "as written"])
@pytest.mark.parametrize("run", ["execute", "sql"])
def test_last_query_is_what_the_last_query_added_to_the_total(planner, run):
    con = llmdb.connect(model="hash-standin", cache=False, planner=planner)
    con.execute("CREATE TABLE t AS SELECT 'row ' || i AS p FROM range(3) r(i)")
    con.execute("CREATE VIEW v AS SELECT p, llm_complete('v ' || p, max_tokens := 2) AS a "
                "FROM t")
    for query in QUERIES:
        before = con.stats()["total"]
        if run == "execute":
            con.execute(query).fetchall()
        else:
            rel = con.sql(query)
            if rel is not None:
                rel.fetchall()
        stats = con.stats()
        added = {k: stats["total"][k] - before[k] for k in ("rows", "calls", "model_rows")}
        assert {k: stats["last_query"][k] for k in added} == added, query
        # Reading llm_stats() reports that query, not itself, however often it is read.
        assert _sql_stats(con) == _sql_stats(con) == con.stats() == stats, query
        con.execute("SELECT * FROM llm_errors()").fetchall()
        assert con.stats() == stats, query
    assert con.stats()["total"]["calls"] == 3 + 3  # t's rows, then v's
