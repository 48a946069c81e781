"""llmdb.complete / filter / classify on pandas, polars and pyarrow tables: the same type back,
the same values as the SQL functions on the same rows, NULL for rows with a NULL field."""

from __future__ import annotations

import numpy as np
import pandas as pd
import polars as pl
import pyarrow as pa
import pytest

import llmdb
from llmdb.session import Options, Session

from .sql_support import column_values

pytestmark = pytest.mark.usefixtures("eng", "own_cache_dir")

DATA = {
    "product": ["blender", "lamp", None, "kettle", "chair"],
    "review": ["Great product, works well. Say yes.", "Broke after one day.", "Fine.", None,
               "Reply yes if 2+2=4."],
}
LABELS = ["positive", "negative"]


def _frame(kind: str):
    if kind == "pandas":
        return pd.DataFrame(DATA)
    if kind == "polars":
        return pl.DataFrame(DATA)
    return pa.table(DATA)


def _names(df) -> list[str]:
    return df.column_names if isinstance(df, pa.Table) else list(df.columns)


@pytest.fixture(scope="module")
def sql_reference(eng):
    """The SQL functions' answers on the same rows (cache off: computed, not looked up)."""
    con = llmdb.connect(cache=False)
    rows = pa.table({"i": list(range(len(DATA["review"]))), **DATA})
    con.register("t", rows)

    def column(expr: str) -> list:
        return [r[0] for r in con.execute(f"SELECT {expr} FROM t ORDER BY i").fetchall()]

    ref = {
        "complete": column("llm_complete('Product ' || product || ': ' || review, "
                           "max_tokens := 6)"),
        "keep": column("llm_filter(review)"),
        "classify": column(f"llm_classify(review, {LABELS!r})"),
    }
    con.close()
    return ref


KINDS = ["pandas", "polars", "pyarrow"]


@pytest.mark.parametrize("kind", KINDS)
def test_complete_equals_sql(kind, sql_reference):
    df = _frame(kind)
    out = llmdb.complete(df, "Product {product}: {review}", output="answer", max_tokens=6,
                         cache=False)
    assert type(out) is type(df)
    assert column_values(out, "answer") == sql_reference["complete"]
    assert column_values(out, "review") == DATA["review"]  # the input columns are kept
    assert column_values(out, "answer")[2] is None and column_values(out, "answer")[3] is None


@pytest.mark.parametrize("kind", KINDS)
def test_filter_keeps_the_rows_sql_keeps(kind, sql_reference):
    df = _frame(kind)
    out = llmdb.filter(df, "{review}", cache=False)
    assert type(out) is type(df)
    keep = sql_reference["keep"]
    assert True in keep and False in keep  # both outcomes are exercised
    assert column_values(out, "product") == [p for p, k in zip(DATA["product"], keep, strict=True)
                                       if k]


@pytest.mark.parametrize("kind", KINDS)
def test_classify_equals_sql(kind, sql_reference):
    df = _frame(kind)
    out = llmdb.classify(df, "review", LABELS, output="sentiment", cache=False)
    assert type(out) is type(df)
    assert column_values(out, "sentiment") == sql_reference["classify"]
    assert column_values(out, "sentiment")[3] is None  # NULL review
    assert all(v in LABELS for v in column_values(out, "sentiment") if v is not None)


def test_pandas_missing_values_of_any_dtype_give_null():
    df = pd.DataFrame({"review": pd.array(["Fine.", None], dtype="string"),
                       "other": pd.Series(["a", None], dtype=object),
                       "when": pd.to_datetime(["2020-01-01", None]),
                       "nan32": pd.Series(["a", np.float32("nan")], dtype=object)})
    for column in df.columns:
        out = llmdb.complete(df, f"{{{column}}}", max_tokens=3, cache=False)
        assert isinstance(out["completion"][0], str) and pd.isna(out["completion"][1]), column


