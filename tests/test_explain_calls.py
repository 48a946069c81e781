"""EXPLAIN LLM's model calls are the calls the query then makes (llm_stats()): the row calls
and the content-free calibration priors of llm_filter/llm_classify templates that this
process has not measured yet; a NULL row is no prompt and no call. The model is the hash
stand-in, the result cache is off unless a test opens its own."""

from __future__ import annotations

import pytest

import llmdb
from llmdb import functions
from llmdb.backends.standin import standin_backend
from llmdb.functions import CONTENT_FREE
from llmdb.planner import LEARNED

STANDIN = "hash-standin"
CLASSIFY = "SELECT llm_classify(x, ['a', 'b']) FROM t"
FILTER = "SELECT llm_filter(x) FROM t"


@pytest.fixture
def fresh_priors(monkeypatch):
    """No calibration prior measured yet, as in a process that just started."""
    monkeypatch.setattr(functions, "_priors", {})


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


@pytest.mark.parametrize(("sql", "per_row", "prior"), [
    (CLASSIFY, 2 * 2, len(CONTENT_FREE) * 2 * 2),  # each label under each rotation
    (FILTER, 2, len(CONTENT_FREE) * 2),  # both answer orders
])
def test_the_estimate_counts_the_calibration_a_fresh_process_makes(fresh_priors, sql,
                                                                   per_row, prior):
    con = _connect(5)
    text = con.explain(sql)
    assert f"calibration calls  est {prior}\n" in text
    assert f"model calls include {prior} calibration calls: the content-free prior" in text
    est = _total(con, sql)
    made = _calls_made(con, sql)
    assert est["calls_est"] == made["calls"] == 5 * per_row + prior
    assert est["calibration_calls_est"] == made["calibration_calls"] == prior
    # The prior is measured now: a second query makes the row calls alone, as estimated.
    text = con.explain(sql)
    assert f"calibration calls  est 0   actual {prior}\n" in text
    assert "content-free" not in text
    est = _total(con, sql)
    made = _calls_made(con, sql)
    assert est["calls_est"] == made["calls"] == 5 * per_row
    assert est["calibration_calls_est"] == made["calibration_calls"] == 0


def test_two_sites_of_one_template_measure_its_prior_once(fresh_priors):
    con = _connect(5)
    sql = "SELECT llm_filter_score(x), llm_filter(x || '!') FROM t"
    est = _total(con, sql)
    made = _calls_made(con, sql)
    assert est["calls_est"] == made["calls"] == 2 * 5 * 2 + 2 * len(CONTENT_FREE)
    assert est["calibration_calls_est"] == made["calibration_calls"] == 2 * len(CONTENT_FREE)


def test_a_prior_in_the_result_cache_is_no_call(fresh_priors, monkeypatch, tmp_path):
    """A later process finds the prior in the result cache, as it finds the rows."""
    con = _connect(5, cache=True, cache_path=str(tmp_path / "cache.sqlite"))
    _calls_made(con, CLASSIFY)
    monkeypatch.setattr(functions, "_priors", {})  # the next process
    est = _total(con, CLASSIFY)
    made = _calls_made(con, CLASSIFY)
    assert est["calls_est"] == made["calls"] == 0
    assert est["calibration_calls_est"] == made["calibration_calls"] == 0


def test_the_interactive_cut_counts_the_calibration(fresh_priors, monkeypatch):
    """6 rows x 4 scorings = 24 calls is interactive (<= 32) once the prior is known; before,
    its 12 calibration calls make it 36: bulk, in EXPLAIN and in the run alike."""
    sent = []
    backend = standin_backend()
    submit = backend.submit
    monkeypatch.setattr(backend, "submit", lambda r, done: (sent.append(r), submit(r, done))[1])
    con = _connect(6)
    for expected in ("BE", "RT"):
        sent.clear()
        assert _total(con, CLASSIFY)["priority"] == expected
        _calls_made(con, CLASSIFY)
        assert {r.priority for r in sent} == {expected}


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
