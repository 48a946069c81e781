"""con.sql() plans a query and leaves its model calls to the reads of the relation: a relation
never read pays nothing, .limit(5) pays for five rows, and reading the relation itself makes
its calls as execute() does, each site's distinct arguments in one batch (see
llmdb/relation.py). The model is the hash stand-in, counting its requests."""

from __future__ import annotations

import gc

import pyarrow as pa
import pytest

import llmdb
from llmdb.backends.standin import StandinBackend

ROWS = 5000  # more than two DuckDB vectors (2,048 rows)
TABLE = pa.table({"i": list(range(ROWS)), "p": [f"row {i}" for i in range(ROWS)]})
COMPLETE = "SELECT i, llm_complete(p, max_tokens := 2) AS c FROM t"
FIRST_PASSING = "SELECT i FROM t WHERE llm_filter(p) ORDER BY i LIMIT 3"


@pytest.fixture
def backend() -> StandinBackend:
    return StandinBackend()


@pytest.fixture
def con(backend):
    c = llmdb.connect(model="counting", backend=backend, cache=False)
    c.register("t", TABLE)
    yield c
    c.close()


def _batches(con, query: str) -> list[list[int]]:
    """The sizes of the batches each call site sent, in the query's last run."""
    return [c.batches for c in con.planner.last_counts(query).values()]


def test_a_relation_never_read_pays_nothing(con, backend):
    rel = con.sql(COMPLETE)
    assert rel.columns == ["i", "c"]  # planned and bound, as before
    assert backend.requests == 0
    del rel
    gc.collect()
    assert backend.requests == 0


def test_a_limit_on_a_relation_pays_for_the_rows_it_reads(con, backend):
    rel = con.sql(COMPLETE)
    five = rel.limit(5).fetchall()
    assert len(five) == 5 and backend.requests == 5
    rows = rel.fetchall()  # the rest, in one batch: the planner's driver
    assert set(five) <= set(rows) and len(rows) == ROWS
    assert backend.requests == ROWS
    assert _batches(con, COMPLETE) == [[5, ROWS - 5]]


def test_reading_a_relation_makes_its_calls_as_execute_does(con, backend):
    rel = con.sql(COMPLETE)
    rows = rel.fetchall()
    assert backend.requests == ROWS and _batches(con, COMPLETE) == [[ROWS]]
    assert sorted(rows) == sorted(con.execute(COMPLETE).fetchall())
    backend.requests = 0
    assert rel.df().shape == (ROWS, 2) and backend.requests == 0  # read again: its memo


def test_a_relation_built_on_an_order_by_limit_query_pays_what_the_query_needs(con, backend):
    """The query's own steps stop at its first passing rows; DuckDB alone would evaluate
    the WHERE on every row, whichever relation reads it."""
    con.execute(FIRST_PASSING).fetchall()  # (its filter's calibration, made once)
    backend.requests = 0
    want = con.execute(FIRST_PASSING).fetchall()
    needed, backend.requests = backend.requests, 0
    assert 0 < needed < 100
    rel = con.sql(FIRST_PASSING)
    assert backend.requests == 0
    assert rel.limit(2).fetchall() == want[:2]
    assert backend.requests == needed
    assert [line.split()[1] for line in repr(rel).splitlines()[4:7]] == \
        [str(i) for (i,) in want]
    assert backend.requests == needed


def test_a_statement_that_writes_runs_now_and_create_reads_in_one_batch(con, backend):
    con.sql(f"CREATE TABLE made AS {COMPLETE} WHERE i < 100")
    assert backend.requests == 100
    assert con.execute("SELECT count(*) FROM made").fetchall() == [(100,)]
    rel = con.sql(f"{COMPLETE} WHERE i >= 4900")
    assert backend.requests == 100
    rel.create("copied")
    assert backend.requests == 200 and _batches(con, f"{COMPLETE} WHERE i >= 4900") == [[100]]
    assert con.execute("SELECT count(*) FROM copied").fetchall() == [(100,)]
