"""The SQL functions: one section per function, all registered the same way in register().

Each function has a row-level form over Python lists (used by the DataFrame API too) and a
vectorized Arrow UDF around it (DuckDB hands it up to 2048 rows per call). A SQL macro in
front of each UDF gives named parameters with defaults, which Python UDFs cannot have.
NULL inputs give NULL without a model call.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import duckdb
import pyarrow as pa

from llmdb.engine.params import SamplingParams

from .backends import Backend, BackendResult, ChoiceRequest, GenerationRequest, ScoreRequest
from .batch import Call, LLMError, describe_row, run_calls
from .cache import request_key
from .session import ON_ERROR, Session, Stats

FILTER_SUFFIX = "\n\nAnswer with yes or no."
CLASSIFY_INSTRUCTION = ("Classify the text into exactly one of these labels: {labels}. "
                        "Answer with the label only.")


@dataclass
class _Row:
    """One non-NULL row of an LLM function, before it becomes a Call."""

    index: int
    text: str  # the user's prompt, to name the row in errors
    model: str | None
    on_error: str | None
    build: Callable[[Backend], Call]


def _execute(session: Session, function: str, n: int, rows: list[_Row],
             combine: Callable[[Call, list[BackendResult]], Any]) -> list[Any]:
    """Values for n rows (None where NULL or failed with on_error='null')."""
    session.record(Stats())  # this query reached an LLM function, even if only with NULLs
    out: list[Any] = [None] * n
    by_model: dict[str | None, list[_Row]] = {}
    for r in rows:
        by_model.setdefault(r.model, []).append(r)
    for model, group in by_model.items():
        calls, where = [], []
        for r in group:
            policy = r.on_error or session.options.on_error
            try:
                if policy not in ON_ERROR:
                    raise ValueError(f"on_error must be one of {ON_ERROR}, got {policy!r}")
                call = r.build(session.backend(model))
            except ValueError as e:
                message = describe_row(function, r.text, str(e))
                if policy != "null":
                    raise LLMError(message) from e
                session.record_error(function, r.text, message)
                continue
            call.on_error = policy
            calls.append(call)
            where.append(r.index)
        if not calls:
            continue
        outcomes = run_calls(session, session.backend(model), function, calls, combine)
        for i, o in zip(where, outcomes, strict=True):
            out[i] = o.value if o.error is None else None
    return out


# Set by the planner around the rows it computes: the class of the whole query (or of the
# call, `priority := ...`), which one batch of rows cannot tell.
PRIORITY: ContextVar[str | None] = ContextVar("llmdb_priority", default=None)


def _priority(session: Session, n: int) -> str:
    # Without the planner (llmdb.register, DataFrames): small batches are interactive work.
    return PRIORITY.get() or session.options.priority or ("RT" if n <= 32 else "BE")


def _rows(text: Sequence, model: Sequence, on_error: Sequence,
          build: Callable[[int, Backend], Call]) -> list[_Row]:
    """The non-NULL rows of a call, each with how to build its model call."""
    return [_Row(i, t, model[i], on_error[i], functools.partial(build, i))
            for i, t in enumerate(text) if t is not None]


def _key(backend: Backend, function: str, request: Any) -> str:
    return request_key(function, backend.identity(), request)


# ---- llm_complete --------------------------------------------------------------------------

def llm_complete(session: Session, prompt: Sequence, max_tokens: Sequence, temperature: Sequence,
                 top_p: Sequence, seed: Sequence, stop: Sequence, system: Sequence,
                 model: Sequence, on_error: Sequence) -> list[str | None]:
    priority = _priority(session, len(prompt))

    def build(i: int, backend: Backend) -> Call:
        params = SamplingParams(
            max_tokens=256 if max_tokens[i] is None else int(max_tokens[i]),
            temperature=0.0 if temperature[i] is None else float(temperature[i]),
            top_p=1.0 if top_p[i] is None else float(top_p[i]),
            seed=None if seed[i] is None else int(seed[i]),
            stop=[s for s in (stop[i] or []) if s],
        )
        params.validate()
        rendered = backend.render_chat(prompt[i], system[i])
        req = GenerationRequest(rendered, params, priority)
        # Unseeded sampling is a fresh draw per row: never shared, never cached.
        key = None if not params.greedy and params.seed is None else _key(
            backend, "complete", [rendered, params.__dict__])
        return Call([req], key, prompt[i])

    rows = _rows(prompt, model, on_error, build)
    return _execute(session, "llm_complete", len(prompt), rows,
                    lambda call, parts: parts[0].text)


# ---- llm_filter / llm_filter_score ---------------------------------------------------------

def llm_filter_score(session: Session, prompt: Sequence, system: Sequence, model: Sequence,
                     on_error: Sequence) -> list[float | None]:
    """P(yes) / (P(yes) + P(no)) for the answer's first token under the chat template."""
    n = len(prompt)
    priority = _priority(session, n)

    def build(i: int, backend: Backend) -> Call:
        rendered = backend.render_chat(prompt[i] + FILTER_SUFFIX, system[i])
        req = ChoiceRequest(rendered, ("yes", "no"), priority)
        return Call([req], _key(backend, "filter", [rendered, req.words]), prompt[i])

    rows = _rows(prompt, model, on_error, build)

    def combine(call: Call, parts: list[BackendResult]) -> float:
        yes, no = parts[0].word_probs
        return yes / (yes + no) if yes + no > 0 else 0.5

    return _execute(session, "llm_filter", n, rows, combine)


