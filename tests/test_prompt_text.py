"""A row renders into the same prompt through SQL and through the DataFrame API.

SQL prompts are text the query builds: `'v: ' || CAST(x AS VARCHAR)`. The DataFrame template
"v: {x}" must give that same text for every type (llmdb/value_text.py), so the same row gets
the same answer through either entry point. The stand-in model answers with a hash of the
prompt: equal answers per row are equal prompts, and the requests it receives show the text.
"""

from __future__ import annotations

import datetime as dt
import math
import re
from decimal import Decimal

import pandas as pd
import polars as pl
import pyarrow as pa
import pytest

import llmdb
from llmdb import dataframe, value_text
from llmdb.backends.standin import STANDIN_MODEL, standin_backend

from .sql_support import column_values

NY = "America/New_York"
_ts = dt.datetime(2024, 1, 2, 3, 4, 5)

# One column per type, five rows each; None is NULL.
COLUMNS: dict[str, tuple[pa.DataType, list]] = {
    "flag": (pa.bool_(), [True, False, None, True, False]),
    "n": (pa.int64(), [1, -2, None, 0, 2**40]),
    "x": (pa.float64(), [1.0, 0.1, 1e20, math.nan, math.inf]),
    "f32": (pa.float32(), [0.1, 2.5, None, -1.0, 1e-5]),
    "price": (pa.decimal128(5, 2), [Decimal("1.50"), Decimal("2"), None, Decimal("0.10"),
                                    Decimal("-3.25")]),
    "day": (pa.date32(), [dt.date(2024, 1, 2), None, dt.date(1999, 12, 31), dt.date(2024, 2, 29),
                          dt.date(1970, 1, 1)]),
    "stamp": (pa.timestamp("us"), [_ts, _ts.replace(microsecond=123456), None, _ts.replace(hour=0),
                                dt.datetime(1970, 1, 1)]),
    "stamp_tz": (pa.timestamp("us", tz=NY), [_ts.replace(tzinfo=dt.UTC), None,
                                          dt.datetime(2024, 7, 1, 12, tzinfo=dt.UTC),
                                          _ts.replace(microsecond=5, tzinfo=dt.UTC),
                                          dt.datetime(1970, 1, 1, tzinfo=dt.UTC)]),
    "ints": (pa.list_(pa.int64()), [[1, 2], [], None, [3, None], [0]]),
    "words": (pa.list_(pa.string()), [["a", "b"], ["a, b"], [], None, ["it's", "x y"]]),
    "rec": (pa.struct([("k", pa.int64()), ("name", pa.string())]),
            [{"k": 1, "name": "x"}, {"k": None, "name": "y z"}, None, {"k": 2, "name": ""},
             {"k": 3, "name": "[a]"}]),
    "blob": (pa.binary(), [b"ab", b"\xaa\x00", None, b"", b"line\n"]),
    "nested": (pa.list_(pa.struct([("k", pa.list_(pa.int64()))])),
               [[{"k": [1, 2]}], [{"k": []}, {"k": None}], None, [], [{"k": [3]}]]),
    "text": (pa.string(), ["plain", "", None, "{braces}", "ünïcode"]),
}
ROWS = 5

# The canonical text of the pyarrow rows: DuckDB's CAST(x AS VARCHAR), spelled out.
EXPECTED = {
    "flag": ["true", "false", None, "true", "false"],
    "x": ["1.0", "0.1", "1e+20", "nan", "inf"],
    "f32": ["0.1", "2.5", None, "-1.0", "1e-05"],
    "price": ["1.50", "2.00", None, "0.10", "-3.25"],
    "stamp": ["2024-01-02 03:04:05", "2024-01-02 03:04:05.123456", None, "2024-01-02 00:04:05",
           "1970-01-01 00:00:00"],
    "stamp_tz": ["2024-01-01 22:04:05-05", None, "2024-07-01 08:00:00-04",
              "2024-01-01 22:04:05.000005-05", "1969-12-31 19:00:00-05"],
    "words": ["[a, b]", "['a, b']", "[]", None, "['it\\'s', x y]"],
    "rec": ["{'k': 1, 'name': x}", "{'k': NULL, 'name': y z}", None, "{'k': 2, 'name': ''}",
            "{'k': 3, 'name': '[a]'}"],
    "blob": ["ab", "\\xAA\\x00", None, "", "line\\x0A"],
}


