"""EXPLAIN LLM and query priorities on the stand-in model: estimates, actuals, the class."""

from __future__ import annotations

import random
import re

import duckdb
import pytest

import llmdb
from llmdb.backends import ChoiceRequest, GenerationRequest
from llmdb.backends.standin import standin_backend
from llmdb.cli import main as cli_main
from llmdb.functions import CONTENT_FREE, RT_MAX_CALLS
from llmdb.planner import LEARNED
from llmdb.planner.estimate import Request, shared_prefixes

from .planner_shapes import STANDIN, make_tables

ROWS = 2000


@pytest.fixture
def con(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMDB_CACHE_DIR", str(tmp_path / "cache"))
    LEARNED.clear()
    c = llmdb.connect(model=STANDIN, cache=False)
    make_tables(c, ROWS)
    yield c
    c.close()


@pytest.fixture
def requests(monkeypatch):
    """Every request the stand-in receives."""
    seen: list = []
    backend = standin_backend()
    submit = backend.submit

    def spy(request, on_finish):
        seen.append(request)
        return submit(request, on_finish)

    monkeypatch.setattr(backend, "submit", spy)
    return seen


def _site_rows(con, sql):
    con.execute(f"EXPLAIN LLM {sql}")
    cols = [d[0] for d in con.description]
    return [dict(zip(cols, r, strict=True)) for r in con.fetchall()]


def test_estimates_with_static_guards_are_exact_and_actuals_follow_a_run(con):
    sql = "SELECT id FROM t WHERE id % 7 = 0 AND llm_filter(x)"
    [site, total] = _site_rows(con, sql)
    rows = sum(1 for i in range(ROWS) if i % 7 == 0)
    distinct = len({i % 97 for i in range(ROWS) if i % 7 == 0})
    # A filter asks each distinct row twice (both answer orders); plus, the first time this
    # process meets the template, its content-free prior.
    prior = site["calibration_calls_est"]
    assert prior in (0, 2 * len(CONTENT_FREE))
    assert (site["rows_est"], site["distinct_est"], site["calls_est"]) == (rows, distinct,
                                                                            2 * distinct + prior)
    assert site["rows_duckdb"] is not None and site["rows_actual"] is None
    assert total["site"] == "total" and total["calls_est"] == 2 * distinct + prior
    con.execute(sql).fetchall()
    [ran, _] = _site_rows(con, sql)
    assert (ran["rows_actual"], ran["distinct_actual"]) == (rows, distinct)
    assert (ran["calls_actual"], ran["calibration_calls_actual"]) == (site["calls_est"], prior)
    assert ran["prompt_tokens_actual"] == site["prompt_tokens_est"]


def test_explain_through_sql_gives_the_same_report(con):
    """con.sql("EXPLAIN LLM ...") is a relation of the report, and the connection goes on
    working after it (DuckDB 2 refuses work while an execute() result is unread)."""
    sql = "SELECT id FROM t WHERE id % 7 = 0 AND llm_filter(x)"
    executed = _site_rows(con, sql)
    rel = con.sql(f"EXPLAIN LLM {sql}")
    other = con.sql("EXPLAIN LLM SELECT llm_complete(x) FROM t")  # its own report
    assert other.fetchall()[0][1] == "llm_complete"
    assert [dict(zip(rel.columns, r, strict=True)) for r in rel.fetchall()] == executed
    assert con.sql("SELECT count(*) FROM t").fetchall() == [(ROWS,)]


def test_incremental_estimate_uses_learned_values(con):
    """ORDER BY ... LIMIT: after one run the pseudo answers are drawn from the real ones."""
    sql = "SELECT id FROM t WHERE llm_filter(x) ORDER BY id LIMIT 20"
    con.execute(sql).fetchall()
    [site, _] = _site_rows(con, sql)
    assert site["calls_actual"] > 20
    assert abs(site["calls_est"] - site["calls_actual"]) <= 0.5 * site["calls_actual"]


def test_cache_hits_are_estimated_from_the_cache(tmp_path):
    c = llmdb.connect(model=STANDIN, cache=True, cache_path=str(tmp_path / "r.sqlite"))
    make_tables(c, 300)
    sql = "SELECT id, llm_complete(y, max_tokens := 3) FROM t WHERE id < 200"
    [before, _] = _site_rows(c, sql)
    assert before["cache_hits_est"] == 0 and before["calls_est"] == 13
    assert before["output_tokens_est"] == 3 * 13
    c.execute(sql).fetchall()
    [after, _] = _site_rows(c, sql)
    assert after["cache_hits_est"] == 13 and after["calls_est"] == 0
    c.close()


def test_explain_of_a_query_without_calls(con):
    rows = _site_rows(con, "SELECT count(*) FROM t")
    assert len(rows) == 1 and "runs as written: no LLM calls" in rows[0]["call"]
    # sqlglot reads `range < 4` as the start of a type: DuckDB runs it as written.
    [row] = _site_rows(con, "SELECT llm_filter('a' || range) FROM range(10) WHERE range < 4")
    assert "cannot parse" in row["call"]


def test_explain_of_a_wrong_query_raises_duckdbs_error(con, requests):
    with pytest.raises(duckdb.CatalogException, match="nosuch does not exist"):
        con.explain("SELECT llm_complete('a') FROM nosuch")
    assert requests == []  # binding it asked the model nothing


@pytest.mark.parametrize("query", ["SELEC 1", "SELECT llm_complete('a') FROM"])
def test_explain_of_a_query_duckdb_cannot_parse_raises_its_error(con, query, requests):
    """DuckDB's own parser error, as running it raises and `llmdb explain` prints: not a
    report that the query "runs as written: no LLM calls"."""
    with pytest.raises(duckdb.ParserException) as reference:
        duckdb.connect().execute(query)
    for explain in (con.explain, lambda q: con.execute(f"EXPLAIN LLM {q}"),
                    lambda q: con.sql(f"EXPLAIN LLM {q}")):
        with pytest.raises(duckdb.ParserException) as raised:
            explain(query)
        assert str(raised.value) == str(reference.value)
    assert requests == []


def test_explain_takes_one_statement(con):
    for explain in (con.explain, lambda q: con.execute(f"EXPLAIN LLM {q}")):
        with pytest.raises(ValueError, match="EXPLAIN LLM explains one statement, not 2"):
            explain("SELECT llm_complete(x) FROM t; SELECT 2")


def test_cli_explain(capsys):
    code = cli_main(["explain", "--model", STANDIN, "--no-cache", "--analyze",
                     "SELECT llm_filter('a' || i) FROM range(10) t(i) WHERE i < 4"])
    out = capsys.readouterr().out
    assert code == 0
    assert "site 0: LLM_FILTER('a' || i)" in out
    # Both answer orders per row, and the prior unless this process measured it already.
    assert re.search(r"model calls        est (8|14)   actual \1\n", out)
    assert "priority RT" in out


def test_small_queries_are_interactive_large_ones_bulk(con, requests):
    con.execute("SELECT id FROM t WHERE id < 12 AND llm_filter(x)").fetchall()
    assert {r.priority for r in requests} == {"RT"}
    requests.clear()
    con.execute("SELECT id FROM t WHERE id < 500 AND llm_filter(x)").fetchall()
    assert {r.priority for r in requests} == {"BE"}


def test_priority_set_on_the_connection_and_on_a_call(requests):
    c = llmdb.connect(model=STANDIN, cache=False, priority="BE")
    make_tables(c, 200)
    c.execute("SELECT id FROM t WHERE id < 5 AND llm_filter(x)").fetchall()
    assert {r.priority for r in requests} == {"BE"}
    requests.clear()
    c.execute("SELECT id FROM t WHERE id < 5 AND llm_filter(x, priority := 'RT')").fetchall()
    assert {r.priority for r in requests} == {"RT"}
    with pytest.raises(Exception, match="priority"):
        c.execute("SELECT llm_filter(x, priority := 'urgent') FROM t").fetchall()
    c.close()


def test_explain_reports_the_class_the_run_uses(con, requests):
    sql = "SELECT id FROM t WHERE id < 300 AND llm_filter(y)"
    [site, total] = _site_rows(con, sql)
    con.execute(sql).fetchall()
    assert site["priority"] == total["priority"] == "RT"  # 13 distinct prompts
    assert {r.priority for r in requests} == {"RT"}


def test_a_query_is_interactive_until_its_calls_pass_the_limit(con, requests):
    """The filter's 13 prompts (26 requests, within RT_MAX_CALLS) are sent first, as RT; the
    completions of the rows it passes take the query past the limit: BE."""
    con.execute("SELECT id, llm_complete(x, max_tokens := 1) FROM t "
                "WHERE id < 500 AND llm_filter(y)").fetchall()
    choices = [r for r in requests if isinstance(r, ChoiceRequest)]
    completions = [r for r in requests if isinstance(r, GenerationRequest)]
    assert len(choices) >= 26 and {r.priority for r in choices} == {"RT"}
    assert len(completions) > RT_MAX_CALLS - 26 and {r.priority for r in completions} == {"BE"}


def test_shared_prefixes_are_the_longest_prefix_another_request_shares():
    """Against the definition: each request's leading full blocks (within what a prefix hit
    may cover) that some other sampled request also leads with, or the pool holds."""
    rng = random.Random(0)
    block = 4
    for _ in range(200):
        stem = [rng.randrange(3) for _ in range(12)]
        requests = []
        for _ in range(rng.randrange(1, 7)):
            ids = tuple(stem[:rng.randrange(13)] + [rng.randrange(3) for _ in range(6)])
            requests.append(Request(ids, len(ids), 1, rng.randrange(len(ids) + 1)))
        held = [rng.randrange(r.cacheable + 1) // block * block for r in requests]

        def leading(a, b):
            n = 0
            while n < min(a.cacheable, b.cacheable) and a.ids[n] == b.ids[n]:
                n += 1
            return n

        want = [max([h] + [leading(a, b) // block * block for j, b in enumerate(requests)
                           if j != i]) for i, (a, h) in enumerate(zip(requests, held, strict=True))]
        assert shared_prefixes(requests, block, held) == want


def test_each_site_gets_the_estimate_of_the_operator_evaluating_it(con):
    """The filter runs on the scan's rows below id 500; the completion on the rows the filter
    passes, which DuckDB estimates at fewer."""
    complete, where, _ = _site_rows(
        con, "SELECT id, llm_complete(x, max_tokens := 2) FROM t WHERE id < 500 AND llm_filter(x)")
    assert where["function"] == "llm_filter" and complete["function"] == "llm_complete"
    assert 0 < complete["rows_duckdb"] < where["rows_duckdb"] <= 500
