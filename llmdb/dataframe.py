"""complete / filter / classify over pandas, polars and pyarrow tables.

The same row functions, batching, dedup and result cache as the SQL functions; the result
has the input's type. Prompts are Python format strings over the columns ("Summarize:
{review}"); a row with NULL in a field the template uses gives NULL, as `||` does in SQL.
"""

from __future__ import annotations

import string
from typing import Any

import pyarrow as pa

from . import functions
from .reorder import ggr, render
from .session import Options, Session

# Options of one call (the rest configure the session: cache, progress, engine, ...).
CALL_OPTIONS = ("max_tokens", "temperature", "top_p", "seed", "stop", "system", "model",
                "on_error", "instruction")

_default_session: Session | None = None


def default_session() -> Session:
    """The session of DataFrame calls made without session options (see llmdb.stats())."""
    global _default_session
    if _default_session is None:
        _default_session = Session()
    return _default_session


def _session_and_call_options(options: dict[str, Any]) -> tuple[Session, dict[str, Any]]:
    """session=Session(...) shares one session (its engine, cache and counters) between
    calls, as a connection does; else the session options make a session for this call."""
    call = {k: options.pop(k) for k in list(options) if k in CALL_OPTIONS}
    session = options.pop("session", None)
    if session is not None:
        if options:
            raise TypeError(f"session options ({', '.join(sorted(options))}) belong to the "
                            f"Session passed as session=, not to the call")
        return session, call
    session = Session(Options.from_kwargs(**options)) if options else default_session()
    return session, call


def _kind(df: Any) -> str:
    module = type(df).__module__.split(".")[0]
    if module in ("pandas", "polars", "pyarrow"):
        return module
    raise TypeError(f"expected a pandas, polars or pyarrow table, got {type(df).__name__}")


def _columns(df: Any, names: list[str]) -> dict[str, list]:
    kind = _kind(df)
    present = list(df.columns) if kind != "pyarrow" else df.column_names
    missing = [n for n in names if n not in present]
    if missing:
        raise KeyError(f"column(s) {', '.join(missing)} not in the table "
                       f"(columns: {', '.join(map(str, present))})")
    if kind == "pandas":
        return {n: [None if _is_missing(v) else v for v in df[n].tolist()] for n in names}
    if kind == "polars":
        return {n: df[n].to_list() for n in names}
    return {n: df.column(n).to_pylist() for n in names}


def _is_missing(v: Any) -> bool:
    import pandas as pd

    # pandas marks missing values with NaN, or pd.NA in its nullable dtypes ("string", ...)
    return v is None or v is pd.NA or (isinstance(v, float) and v != v)


def _render(df: Any, template: str) -> list[str | None]:
    fields = [f for _, f, _, _ in string.Formatter().parse(template) if f]
    names = list(dict.fromkeys(f.split(".")[0].split("[")[0] for f in fields))
    cols = _columns(df, names)
    n = len(df) if _kind(df) != "pyarrow" else df.num_rows
    out = []
    for i in range(n):
        row = {k: cols[k][i] for k in names}
        out.append(None if any(v is None for v in row.values()) else template.format(**row))
    return out


def _with_column(df: Any, name: str, values: list[str | None]) -> Any:
    """df plus a text column (typed as text even with no rows or all NULLs)."""
    kind = _kind(df)
    if kind == "pandas":
        return df.assign(**{name: values})
    if kind == "polars":
        import polars as pl

        return df.with_columns(pl.Series(name, values, dtype=pl.String))
    array = pa.array(values, type=pa.string())
    if name in df.column_names:
        return df.set_column(df.column_names.index(name), name, array)
    return df.append_column(name, array)


def _keep(df: Any, mask: list[bool]) -> Any:
    kind = _kind(df)
    if kind == "pandas":
        return df[mask]
    if kind == "polars":
        import polars as pl

        return df.filter(pl.Series(mask, dtype=pl.Boolean))
    return df.filter(pa.array(mask, type=pa.bool_()))


def _broadcast(n: int, call: dict[str, Any], names: tuple[str, ...]) -> list[list]:
    return [[call.get(k)] * n for k in names]


def _field_prompts(df: Any, instruction: str, fields: list[str],
                   reorder: bool) -> tuple[list[str | None], list[int]]:
    """Prompts "instruction + one 'field: value' line per field", and the order to send
    them in: with reorder, GGR's field order per row and row order (shared prefixes)."""
    cols = _columns(df, fields)
    n = len(next(iter(cols.values()))) if cols else 0
    rows = [{f: cols[f][i] for f in fields} for i in range(n)]
    usable = [i for i, r in enumerate(rows) if all(v is not None for v in r.values())]
    text = [{f: str(v) for f, v in rows[i].items()} for i in usable]
    plan = ggr(text, fields) if reorder else [(k, list(fields)) for k in range(len(usable))]
    prompts: list[str | None] = [None] * n
    for k, order in plan:
        prompts[usable[k]] = render(instruction, text[k], order)
    send = [usable[k] for k, _ in plan] + [i for i in range(n) if prompts[i] is None]
    return prompts, send


def complete(df: Any, template: str, output: str = "completion", *,
             fields: list[str] | None = None, reorder_fields: bool = False,
             **options: Any) -> Any:
    """df plus a column `output` with the model's answer to the rendered template per row.

    With `fields`, the template is an instruction followed by one "field: value" line per
    field; reorder_fields=True lets llmdb choose each row's field order and the row order so
    that prompts share the longest prefixes (GGR), which the engine computes once."""
    session, call = _session_and_call_options(options)
    if fields:
        prompts, send = _field_prompts(df, template, list(fields), reorder_fields)
    else:
        prompts = _render(df, template)
        send = list(range(len(prompts)))
    n = len(prompts)
    if call.get("stop") is not None and isinstance(call["stop"], str):
        call["stop"] = [call["stop"]]
    cols = _broadcast(n, call, ("max_tokens", "temperature", "top_p", "seed", "stop", "system",
                                "model", "on_error"))
    with session.query():
        answers = functions.llm_complete(session, [prompts[i] for i in send], *cols)
    values: list[Any] = [None] * n
    for i, a in zip(send, answers, strict=True):
        values[i] = a
    return _with_column(df, output, values)


def filter(df: Any, template: str, **options: Any) -> Any:  # noqa: A001 - mirrors llm_filter
    """The rows for which the model answers yes to the rendered template."""
    session, call = _session_and_call_options(options)
    prompts = _render(df, template)
    cols = _broadcast(len(prompts), call, ("system", "model", "on_error"))
    with session.query():
        keep = functions.llm_filter(session, prompts, *cols)
    return _keep(df, [bool(k) for k in keep])


def classify(df: Any, column: str, labels: list[str], output: str = "label",
             **options: Any) -> Any:
    """df plus a column `output` holding one of `labels` for each row's `column`."""
    session, call = _session_and_call_options(options)
    texts = _columns(df, [column])[column]
    n = len(texts)
    cols = _broadcast(n, call, ("instruction", "system", "model", "on_error"))
    with session.query():
        values = functions.llm_classify(session, texts, [list(labels)] * n, *cols)
    return _with_column(df, output, values)