def _arrow() -> pa.Table:
    return pa.table({"i": list(range(ROWS)),
                     **{c: pa.array(v, type=t) for c, (t, v) in COLUMNS.items()}})


def _pandas() -> pd.DataFrame:
    """As a pandas user builds it: Python objects in object columns, NaN and NaT for NULL."""
    df = pd.DataFrame({c: pd.Series(v, dtype=object) for c, (_, v) in COLUMNS.items()})
    df["i"] = range(ROWS)
    df["flag"] = pd.array(COLUMNS["flag"][1], dtype="boolean")
    df["n"] = pd.array(COLUMNS["n"][1], dtype="Int64")
    df["x"] = pd.Series(COLUMNS["x"][1], dtype="float64")
    df["f32"] = pd.Series(COLUMNS["f32"][1], dtype="float32")
    df["stamp"] = pd.to_datetime(pd.Series(COLUMNS["stamp"][1]))
    df["stamp_tz"] = pd.to_datetime(pd.Series(COLUMNS["stamp_tz"][1]), utc=True).dt.tz_convert(NY)
    df["text"] = pd.Series(COLUMNS["text"][1], dtype="string")
    return df


def _polars() -> pl.DataFrame:
    return pl.from_arrow(_arrow())


FRAMES = {"pyarrow": _arrow, "pandas": _pandas, "polars": _polars}


@pytest.fixture(autouse=True)
def _own_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMDB_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture
def prompts(monkeypatch):
    """The prompt of every request the stand-in receives."""
    seen: list[str] = []
    backend = standin_backend()
    submit = backend.submit

    def spy(request, on_finish):
        seen.append(request.prompt)
        return submit(request, on_finish)

    monkeypatch.setattr(backend, "submit", spy)
    return seen


@pytest.fixture
def con():
    c = llmdb.connect(model=STANDIN_MODEL, cache=False)
    # The DataFrame path writes a tz-aware column in its own zone; SQL in the connection's.
    c.execute(f"SET TimeZone = '{NY}'")
    yield c
    c.close()


def _sql(con, df, expr: str) -> list:
    con.register("t", df)
    return [r[0] for r in con.execute(f"SELECT {expr} FROM t ORDER BY i").fetchall()]


@pytest.mark.parametrize("kind", list(FRAMES))
def test_a_row_gives_the_same_prompt_and_answer_through_sql_and_a_dataframe(kind, con,
                                                                            prompts):
    df = FRAMES[kind]()
    for c in COLUMNS:
        text = _sql(con, df, f"'v: ' || CAST({c} AS VARCHAR)")
        prompts.clear()
        answers = column_values(llmdb.complete(df, f"v: {{{c}}}", model=STANDIN_MODEL,
                                         max_tokens=4, cache=False), "completion")
        assert sorted(set(prompts)) == sorted({t for t in text if t is not None}), c
        # NULL in, NULL out, no call: as `||` makes the SQL prompt NULL.
        assert [a is None for a in answers] == [t is None for t in text], c
        sql_answers = _sql(con, df, f"llm_complete('v: ' || CAST({c} AS VARCHAR), "
                                    f"max_tokens := 4)")
        assert answers == sql_answers, c


def test_the_canonical_text_is_duckdbs_cast(prompts):
    df = _arrow()
    for c, expected in EXPECTED.items():
        prompts.clear()
        llmdb.complete(df, f"v: {{{c}}}", model=STANDIN_MODEL, max_tokens=1, cache=False)
        # (identical prompts of a query run once)
        assert sorted(set(prompts)) == sorted({f"v: {e}" for e in expected if e is not None}), c


