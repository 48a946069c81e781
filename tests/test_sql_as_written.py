"""A statement fails, or runs, as DuckDB would run it as written. The planner (and the
per-row draws rename) run sqlglot's text of a statement, which reads more than DuckDB does:
a statement DuckDB refuses must raise DuckDB's own error, before any model call."""

from __future__ import annotations

import duckdb
import pytest

import llmdb

# llm_complete in plain DuckDB: the prompt itself (the statements' syntax is the point).
PLAIN_MACRO = "CREATE MACRO llm_complete(p, temperature := 0.0) AS p"

REFUSED = [
    # DuckDB 1.3+ refuses the single-arrow lambda (sqlglot writes it as `lambda x: ...`).
    "SELECT list_transform(['a', 'b'], x -> llm_complete(x)) AS r",
    "SELECT list_transform(['a'], x -> llm_complete(x, temperature := 0.5)) AS r",
    "CREATE TABLE t AS SELECT list_transform(['a'], x -> llm_complete(x)) AS r",
    # A LIMIT before UNION ALL is a syntax error (sqlglot moves it into the first branch).
    "SELECT llm_complete('a') AS r FROM range(3) LIMIT 2 UNION ALL SELECT llm_complete('b')",
]
ACCEPTED = [
    "SELECT list_transform(['a', 'b'], lambda x: llm_complete(x)) AS r",
    "SELECT * FROM (SELECT llm_complete('a') AS r FROM range(3) LIMIT 2) "
    "UNION ALL SELECT llm_complete('b')",
]


def duckdb_outcome(sql: str) -> tuple[type, str] | None:
    con = duckdb.connect()
    con.execute(PLAIN_MACRO)
    try:
        con.execute(sql).fetchall()
        return None
    except duckdb.Error as e:
        return type(e), str(e)
    finally:
        con.close()


@pytest.mark.parametrize("planner", [True, False])
@pytest.mark.parametrize("method", ["execute", "sql"])
@pytest.mark.parametrize("sql", REFUSED + ACCEPTED)
def test_a_statement_fails_as_duckdb_fails_it(sql, method, planner):
    want = duckdb_outcome(sql)
    assert (want is None) == (sql in ACCEPTED)
    con = llmdb.connect(model="hash-standin", cache=False, planner=planner)
    try:
        if want is None:
            getattr(con, method)(sql)
            return
        with pytest.raises(duckdb.Error) as info:
            rel = getattr(con, method)(sql)
            if rel is not None and method == "sql":
                rel.fetchall()
        assert (type(info.value), str(info.value)) == want
        assert con.stats()["total"]["calls"] == 0
    finally:
        con.close()
