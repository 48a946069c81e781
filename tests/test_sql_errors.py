"""Per-row errors: 'raise' fails the query naming the row, the cause and the numbers; 'null'
answers the other rows and keeps the reason in llm_errors()."""

from __future__ import annotations

import re

import duckdb
import pyarrow as pa
import pytest

import llmdb
from llmdb.engine.params import SamplingParams

from .sql_support import chat, column, register_rows

pytestmark = pytest.mark.usefixtures("eng", "own_cache_dir")

LONG = "word " * 9000  # about 9,000 tokens: longer than the model's context of 8,192
TOO_LONG = re.compile(r"prompt is 9,\d{3} tokens, longer than the model's context of 8,192")


def _errors(con) -> list[tuple]:
    return con.execute("SELECT function, prompt, error FROM llm_errors()").fetchall()


def _assert_engine_clean(eng) -> None:
    assert not eng.has_unfinished
    assert eng.pool.num_free == eng.pool.num_blocks, "blocks leaked"


def test_raise_names_the_row_the_cause_and_the_numbers(con, eng):
    register_rows(con, ["Name a color.", LONG, "Name a fruit."])
    with pytest.raises(duckdb.Error) as info:
        column(con, "llm_complete(p, max_tokens := 4)")
    message = str(info.value)
    assert "llm_complete" in message
    assert "'word word word" in message  # the row, by a prefix of its prompt
    assert TOO_LONG.search(message), message
    # Not the engine's request id (it differs from run to run, and means nothing to a user)
    assert "(request" not in message, message
    assert _errors(con) == []  # raised, not recorded
    assert con.stats()["last_query"]["errors"] == 1  # counted once
    _assert_engine_clean(eng)


def test_a_long_prompt_is_named_by_its_start_and_its_end():
    """A shared instruction first, the row's own value last: both show in the error."""
    from llmdb.batch import describe_row

    prompt = "Summarize this customer review in exactly ten words, no more: " + "x" * 80 + \
        " (order 4711)"
    message = describe_row("llm_complete", prompt, "the cause")
    assert "'Summarize this customer review in exactl..." in message
    assert "(order 4711)': the cause" in message
    assert describe_row("llm_complete", "short", "c") == \
        "llm_complete failed on the row with prompt 'short': c"


def test_an_ill_formed_row_is_counted_once():
    con = llmdb.connect(cache=False)
    con.execute("CREATE TABLE m AS SELECT 'Say ' || i AS p, CASE WHEN i = 2 THEN -1 ELSE 2 END "
                "AS n FROM range(4) r(i)")
    with pytest.raises(llmdb.LLMError, match="max_tokens must be positive"):
        con.execute("SELECT llm_complete(p, max_tokens := n) FROM m").fetchall()
    assert con.stats()["last_query"]["errors"] == 1
    con.execute("SELECT llm_complete(p, max_tokens := n, on_error := 'null') FROM m").fetchall()
    stats = con.stats()["last_query"]
    assert (stats["rows"], stats["errors"], stats["model_rows"]) == (4, 1, 3)
    con.close()


@pytest.mark.parametrize("planner", [True, False], ids=["planned", "as written"])
def test_a_failing_call_reaches_the_model_once_per_query(planner):
    """DuckDB evaluates a failing constant call once per constant-folding attempt, and the
    planner's lookups follow a failed driver: one query still sends it once, and records it
    once. The next query tries it again (a failure may be transient)."""
    con = llmdb.connect(cache=False, planner=planner)
    con.execute("CREATE TABLE r AS SELECT range AS i FROM range(3)")
    query = f"SELECT llm_complete('{LONG}', max_tokens := 2{{}}) FROM r"
    for _ in range(2):
        with pytest.raises(llmdb.LLMError, match=TOO_LONG):
            con.execute(query.format("")).fetchall()
        stats = con.stats()["last_query"]
        assert (stats["model_rows"], stats["errors"]) == (1, 1)
    assert con.execute(query.format(", on_error := 'null'")).fetchall() == [(None,)] * 3
    stats = con.stats()["last_query"]
    assert (stats["model_rows"], stats["errors"]) == (1, 1)
    assert len(_errors(con)) == 1
    con.close()