def test_options_are_checked_before_any_row():
    """A wrong option fails every row alike: it is the call's error, raised before any
    work, even under on_error='null' (which would otherwise answer NULL everywhere)."""
    table = pa.table(DATA)
    wrong = [
        (lambda: llmdb.complete(table, "{review}", max_tokens=0, on_error="null"),
         ValueError, "max_tokens must be positive"),
        (lambda: llmdb.complete(table, "{review}", temperature=-1, on_error="null"),
         ValueError, "temperature must be >= 0"),
        (lambda: llmdb.complete(table, "{review}", on_error="ignore"), ValueError, "on_error"),
        (lambda: llmdb.classify(table, "review", "positive", on_error="null"), TypeError,
         "labels must be a list of strings, got str"),
        (lambda: llmdb.classify(table, "review", ["yes", "yes"], on_error="null"),
         ValueError, "listed twice"),
        # Another function's option would be ignored.
        (lambda: llmdb.complete(table, "{review}", instruction="Be brief."), TypeError,
         "llmdb.complete does not take instruction"),
        (lambda: llmdb.filter(table, "{review}", max_tokens=2), TypeError,
         "llmdb.filter does not take max_tokens"),
        (lambda: llmdb.complete(table, "{review}", reorder_fields=True), ValueError,
         "give fields"),
        (lambda: llmdb.classify(table, "review", LABELS, error_column="label"), ValueError,
         "error_column and output are both 'label'"),
        (lambda: llmdb.filter(table, "{review}", error_column=1), TypeError,
         "error_column must be a column name, got 1"),
        # str.format's positional fields are no column: not an IndexError from a row.
        (lambda: llmdb.complete(table, "Say {}"), ValueError, r"\{\} names no column"),
        (lambda: llmdb.complete(pa.table({"0": ["a"]}), "Say {0}", on_error="null"),
         ValueError, r"\{0\} names no column.*rename a column whose name is a number"),
        # A value of the wrong type is refused by name, not cast (2.5 tokens ran as 2, "5"
        # as 5, a seed of 1.5 as 1) nor left to fail every row (system=5: NULL everywhere).
        (lambda: llmdb.complete(table, "{review}", max_tokens="5"), TypeError,
         "llmdb.complete: max_tokens must be an integer, got '5'"),
        (lambda: llmdb.complete(table, "{review}", max_tokens=2.5), TypeError,
         "max_tokens must be an integer, got 2.5"),
        (lambda: llmdb.complete(table, "{review}", max_tokens=True), TypeError,
         "max_tokens must be an integer, got True"),
        (lambda: llmdb.complete(table, "{review}", seed=1.5), TypeError,
         "seed must be an integer, got 1.5"),
        (lambda: llmdb.complete(table, "{review}", temperature="0.5"), TypeError,
         "temperature must be a number, got '0.5'"),
        (lambda: llmdb.complete(table, "{review}", stop=5), TypeError,
         "stop must be a string or a list of strings, got 5"),
        (lambda: llmdb.complete(table, "{review}", stop=["x", 5]), TypeError,
         r"stop must be a string or a list of strings, got \['x', 5\]"),
        (lambda: llmdb.complete(table, "{review}", system=5, on_error="null"), TypeError,
         "llmdb.complete: system must be a string, got 5"),
        (lambda: llmdb.classify(table, "review", LABELS, instruction=5, on_error="null"),
         TypeError, "llmdb.classify: instruction must be a string, got 5"),
        (lambda: llmdb.complete(table, "Summarize.", fields="review"), TypeError,
         "fields must be a list of column names, got 'review'"),
        (lambda: llmdb.complete(table, "{review}", output=None), TypeError,
         "output must be a column name, got None"),
        (lambda: llmdb.complete(table, None), TypeError,
         "llmdb.complete: template must be a string, got None"),
        (lambda: llmdb.filter(table, 5), TypeError,
         "llmdb.filter: template must be a string, got 5"),
    ]
    before = llmdb.stats()["total"]
    for call, error, message in wrong:
        with pytest.raises(error, match=message):
            call()
    assert llmdb.stats()["total"] == before  # no row reached a model


def test_classify_takes_any_column_type():
    df = pd.DataFrame({"score": [4.5, None, 1.0]})
    out = llmdb.classify(df, "score", ["high", "low"], on_error="null", cache=False)
    assert out["label"][0] in ("high", "low") and pd.isna(out["label"][1])


