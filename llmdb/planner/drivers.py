"""Driver queries: the distinct arguments a call site needs, fetched before the query runs.

A driver returns (arguments..., row count) for the rows on which a site's value can matter,
so that those are computed in one batch rather than in DuckDB's vector-sized pieces. Where a
site sits decides the driver's form (its placement):
  where        in WHERE: the rows of FROM on which its guard holds;
  pre_agg      evaluated per input row although the query aggregates or orders: inside an
               aggregate or window, a GROUP BY key, ORDER BY of an unaggregated query: the
               rows of FROM passing WHERE (and the guard);
  output       per result row (the select list, HAVING or ORDER BY of an aggregate): the
               query itself with the arguments as extra columns, minus the clauses that
               read the site's value (those need it on every row);
  incremental  WHERE of a query with LIMIT (and ORDER BY): see Incremental;
  lazy         anything else (nested scopes, outer-join ON, QUALIFY, lambdas): no driver;
               the lookup computes on a miss, on the rows DuckDB evaluates it on.
Drivers only ever decide batching and call counts, never results: a driver that fetches
too little leaves misses that the lookup computes, one that fails leaves the site lazy.
Only SELECTs whose every row reaches the result (top_level_selects) get drivers: a nested
query's rows depend on how its consumer uses them, which DuckDB's own pushdown handles.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlglot import exp

from .callsites import Site, checked
from .guards import (
    Predicate,
    as_copy,
    conjunction,
    is_lookup,
    operands,
)
from .placement import Placement, main_lookups, placement, projection_index, reads_site
from .shapes import int_literal, offset_of, own_qualify

# A driver's tree is built from copies, for its text alone: it is written out without the
# deep copy sqlglot otherwise makes first.
ARG = "__llmdb_a{}"
GUARD = "__llmdb_g"
PASS = "__llmdb_p"
ROWS = "__llmdb_n"
PHASE = {"incremental": 0, "where": 0, "pre_agg": 1, "output": 2, "lazy": 3}


@dataclass
class Fill:
    """Compute one site's arguments from a driver query."""

    site: Site
    sql: str


@dataclass
class Learn:
    """Count how many rows a predicate passed, once its sites are computed."""

    predicate: Predicate
    sql: str


@dataclass
class Incremental:
    """`WHERE <LLM predicates> [ORDER BY keys] LIMIT k [OFFSET o]`, evaluated in order.

    Rounds over the first n rows (in the query's order) that pass the WHERE's static
    conjuncts: compute the sites on them, count how many pass the whole WHERE, and grow n by
    the number still missing. Growing by exactly that many rows never evaluates a row past
    the one that completes the k + o: each new row might pass. The sites are strict: the
    query itself reads the computed rows and treats the others as not passing, which cannot
    change its result, since every row ordered before its last one was computed."""

    scope: exp.Select
    sites: list[Site]
    target: int  # k + o rows must pass
    site_sql: dict[int, exp.Select] = field(default_factory=dict)  # per site; LIMIT set per round
    count_sql: exp.Select | None = None


Step = Fill | Learn | Incremental


# ---- driver SQL --------------------------------------------------------------------------

def _ctes_above(s: exp.Select) -> list[exp.CTE]:
    """CTEs of the queries enclosing s (s's own stay with s)."""
    out: list[exp.CTE] = []
    node = s.parent
    while node is not None:
        w = node.args.get("with_") if isinstance(node, exp.Query) else None
        if w is not None:
            out = [c.copy() for c in w.expressions] + out
        node = node.parent
    return out


def _with(select: exp.Select, ctes: list[exp.CTE], own: exp.With | None = None) -> exp.Select:
    all_ctes = ctes + ([c.copy() for c in own.expressions] if own is not None else [])
    if all_ctes:
        select.set("with_", exp.With(expressions=all_ctes,
                                     recursive=bool(own and own.args.get("recursive"))))
    return select


def _arg_columns(site: Site) -> list[exp.Expression]:
    return [exp.alias_(checked(site, i, as_copy(a)), ARG.format(i))
            for i, a in enumerate(site.args)]