def test_null_policy_answers_the_other_rows_and_records_the_failure(con, eng):
    good = ["Name a color.", "Name a fruit."]
    register_rows(con, [good[0], LONG, good[1]])
    got = column(con, "llm_complete(p, max_tokens := 4, on_error := 'null')")
    ref = [r.text for r in eng.generate([chat(p) for p in good], SamplingParams(max_tokens=4))]
    assert got == [ref[0], None, ref[1]]
    assert con.stats()["last_query"]["errors"] == 1
    [(function, prompt, error)] = _errors(con)
    assert function == "llm_complete"
    assert prompt.startswith("word word") and len(prompt) <= 200
    assert TOO_LONG.search(error), error
    _assert_engine_clean(eng)


def test_null_policy_on_filter_and_classify(con, eng):
    register_rows(con, ["Say yes.", LONG])
    scores = column(con, "llm_filter_score(p, on_error := 'null')")
    assert scores[0] is not None and scores[1] is None
    labels = column(con, "llm_classify(p, ['yes', 'no'], on_error := 'null')")
    assert labels[0] in ("yes", "no") and labels[1] is None
    assert [f for f, _, _ in _errors(con)] == ["llm_filter", "llm_classify"]
    _assert_engine_clean(eng)


def test_a_template_whose_calibration_fails_fails_its_rows_only(con, eng):
    """A filter's calibration prior is per system prompt: one too long for the model fails
    the rows asking under it (named by their own prompts), not the query."""
    con.register("s", pa.table({"p": ["Is the sky blue?", "Is grass green?"],
                                "s": ["Answer briefly.", LONG]}))
    got = con.execute("SELECT llm_filter(p, system := s, on_error := 'null') FROM s "
                      "ORDER BY p DESC").fetchall()
    assert got[0][0] is not None and got[1][0] is None
    [(function, prompt, error)] = _errors(con)
    assert function == "llm_filter" and prompt == "Is grass green?"
    assert "calibrating its prompt template failed" in error and TOO_LONG.search(error)
    with pytest.raises(duckdb.Error, match="'Is grass green\\?'"):
        con.execute("SELECT llm_filter(p, system := s) FROM s").fetchall()
    _assert_engine_clean(eng)


def test_a_label_that_does_not_fit_aborts_the_labels_already_queued(con, eng):
    text = "word " * 7900  # fits with a short label, not with a 400-token one
    got = con.execute("SELECT llm_classify(?, ['a', ?], instruction := 'Pick one.', "
                      "on_error := 'null')", [text, "x " * 400]).fetchall()
    assert got == [(None,)]
    [(_, _, error)] = _errors(con)
    assert re.search(r"prompt plus continuation is 8,\d{3} tokens", error), error
    _assert_engine_clean(eng)  # label 'a' was queued, then aborted with its row


def test_connection_level_null_policy_and_per_call_override(eng):
    con = llmdb.connect(cache=False, on_error="null")
    register_rows(con, [LONG, "Name a color."])
    got = column(con, "llm_complete(p, max_tokens := 4)")
    assert got[0] is None and isinstance(got[1], str)
    assert len(_errors(con)) == 1
    with pytest.raises(duckdb.Error, match="8,192"):
        column(con, "llm_complete(p, max_tokens := 4, on_error := 'raise')")
    con.close()
    with pytest.raises(ValueError, match="on_error must be one of"):
        llmdb.connect(cache=False, on_error="ignore")


def test_unknown_model_names_the_registered_models(con):
    with pytest.raises(duckdb.Error) as info:
        con.execute("SELECT llm_complete('Name a color.', model := 'nope')").fetchall()
    message = str(info.value)
    assert "unknown model 'nope'" in message and "smollm2-135m" in message
    got = con.execute("SELECT llm_complete('Name a color.', model := 'nope', "
                      "on_error := 'null')").fetchall()
    assert got == [(None,)]
    [(_, prompt, error)] = _errors(con)
    assert prompt == "Name a color." and "unknown model 'nope'" in error
    assert con.stats()["total"]["calls"] == 0


