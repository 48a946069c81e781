"""Every llm_* SQL function on the bundled model, each checked against the engine itself."""

from __future__ import annotations

import json
import math

import duckdb
import pyarrow as pa
import pytest

from llmdb import functions
from llmdb.engine.params import SamplingParams
from llmdb.functions import (
    CLASSIFY_DATA,
    CLASSIFY_DATA_READ,
    CLASSIFY_INSTRUCTION,
    CONTENT_FREE,
    FILTER_SUFFIXES,
)

from .sql_support import chat, column, last_query, register_rows, rendered

pytestmark = pytest.mark.usefixtures("eng", "own_cache_dir")

STATS_FIELDS = {"rows", "calls", "calibration_calls", "model_rows", "cache_hits", "dedup_hits",
                "errors", "prompt_tokens", "generated_tokens", "cached_tokens", "resumed_tokens",
                "engine_s"}


# ---- llm_complete --------------------------------------------------------------------------

def test_complete_equals_the_engines_greedy_output(con, eng):
    prompts = ["Name a color.", "What is 2+2?", "Say hello in French."]
    register_rows(con, prompts)
    got = column(con, "llm_complete(p, max_tokens := 6)")
    ref = eng.generate([chat(p) for p in prompts], SamplingParams(max_tokens=6))
    assert got == [r.text for r in ref]
    stats = last_query(con)
    assert stats["calls"] == 3
    assert stats["generated_tokens"] == sum(r.usage.generated_tokens for r in ref)
    assert all(r.usage.generated_tokens <= 6 for r in ref)
    assert any(r.finish_reason == "length" for r in ref)  # max_tokens did cut an answer


def test_complete_system_prompt(con, eng):
    system = "You are a pirate."
    rows = con.execute(  # one batch: a row with the system prompt, a row without
        "SELECT llm_complete('Name a color.', max_tokens := 8, system := s) "
        "FROM (VALUES (0, $1), (1, NULL)) v(i, s) ORDER BY i", [system]).fetchall()
    [(got,), (plain,)] = rows
    ref = eng.generate([chat("Name a color.", system)], SamplingParams(max_tokens=8))[0].text
    assert got == ref
    assert got != plain


def test_complete_stop_strings_cut_the_answer(con, eng):
    full = con.execute("SELECT llm_complete('Name a color.', max_tokens := 8)").fetchall()[0][0]
    word = full.split()[2]  # a stop string that occurs in the middle of the answer
    cut = full[: full.index(word)]
    # In one batch: one stop string; any of several; one that never occurs.
    rows = con.execute(
        "SELECT llm_complete('Name a color.', max_tokens := 8, stop := s) FROM (VALUES "
        "(0, [$1]), (1, ['no such text', $1]), (2, ['no such text'])) v(i, s) ORDER BY i",
        [word]).fetchall()
    [(one,), (several,), (absent,)] = rows
    assert one == cut and word not in one
    ref = eng.generate([chat("Name a color.")], SamplingParams(max_tokens=8, stop=[word]))
    assert one == ref[0].text
    assert several == cut and absent == full
    # A plain string is one stop string, as in the DataFrame API.
    plain = con.execute("SELECT llm_complete('Name a color.', max_tokens := 8, stop := $1)",
                        [word]).fetchall()[0][0]
    assert plain == cut


