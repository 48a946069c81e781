"""Where a call site sits, which decides how its arguments are fetched (see drivers)."""

from __future__ import annotations

from dataclasses import dataclass

from sqlglot import exp

from .callsites import is_check
from .guards import MAIN, is_lookup, lookup_tag
from .shapes import aggregated, contains, has_window, int_literal, own_qualify


@dataclass(frozen=True)
class Placement:
    kind: str
    scope: exp.Select | None = None
    why: str = ""  # for EXPLAIN: the reason a site is lazy


def main_lookups(tree: exp.Expression) -> dict[int, exp.Anonymous]:
    out = {}
    for node in tree.walk():
        if is_lookup(node):
            site_id, role = lookup_tag(node)
            if role == MAIN:
                out[site_id] = node
    return out


def _locate(node: exp.Expression) -> tuple[exp.Select | None, str | None, set[str]]:
    """The innermost SELECT around a node, the clause it is in, and what lies between."""
    flags: set[str] = set()
    child, parent = node, node.parent
    while parent is not None:
        if isinstance(parent, exp.AggFunc | exp.Filter):
            flags.add("agg")
        elif isinstance(parent, exp.Window):
            flags.add("window")
        elif isinstance(parent, exp.Lambda):
            flags.add("lambda")
        elif isinstance(parent, exp.Anonymous) and not (is_lookup(parent) or is_check(parent)):
            flags.add("unknown_fn")
        if isinstance(parent, exp.Select):
            return parent, child.arg_key, flags
        if isinstance(parent, exp.Query | exp.Subquery):
            flags.add("nested")
        child, parent = parent, parent.parent
    return None, None, flags


def projection_index(s: exp.Select, node: exp.Expression) -> int | None:
    for i, p in enumerate(s.expressions):
        if any(n is node for n in p.walk()):
            return i
    return None


def reads_projection(clause: exp.Expression | None, s: exp.Select, index: int,
                      ordinals: bool = True) -> bool:
    """Whether a clause reads projection `index` by its alias (or, in ORDER BY, ordinal)."""
    if clause is None:
        return False
    alias = s.expressions[index].alias
    for n in clause.walk():
        if alias and isinstance(n, exp.Column) and not n.table and n.name == alias:
            return True
        if ordinals and isinstance(n, exp.Ordered) and int_literal(n.this) == index + 1:
            return True
    return False


def reads_site(clause: exp.Expression, s: exp.Select, index: int | None, site_id: int,
                ordinals: bool) -> bool:
    """Whether a clause needs the site's value: it calls it or reads its projection."""
    if any(is_lookup(n) and lookup_tag(n)[0] == site_id for n in clause.walk()):
        return True
    return index is not None and reads_projection(clause, s, index, ordinals)


def _group_key(s: exp.Select, index: int) -> bool:
    group = s.args.get("group")
    if group is None:
        return False
    if group.args.get("all"):
        return not contains(s.expressions[index], (exp.AggFunc,))
    alias = s.expressions[index].alias
    for g in group.expressions:
        if int_literal(g) == index + 1:
            return True
        if alias and isinstance(g, exp.Column) and not g.table and g.name == alias:
            return True
    return False


def incremental_ok(s: exp.Select, root: exp.Expression) -> bool:
    if s is not root or int_literal(s.args.get("limit")) is None:
        return False
    if s.args.get("offset") is not None and int_literal(s.args.get("offset")) is None:
        return False
    if aggregated(s) or s.args.get("distinct") or has_window(s) or (
            s.args.get("qualify") and not own_qualify(s)):
        return False
    order = s.args.get("order")
    if order is None:  # scan order: only a plain table has one to follow
        source = s.args.get("from_")
        return source is not None and isinstance(source.this, exp.Table) \
            and not s.args.get("joins")
    if any(is_lookup(n) for n in order.walk()):
        return False
    return not any(reads_projection(order, s, i) for i, p in enumerate(s.expressions)
                   if any(is_lookup(n) for n in p.walk()))


def _streamed(s: exp.Select, agg: bool) -> bool:
    """LIMIT without ORDER BY where the rows it keeps are not a table's first rows (a
    join's, a grouping's come in an order of the threads'): a driver, a run of its own,
    would keep other rows than the query, and the query compute its own again (8 calls
    where the query as written made 4)."""
    if s.args.get("order") is not None or (s.args.get("limit") is None and
                                           s.args.get("offset") is None):
        return False
    source = s.args.get("from_")
    return agg or bool(s.args.get("distinct")) or bool(s.args.get("joins")) or \
        source is None or not isinstance(source.this, exp.Table)


def placement(node: exp.Expression, tops: list[exp.Select], root: exp.Expression) -> Placement:
    s, clause, flags = _locate(node)
    if s is None or not any(s is t for t in tops) or "nested" in flags:
        return Placement("lazy", s, "in a nested query: DuckDB decides which rows reach it")
    if "lambda" in flags:
        return Placement("lazy", s, "inside a lambda")
    if int_literal(s.args.get("limit")) == 0:
        # DuckDB runs no part of a query under LIMIT 0 (tools send one to learn a query's
        # columns): a driver would compute the calls of rows it never returns.
        return Placement("lazy", s, "LIMIT 0: no rows are computed")
    agg = aggregated(s)
    if clause == "where":
        limited = s.args.get("limit") is not None or s.args.get("offset") is not None
        if limited and not agg and not s.args.get("distinct") and not has_window(s):
            if incremental_ok(s, root):
                return Placement("incremental", s)
            return Placement("lazy", s, "LIMIT over joins without ORDER BY: streamed")
        return Placement("where", s)
    if clause == "group":
        return Placement("pre_agg", s)
    if clause in ("expressions", "having", "order"):
        if "window" in flags:
            return Placement("lazy", s, "a window over groups") if agg else \
                Placement("pre_agg", s)
        if "agg" in flags:
            return Placement("pre_agg", s)
        if "unknown_fn" in flags and agg:
            return Placement("lazy", s, "inside a function unknown to the planner")
        if clause == "order" and not agg:
            return Placement("pre_agg", s)
        if clause == "expressions":
            i = projection_index(s, node)
            if i is not None and _group_key(s, i):
                return Placement("pre_agg", s)
        if _streamed(s, agg):
            return Placement("lazy", s, "LIMIT without ORDER BY over joins or groups: "
                                        "streamed")
        return Placement("output", s)
    return Placement("lazy", s, f"in {clause}: evaluated where DuckDB puts it")
