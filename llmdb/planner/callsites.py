"""LLM call sites: where a query calls a model, with its arguments resolved.

A call site is one occurrence of llm_complete / llm_filter / llm_filter_score / llm_classify
in the query text. The SQL macros give these functions named parameters with defaults; here
each call is resolved into the full positional argument list of the Arrow UDF behind the
macro, so that the planner can enumerate, deduplicate and look up calls by their arguments.
llm_count_tokens is not a call site: it never reaches a model.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, replace

import sqlglot
from sqlglot import exp
from sqlglot.errors import SqlglotError

from llmdb.functions import CHECK_PREFIX, DRAWN, DRAWS, FUNCTIONS, SqlFunction, check_macro

PRIORITIES = ("RT", "BE")


class Unsupported(Exception):
    """The planner does not understand this query; it runs as written."""


# The functions whose rows turn into model requests, by name.
SIGNATURES: dict[str, SqlFunction] = {n: f for n, f in FUNCTIONS.items() if f.call is not None}


@dataclass(frozen=True)
class Site:
    """One call in the query, in source order (id). Passes return new ones (replace)."""

    id: int
    signature: SqlFunction
    node: exp.Expression  # the call as parsed (in the planner's copy of the tree)
    args: tuple[exp.Expression, ...]  # one per UDF parameter, defaults filled in
    priority: str | None  # `priority := 'RT'` on the call overrides the query's class
    key: str  # the call's normalized SQL text: learned statistics are kept under it
    # Set by the rewrite (guards.rewrite_sites).
    order: int = -1  # evaluation order among the query's sites
    guard: tuple[exp.Expression, ...] = ()

    @property
    def function(self) -> str:
        return self.signature.name

    def arg(self, name: str) -> exp.Expression:
        return self.args[self.signature.index(name)]


def call_name(node: exp.Expression) -> str | None:
    """The LLM function a node calls, if it is a call site."""
    if isinstance(node, exp.Anonymous):
        name = node.name.lower()
        if name in SIGNATURES:
            return name
    return None


def _literal_number(e: exp.Expression) -> float | None:
    if isinstance(e, exp.Neg):
        v = _literal_number(e.this)
        return None if v is None else -v
    if isinstance(e, exp.Literal) and not e.is_string:
        try:
            return float(e.this)
        except ValueError:
            return None
    return None


def resolve(node: exp.Anonymous, site_id: int) -> Site:
    """A call's UDF arguments: positional ones, then `name := value` ones, then defaults."""
    sig = SIGNATURES[node.name.lower()]
    names = sig.names
    given: dict[str, exp.Expression] = {}
    priority = None
    positional = True
    for i, a in enumerate(node.expressions):
        if isinstance(a, exp.PropertyEQ | exp.Kwarg):
            positional = False
            name = a.this.name.lower()
            if name == "priority":
                priority = _priority_literal(a.expression)
                continue
            if name not in names or name in given:
                raise Unsupported(f"{sig.name}: unknown or repeated parameter {name!r}")
            given[name] = a.expression
        else:
            if not positional or i >= len(names):
                raise Unsupported(f"{sig.name}: unexpected positional argument")
            given[names[i]] = a
    args = []
    for p in sig.params:
        if p.name in given:
            args.append(given[p.name])
        elif p.default is None:
            raise Unsupported(f"{sig.name}: missing argument {p.name!r}")
        else:
            args.append(_parsed(p.default).copy())
    return Site(site_id, sig, node, tuple(args), priority, node.sql("duckdb"))


_INT_RANGE = {"INTEGER": 2**31, "BIGINT": 2**63}


def checked(site: Site, i: int, arg: exp.Expression) -> exp.Expression:
    """The site's i-th argument expression inside its type check, as the SQL function's
    macro has it: a wrong type fails naming the function and parameter. A literal that
    passes it (the defaults, `max_tokens := 32`) is only cast: binding nine checks per
    call costs DuckDB more than planning the query."""
    p = site.signature.params[i]
    if _passes(p.sql_type, arg):
        return exp.cast(arg, p.sql_type, dialect="duckdb")
    return exp.Anonymous(this=check_macro(site.function, p), expressions=[arg])


def _passes(sql_type: str, arg: exp.Expression) -> bool:
    if isinstance(arg, exp.Null):
        return True
    if sql_type == "VARCHAR":
        return isinstance(arg, exp.Literal) and arg.is_string
    whole = _integer_literal(arg)
    if sql_type in _INT_RANGE:  # digits alone: DuckDB types 4.0 and 4e0 as non-integers
        return whole is not None and -_INT_RANGE[sql_type] <= whole < _INT_RANGE[sql_type]
    if sql_type == "DOUBLE":  # a decimal or exponent literal; integers of the BIGINT range
        # (beyond it DuckDB types them HUGEINT, UHUGEINT or BIGNUM, and the check decides)
        if whole is not None:
            return -_INT_RANGE["BIGINT"] <= whole < _INT_RANGE["BIGINT"]
        return _literal_number(arg) is not None
    return False