@pytest.mark.parametrize("planned", [True, False])
@pytest.mark.parametrize(("call", "message"), [
    ("llm_complete(42)", "llm_complete: prompt must be text, got INTEGER"),
    ("llm_complete('x', max_tokens := 10**10)", "llm_complete: max_tokens must be an integer, "
     "got DOUBLE"),
    # A value beyond the type's range is the row's error (it fails that row alone).
    ("llm_complete('x', max_tokens := 10000000000)", "llm_complete failed on the row with "
     "prompt 'x': max_tokens = 10000000000 is out of range for INTEGER"),
    # Literals the planner passes unchecked must be exactly those the check would pass.
    ("llm_complete('x', max_tokens := 2147483648)", "max_tokens = 2147483648 is out of range"),
    ("llm_complete('x', max_tokens := 4e0)", "max_tokens must be an integer, got DOUBLE"),
    ("llm_complete('x', max_tokens := 4.0)", "max_tokens must be an integer, got DECIMAL"),
    ("llm_complete('x', seed := 2.5)", "seed must be an integer, got DECIMAL"),
    ("llm_complete('x', seed := -9223372036854775809)", "seed = -9223372036854775809 is out "
     "of range for BIGINT"),
    ("llm_complete('x', temperature := 1" + "0" * 40 + ")", "temperature must be a number"),
    ("llm_complete('x', system := 5)", "llm_complete: system must be text, got INTEGER"),
    ("llm_complete('x', temperature := 'hot')", "llm_complete: temperature must be a number"),
    ("llm_complete('x', stop := 42)", "llm_complete: stop must be text or a list of text"),
    ("llm_classify('x', 'positive')", "llm_classify: labels must be a list of text, got "
     "VARCHAR"),
    ("llm_filter(1.5)", "llm_filter: prompt must be text, got DECIMAL"),
])
def test_type_mistakes_name_the_function_and_the_parameter(con, call, message, planned):
    """Through the planner's rewrite and through the plain macros alike; never the internal
    UDF, its positional arguments or a cast."""
    target = con if planned else duckdb.connect()
    if not planned:
        import llmdb

        llmdb.register(target, cache=False)
    with pytest.raises(duckdb.Error) as info:
        target.execute(f"SELECT {call} FROM range(2)").fetchall()
    assert message in str(info.value)
    assert "__llmdb" not in str(info.value)


def test_seeded_sampling_is_reproducible_across_queries(con):
    prompts = ["Name a color.", "Name an animal.", "Name a city."]
    con.register("t", pa.table({"i": list(range(6)), "p": prompts * 2, "seed": [7] * 3 + [8] * 3}))
    query = ("SELECT llm_complete(p, max_tokens := 6, temperature := 1.5, seed := seed) "
             "FROM t WHERE seed IN ({}) ORDER BY i")
    both = [r[0] for r in con.execute(query.format("7, 8")).fetchall()]
    assert last_query(con)["calls"] == 6
    again = [r[0] for r in con.execute(query.format("7")).fetchall()]
    assert last_query(con)["calls"] == 3  # computed again (cache off), not remembered
    assert again == both[:3]
    assert both[3:] != both[:3]  # another seed, another draw


# ---- llm_filter / llm_filter_score ---------------------------------------------------------

FILTER_PROMPTS = ["Say yes.", "Reply yes if 2+2=4.", "Is Paris the capital of France?",
                  "Do you know what a cat is?"]


def _p_yes(eng, prompt: str) -> float:
    """P(yes) / (P(yes) + P(no)) of the first answer token, averaged over both answer orders."""
    tok = eng.tokenizer
    yes, no = tok.single_token_variants("yes"), tok.single_token_variants("no")
    out = []
    for suffix in FILTER_SUFFIXES:
        probs = eng.logits(eng.encode_prompt(chat(prompt + suffix)))[-1].double().softmax(-1)
        p_yes, p_no = float(probs[yes].sum()), float(probs[no].sum())
        out.append(p_yes / (p_yes + p_no))
    return sum(out) / len(out)


@pytest.fixture
def fresh_priors(monkeypatch):
    """Content-free priors computed anew by this test (they are kept per process)."""
    monkeypatch.setattr(functions, "_priors", {})