def llm_filter(session: Session, *args: Sequence) -> list[bool | None]:
    return [None if s is None else s >= 0.5 for s in llm_filter_score(session, *args)]


# ---- llm_classify --------------------------------------------------------------------------

def llm_classify(session: Session, text: Sequence, labels: Sequence, instruction: Sequence,
                 system: Sequence, model: Sequence, on_error: Sequence) -> list[str | None]:
    """The label whose tokens plus end of turn are most likely as the answer; ties: first."""
    priority = _priority(session, len(text))

    def build(i: int, backend: Backend) -> Call:
        choices = list(labels[i])
        if not choices or any(not isinstance(c, str) or not c for c in choices):
            raise ValueError(f"labels must be a non-empty list of non-empty strings, "
                             f"got {choices!r}")
        head = instruction[i] or CLASSIFY_INSTRUCTION.format(labels=", ".join(choices))
        rendered = backend.render_chat(f"{head}\n\nText: {text[i]}", system[i])
        reqs = [ScoreRequest(rendered, c, priority) for c in choices]
        return Call(reqs, _key(backend, "classify", [rendered, choices]), text[i])

    present = [None if lb is None else t for t, lb in zip(text, labels, strict=True)]
    rows = _rows(present, model, on_error, build)
    return _execute(session, "llm_classify", len(text), rows, _best_label)


def _best_label(call: Call, parts: list[BackendResult]) -> str:
    scores = [p.logprob for p in parts]
    return call.requests[scores.index(max(scores))].continuation  # first of equal scores


# ---- llm_count_tokens ----------------------------------------------------------------------

def llm_count_tokens(session: Session, text: Sequence, model: Sequence) -> list[int | None]:
    """Tokens of the text itself, without the chat template; no model call."""
    return [None if t is None else session.backend(m).count_tokens(t)
            for t, m in zip(text, model, strict=True)]


# ---- registration --------------------------------------------------------------------------

def _arrow_udf(session: Session, fn: Callable[..., list], names: list[str]
               ) -> Callable[..., pa.Array]:
    def udf(*arrays: pa.Array) -> pa.Array:
        return pa.array(fn(session, *(a.to_pylist() for a in arrays)))
    # DuckDB counts the parameters from the signature.
    udf.__signature__ = inspect.Signature(
        [inspect.Parameter(n, inspect.Parameter.POSITIONAL_ONLY) for n in names])
    return udf


