"""Facts about a SELECT's shape that several rules and the drivers ask about."""

from __future__ import annotations

from sqlglot import exp


def int_literal(e: exp.Expression | None) -> int | None:
    if isinstance(e, exp.Limit | exp.Offset):
        options = e.args.get("limit_options")
        if options is not None and any(options.args.values()):  # PERCENT, WITH TIES
            return None
        e = e.expression
    if isinstance(e, exp.Literal) and not e.is_string and e.this.isdigit():
        return int(e.this)
    return None


def contains(e: exp.Expression | None, kinds: tuple[type, ...]) -> bool:
    """Whether e holds a node of `kinds` outside nested queries and windows."""
    if e is None:
        return False
    stack = [e]
    while stack:
        n = stack.pop()
        if isinstance(n, kinds):
            return True
        if n is not e and isinstance(n, exp.Query | exp.Subquery | exp.Window):
            continue
        stack.extend(n.iter_expressions())
    return False


def aggregated(s: exp.Select) -> bool:
    if s.args.get("group") or s.args.get("having"):
        return True
    return any(contains(e, (exp.AggFunc,)) for e in s.expressions) or \
        contains(s.args.get("order"), (exp.AggFunc,))


def has_window(s: exp.Select) -> bool:
    return any(any(isinstance(n, exp.Window) for n in e.walk())
               for e in [*s.expressions, s.args.get("order")] if e is not None)



# The QUALIFY that rules.top_rows_before_calls adds carries this mark, and the OFFSET it
# replaced.
TOP_ROWS = "llmdb_top_rows"
SKIPPED = "llmdb_skipped"


def own_qualify(s: exp.Select) -> bool:
    q = s.args.get("qualify")
    return q is not None and bool(q.meta.get(TOP_ROWS))


def offset_of(s: exp.Select) -> int | None:
    """The rows s skips: its OFFSET, or the one its own QUALIFY took over."""
    q = s.args.get("qualify")
    if q is not None and q.meta.get(SKIPPED):
        return q.meta[SKIPPED]
    return int_literal(s.args.get("offset"))