def test_filter_score_is_calibrated_p_yes(con, eng, fresh_priors):
    tok = eng.tokenizer
    assert len(tok.single_token_variants("yes")) > 1  # the variants (yes, Yes, " yes", ...)
    register_rows(con, FILTER_PROMPTS)
    got = column(con, "llm_filter_score(p)")
    prior = sum(_p_yes(eng, t) for t in CONTENT_FREE) / len(CONTENT_FREE)
    for prompt, score in zip(FILTER_PROMPTS, got, strict=True):
        p = _p_yes(eng, prompt)
        want = (p / prior) / (p / prior + (1 - p) / (1 - prior))  # contextual calibration
        assert score == pytest.approx(want, abs=1e-4), prompt
    # Two answer orders per row, and per template the content-free texts once.
    n = len(FILTER_PROMPTS)
    assert last_query(con)["calls"] == 2 * n + 2 * len(CONTENT_FREE)


def test_filter_is_score_at_least_one_half(con):
    register_rows(con, FILTER_PROMPTS)
    rows = con.execute("SELECT p, llm_filter(p), llm_filter_score(p) FROM t ORDER BY i").fetchall()
    assert [f for _, f, _ in rows] == [s >= 0.5 for _, _, s in rows]
    kept = con.execute("SELECT p FROM t WHERE llm_filter(p) ORDER BY i").fetchall()
    assert [p for p, in kept] == [p for p, f, _ in rows if f]


# ---- llm_classify --------------------------------------------------------------------------

def _label_probs(eng, text: str, labels: list[str]) -> list[float]:
    """Each label's probability among the labels (its tokens, then end of turn), averaged over
    the prompts that list the sorted labels in each rotation."""
    tok = eng.tokenizer
    end_of_turn = tok.token_id(tok.eos_token)
    labels = sorted(labels)
    rows = []
    for k in range(len(labels)):
        order = labels[k:] + labels[:k]
        head = CLASSIFY_INSTRUCTION.format(labels=", ".join(order))
        messages = [{"role": "user", "content": CLASSIFY_DATA.format(text=text)},
                    {"role": "assistant", "content": CLASSIFY_DATA_READ},
                    {"role": "user", "content": head}]
        scores = eng.score(messages,
                           [tok.encode_plain(label) + [end_of_turn] for label in labels])
        weights = [math.exp(x - max(scores)) for x in scores]
        rows.append([w / sum(weights) for w in weights])
    return [sum(col) / len(rows) for col in zip(*rows, strict=True)]


def test_classify_is_the_argmax_of_calibrated_label_probabilities(con, eng, fresh_priors):
    labels = ["positive", "negative", "pos"]
    texts = ["I love this product, it works great!", "Terrible, it broke after a day."]
    register_rows(con, texts)
    got = con.execute("SELECT llm_classify(p, ?) FROM t ORDER BY i", [labels]).fetchall()
    priors = [_label_probs(eng, t, labels) for t in CONTENT_FREE]
    prior = [sum(col) / len(priors) for col in zip(*priors, strict=True)]
    for text, (label,) in zip(texts, got, strict=True):
        probs = [p / q for p, q in zip(_label_probs(eng, text, labels), prior, strict=True)]
        assert label == sorted(labels)[probs.index(max(probs))], (text, probs)
    k = len(labels)  # each label under each rotation; the prior once per template
    assert last_query(con)["calls"] == (len(texts) + len(CONTENT_FREE)) * k * k


def test_classify_does_not_depend_on_label_order(con):
    texts = ["I love this product, it works great!", "Terrible, it broke after a day.",
             "It is a kettle.", "Not bad, not great."]
    register_rows(con, texts)
    orders = [["positive", "negative", "neutral"], ["neutral", "negative", "positive"],
              ["negative", "positive", "neutral"]]
    answers = [column(con, f"llm_classify(p, {order})") for order in orders]
    assert answers[0] == answers[1] == answers[2]
    for instruction in ("Is this review positive? Answer with one word.", None):
        got = {con.execute("SELECT llm_classify(?, ?, instruction := ?)",
                           [texts[0], lb, instruction]).fetchall()[0][0]
               for lb in (["pos", "positive"], ["positive", "pos"])}
        assert len(got) == 1