# name -> (row function, parameters with their SQL types and macro defaults, return type)
_FUNCTIONS: dict[str, tuple[Callable, list[tuple[str, str, str | None]], str]] = {
    "llm_complete": (llm_complete, [
        ("prompt", "VARCHAR", None), ("max_tokens", "INTEGER", "256"),
        ("temperature", "DOUBLE", "0.0"), ("top_p", "DOUBLE", "1.0"),
        ("seed", "BIGINT", "NULL"), ("stop", "VARCHAR[]", "NULL"),
        ("system", "VARCHAR", "NULL"), ("model", "VARCHAR", "NULL"),
        ("on_error", "VARCHAR", "NULL")], "VARCHAR"),
    "llm_filter": (llm_filter, [
        ("prompt", "VARCHAR", None), ("system", "VARCHAR", "NULL"),
        ("model", "VARCHAR", "NULL"), ("on_error", "VARCHAR", "NULL")], "BOOLEAN"),
    "llm_filter_score": (llm_filter_score, [
        ("prompt", "VARCHAR", None), ("system", "VARCHAR", "NULL"),
        ("model", "VARCHAR", "NULL"), ("on_error", "VARCHAR", "NULL")], "DOUBLE"),
    "llm_classify": (llm_classify, [
        ("text", "VARCHAR", None), ("labels", "VARCHAR[]", None),
        ("instruction", "VARCHAR", "NULL"), ("system", "VARCHAR", "NULL"),
        ("model", "VARCHAR", "NULL"), ("on_error", "VARCHAR", "NULL")], "VARCHAR"),
    "llm_count_tokens": (llm_count_tokens, [
        ("text", "VARCHAR", None), ("model", "VARCHAR", "NULL")], "INTEGER"),
}


def signatures() -> list[str]:
    """'name(param, option := default, ...)' of every SQL function, for help texts."""
    return [f"{name}({', '.join(p if d is None else f'{p} := {d}' for p, _, d in params)})"
            for name, (_, params, _) in _FUNCTIONS.items()]


def _errors_json(session: Session) -> str:
    return json.dumps([e.__dict__ for e in session.errors])


def register(con: duckdb.DuckDBPyConnection, session: Session) -> None:
    """Add the llm_* functions (and their macros) to a DuckDB connection."""
    for name, (fn, params, returns) in _FUNCTIONS.items():
        impl = f"__llmdb_{name}"
        udf = _arrow_udf(session, fn, [p for p, _, _ in params])
        con.create_function(impl, udf, [t for _, t, _ in params], returns, type="arrow",
                            null_handling="special", side_effects=False)
        args = ", ".join(p if d is None else f"{p} := {d}" for p, _, d in params)
        call = ", ".join(p for p, _, _ in params)
        con.execute(f"CREATE OR REPLACE TEMP MACRO {name}({args}) AS {impl}({call})")
    # Zero-argument helpers, evaluated per query (side effects: never folded or cached).
    con.create_function("__llmdb_stats", lambda: json.dumps(session.stats()), [], "VARCHAR",
                        side_effects=True)
    con.execute("CREATE OR REPLACE TEMP MACRO llm_stats() AS CAST(__llmdb_stats() AS JSON)")
    con.create_function("__llmdb_cache_clear", lambda: _cache_clear(session), [], "BIGINT",
                        side_effects=True)
    con.execute("CREATE OR REPLACE TEMP MACRO llm_cache_clear() AS __llmdb_cache_clear()")
    # SELECT * FROM llm_errors(): the rows that failed under on_error = 'null'.
    con.create_function("__llmdb_errors", lambda: _errors_json(session), [], "VARCHAR",
                        side_effects=True)
    con.execute(f"CREATE OR REPLACE TEMP MACRO llm_errors() AS TABLE SELECT unnest(from_json("
                f"__llmdb_errors(), '{_ERRORS_SHAPE}'), recursive := true)")


_ERRORS_SHAPE = ('[{"query_id": "BIGINT", "function": "VARCHAR", "prompt": "VARCHAR", '
                 '"error": "VARCHAR"}]')


def _cache_clear(session: Session) -> int:
    cache = session.cache()
    return cache.clear() if cache is not None else 0
