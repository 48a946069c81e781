"""Identical requests are computed once: within a vector, and across threads and connections
while one of them is in flight."""

from __future__ import annotations

import threading

import duckdb
import pytest

import llmdb

from .sql_support import column, last_query, register_rows

pytestmark = pytest.mark.usefixtures("eng", "own_cache_dir")


DUPLICATED = ["Name a color.", "Name a fruit.", "Name a color.", None, "Name a city.",
              "Name a fruit.", "Name a color."]


def test_duplicates_in_a_vector_are_computed_once():
    # A plain DuckDB connection (no planner): the UDF itself gets the duplicated vector.
    plain = duckdb.connect()
    session = llmdb.register(plain, cache=False)
    register_rows(plain, DUPLICATED)
    got = column(plain, "llm_complete(p, max_tokens := 4)")
    stats = session.stats()["total"]
    assert (stats["rows"], stats["calls"], stats["dedup_hits"]) == (6, 3, 3)
    assert got[3] is None
    # Every copy carries the answer that the distinct prompt gets on its own.
    register_rows(plain, ["Name a color.", "Name a fruit.", "Name a city."])
    alone = dict(zip(["Name a color.", "Name a fruit.", "Name a city."],
                     column(plain, "llm_complete(p, max_tokens := 4)"), strict=True))
    assert got == [None if p is None else alone[p] for p in DUPLICATED]
    plain.close()


def test_a_connection_calls_the_model_once_per_distinct_prompt(con):
    register_rows(con, DUPLICATED)
    column(con, "llm_complete(p, max_tokens := 4)")
    assert last_query(con)["calls"] == 3


def test_rows_repeating_a_prompt_count_as_rows_and_dedup_hits(con):
    """The planner sends each distinct prompt once; the repeats still count as rows."""
    prompts = ["Name a color."] * 20 + [f"Name {i} colors." for i in range(10)] + [None] * 3
    register_rows(con, prompts)
    column(con, "llm_complete(p, max_tokens := 2)")
    stats = last_query(con)
    assert (stats["rows"], stats["model_rows"], stats["dedup_hits"]) == (30, 11, 19)


def test_dedup_covers_filter_and_classify(con):
    register_rows(con, ["Say yes.", "Say no.", "Say yes.", "Say yes."])
    scores = column(con, "llm_filter_score(p)")
    assert scores[0] == scores[2] == scores[3]
    assert last_query(con)["model_rows"] == 2  # each asked with both answer orders
    labels = column(con, "llm_classify(p, ['yes', 'no', 'maybe'])")
    assert labels[0] == labels[2] == labels[3]
    assert last_query(con)["model_rows"] == 2  # distinct rows, each labels x labels requests


def test_sampling_without_seed_is_never_shared(con):
    register_rows(con, ["Name a color."] * 3)
    column(con, "llm_complete(p, max_tokens := 4, temperature := 1.0)")
    stats = last_query(con)
    assert stats["calls"] == 3 and stats["dedup_hits"] == 0  # three independent draws
    column(con, "llm_complete(p, max_tokens := 4, temperature := 1.0, seed := 3)")
    assert last_query(con)["calls"] == 1  # a seeded draw is one answer


CALL = "llm_complete({}, max_tokens := 4, {})"


@pytest.mark.parametrize("run", ["execute", "sql"])
@pytest.mark.parametrize("planner", [True, False], ids=["planned", "as written"])
@pytest.mark.parametrize("prompt", ["'Name a color.'", "'Name a color.' || (i * 0)"],
                         ids=["constant", "constant per row"])
def test_sampling_without_seed_draws_per_row_for_a_constant_prompt(run, planner, prompt):
    """DuckDB computes a pure function of constant arguments once and copies the value to
    every row: `llm_complete('...', temperature := 1.0) FROM range(4)` (generating rows)
    was one draw copied four times, where a column of four equal prompts is four draws."""
    con = llmdb.connect(cache=False, planner=planner)

    def calls(options: str) -> int:
        before = con.stats()["total"]["calls"]
        query = f"SELECT {CALL.format(prompt, options)} FROM range(4) t(i)"
        assert len(getattr(con, run)(query).fetchall()) == 4
        return con.stats()["total"]["calls"] - before

    assert calls("temperature := 1.0") == 4  # four independent draws
    # A seeded or greedy call of constants is one answer, computed once.
    assert calls("temperature := 1.0, seed := 3") == 1
    assert calls("temperature := 0.0") == 1


def test_identical_queries_on_two_connections_share_in_flight_work():
    rows = [f"Write a word that rhymes with number {k}." for k in range(8)]
    barrier = threading.Barrier(2)
    results: dict[int, list] = {}
    sessions: dict[int, dict] = {}
    failures: list[BaseException] = []

    def run(k: int) -> None:
        try:
            c = llmdb.connect(cache=False)
            register_rows(c, rows)
            barrier.wait()
            results[k] = column(c, "llm_complete(p, max_tokens := 8)")
            sessions[k] = c.stats()["total"]
            c.close()
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            failures.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not failures, failures
    assert results[0] == results[1]
    # Each prompt was computed once between the two: the other connection waited for it.
    assert sessions[0]["calls"] + sessions[1]["calls"] == len(rows)
    assert sessions[0]["dedup_hits"] + sessions[1]["dedup_hits"] == len(rows)