def _rows_of(site: Site, inner: exp.Select, guarded: bool) -> exp.Select:
    """SELECT args..., count(*) [FILTER (WHERE guard)] FROM (inner) GROUP BY ALL
    [HAVING count(*) FILTER (WHERE guard) > 0].

    The guard is counted, not filtered by a WHERE: DuckDB pushes an outer WHERE into the
    inner query's and evaluates the conjuncts in an order of its own, so the lookups in the
    guard (SELECT f(x) OR f(y) ... WHERE id % 10 = 0: f(x)'s, in f(y)'s guard) ran on rows
    the inner WHERE drops, computing calls the query never makes."""
    cols = [exp.column(ARG.format(i)) for i in range(len(site.args))]
    rows: exp.Expression = exp.Count(this=exp.Star())
    if guarded:
        rows = exp.Filter(this=rows, expression=exp.Where(this=exp.column(GUARD)))
    out = exp.Select(expressions=[*cols, exp.alias_(rows, ROWS)])
    out = out.from_(exp.Subquery(this=inner, alias=exp.TableAlias(this=exp.to_identifier(
        "__llmdb_s"))))
    out.set("group", exp.Group(all=True))
    if guarded:
        out.set("having", exp.Having(this=exp.GT(this=rows.copy(),
                                                  expression=exp.Literal.number(0))))
    return out


def _source(s: exp.Select) -> exp.Select:
    """SELECT FROM s's FROM and joins (copies, lookups in COPY role)."""
    out = exp.Select()
    if s.args.get("from_") is not None:
        out.set("from_", as_copy(s.args["from_"]))
    if s.args.get("joins"):
        out.set("joins", [as_copy(j) for j in s.args["joins"]])
    return out


def where_driver(s: exp.Select, site: Site, with_where: bool) -> exp.Select:
    inner = _source(s)
    inner.set("expressions", _arg_columns(site))
    conds = [as_copy(s.args["where"].this)] if with_where and s.args.get("where") else []
    # The guard's conditions that hold calls are a column counted above the WHERE, not its
    # conjuncts: DuckDB evaluates a WHERE's conjuncts in an order of its own, and pushes one
    # that reads one table below the joins, so their lookups ran on rows that the query's
    # WHERE or its joins drop (see _rows_of).
    called = [c.copy() for c in site.guard if any(is_lookup(n) for n in c.walk())]
    conds += [c.copy() for c in site.guard if not any(is_lookup(n) for n in c.walk())]
    cond = conjunction(conds)
    if cond is not None:
        inner.set("where", exp.Where(this=cond))
    if called:
        inner.set("expressions", [*inner.expressions, exp.alias_(conjunction(called), GUARD)])
    outer = _rows_of(site, inner, guarded=bool(called))
    return _with(outer, _ctes_above(s), s.args.get("with_"))


def output_driver(s: exp.Select, site: Site, node: exp.Expression) -> exp.Select:
    inner = as_copy(s)
    inner.set("with_", None)
    index = projection_index(s, node)
    for clause in ("having", "qualify", "order"):
        c = s.args.get(clause)
        if c is not None and reads_site(c, s, index, site.id, ordinals=clause == "order"):
            inner.set(clause, None)
    # LIMIT picks rows by ORDER BY, or among DISTINCT rows, which needs every row's value;
    # and it picks among the rows HAVING and QUALIFY keep: without them, other rows.
    dropped = any(s.args.get(c) is not None and inner.args.get(c) is None
                  for c in ("having", "qualify", "order"))
    if s.args.get("distinct") or dropped:
        inner.set("order", None)
        inner.set("limit", None)
        inner.set("offset", None)
    inner.set("distinct", None)
    guard = conjunction([c.copy() for c in site.guard]) or exp.true()
    inner.set("expressions", [*inner.expressions, *_arg_columns(site),
                              exp.alias_(guard, GUARD)])
    outer = _rows_of(site, inner, guarded=True)
    return _with(outer, _ctes_above(s), s.args.get("with_"))


def static_where(s: exp.Select) -> exp.Expression | None:
    where = s.args.get("where")
    if where is None:
        return None
    parts = [o for o in operands(where.this, exp.And)
             if not any(is_lookup(n) for n in o.walk())]
    return conjunction([as_copy(p) for p in parts])


def _prefix(s: exp.Select, extra: list[exp.Expression]) -> exp.Select:
    inner = as_copy(s)
    inner.set("with_", None)
    static = static_where(s)
    inner.set("where", exp.Where(this=static) if static is not None else None)
    inner.set("offset", None)
    if own_qualify(s):  # it keeps the top k: a prefix must keep its n rows
        inner.set("qualify", None)
    # Columns with calls are NULL here (the ORDER BY reads none, see incremental_ok): the
    # prefix only orders the rows, and DuckDB keeps a correlated subquery's join even where
    # its column goes unread, so its calls ran on every row of the prefix (22 calls where
    # the query as written made 7).
    kept = [p if not any(is_lookup(n) for n in p.walk()) else
            exp.alias_(exp.null(), p.alias) if p.alias else exp.null()
            for p in inner.expressions]
    inner.set("expressions", [*kept, *extra])
    return inner