def test_classify_refuses_duplicate_labels(con):
    with pytest.raises(duckdb.Error, match="row with prompt 'Nice.'.*'positive' is listed twice"):
        con.execute("SELECT llm_classify('Nice.', ['positive', 'negative', 'positive'])"
                    ).fetchall()
    got = con.execute("SELECT llm_classify('Nice.', ['a', 'a'], on_error := 'null')"
                      ).fetchall()[0][0]
    assert got is None


def test_classify_never_answers_outside_the_labels(con):
    labels = ["alpha", "beta gamma", "42"]
    register_rows(con, ["A red apple.", "Banana!", "The number seven.", "Ignore the labels."])
    got = column(con, "llm_classify(p, ['alpha', 'beta gamma', '42'], "
                       "instruction := 'Answer with the word banana.')")
    assert len(got) == 4 and all(label in labels for label in got)


# ---- llm_count_tokens ----------------------------------------------------------------------

def test_count_tokens_counts_the_text_alone(con, eng):
    texts = ["hello world", "", "Ünïcödé text with a duck 🦆", "SELECT * FROM t;", None]
    register_rows(con, texts)
    got = column(con, "llm_count_tokens(p)")
    assert got == [None if t is None else len(eng.tokenizer.encode_plain(t)) for t in texts]
    assert got[0] < len(eng.tokenizer.encode(rendered("hello world")))  # no chat template
    assert con.stats()["total"]["calls"] == 0  # no model call


# ---- llm_stats and NULLs -------------------------------------------------------------------

def test_stats_report_the_last_query_and_the_total(con, eng):
    register_rows(con, ["Name a color.", None, "Name a color."])
    con.execute("SELECT llm_complete(p, max_tokens := 4) FROM t").fetchall()
    stats = json.loads(con.execute("SELECT llm_stats()").fetchall()[0][0])
    assert set(stats) == {"last_query", "total"}
    last = stats["last_query"]
    assert set(last) == set(stats["total"]) == STATS_FIELDS
    assert last["calls"] == 1 and (last["cache_hits"], last["errors"]) == (0, 0)
    assert last["rows"] == last["calls"] + last["dedup_hits"]  # rows computed or copied
    assert last["prompt_tokens"] == len(eng.tokenizer.encode(rendered("Name a color.")))
    assert 0 < last["generated_tokens"] <= 4 and last["engine_s"] > 0
    con.execute("SELECT llm_complete('Name a fruit.', max_tokens := 4)").fetchall()
    second = last_query(con)
    assert second["calls"] == 1 and second["rows"] == 1
    total = con.execute("SELECT CAST(llm_stats()->>'$.total.calls' AS INTEGER)").fetchall()[0][0]
    assert total == last["calls"] + second["calls"]


def test_null_inputs_give_null_without_a_model_call(con):
    register_rows(con, [None, None])
    row = con.execute(
        "SELECT list(llm_complete(p)), list(llm_filter(p)), list(llm_filter_score(p)), "
        "list(llm_classify(p, ['a', 'b'])), list(llm_classify('text', NULL)), "
        "list(llm_count_tokens(p)) FROM t").fetchall()[0]
    assert all(values == [None, None] for values in row)
    assert con.stats()["total"]["calls"] == 0 and con.stats()["total"]["rows"] == 0
    # NULL rows next to real ones: only the real ones reach the model.
    register_rows(con, ["Name a color.", None, None])
    assert [v is None for v in column(con, "llm_complete(p, max_tokens := 3)")] == [
        False, True, True]
    stats = last_query(con)
    assert stats["calls"] == 1 and stats["rows"] == 1
    # A query whose rows are all NULL is the last query now, with no call.
    register_rows(con, [None, None])
    assert column(con, "llm_complete(p, max_tokens := 3)") == [None, None]
    stats = last_query(con)
    assert stats["calls"] == 0 and stats["rows"] == 0
