"""How a row's value becomes prompt text: one rule for SQL and the DataFrame API.

The text of a value is DuckDB's `CAST(value AS VARCHAR)`, which is what `'...' || x` writes
in SQL: true, 0.1, 1e+20, nan, 1.50 (a DECIMAL keeps its scale), 2024-01-02 03:04:05,
[1, 2], [a, b], {'k': 1, 'name': x}, NULL inside a list or struct, \\xAA for a byte that is
not printable ASCII. SQL users are the main audience and see that form in their results.
The DataFrame functions let DuckDB read and cast the column, as a SQL query over the same
DataFrame would, so a row renders into the same prompt through either entry point and gets
the same answer (the result cache keys on the prompt text).

- Text columns are their own text and never reach DuckDB (the common path stays a
  str.format over Python strings).
- A tz-aware timestamp column is written in its own time zone, as SQL writes it with
  `SET TimeZone` to that zone (SQL uses the connection's TimeZone); a timestamp nested in a
  list or struct, or a zone DuckDB does not know, is written in UTC.
- A column DuckDB cannot read (a polars column of Python objects) falls back to Python's str.
- NULL: a template field that is NULL makes the prompt NULL, as `||` does in SQL, so the row
  answers NULL without a model call (a NULL inside a list or struct is written NULL).
- In a template, `{x}` writes this text; a format spec, a conversion or an attribute or
  index (`{price:.2f}`, `{x!r}`, `{day.year}`) applies Python's formatting to the value as
  the DataFrame library returns it, as str.format does.
"""

from __future__ import annotations

import re
import string
import threading
from collections.abc import Callable, Sequence
from typing import Any

import duckdb

_connection: duckdb.DuckDBPyConnection | None = None
_lock = threading.Lock()
# Fixed offsets as arrow ("+05:30") and pandas ("UTC+05:30") name them; ICU reads
# "UTC+05:30" as "+05" (a POSIX-style name) but "GMT+05:30" as the offset it says.
_OFFSET = re.compile(r"^(?:UTC)?([+-]\d\d:\d\d)$")


def _cursor() -> duckdb.DuckDBPyConnection:
    """A cursor of this module's own in-memory DuckDB (never the user's connection): one per
    call, since a DuckDB connection is not to be shared between threads."""
    global _connection
    with _lock:
        if _connection is None:
            _connection = duckdb.connect()
        return _connection.cursor()


def _zone_name(zone: str | None) -> str:
    if zone is None:
        return "UTC"
    offset = _OFFSET.match(zone)
    return "GMT" + offset[1] if offset else zone


def column_text(values: Sequence[Any], column: Callable[[], tuple[Any, str | None]]
                ) -> Sequence[str | None]:
    """The text of each value of a table column (None where the value is NULL).

    values: the column as Python values, None for NULL; column: makes the same column as a
    one-column pandas, polars or pyarrow table, which DuckDB reads, and the zone of a
    tz-aware timestamp column (its values are written in it), or None. Called only for a
    column that is not all text."""
    if all(v is None or isinstance(v, str) for v in values):
        return values  # text is its own text: no copy, no table, no DuckDB
    table, time_zone = column()
    try:
        texts = _duckdb_text(table, _zone_name(time_zone))
    except duckdb.Error:
        # A column DuckDB cannot read, so SQL cannot see it either: Python's str is the only
        # text it has.
        texts = [str(v) for v in values]
    # NULL where either side says so (pandas' missing values DuckDB reads as NULL anyway).
    return [None if v is None else t for v, t in zip(values, texts, strict=True)]


def _duckdb_text(column: Any, zone: str) -> list[str | None]:
    cur = _cursor()
    try:
        try:
            cur.execute("SET TimeZone = '" + zone.replace("'", "''") + "'")
        except duckdb.Error:  # a zone ICU does not know: UTC, not the machine's own zone
            cur.execute("SET TimeZone = 'UTC'")
        cur.register("llmdb_column", column)
        # By position: the column's name may need quoting (or be a keyword such as "at").
        return [r[0] for r in cur.execute(
            "SELECT CAST(#1 AS VARCHAR) FROM llmdb_column").fetchall()]
    finally:
        cur.close()


class Value:
    """A non-text value in a template: `{x}` writes its text; a format spec, a conversion
    (`!r`, `!s`, `!a`) or an attribute or index works on the Python value, as in
    str.format."""

    __slots__ = ("text", "value")

    def __init__(self, value: Any, text: str):
        self.value = value
        self.text = text

    def __format__(self, spec: str) -> str:
        return format(self.value, spec) if spec else self.text

    def __str__(self) -> str:
        return str(self.value)

    def __repr__(self) -> str:
        return repr(self.value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.value, name)

    def __getitem__(self, key: Any) -> Any:
        return self.value[key]


def template_fields(template: str) -> list[str]:
    """The columns a template names ("{a.year} {b[0]:>4}" -> a, b), once each, in order."""
    fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    names = list(dict.fromkeys(f.split(".")[0].split("[")[0] for f in fields))
    positional = [n for n in names if not n or n.isdigit()]
    if positional:  # str.format would take them for positional arguments: an IndexError
        raise ValueError(f"template {template!r}: {{{positional[0]}}} names no column; write "
                         "the column's name in the braces ({review}), and rename a column "
                         "whose name is a number")
    return names


def render(template: str, rows: int, values: dict[str, Sequence[Any]],
           texts: dict[str, Sequence[str | None]]) -> list[str | None]:
    """The template over each of `rows` rows (None for a row with a NULL field).

    values: each field's column as Python values; texts: column_text of each."""
    if not values:  # a template without fields is every row's prompt
        return [template.format()] * rows
    names = list(values)
    # A text column's values are its texts (the same list): str.format writes them as is.
    cells = [values[k] if texts[k] is values[k] else
             [None if t is None else Value(v, t) for v, t in zip(values[k], texts[k],
                                                                   strict=True)]
             for k in names]
    fill = template.format_map
    return [None if None in row else fill(dict(zip(names, row, strict=True)))
            for row in zip(*cells, strict=True)]
