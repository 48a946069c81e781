"""What a DuckDB user does with a connection works through llmdb's: tables from the caller's
Python scope, cursor(), and several connections to one database file."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import duckdb
import pandas as pd
import polars as pl
import pyarrow as pa
import pytest

import llmdb

pytestmark = pytest.mark.usefixtures("eng", "own_cache_dir")

QUESTION = "SELECT t, llm_complete(t, max_tokens := 4) AS a FROM {} ORDER BY t"
ROWS = ["Name a colour.", "Name a fruit."]
MODULE_TABLE = pa.table({"t": ROWS})  # found in the caller's globals


def reference(con) -> list[tuple]:
    """The answers over a table of the database."""
    con.execute("CREATE OR REPLACE TABLE ref AS SELECT unnest(?) AS t", [ROWS])
    return con.execute(QUESTION.format("ref")).fetchall()


@pytest.mark.parametrize("make", [pd.DataFrame, pl.DataFrame, pa.table],
                         ids=["pandas", "polars", "arrow"])
def test_a_table_in_the_callers_scope_is_queried_as_plain_duckdb_would(con, make):
    frame = make({"t": ROWS})  # noqa: F841 - read by the query, by name
    want = reference(con)
    assert con.execute(QUESTION.format("frame")).fetchall() == want
    assert con.sql(QUESTION.format("frame")).fetchall() == want
    assert con.execute("SELECT count(*) FROM frame").fetchall() == [(2,)]


def test_globals_are_found_and_locals_come_first(con):
    assert con.execute("SELECT count(*) FROM MODULE_TABLE").fetchall() == [(2,)]
    MODULE_TABLE = pa.table({"t": ["only one"]})  # noqa: N806, F841 - shadows the global
    assert con.execute("SELECT count(*) FROM MODULE_TABLE").fetchall() == [(1,)]


def test_the_databases_table_wins_and_a_relation_keeps_its_object(con):
    t = pd.DataFrame({"x": [1, 2, 3]})
    assert con.execute("SELECT sum(x) FROM t").fetchall() == [(6,)]
    rel = con.sql("SELECT sum(x) FROM t")
    t = pd.DataFrame({"x": [10]})  # a later query sees the variable's new value
    assert con.execute("SELECT sum(x) FROM t").fetchall() == [(10,)]
    assert rel.fetchall() == [(6,)]  # a relation, the object it was made with (as DuckDB)
    con.execute("CREATE TABLE t AS SELECT 100 AS x")
    assert con.execute("SELECT sum(x) FROM t").fetchall() == [(100,)]
    con.execute("DROP TABLE t")
    del t
    with pytest.raises(duckdb.CatalogException, match="t does not exist"):
        con.execute("SELECT sum(x) FROM t")
    assert rel.fetchall() == [(6,)]


def test_a_tables_name_in_scope_is_no_obstacle_to_writing_it(con):
    """A variable named like a table being created, or a view of the user's, is not read
    for it (nothing is registered under its name)."""
    results = pd.DataFrame({"old": [1]})
    con.execute("CREATE TEMP TABLE results AS SELECT 7 AS new")
    assert con.table("results").fetchall() == [(7,)]
    con.execute("CREATE TEMP TABLE copy AS SELECT * FROM results")  # the table's, not ours
    assert con.execute("SELECT * FROM copy").fetchall() == [(7,)]
    frame = pd.DataFrame({"x": [1]})
    assert con.execute("SELECT x FROM frame").fetchall() == [(1,)]
    con.execute("CREATE OR REPLACE TEMP VIEW frame AS SELECT 2 AS x")
    assert con.execute("SELECT x FROM frame").fetchall() == [(2,)]
    del results, frame


def test_names_that_are_not_tables_are_left_to_duckdb(con):
    t = "a string, not a table"  # noqa: F841
    with pytest.raises(duckdb.CatalogException, match="t does not exist"):
        con.execute("SELECT * FROM t")
    # A CTE of that name is the CTE.
    assert con.execute("WITH t AS (SELECT 7 AS x) SELECT x FROM t").fetchall() == [(7,)]


def test_an_explicit_register_is_the_users(con):
    frame = pd.DataFrame({"x": [1]})
    assert con.execute("SELECT sum(x) FROM frame").fetchall() == [(1,)]
    con.register("frame", pd.DataFrame({"x": [5]}))
    assert con.execute("SELECT sum(x) FROM frame").fetchall() == [(5,)]  # not the variable
    del frame


def test_a_cursor_has_the_llm_functions_and_its_own_stats(con):
    want = reference(con)
    cur = con.cursor()
    assert cur.execute(QUESTION.format("ref")).fetchall() == want
    assert cur.stats()["total"]["rows"] == 2
    assert con.stats()["total"]["rows"] == 2  # reference()'s rows only

    # The cursor's use: a second open result, and work on another thread.
    con.execute(QUESTION.format("ref"))
    assert cur.execute("SELECT count(*) FROM ref").fetchall() == [(2,)]
    assert con.fetchall() == want
    answers: list = []
    worker = threading.Thread(
        target=lambda: answers.extend(cur.execute(QUESTION.format("ref")).fetchall()))
    worker.start()
    assert con.execute(QUESTION.format("ref")).fetchall() == want
    worker.join()
    assert answers == want
    cur.close()
    assert con.execute(QUESTION.format("ref")).fetchall() == want


def test_two_connections_to_one_file(tmp_path):
    path = str(tmp_path / "db.duckdb")
    first = llmdb.connect(path, cache=False)
    second = llmdb.connect(path, cache=False)  # DuckDB shares the database: its functions
    want = reference(first)
    assert second.execute(QUESTION.format("ref")).fetchall() == want
    assert (first.stats()["total"]["rows"], second.stats()["total"]["rows"]) == (2, 2)
    gone = second.session.id
    second.close()
    assert first.execute(QUESTION.format("ref")).fetchall() == want
    # The closed connection's functions (which hold its session) left the database.
    names = [r[0] for r in first.execute("SELECT function_name FROM duckdb_functions()")
             .fetchall()]
    assert not [n for n in names if n.startswith("__llmdb") and n.endswith(f"_{gone}")]
    assert any(n.endswith(f"_{first.session.id}") for n in names)
    first.close()


def _open_files_under(folder) -> list[str]:
    fds = Path("/proc/self/fd")
    return [t for t in (os.readlink(f) if f.exists() else "" for f in fds.iterdir())
            if t.startswith(str(folder))]


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="lists /proc/self/fd")
def test_a_closed_connections_cache_file_is_closed(tmp_path):
    """A service with a cache per job: every cache_path the process had used stayed open
    (database, WAL and shared memory), the disk of a deleted job's files never freed. Open
    while a connection uses it, shared, and closed after the last one."""
    ask = "SELECT llm_complete('Name a colour.', max_tokens := 2)"
    for job in range(5):
        path = str(tmp_path / f"job{job}" / "cache.sqlite")
        first, second = llmdb.connect(cache_path=path), llmdb.connect(cache_path=path)
        assert first.session.cache() is second.session.cache()  # one per file
        want = first.execute(ask).fetchall()
        first.close()
        assert second.execute(ask).fetchall() == want
        assert second.stats()["last_query"]["cache_hits"] == 1  # the first one's answer
        assert _open_files_under(tmp_path)
        second.close()
        assert not _open_files_under(tmp_path)


def test_sql_refuses_while_a_result_is_unread_as_duckdb_does(con):
    """DuckDB 2 refuses a relation while an execute() result is unread; the planner's own
    queries must not throw the user's result away instead."""
    con.execute("SELECT range AS i FROM range(5000)")
    assert con.fetchone() == (0,)
    for query in ("SELECT 1", "SELECT llm_complete('Name a colour.', max_tokens := 2)"):
        with pytest.raises(duckdb.ResourceInUseException):
            con.sql(query).fetchall()
    assert con.fetchone() == (1,)  # the result is still there
    assert len(con.fetchall()) == 4998
    assert con.sql("SELECT 1").fetchall() == [(1,)]


def test_a_record_batch_reader_in_scope_gives_every_row_once(con):
    """A reader is a one-shot stream: the planner's statements must not use up the rows the
    query itself reads."""
    want = reference(con)
    stream = pa.RecordBatchReader.from_batches(  # noqa: F841 - read by the query, by name
        MODULE_TABLE.schema, MODULE_TABLE.to_batches())
    assert con.execute(QUESTION.format("stream")).fetchall() == want


def test_a_reader_named_by_a_query_without_llm_calls_is_left_to_duckdb(con):
    """Only a planned query reads a stream twice: another one (or one that merely names
    it) leaves the reader to DuckDB, which streams it."""
    stream = pa.RecordBatchReader.from_batches(MODULE_TABLE.schema, MODULE_TABLE.to_batches())
    assert con.execute("SELECT 'stream' AS s").fetchall() == [("stream",)]
    assert stream.read_all().num_rows == 2
