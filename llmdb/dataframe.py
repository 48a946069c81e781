"""complete / filter / classify over pandas, polars and pyarrow tables.

The same row functions, batching, dedup and result cache as the SQL functions; the result
has the input's type. Prompts are Python format strings over the columns ("Summarize:
{review}"); a row with NULL in a field the template uses gives NULL, as `||` does in SQL.
A value is written as SQL writes it (`CAST(x AS VARCHAR)`: true, [a, b], 1.50), so a row
renders into the same prompt here and in SQL; a format spec ({price:.2f}) applies to the
Python value (value_text.py has the rule). A polars LazyFrame comes back lazy, and the
model is asked when it is collected, about the rows that reach the call (see _apply).
"""

from __future__ import annotations

import functools
import inspect
import numbers
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pyarrow as pa

from . import functions, value_text
from .batch import LLMError
from .reorder import ggr, render
from .session import ON_ERROR, Options, Session, Stats

# Options of one call, per function (the rest configure the session: cache, progress,
# engine, ...): the SQL function's parameters after its row argument(s).
CALL_OPTIONS = {
    "complete": ("max_tokens", "temperature", "top_p", "seed", "stop", "system", "model",
                 "on_error"),
    "filter": ("system", "model", "on_error"),
    "classify": ("instruction", "system", "model", "on_error"),
}
ALL_CALL_OPTIONS = {o for names in CALL_OPTIONS.values() for o in names}


