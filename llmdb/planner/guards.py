"""The guard rule: each call site becomes `CASE WHEN <guard> THEN <lookup> END`.

A call's guard is the condition under which its value can change the clause it sits in,
derived from the expression above it with SQL's three-valued logic. Where its guard is not
TRUE, the value cannot matter, so the rewritten query may leave it NULL; DuckDB evaluates a
CASE's THEN branch only on the rows whose WHEN is TRUE (measured on DuckDB 2.0), so the
lookup, and the model call behind a lookup that misses, happens only on those rows.

What matters of an expression depends on its context:
  T  only whether it IS TRUE (WHERE, ON, HAVING, QUALIFY, a CASE condition);
  F  only whether it IS FALSE (under NOT in a T context);
  V  its whole value (everywhere else).
An operand of AND/OR matters when the other operands do not decide the result already:
  AND  T: the others are TRUE       F, V: the others are NOT FALSE
  OR   T, V: the others are NOT TRUE  F: the others are FALSE
NOT swaps T and F. CASE, IF, COALESCE and NULLIF guard their branches with the conditions
that select them. Everything else passes its guard down unchanged, which can only evaluate
more rows, never fewer; guards stop at aggregates, windows, lambdas, functions unknown to
sqlglot (which may be aggregates) and subqueries, whose operands are evaluated on other rows.

LLM operands of AND/OR are evaluated in the planner's order (see rank): a later one is
guarded by the earlier ones' results, so it runs only where they left the result open.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from sqlglot import exp

from .callsites import Site, Unsupported, call_name, checked, resolve

T, F, V = "T", "F", "V"
MAIN, COPY = "main", "copy"  # a lookup's role: the site, or a copy of it in another's guard
LOOKUP_PREFIX = "__llmdb_site_"

# Nodes whose operands are evaluated on other rows than the node itself.
_GUARD_BARRIERS = (exp.AggFunc, exp.Window, exp.Lambda, exp.Anonymous, exp.Query,
                   exp.Subquery)


@dataclass(frozen=True)
class Predicate:
    """An LLM operand of AND/OR in a T context: its pass rate is learned per `key`."""

    key: str  # its SQL text as written
    op: str  # "and" | "or"
    expr: exp.Expression  # rewritten (lookups in COPY role)
    guard: list[exp.Expression]
    site_ids: list[int] = field(default_factory=list)


def lookup_name(function: str, namespace: int) -> str:
    """A site lookup's UDF name. Connections to one database share its functions, so each
    planner's lookups (closing over its runs) carry its session's number."""
    return f"{LOOKUP_PREFIX}{namespace}_{function}"


def is_lookup(node: exp.Expression) -> bool:
    return isinstance(node, exp.Anonymous) and node.name.lower().startswith(LOOKUP_PREFIX)


def tag(site_id: int, role: str) -> str:
    """A lookup's second argument, naming its site and role. A string literal: DuckDB prints
    it as it is in its plans, where EXPLAIN LLM finds the operator evaluating a site by it."""
    return f"llmdb site {site_id} {role}"


def parse_tag(text: str) -> tuple[int, str]:
    """(site id, role) of a tag."""
    _, _, site_id, role = text.split()
    return int(site_id), role


def lookup_tag(node: exp.Expression) -> tuple[int, str]:
    """(site id, role) of a lookup node."""
    return parse_tag(node.expressions[1].this)


def make_lookup(site: Site, qid: int, namespace: int) -> exp.Anonymous:
    return exp.Anonymous(this=lookup_name(site.function, namespace), expressions=[
        exp.Literal.number(qid), exp.Literal.string(tag(site.id, MAIN)),
        *[checked(site, i, a) for i, a in enumerate(site.args)]])


def as_copy(e: exp.Expression) -> exp.Expression:
    """A copy of a rewritten expression for use inside a guard: its lookups say so."""
    out = e.copy()
    for node in list(out.walk()):
        if is_lookup(node):
            site_id, _ = lookup_tag(node)
            node.expressions[1].replace(exp.Literal.string(tag(site_id, COPY)))
    return out


def _p(e: exp.Expression) -> exp.Paren:
    return e if isinstance(e, exp.Paren) else exp.Paren(this=e)


def _is(e: exp.Expression, what: exp.Expression) -> exp.Expression:
    return exp.Paren(this=exp.Is(this=_p(e), expression=what))


def is_true(e: exp.Expression) -> exp.Expression:
    return _p(e)


def not_true(e: exp.Expression) -> exp.Expression:
    return exp.Not(this=_is(e, exp.true()))


def not_false(e: exp.Expression) -> exp.Expression:
    return exp.Not(this=_is(e, exp.false()))


def is_false(e: exp.Expression) -> exp.Expression:
    return _is(e, exp.false())


def is_null(e: exp.Expression) -> exp.Expression:
    return _is(e, exp.null())


def conjunction(conds: list[exp.Expression]) -> exp.Expression | None:
    if not conds:
        return None
    out = _p(conds[0])
    for c in conds[1:]:
        out = exp.And(this=out, expression=_p(c))
    return out


# A guard repeats its LLM siblings (with their own guards), so deep nests of LLM operands
# grow it geometrically. Past this many nodes the conditions that contain calls are left out:
# a weaker guard evaluates a call on more rows, never on fewer, so results stay the same.
MAX_GUARD_NODES = 300


def _size(e: exp.Expression) -> int:
    return sum(1 for _ in e.walk())


def bounded(conds: list[exp.Expression]) -> list[exp.Expression]:
    out, size = [], 0
    for c in conds:
        n = _size(c)
        calls = any(is_lookup(x) for x in c.walk())
        if calls and size + n > MAX_GUARD_NODES:
            continue
        out.append(c)
        size += n
    return out


def guarded(value: exp.Expression, guard: list[exp.Expression]) -> exp.Expression:
    cond = conjunction([c.copy() for c in guard])  # a node has one parent: never share
    if cond is None:
        return value
    return exp.Case(ifs=[exp.If(this=cond, true=value)])


# (connector, context) -> the condition an operand's siblings must meet for it to matter.
_SIBLING = {
    ("and", T): is_true, ("and", F): not_false, ("and", V): not_false,
    ("or", T): not_true, ("or", F): is_false, ("or", V): not_true,
}


def operands(node: exp.Expression, kind: type) -> list[exp.Expression]:
    """A AND (B AND C) -> [A, B, C]: same-kind connectors and parentheses flattened."""
    inner = node.unnest() if isinstance(node, exp.Paren) else node
    if isinstance(inner, kind):
        return operands(inner.this, kind) + operands(inner.expression, kind)
    return [node]


class Rewriter:
    """Rewrites a statement in place; `rank(operand, op)` orders LLM operands of AND/OR."""

    def __init__(self, sites: list[Site], qid: int, namespace: int,
                 rank: Callable[[exp.Expression, str], float]):
        self.sites = {id(s.node): s for s in sites}
        self.qid = qid
        self.namespace = namespace
        self.rank = rank
        self.rewritten: dict[int, Site] = {}  # by site id, in evaluation order
        self.predicates: list[Predicate] = []

    def has_site(self, e: exp.Expression) -> bool:
        return any(id(n) in self.sites or is_lookup(n) for n in e.walk())

    def run(self, tree: exp.Expression) -> exp.Expression:
        return self.rewrite(tree, V, [])

    # ---- dispatch ------------------------------------------------------------------------

    def rewrite(self, node: exp.Expression, ctx: str, guard: list[exp.Expression]
                ) -> exp.Expression:
        if id(node) in self.sites:
            return self.site(node, guard)
        if not self.has_site(node):
            return node
        if isinstance(node, exp.Paren):
            node.set("this", self.rewrite(node.this, ctx, guard))
            return node
        if isinstance(node, exp.Not):
            flipped = {T: F, F: T, V: V}[ctx]
            node.set("this", self.rewrite(node.this, flipped, guard))
            return node
        if isinstance(node, exp.And | exp.Or):
            return self.connector(node, ctx, guard)
        if isinstance(node, exp.Case):
            return self.case(node, ctx, guard)
        if isinstance(node, exp.If):
            return self.if_(node, ctx, guard)
        if isinstance(node, exp.Coalesce):
            return self.coalesce(node, guard)
        if isinstance(node, exp.Nullif):
            return self.nullif(node, guard)
        return self.generic(node, guard)

    def generic(self, node: exp.Expression, guard: list[exp.Expression]) -> exp.Expression:
        inner_guard = [] if isinstance(node, _GUARD_BARRIERS) else guard
        for key, value in list(node.args.items()):
            ctx = T if isinstance(node, exp.Where | exp.Having | exp.Qualify) or (
                isinstance(node, exp.Join) and key == "on") else V
            child_guard = [] if ctx == T else inner_guard
            if isinstance(value, exp.Expression):
                node.set(key, self.rewrite(value, ctx, child_guard))
            elif isinstance(value, list):
                node.set(key, [self.rewrite(v, ctx, child_guard)
                               if isinstance(v, exp.Expression) else v for v in value])
        return node

    # ---- rules ---------------------------------------------------------------------------

    def site(self, node: exp.Anonymous, guard: list[exp.Expression]) -> exp.Expression:
        site = self.sites[id(node)]
        # Calls nested in the arguments come first: their values are this call's arguments.
        node.set("expressions", [self.rewrite(a, V, guard) for a in node.expressions])
        site = replace(site, args=resolve(node, site.id).args, order=len(self.rewritten),
                       guard=tuple(g.copy() for g in guard))
        self.rewritten[site.id] = site
        return guarded(make_lookup(site, self.qid, self.namespace), guard)

    def connector(self, node: exp.Expression, ctx: str, guard: list[exp.Expression]
                  ) -> exp.Expression:
        kind = type(node)
        op = "and" if kind is exp.And else "or"
        ops = operands(node, kind)
        static = [o for o in ops if not self.has_site(o)]
        llm = sorted((o for o in ops if self.has_site(o)), key=lambda o: self.rank(o, op))
        sibling = _SIBLING[(op, ctx)]
        done: list[exp.Expression] = []
        for o in llm:
            g = bounded(guard + [sibling(s.copy()) for s in static]
                        + [sibling(as_copy(d)) for d in done])
            key = o.sql("duckdb")
            before = {id(n) for n in o.walk()}
            ids = [s.id for nid, s in self.sites.items() if nid in before]
            new = self.rewrite(o, ctx, g)
            if ctx == T:
                self.predicates.append(Predicate(key, op, as_copy(new), [c.copy() for c in g],
                                                 sorted(ids)))
            done.append(new)
        out = _p(static[0]) if static else None
        for o in static[1:] + done:
            out = _p(o) if out is None else kind(this=out, expression=_p(o))
        return out

    def case(self, node: exp.Case, ctx: str, guard: list[exp.Expression]) -> exp.Expression:
        operand = node.args.get("this")
        if operand is not None:
            operand = self.rewrite(operand, V, guard)
            node.set("this", operand)
        earlier: list[exp.Expression] = []
        for branch in node.args["ifs"]:
            g = bounded(guard + [not_true(as_copy(c)) for c in earlier])
            cond = self.rewrite(branch.this, T if operand is None else V, g)
            branch.set("this", cond)
            test = cond if operand is None else exp.EQ(this=_p(operand.copy()),
                                                        expression=_p(cond.copy()))
            branch.set("true", self.rewrite(branch.args["true"], ctx,
                                            bounded(g + [as_copy(test)])))
            earlier.append(test)
        default = node.args.get("default")
        if default is not None:
            g = bounded(guard + [not_true(as_copy(c)) for c in earlier])
            node.set("default", self.rewrite(default, ctx, g))
        return node

    def if_(self, node: exp.If, ctx: str, guard: list[exp.Expression]) -> exp.Expression:
        cond = self.rewrite(node.this, T, guard)
        node.set("this", cond)
        node.set("true", self.rewrite(node.args["true"], ctx, bounded(guard + [as_copy(cond)])))
        if node.args.get("false") is not None:
            node.set("false", self.rewrite(node.args["false"], ctx,
                                           bounded(guard + [not_true(as_copy(cond))])))
        return node

    def nullif(self, node: exp.Nullif, guard: list[exp.Expression]) -> exp.Expression:
        """NULLIF(a, b) is NULL where a is, whatever b: b matters where a is not NULL. (As
        written, DuckDB leaves b uncomputed on a join's unmatched rows, where a is NULL;
        a driver computed it on all of them: 171 calls for 52.)"""
        first = self.rewrite(node.this, V, guard)
        node.set("this", first)
        node.set("expression", self.rewrite(node.expression, V, bounded(
            guard + [exp.Not(this=is_null(as_copy(first)))])))
        return node

    def coalesce(self, node: exp.Coalesce, guard: list[exp.Expression]) -> exp.Expression:
        first = self.rewrite(node.this, V, guard)
        node.set("this", first)
        earlier = [first]
        rest = []
        for e in node.expressions:
            new = self.rewrite(e, V, bounded(guard + [is_null(as_copy(p)) for p in earlier]))
            rest.append(new)
            earlier.append(new)
        node.set("expressions", rest)
        return node


def rewrite_sites(tree: exp.Expression, sites: list[Site], qid: int, namespace: int,
                  rank: Callable[[exp.Expression, str], float]
                  ) -> tuple[exp.Expression, list[Site], list[Predicate]]:
    """The statement with every call site replaced by its guarded lookup, and the sites
    with their rewritten arguments, guards and evaluation order."""
    rw = Rewriter(sites, qid, namespace, rank)
    out = rw.run(tree)
    missing = [s.key for s in sites if s.id not in rw.rewritten]
    if missing:  # a call in a position the traversal never reached: do not guess
        raise Unsupported(f"call sites not rewritten: {missing}")
    assert all(call_name(n) is None for n in out.walk()), "a call site was left in place"
    return out, [rw.rewritten[s.id] for s in sites], rw.predicates