def test_a_row_the_tokenizer_cannot_take_fails_alone():
    """A lone surrogate (bytes decoded with errors='surrogateescape') makes the tokenizer
    raise a TypeError: that row's error, not the job's."""
    df = pd.DataFrame({"p": pd.Series(["Say hi.", "bad \udcff row"], dtype=object)})
    out = llmdb.complete(df, "{p}", max_tokens=2, on_error="null")
    assert isinstance(out["completion"][0], str) and pd.isna(out["completion"][1])
    [error] = [e for e in llmdb.errors() if "bad" in e["prompt"]]
    assert "TypeError" in error["error"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_row_the_template_cannot_write_fails_alone(kind):
    """An index or format spec a row's value does not take ({l[0]} of an empty list) is that
    row's error, naming the row, not the frame's: the other rows get the answers they get
    alone. (The frame failed with a bare IndexError, also under on_error='null'.)"""
    data = {"l": [[7], [], None, [9]]}
    df = pd.DataFrame(data, index=[10, 20, 30, 40]) if kind == "pandas" else \
        pl.DataFrame(data) if kind == "polars" else pa.table(data)
    row = 20 if kind == "pandas" else 1  # pandas names the row by its index
    session = Session(Options(model="hash-standin", cache=False))
    out = llmdb.complete(df, "Item {l[0]}", on_error="null", error_column="why",
                         session=session)
    rows = [df.iloc[[i]] if kind == "pandas" else df.slice(i, 1) for i in (0, 3)]
    alone = [column_values(llmdb.complete(r, "Item {l[0]}", session=session),
                           "completion")[0] for r in rows]
    assert column_values(out, "completion") == [alone[0], None, None, alone[1]]
    why = column_values(out, "why")
    assert why[0] is None and why[2] is None and why[3] is None
    assert why[1].startswith(f"llm_complete failed on row {row} (l=[]): the template "
                             f"'Item {{l[0]}}' cannot write its values (IndexError")
    assert why[1] in [e.error for e in session.errors]
    kept = llmdb.filter(df, "Item {l[0]}", on_error="null", error_column="why",
                        session=session)
    assert why[1].replace("llm_complete", "llm_filter") in column_values(kept, "why")
    calls = session.total.calls
    with pytest.raises(llmdb.LLMError, match=fr"failed on row {row} \(l=\[\]\): .*IndexError"):
        llmdb.complete(df, "Item {l[0]} again", session=session)
    assert session.total.calls == calls  # raised before any row was asked


def test_a_polars_lazyframe_comes_back_lazy(sql_reference):
    lazy = pl.DataFrame(DATA).lazy()
    out = llmdb.complete(lazy, "Product {product}: {review}", max_tokens=6)
    assert isinstance(out, pl.LazyFrame)
    assert out.collect()["completion"].to_list() == sql_reference["complete"]
    kept = llmdb.filter(lazy, "{review}")
    assert isinstance(kept, pl.LazyFrame)
    with pytest.raises(TypeError, match="got polars.series"):
        llmdb.complete(pl.Series("review", ["x"]), "{review}")


def test_a_polars_lazyframe_asks_the_model_when_collected_and_only_its_rows(sql_reference):
    """Nothing runs before collect; then only the rows that reach the call are asked: a
    head(k) after complete or classify asks k rows, a polars filter over the input's columns
    runs first. (The LazyFrame was collected whole, at the call.)"""
    lazy = pl.DataFrame(DATA).lazy()
    session = Session(Options(cache=False))
    out = llmdb.complete(lazy, "Product {product}: {review}", max_tokens=6, session=session)
    labelled = llmdb.classify(lazy, "review", LABELS, output="sentiment", session=session)
    kept = llmdb.filter(lazy, "{review}", session=session)
    assert session.total.rows == 0  # no row asked yet
    assert out.head(2).collect()["completion"].to_list() == sql_reference["complete"][:2]
    assert session.total.rows == 2
    chair = out.filter(pl.col("product") == "chair").collect()
    assert chair["completion"].to_list() == sql_reference["complete"][4:]
    assert session.total.rows == 3
    assert labelled.head(1).collect()["sentiment"].to_list() == sql_reference["classify"][:1]
    assert session.total.rows == 4
    # filter: a head(k) after it is the first k rows kept, not the rows kept of the first k
    first = [p for p, k in zip(DATA["product"], sql_reference["keep"], strict=True) if k][:1]
    assert kept.head(1).collect()["product"].to_list() == first
    with pytest.raises(KeyError, match="nope"):  # a missing column is named at the call
        llmdb.complete(lazy, "{nope}", session=session)


@pytest.mark.parametrize("kind", [*KINDS, "polars lazy"])
def test_a_new_column_never_replaces_one_of_the_table(kind):
    """An output or error column named as a column of the table replaced it without a word,
    its values lost (classify's default output, 'label', is a labelled data set's own
    column). Refused at the call, naming the column and the option that names it, before any
    row is asked."""
    table = _frame(kind.split()[0]).lazy() if kind == "polars lazy" else _frame(kind)
    options = {"model": "hash-standin", "cache": False, "on_error": "null"}
    calls = [
        (lambda: llmdb.complete(table, "{review}", output="product", **options),
         "column 'product': output='product'"),
        (lambda: llmdb.complete(table, "{product}", output="review", **options),
         "column 'review': output='review'"),  # a column the template reads
        (lambda: llmdb.complete(table, "{review}", error_column="product", **options),
         "column 'product': error_column='product'"),
        (lambda: llmdb.filter(table, "{review}", error_column="review", **options),
         "column 'review': error_column='review'"),
        (lambda: llmdb.classify(table, "review", LABELS, output="product", **options),
         "column 'product': output='product'"),
    ]
    before = llmdb.stats()["total"]
    for call, message in calls:
        with pytest.raises(ValueError, match=f"already has a {message} would replace it"):
            call()
    assert llmdb.stats()["total"] == before  # no row reached a model
    labelled = llmdb.complete(table, "{review}", output="label", **options)
    with pytest.raises(ValueError, match="column 'label': output='label'.*output=..."):
        llmdb.classify(labelled, "review", LABELS, **options)  # the default output name
    out = llmdb.classify(labelled, "review", LABELS, output="predicted", **options)
    if kind == "polars lazy":
        out = out.collect()
    assert column_values(out, "product") == DATA["product"]
    assert column_values(out, "label") == column_values(
        labelled.collect() if kind == "polars lazy" else labelled, "label")


def test_dataframe_calls_share_the_sql_result_cache():
    con = llmdb.connect()  # the default cache, under this test's LLMDB_CACHE_DIR
    con.register("t", pa.table(DATA))
    con.execute("SELECT llm_complete('Product ' || product || ': ' || review, "
                "max_tokens := 6) FROM t").fetchall()
    before = llmdb.stats()["total"]
    llmdb.complete(pa.table(DATA), "Product {product}: {review}", max_tokens=6)
    after = llmdb.stats()["total"]
    assert after["calls"] == before["calls"]
    assert after["cache_hits"] - before["cache_hits"] == 3  # the three rows without a NULL
    con.close()


def test_unknown_column_and_table_type_are_named():
    with pytest.raises(KeyError, match="nope"):
        llmdb.complete(pa.table(DATA), "{nope}", cache=False)
    with pytest.raises(TypeError, match="pandas or polars DataFrame or a pyarrow Table"):
        llmdb.complete([{"review": "x"}], "{review}", cache=False)


@pytest.mark.parametrize("kind", ["pandas", "pyarrow"])  # (polars refuses such a table)
def test_a_column_name_the_table_repeats_is_named(kind):
    """Which of the two columns would be the row's value? pandas failed with an
    AttributeError about a DataFrame's tolist."""
    table = pd.DataFrame([["blender", "lamp"]], columns=["product", "product"])
    if kind == "pyarrow":
        table = pa.table([["blender"], ["lamp"]], names=["product", "product"])
    for call in (lambda: llmdb.complete(table, "Name: {product}", model="hash-standin"),
                 lambda: llmdb.classify(table, "product", LABELS, model="hash-standin")):
        with pytest.raises(KeyError, match="column 'product' is in the table 2 times"):
            call()


@pytest.mark.parametrize("kind", KINDS)
def test_empty_tables_come_back_empty_and_typed(kind):
    empty = _frame(kind)
    empty = empty.head(0) if kind != "pyarrow" else empty.slice(0, 0)
    kept = llmdb.filter(empty, "Is this positive? {review}")
    assert type(kept) is type(empty) and len(kept) == 0
    assert list(_names(kept)) == list(DATA)  # pandas: not df[[]], which selects no columns
    done = llmdb.complete(empty, "Summarize: {review}", max_tokens=4)
    labelled = llmdb.classify(empty, "review", LABELS)
    assert len(done) == 0 and len(labelled) == 0
    if kind == "pandas":
        text = pd.Series(["x"]).dtype
        assert done["completion"].dtype == text and labelled["label"].dtype == text
    if kind == "pyarrow":
        assert done.schema.field("completion").type == pa.string()
        assert labelled.schema.field("label").type == pa.string()
    if kind == "polars":
        assert done["completion"].dtype == pl.String and labelled["label"].dtype == pl.String


def test_each_dataframe_call_is_a_query_of_its_own():
    table = pa.table(DATA)
    llmdb.complete(table, "Summarize: {review}", max_tokens=4)
    first = llmdb.stats()["last_query"]
    assert first["rows"] == 4  # one NULL review
    llmdb.complete(table.slice(0, 2), "Summarize: {review}", max_tokens=4)
    second = llmdb.stats()["last_query"]
    assert second["rows"] == 2 and second["cache_hits"] == 2  # computed by the first call


def test_failed_rows_under_null_are_listed():
    table = pa.table({"review": ["Fine.", "word " * 9000]})
    out = llmdb.complete(table, "{review}", max_tokens=2, on_error="null")
    assert out.column("completion").to_pylist()[1] is None
    failed = llmdb.errors()[-1]
    assert failed["function"] == "llm_complete" and failed["prompt"].startswith("word word")
    assert "longer than the model's context" in failed["error"]


def test_a_call_with_session_options_reports_to_llmdb_stats_and_errors():
    """cache=False (any session option) runs the call in a session of its own; its failed
    rows and counters still reach llmdb.errors() and llmdb.stats(), each call one query."""
    table = pa.table({"review": ["Fine.", "word " * 9000]})
    before = llmdb.stats()["total"]
    known = {e["query_id"] for e in llmdb.errors()}
    for _ in range(2):
        out = llmdb.complete(table, "{review}", max_tokens=2, on_error="null", cache=False)
        assert out.column("completion").to_pylist()[1] is None
        last = llmdb.stats()["last_query"]
        assert (last["rows"], last["errors"], last["cache_hits"]) == (2, 1, 0)
    new = [e for e in llmdb.errors() if e["query_id"] not in known]
    assert len(new) == 2 and new[0]["query_id"] < new[1]["query_id"]
    assert all(e["prompt"].startswith("word word") and "longer than the model's context"
               in e["error"] for e in new)
    total = llmdb.stats()["total"]
    assert total["rows"] - before["rows"] == 4 and total["errors"] - before["errors"] == 2


LONG = "word " * 9000  # longer than the model's context: the row fails at submit


@pytest.mark.parametrize("kind", KINDS)
def test_error_column_holds_each_failed_rows_error(kind):
    """error_column: each failed row's error, the text llmdb.errors() (SQL's llm_errors())
    lists for its prompt, also on a repeated row, which that list names once; NULL on the
    other rows, whose answers are those of the call without it."""
    other = "Also " + LONG
    data = {"review": ["Fine.", LONG, None, other, LONG]}
    df = pd.DataFrame(data) if kind == "pandas" else pl.DataFrame(data) \
        if kind == "polars" else pa.table(data)
    session = Session(Options(cache=False))
    out = llmdb.complete(df, "{review}", max_tokens=2, on_error="null", error_column="why",
                         session=session)
    listed = {e.prompt: e.error for e in session.errors}
    assert len(listed) == 2 and all("longer than the model's context" in e
                                    for e in listed.values())
    assert column_values(out, "why") == [None, listed[LONG[:200]], None, listed[other[:200]],
                                   listed[LONG[:200]]]
    plain = llmdb.complete(df, "{review}", max_tokens=2, on_error="null", session=session)
    assert _names(plain) == ["review", "completion"]  # no error column unless asked
    assert column_values(out, "completion") == column_values(plain, "completion")
    if kind == "pandas":
        assert out["why"].dtype == pd.Series(["x"]).dtype


def test_error_column_of_classify_and_filter():
    """classify: the rows of a template whose calibration failed (a system prompt longer
    than the context) each carry the error; filter keeps its failed rows, with their
    error, beside the rows answered yes."""
    table = pa.table({"i": [0, 1, 2, 3], "review": ["Great, works well.", LONG, None,
                                                    "Broke after one day."]})
    session = Session(Options(cache=False))
    out = llmdb.classify(table, "review", LABELS, system=LONG, on_error="null",
                         error_column="why", session=session)
    why = out.column("why").to_pylist()
    assert out.column("label").to_pylist() == [None] * 4
    assert why[2] is None  # NULL text: no call, no error
    for text, error in zip(table.column("review").to_pylist(), why, strict=True):
        if text is not None:
            assert error.startswith(f"llm_classify failed on the row with prompt "
                                    f"{text[:40]!r}"[:-1])
            assert "calibrating its prompt template failed" in error
            assert error in [e.error for e in session.errors]

    kept = llmdb.filter(table, "{review}", on_error="null", session=session)
    with_errors = llmdb.filter(table, "{review}", on_error="null", error_column="why",
                               session=session)
    yes = kept.column("i").to_pylist()
    assert 1 not in yes
    assert with_errors.column("i").to_pylist() == sorted(yes + [1])
    [failed] = [e.error for e in session.errors if e.function == "llm_filter"][-1:]
    assert with_errors.column("why").to_pylist() == [failed if i == 1 else None
                                                     for i in sorted(yes + [1])]
    assert "longer than the model's context" in failed