def _integer(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _number(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _stop(v: Any) -> bool:
    return isinstance(v, str) or (isinstance(v, list | tuple)
                                  and all(isinstance(s, str) for s in v))


# What a call option must be (None, its default, always passes). The row functions take
# SQL's values, which DuckDB has typed: from Python, a value of another type would be cast
# per row (max_tokens=2.5 ran as 2, "5" as 5) or fail every row alike (system=5).
OPTION_TYPES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "max_tokens": (_integer, "an integer"), "seed": (_integer, "an integer"),
    "temperature": (_number, "a number"), "top_p": (_number, "a number"),
    "stop": (_stop, "a string or a list of strings"),
    **{name: ((lambda v: isinstance(v, str)), "a string")
       for name in ("system", "instruction", "model", "on_error")},
}

_default_session: Session | None = None
_PER_CALL: weakref.WeakSet[Session] = weakref.WeakSet()  # sessions made for one call's options


def default_session() -> Session:
    """The session of DataFrame calls made without session= (see llmdb.stats()): calls with
    session options run in a session of their own, then report to this one."""
    global _default_session
    if _default_session is None:
        _default_session = Session()
    return _default_session


def _session_and_call_options(function: str, options: dict[str, Any]
                               ) -> tuple[Session, dict[str, Any]]:
    """session=Session(...) shares one session (its engine, cache and counters) between
    calls, as a connection does; else the session options make a session for this call."""
    own = CALL_OPTIONS[function]
    other = sorted(k for k in options if k in ALL_CALL_OPTIONS and k not in own)
    if other:  # another function's option would be ignored: say so instead
        raise TypeError(f"llmdb.{function} does not take {', '.join(other)} (its options: "
                        f"{', '.join(own)})")
    call = {k: options.pop(k) for k in list(options) if k in own}
    session = options.pop("session", None)
    if session is not None:
        if options:
            raise TypeError(f"session options ({', '.join(sorted(options))}) belong to the "
                            f"Session passed as session=, not to the call")
        return session, call
    if not options:
        return default_session(), call
    session = Session(Options.from_kwargs(**options))
    _PER_CALL.add(session)
    return session, call


@contextmanager
def _query(session: Session) -> Iterator[None]:
    """One call's query. A session made for the call's options (cache=False, progress=...)
    reports to the default one when done, so llmdb.stats() and llmdb.errors() see every
    call made without session=, as the README says."""
    try:
        with session.query():
            yield
    finally:
        if session in _PER_CALL:
            default_session().absorb(session)


_TABLES = {"pandas": ("DataFrame",), "polars": ("DataFrame",),
           "pyarrow": ("Table", "RecordBatch")}


def _kind(df: Any) -> str:
    for cls in type(df).__mro__:  # subclasses too (a GeoDataFrame)
        module = cls.__module__.split(".")[0]
        if cls.__name__ in _TABLES.get(module, ()):
            return module
    raise TypeError(f"expected a pandas or polars DataFrame or a pyarrow Table, got "
                    f"{type(df).__module__}.{type(df).__name__}")


def _lazy(df: Any) -> bool:
    return type(df).__name__ == "LazyFrame" and type(df).__module__.startswith("polars")


def _apply(df: Any, rows: Callable[[Any], Any], reads: list[str], adds: dict[str, str],
           every_row: bool) -> Any:
    """rows(df): the call over a table. A polars LazyFrame stays lazy: the call runs when it
    is collected, once over the rows that reach it (so that duplicates are asked once):
    `.head(k)` after a call that keeps every row (every_row) asks k rows, and a polars
    filter over the input's columns runs first. reads: the columns the call reads, checked
    now; adds: the text columns it adds, by the option that names each."""
    if not _lazy(df):
        check_new_columns(adds, _column_names(df))
        return rows(df)
    import polars as pl

    schema = df.collect_schema()
    check_columns(reads, schema.names())
    check_new_columns(adds, schema.names())
    # Not pushed below llmdb.filter: polars 2.1 pushes a slice wherever it pushes a
    # predicate, whatever slice_pushdown says, and the first k rows kept are not the rows
    # kept of the first k.
    return df.map_batches(rows, schema={**schema, **dict.fromkeys(adds.values(), pl.String)},
                          predicate_pushdown=every_row, slice_pushdown=every_row)


def check_option_types(function: str, call: dict[str, Any]) -> None:
    """TypeError naming the first option of llmdb.<function>'s call of the wrong type."""
    for option, value in call.items():
        ok, kind = OPTION_TYPES.get(option, (None, ""))
        if ok is not None and value is not None and not ok(value):
            raise TypeError(f"llmdb.{function}: {option} must be {kind}, got {value!r}")


def _check_call(session: Session, function: str, call: dict[str, Any]) -> None:
    """The call's options checked once, before any row: a wrong one (max_tokens=0, an
    unknown on_error) would fail every row, which on_error='null' turns into NULLs."""
    name = function.removeprefix("llm_")
    check_option_types(name, call)
    policy = call.get("on_error")
    if policy is not None and policy not in ON_ERROR:
        raise ValueError(f"on_error must be one of {ON_ERROR}, got {policy!r}")
    spec = functions.FUNCTIONS[function]
    probe = {p.name: call.get(p.name) for p in spec.params}
    probe[spec.params[0].name] = "x"  # a row: only the call's own values can fail it
    try:
        functions.row_call(function, session.backend(probe["model"]), probe, "BE")
    except ValueError as e:
        raise ValueError(f"llmdb.{name}: {e}") from None


def check_columns(names: list[str], present: list[str]) -> None:
    """KeyError naming the columns a call reads that the table lacks, or holds twice."""
    missing = [n for n in names if n not in present]
    if missing:
        raise KeyError(f"column(s) {', '.join(missing)} not in the table "
                       f"(columns: {', '.join(map(str, present))})")
    for n in names:
        if present.count(n) > 1:
            raise KeyError(f"column {n!r} is in the table {present.count(n)} times: which "
                           f"one is the row's value? Rename them apart")


def check_new_columns(adds: dict[str, str], present: list[str]) -> None:
    """ValueError naming a column the call would add that the table has already: replaced,
    its values would be lost without a word (a labelled data set's own `label`, under
    classify's default output name). No replace=True: pandas' insert and join refuse a
    taken name too, and replacing on purpose is a drop and a rename, which say so."""
    for option, name in adds.items():
        if name in present:
            raise ValueError(f"the table already has a column {name!r}: {option}={name!r} "
                             f"would replace it and lose its values. Choose another name "
                             f"with {option}=... (to replace the column on purpose, drop it "
                             f"and rename the new one afterwards)")


def _column_names(df: Any) -> list[str]:
    return df.column_names if _kind(df) == "pyarrow" else list(df.columns)


def columns_read(function: str, args: tuple, options: dict[str, Any]) -> list[str]:
    """The columns llmdb.<function>(df, *args, **options) reads."""
    first = args[0] if args else options.get("column" if function == "classify" else "template")
    if function == "classify":
        return [first]
    if function == "complete" and options.get("fields"):
        return list(options["fields"])
    return value_text.template_fields(first) if isinstance(first, str) else []


def columns_added(function: str, args: tuple, options: dict[str, Any]) -> dict[str, str]:
    """The columns llmdb.<function>(df, *args, **options) adds, by the option naming each
    (output may be positional, and has a default)."""
    call = inspect.signature(globals()[function]).bind(None, *args, **options)
    call.apply_defaults()
    return _added(output=call.arguments.get("output"),
                  error_column=call.arguments.get("error_column"))


def _columns(df: Any, names: list[str]) -> dict[str, list]:
    kind = _kind(df)
    check_columns(names, _column_names(df))
    if kind == "pandas":
        return {n: [None if _is_missing(v) else v for v in df[n].tolist()] for n in names}
    if kind == "polars":
        return {n: df[n].to_list() for n in names}
    return {n: df.column(n).to_pylist() for n in names}


def _is_missing(v: Any) -> bool:
    import pandas as pd

    # pandas marks missing values with NaN (any float type), NaT, or pd.NA in its nullable
    # dtypes ("string", ...)
    return v is None or (pd.api.types.is_scalar(v) and bool(pd.isna(v)))


def _one_column(df: Any, name: str) -> tuple[Any, str | None]:
    """The column as a one-column table of df's kind (what DuckDB reads to write its values
    as text), and its time zone where it is a tz-aware timestamp column."""
    kind = _kind(df)
    if kind == "pandas":
        dtype = df[name].dtype  # DatetimeTZDtype has .tz; ArrowDtype a pyarrow type's .tz
        tz = getattr(dtype, "tz", None) or getattr(getattr(dtype, "pyarrow_dtype", None),
                                                   "tz", None)
        return df[[name]], None if tz is None else str(getattr(tz, "key", None) or tz)
    if kind == "polars":
        return df.select(name), getattr(df.schema[name], "time_zone", None)
    return df.select([name]), getattr(df.schema.field(name).type, "tz", None)


def _texts(df: Any, cols: dict[str, list]) -> dict[str, list[str | None]]:
    """Each column's values as prompt text (value_text.column_text)."""
    return {n: value_text.column_text(values, functools.partial(_one_column, df, n))
            for n, values in cols.items()}


def _render(df: Any, template: str, function: str = "llm_complete",
            errors: list[str | None] | None = None) -> list[str | None]:
    """Each row's prompt. errors, when given, gets the error of each row the template cannot
    write (an index or format spec its value does not take: {l[0]} of an empty list,
    {x:.2f} of a text), which is that row's failure, not the frame's; else such a row
    raises."""
    cols = _columns(df, value_text.template_fields(template))
    texts = _texts(df, cols)
    n = len(df) if _kind(df) != "pyarrow" else df.num_rows
    try:
        prompts = value_text.render(template, n, cols, texts)
        if errors is not None:
            errors[:] = [None] * n
        return prompts
    except Exception:  # (a value's own __format__ may raise anything) find the rows
        if errors is None:
            raise
    prompts = []
    errors.clear()
    for i in range(n):
        values = {k: [v[i]] for k, v in cols.items()}
        # (a text column's texts are its values, the same list: render writes them as is)
        one = {k: values[k] if texts[k] is cols[k] else [texts[k][i]] for k in cols}
        try:
            prompts += value_text.render(template, 1, values, one)
            errors.append(None)
        except Exception as e:
            # The values name the row where its position does not (a Ray worker's batch).
            row = df.index[i] if _kind(df) == "pandas" else i
            shown = ", ".join(f"{k}={_short(repr(v[0]))}" for k, v in values.items())
            prompts.append(None)
            errors.append(f"{function} failed on row {row} ({shown}): the template "
                          f"{template!r} cannot write its values ({type(e).__name__}: {e})")
    return prompts


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _unwritable_rows(session: Session, function: str, template: str, policy: str | None,
                     errors: list[str | None]) -> None:
    """The rows _render could not write: raised under on_error='raise' (before any model
    call), else counted and listed in llmdb.errors() as failed rows are."""
    failed = [e for e in errors if e is not None]
    if not failed:
        return
    if (policy or session.options.on_error) != "null":
        raise LLMError(failed[0])
    for error in failed:
        session.record(Stats(rows=1, errors=1))
        session.record_error(function, template, error)


def _with_column(df: Any, name: str, values: list[str | None]) -> Any:
    """df plus a text column (typed as text even with no rows or all NULLs)."""
    kind = _kind(df)
    if kind == "pandas":
        import pandas as pd

        text = pd.Series(["x"]).dtype  # this pandas' text type: str (3.x), object (2.x)
        return df.assign(**{name: pd.Series(values, index=df.index, dtype=text)})
    if kind == "polars":
        import polars as pl

        return df.with_columns(pl.Series(name, values, dtype=pl.String))
    return df.append_column(name, pa.array(values, type=pa.string()))


def _check_template(function: str, template: Any) -> None:
    if not isinstance(template, str):
        raise TypeError(f"llmdb.{function}: template must be a string, got {template!r}")


def _check_column_name(option: str, name: Any) -> None:
    if not isinstance(name, str) or not name:
        raise TypeError(f"{option} must be a column name, got {name!r}")


def _check_error_column(error_column: str | None, output: str | None = None) -> None:
    if error_column is None:
        return
    _check_column_name("error_column", error_column)
    if error_column == output:
        raise ValueError(f"error_column and output are both {output!r}: the errors would "
                         f"replace the answers")


def _added(**names: str | None) -> dict[str, str]:
    """The columns a call adds, by option: its output, its error column if any."""
    return {option: n for option, n in names.items() if n is not None}


def _with_error_column(df: Any, error_column: str | None, errors: list[str | None]) -> Any:
    return df if error_column is None else _with_column(df, error_column, errors)


def _keep(df: Any, mask: list[bool]) -> Any:
    kind = _kind(df)
    if kind == "pandas":  # by position: df[[]] would select no columns
        return df.iloc[[i for i, k in enumerate(mask) if k]]
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
    cols = _texts(df, _columns(df, fields))
    n = len(next(iter(cols.values()))) if cols else 0
    rows = [{f: cols[f][i] for f in fields} for i in range(n)]
    usable = [i for i, r in enumerate(rows) if all(v is not None for v in r.values())]
    text = [rows[i] for i in usable]
    plan = ggr(text, fields) if reorder else [(k, list(fields)) for k in range(len(usable))]
    prompts: list[str | None] = [None] * n
    for k, order in plan:
        prompts[usable[k]] = render(instruction, text[k], order)
    send = [usable[k] for k, _ in plan] + [i for i in range(n) if prompts[i] is None]
    return prompts, send


def complete(df: Any, template: str, output: str = "completion", *,
             fields: list[str] | None = None, reorder_fields: bool = False,
             error_column: str | None = None, **options: Any) -> Any:
    """df plus a column `output` with the model's answer to the rendered template per row
    (a value written as SQL's CAST(x AS VARCHAR) writes it, so the same row gets the same
    prompt as in SQL; a format spec applies to the Python value: see value_text.py).

    With `fields`, the template is an instruction followed by one "field: value" line per
    field; reorder_fields=True lets llmdb choose each row's field order and the row order so
    that prompts share the longest prefixes (GGR), which the engine computes once.
    error_column: also a column with the error of each row that failed under
    on_error='null' (the text llmdb.errors() shows), NULL for the others."""
    session, call = _session_and_call_options("complete", options)
    _check_template("complete", template)
    _check_column_name("output", output)
    _check_error_column(error_column, output)
    if fields is not None and (isinstance(fields, str) or not hasattr(fields, "__iter__")):
        raise TypeError(f"fields must be a list of column names, got {fields!r}")
    if reorder_fields and not fields:
        raise ValueError("reorder_fields=True orders the `fields`: give fields=[...]")
    if call.get("stop") is not None and isinstance(call["stop"], str):
        call["stop"] = [call["stop"]]
    _check_call(session, "llm_complete", call)

    def rows(df: Any) -> Any:
        unwritable: list[str | None] = []
        if fields:
            prompts, send = _field_prompts(df, template, list(fields), reorder_fields)
            unwritable = [None] * len(prompts)
        else:
            prompts = _render(df, template, "llm_complete", unwritable)
            send = list(range(len(prompts)))
        n = len(prompts)
        cols = _broadcast(n, call, ("max_tokens", "temperature", "top_p", "seed", "stop",
                                    "system", "model", "on_error"))
        sent_errors: list[str | None] = []
        with _query(session):
            _unwritable_rows(session, "llm_complete", template, call.get("on_error"),
                             unwritable)
            answers = functions.llm_complete(session, [prompts[i] for i in send], *cols,
                                             errors=sent_errors)
        values: list[Any] = [None] * n
        errors = unwritable
        for i, a, e in zip(send, answers, sent_errors, strict=True):
            values[i], errors[i] = a, e or errors[i]
        return _with_error_column(_with_column(df, output, values), error_column, errors)

    reads = columns_read("complete", (template,), {"fields": fields})
    added = _added(output=output, error_column=error_column)
    return _apply(df, rows, reads, added, every_row=True)


def filter(df: Any, template: str, *,  # noqa: A001 - mirrors llm_filter
           error_column: str | None = None, **options: Any) -> Any:
    """The rows for which the model answers yes to the rendered template (rendered as by
    complete).

    error_column: also the rows that failed under on_error='null' (else dropped, as NULL is
    by SQL's WHERE), with their error in this column; NULL for the rows answered yes."""
    session, call = _session_and_call_options("filter", options)
    _check_template("filter", template)
    _check_error_column(error_column)
    _check_call(session, "llm_filter", call)

    def rows(df: Any) -> Any:
        unwritable: list[str | None] = []
        prompts = _render(df, template, "llm_filter", unwritable)
        cols = _broadcast(len(prompts), call, ("system", "model", "on_error"))
        errors: list[str | None] = []
        with _query(session):
            _unwritable_rows(session, "llm_filter", template, call.get("on_error"), unwritable)
            keep = functions.llm_filter(session, prompts, *cols, errors=errors)
        errors = [e or u for e, u in zip(errors, unwritable, strict=True)]
        if error_column is None:
            return _keep(df, [bool(k) for k in keep])
        return _keep(_with_column(df, error_column, errors),
                     [bool(k) or e is not None for k, e in zip(keep, errors, strict=True)])

    reads = columns_read("filter", (template,), {})
    return _apply(df, rows, reads, _added(error_column=error_column), every_row=False)


def classify(df: Any, column: str, labels: list[str], output: str = "label", *,
             error_column: str | None = None, **options: Any) -> Any:
    """df plus a column `output` holding one of `labels` for each row's `column` (its
    text: a number or date as SQL's CAST(column AS VARCHAR) writes it). error_column: as
    complete's."""
    session, call = _session_and_call_options("classify", options)
    _check_column_name("output", output)
    _check_error_column(error_column, output)
    if isinstance(labels, str) or not hasattr(labels, "__iter__"):
        raise TypeError(f"labels must be a list of strings, got {type(labels).__name__}")
    labels = list(labels)
    _check_call(session, "llm_classify", {**call, "labels": labels})

    def rows(df: Any) -> Any:
        texts = _texts(df, _columns(df, [column]))[column]
        n = len(texts)
        cols = _broadcast(n, call, ("instruction", "system", "model", "on_error"))
        errors: list[str | None] = []
        with _query(session):
            values = functions.llm_classify(session, texts, [labels] * n, *cols,
                                            errors=errors)
        return _with_error_column(_with_column(df, output, values), error_column, errors)

    added = _added(output=output, error_column=error_column)
    return _apply(df, rows, [column], added, every_row=True)