def incremental_step(s: exp.Select, sites: list[Site]) -> Incremental:
    limit = int_literal(s.args.get("limit")) or 0
    offset = offset_of(s) or 0
    step = Incremental(s, sites, limit + offset)
    for site in sites:
        guard = conjunction([c.copy() for c in site.guard]) or exp.true()
        inner = _prefix(s, [*_arg_columns(site), exp.alias_(guard, GUARD)])
        step.site_sql[site.id] = _with(_rows_of(site, inner, guarded=True), _ctes_above(s),
                                       s.args.get("with_"))
    passes = exp.alias_(as_copy(s.args["where"].this), PASS)
    inner = _prefix(s, [passes])
    count = exp.Select(expressions=[
        exp.alias_(exp.Count(this=exp.Star()), "rows"),
        exp.alias_(exp.Filter(this=exp.Count(this=exp.Star()),
                              expression=exp.Where(this=exp.column(PASS))), "passed")])
    count = count.from_(exp.Subquery(this=inner, alias=exp.TableAlias(
        this=exp.to_identifier("__llmdb_s"))))
    step.count_sql = _with(count, _ctes_above(s), s.args.get("with_"))
    return step


def with_limit(select: exp.Select, n: int) -> str:
    """An incremental driver's SQL for the first n rows."""
    q = select.copy()
    inner = q.args["from_"].this.this  # FROM (inner) AS __llmdb_s
    inner.set("limit", exp.Limit(expression=exp.Literal.number(n)))
    return q.sql("duckdb", copy=False)


def learn_sql(s: exp.Select, pred: Predicate) -> str:
    inner = _source(s)
    inner.set("expressions", [
        exp.alias_(exp.Filter(this=exp.Count(this=exp.Star()),
                              expression=exp.Where(this=pred.expr.copy())), "passed"),
        exp.alias_(exp.Count(this=exp.Star()), "seen")])
    cond = conjunction([c.copy() for c in pred.guard])
    if cond is not None:
        inner.set("where", exp.Where(this=cond))
    return _with(inner, _ctes_above(s), s.args.get("with_")).sql("duckdb", copy=False)


def plan_steps(tree: exp.Expression, root: exp.Expression, tops: list[exp.Select],
               sites: list[Site], predicates: list[Predicate]
               ) -> tuple[list[Step], dict[int, Placement]]:
    """The prefetch steps in order, and where each site sits."""
    lookups = main_lookups(tree)
    placed: dict[int, Placement] = {}
    for site in sites:
        node = lookups.get(site.id)
        placed[site.id] = placement(node, tops, root) if node is not None else \
            Placement("lazy", None, "not found after the rewrite")
    steps: list[Step] = []
    incremental: dict[int, list[Site]] = {}
    ordered = sorted(sites, key=lambda x: (PHASE[placed[x.id].kind], x.order))
    done: set[int] = set()
    for site in ordered:
        p = placed[site.id]
        if p.kind == "incremental":
            incremental.setdefault(id(p.scope), []).append(site)
            continue
        if p.kind == "lazy":
            continue
        if incremental:  # the strict WHERE sites come first: they limit the rows
            for group in incremental.values():
                steps.append(incremental_step(placed[group[0].id].scope, group))
            incremental.clear()
        node = lookups[site.id]
        if p.kind == "where":
            sel = where_driver(p.scope, site, with_where=False)
        elif p.kind == "pre_agg":
            sel = where_driver(p.scope, site, with_where=True)
        else:
            sel = output_driver(p.scope, site, node)
        steps.append(Fill(site, sel.sql("duckdb", copy=False)))
        done.add(site.id)
        for pred in predicates:  # learn a WHERE predicate's pass rate once it is computed
            if pred.site_ids and max(pred.site_ids) == site.id and all(
                    placed[i].kind == "where" and placed[i].scope is p.scope
                    for i in pred.site_ids) and all(i in done for i in pred.site_ids):
                steps.append(Learn(pred, learn_sql(p.scope, pred)))
    for group in incremental.values():
        steps.append(incremental_step(placed[group[0].id].scope, group))
    return steps, placed