def test_a_fixed_offset_zone_is_written_at_its_offset(con):
    """arrow names a fixed offset "+05:30" and pandas "UTC+05:30", names DuckDB refuses or
    reads as "+05"; SQL with the zone set says what the text must be."""
    at = dt.datetime(2024, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    arrow = pa.table({"i": [0], "t": pa.array([at], type=pa.timestamp("us", tz="+05:30"))})
    india = dt.timezone(dt.timedelta(hours=5, minutes=30))
    pandas = pd.DataFrame({"i": [0], "t": pd.Series([at]).dt.tz_convert(india)})
    con.execute("SET TimeZone = 'Asia/Kolkata'")
    for df in (arrow, pandas):
        [text] = _sql(con, df, "CAST(t AS VARCHAR)")
        assert text == "2024-01-02 08:34:05+05:30"
        assert dataframe._render(df, "{t}") == [text]


def test_pandas_nan_is_null_in_both_paths(con):
    """pandas marks missing floats with NaN; DuckDB reads a pandas NaN as NULL too."""
    df = _pandas()
    assert _sql(con, df, "CAST(x AS VARCHAR)")[3] is None
    out = llmdb.complete(df, "v: {x}", model=STANDIN_MODEL, max_tokens=2, cache=False)
    assert column_values(out, "completion")[3] is None
    polars_out = llmdb.complete(_polars(), "v: {x}", model=STANDIN_MODEL, max_tokens=2,
                                cache=False)
    assert column_values(polars_out, "completion")[3] is not None  # polars and arrow keep NaN


@pytest.mark.parametrize("kind", list(FRAMES))
def test_a_format_spec_applies_to_the_python_value(kind, prompts):
    df = FRAMES[kind]()
    template = "{x:.2f} | {price:.1f} | {day:%d/%m/%Y} | {n!r} | {stamp.year} | {flag}"
    llmdb.complete(df, template, model=STANDIN_MODEL, max_tokens=1, cache=False)
    expected = ["1.00 | 1.5 | 02/01/2024 | 1 | 2024 | true",
                "inf | -3.2 | 01/01/1970 | 1099511627776 | 1970 | false"]
    if kind != "pandas":  # row 3's x is NaN, which is NULL in pandas
        expected.append("nan | 0.1 | 29/02/2024 | 0 | 2024 | true")
    assert sorted(prompts) == sorted(expected)


def _classified_texts(prompts: list[str]) -> set[str]:
    """The row texts classify prompts hold (not the content-free ones of the prior)."""
    texts = {m for p in prompts for m in re.findall(r"<text>\n(.*?)\n</text>", p, re.S)}
    return texts - {"N/A", "", "[MASK]"}


def test_classify_and_field_prompts_write_values_as_sql_does(con, prompts):
    df = _arrow()
    labels = column_values(llmdb.classify(df, "words", ["yes", "no"], model=STANDIN_MODEL,
                                    cache=False), "label")
    assert _classified_texts(prompts) == {"[a, b]", "['a, b']", "[]", "['it\\'s', x y]"}
    prompts.clear()
    assert labels == _sql(con, df, "llm_classify(CAST(words AS VARCHAR), ['yes', 'no'])")
    assert _classified_texts(prompts) == {"[a, b]", "['a, b']", "[]", "['it\\'s', x y]"}

    prompts.clear()
    llmdb.complete(df, "Describe.", fields=["flag", "price", "rec"], model=STANDIN_MODEL,
                   max_tokens=1, cache=False)
    assert "Describe.\n\nflag: true\nprice: 1.50\nrec: {'k': 1, 'name': x}" in prompts
    nl = "chr(10)"
    as_sql = _sql(con, df, f"'Describe.' || {nl} || {nl} || 'flag: ' || CAST(flag AS VARCHAR) "
                           f"|| {nl} || 'price: ' || CAST(price AS VARCHAR) || {nl} || 'rec: ' "
                           f"|| CAST(rec AS VARCHAR)")
    assert sorted(prompts) == sorted(p for p in as_sql if p is not None)  # row 2: NULL, no call


def test_an_unreadable_column_falls_back_to_python_str(prompts):
    """A polars column of Python objects: DuckDB cannot read it (neither can SQL)."""

    class Thing:
        def __str__(self) -> str:
            return "a thing"

    df = pl.DataFrame({"o": pl.Series([Thing(), None], dtype=pl.Object)})
    out = llmdb.complete(df, "v: {o}", model=STANDIN_MODEL, max_tokens=1, cache=False)
    assert prompts == ["v: a thing"] and out["completion"].to_list()[1] is None


def test_text_columns_do_not_go_through_duckdb():
    """The common path: a text column is its own text, the very list of its values (no
    copy, no one-column table, no DuckDB query, no wrapped values), so the template is a
    str.format over them."""
    def no_table():
        raise AssertionError("a text column was made into a table for DuckDB")

    for df in (pa.table({"a": ["x", None, "{y}"]}), pd.DataFrame({"a": ["x", None, "{y}"]}),
               pl.DataFrame({"a": ["x", None, "{y}"]})):
        values = dataframe._columns(df, ["a"])["a"]
        assert value_text.column_text(values, no_table) is values
    assert dataframe._render(pa.table({"a": ["x", None, "{y}"]}), "<{a}>") == [
        "<x>", None, "<{y}>"]
