"""con.executemany runs its statement once per parameter set as con.execute runs it: planned,
cancellable, each set a query of llm_stats(). The model is the hash stand-in."""

from __future__ import annotations

import duckdb
import pytest

import llmdb
from llmdb.backends.standin import StandinBackend

INSERT = "INSERT INTO t SELECT ?, llm_complete(?, max_tokens := 2)"
SETS = [["a", "Name a color."], ["b", "Name a fruit."], ["c", "Name a tree."]]


def test_each_parameter_set_runs_as_execute_runs_it():
    with llmdb.connect(model="hash-standin", cache=False) as con:
        con.execute("CREATE TABLE t (k VARCHAR, v VARCHAR)")
        con.executemany(INSERT, SETS)
        assert con.planner.last_counts(INSERT) is not None  # planned
        assert con.stats()["total"]["calls"] == 3
        assert con.stats()["last_query"]["calls"] == 1  # the last set was a query of its own
        got = con.execute("SELECT k, v FROM t ORDER BY k").fetchall()
    with llmdb.connect(model="hash-standin", cache=False) as con:
        want = [(k, con.execute("SELECT llm_complete(?, max_tokens := 2)", [p]).fetchall()[0][0])
                for k, p in SETS]
    assert got == want


def test_a_select_leaves_the_last_sets_rows_to_fetch():
    with llmdb.connect(model="hash-standin", cache=False) as con:
        con.executemany("SELECT ? AS k", [[1], [2]])
        assert con.fetchall() == [(2,)]
        with pytest.raises(duckdb.InvalidInputException, match="non-empty list"):
            con.executemany("SELECT 1", [])


def test_an_interrupt_cancels_the_remaining_sets():
    class Interrupting(StandinBackend):
        sent = 0

        def submit(self, request, on_finish):
            self.sent += 1
            con.interrupt()
            return super().submit(request, on_finish)

    backend = Interrupting()
    con = llmdb.connect(model="interrupting", backend=backend, cache=False)
    con.execute("CREATE TABLE t (k VARCHAR, v VARCHAR)")
    with pytest.raises(llmdb.QueryCancelled):
        con.executemany(INSERT, SETS)
    assert backend.sent == 1
    assert con.execute("SELECT count(*) FROM t").fetchall() == [(0,)]
    con.close()