def _integer_literal(arg: exp.Expression) -> int | None:
    """The exact value of a literal of digits, or of its negation (float would round)."""
    digits = arg.this if isinstance(arg, exp.Neg) else arg
    if not (isinstance(digits, exp.Literal) and not digits.is_string and
            digits.this.isdigit()):
        return None
    return -int(digits.this) if digits is not arg else int(digits.this)


def is_check(node: exp.Expression) -> bool:
    return isinstance(node, exp.Anonymous) and node.name.lower().startswith(CHECK_PREFIX)


@functools.lru_cache(maxsize=64)
def _parsed(sql: str) -> exp.Expression:
    """A parameter's default, parsed once (callers take a copy)."""
    return sqlglot.parse_one(sql, read="duckdb")


# `priority := 'RT'` is the planner's argument: the SQL functions have no such parameter.
_PRIORITY_ARGUMENT = re.compile(r",\s*priority\s*:=\s*'[^']*'", re.IGNORECASE)


def without_priority(sql: str) -> str:
    """The statement as DuckDB's functions take it: without the calls' `priority := '..'`."""
    return _PRIORITY_ARGUMENT.sub("", sql)


def _priority_literal(e: exp.Expression) -> str:
    if not (isinstance(e, exp.Literal) and e.is_string and e.this.upper() in PRIORITIES):
        raise ValueError(f"priority := must be 'RT' or 'BE', got {e.sql('duckdb')}")
    return e.this.upper()


def deterministic(site: Site) -> bool:
    """Whether equal arguments always give equal answers, so one call can serve many rows.

    Sampling without a seed is a fresh draw per row: computing it once per distinct prompt
    would change the query's meaning, so such queries are not rewritten."""
    if site.function != "llm_complete":
        return True
    temperature = _literal_number(site.arg("temperature"))
    if temperature == 0.0:
        return True
    return _literal_number(site.arg("seed")) is not None  # -3 too (a Neg of a literal)


def draws_per_row(sql: str) -> str:
    """The statement with its calls that sample without a seed renamed to the volatile copy
    of llm_complete (functions.DRAWS), so that DuckDB draws for every row even where the
    arguments are constants; the text itself when it has none (or sqlglot cannot read it)."""
    if "temperature" not in sql.lower():  # (every such call names it)
        return sql
    try:
        statements = sqlglot.parse(sql, read="duckdb")
    except SqlglotError:
        return sql
    if len(statements) != 1 or statements[0] is None:
        return sql
    renamed = False
    for node in statements[0].find_all(exp.Anonymous):
        if call_name(node) != DRAWN:
            continue
        try:
            site = resolve(node, 0)
        except (Unsupported, ValueError):
            continue
        if not deterministic(site):
            node.set("this", DRAWS)
            renamed = True
    return statements[0].sql("duckdb") if renamed else sql


def null_call(site: Site) -> bool:
    """Whether the call is NULL without a model call whatever the row: a NULL literal for a
    required argument (the function's NULL row), and every other argument a literal that
    passes its type check (a wrong one raises, NULL prompt or not)."""
    def literal(p, a: exp.Expression) -> bool:
        if _null(a):
            return True
        if p.sql_type.endswith("[]") and isinstance(a, exp.Array):
            return all(isinstance(x, exp.Literal) and x.is_string for x in a.expressions)
        return _passes(p.sql_type, a)

    params = site.signature.params
    return any(p.default is None and _null(a) for p, a in zip(params, site.args, strict=True)) \
        and all(literal(p, a) for p, a in zip(params, site.args, strict=True))


def _null(e: exp.Expression) -> bool:
    """NULL, or NULL cast to a type."""
    return isinstance(e, exp.Null) or isinstance(e, exp.Cast) and isinstance(e.this, exp.Null)


def find_sites(tree: exp.Expression) -> list[Site]:
    """Every call site in source order; raises Unsupported when one cannot be planned."""
    sites = []
    for node in tree.find_all(exp.Anonymous):
        if call_name(node) is None:
            continue
        site = resolve(node, len(sites))
        if not deterministic(site):
            raise Unsupported(f"{site.key}: sampling without a seed is a fresh draw per row")
        sites.append(site)
    # find_all is breadth-first; source order keeps site ids stable across runs.
    return [replace(s, id=i) for i, s in enumerate(sorted(sites, key=lambda s: _position(s.node)))]


def _position(node: exp.Expression) -> tuple[int, ...]:
    path = []
    while node.parent is not None:
        parent = node.parent
        keys = list(parent.args)
        k = keys.index(node.arg_key)
        path.append((k, node.index or 0))
        node = parent
    return tuple(x for pair in reversed(path) for x in pair)