@pytest.mark.parametrize("labels", ["[]::VARCHAR[]", "['a', '']"])
def test_invalid_labels_fail(con, labels):
    with pytest.raises(duckdb.Error, match="labels must be a non-empty list"):
        con.execute(f"SELECT llm_classify('Some text.', {labels})").fetchall()
    assert con.stats()["total"]["calls"] == 0


@pytest.mark.parametrize("call, cause", [
    ("llm_complete('Name a color.', max_tokens := 0)", "max_tokens must be positive"),
    ("llm_complete('Name a color.', top_p := 0.0)", "top_p must be in"),
    ("llm_complete('Name a color.', on_error := 'ignore')", "on_error must be one of"),
])
def test_invalid_parameters_name_the_cause(con, call, cause):
    with pytest.raises(duckdb.Error, match=cause):
        con.execute(f"SELECT {call}").fetchall()


@pytest.mark.parametrize("planner", [True, False])
def test_a_failed_row_raises_llmdb_error_and_duckdbs(planner):
    """The planner computes the row before the query runs (its own LLMError is the cause);
    without it DuckDB does, inside the query (DuckDB's error is the cause)."""
    con = llmdb.connect(cache=False, planner=planner)
    with pytest.raises(llmdb.LLMError, match="max_tokens must be positive") as e:
        con.execute("SELECT llm_complete('x', max_tokens := -5)").fetchall()
    assert isinstance(e.value, duckdb.InvalidInputException)  # as before, for DuckDB code
    assert str(e.value).startswith("llm_complete failed on the row with prompt 'x'")
    if planner:
        assert isinstance(e.value.__cause__, llmdb.LLMError)
        assert str(e.value.__cause__) == str(e.value)
    else:
        assert isinstance(e.value.__cause__, duckdb.Error)
        assert "Python exception" in str(e.value.__cause__)
    con.close()


def test_explains_time_scale_learns_from_whole_warm_batches(monkeypatch):
    """The time scale EXPLAIN applies learns from neither a model's first batch in the
    process (the engine's warm-up) nor a batch with failed rows (cut short)."""
    from llmdb.planner import estimate
    from llmdb.planner.learned import Learned

    monkeypatch.setattr(estimate, "calibrated", lambda cm: True)  # whatever this CPU is
    con = llmdb.connect(cache=False)
    con.planner.learned = learned = Learned()
    register_rows(con, ["Name a color.", "Name a fruit."])
    model = con.session.options.model

    def batches_after(call: str) -> int:
        con.execute(f"SELECT {call} FROM t").fetchall()
        return learned.time_scale(model)[1]

    assert batches_after("llm_complete(p, max_tokens := 2)") == 0  # the first: warm-up
    assert batches_after("llm_complete(p, max_tokens := 3)") == 1
    register_rows(con, ["Name a color.", LONG])
    assert batches_after("llm_complete(p, max_tokens := 2, on_error := 'null')") == 1
    con.close()


def test_a_relation_fetched_again_retries_a_failed_call():
    """The query's memory of failures lasts while the connection runs it: a relation the
    user fetches again later sends its calls again (the failure may have been transient)."""
    from llmdb.backends.standin import StandinBackend

    class Flaky(StandinBackend):
        failing, sent = True, 0

        def submit(self, request, on_finish):
            self.sent += 1
            if self.failing:
                raise ValueError("503 from the server")
            return super().submit(request, on_finish)

    backend = Flaky()
    # (Planned, the relation's calls would be made, and fail, by sql() itself.)
    con = llmdb.connect(model="flaky", backend=backend, cache=False, planner=False)
    rel = con.sql("SELECT llm_complete(p, max_tokens := 2) AS c FROM (VALUES ('a'), ('b')) v(p)")
    with pytest.raises(duckdb.Error, match="503"):
        rel.fetchall()
    backend.failing, backend.sent = False, 0
    assert all(c for (c,) in rel.fetchall())
    assert backend.sent == 2
    con.close()
