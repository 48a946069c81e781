"""Small rewrites that prepare a statement for the guard rule; each keeps its meaning.

Each rule takes the planner's copy of the tree, changes it in place and returns it.
"""

from __future__ import annotations

from sqlglot import exp
from sqlglot.dialects.duckdb import DuckDB
from sqlglot.tokens import TokenType

from .callsites import Unsupported, call_name, null_call, resolve
from .guards import as_copy, is_lookup
from .placement import reads_projection
from .shapes import SKIPPED, TOP_ROWS, aggregated, has_window, int_literal

# Functions whose value changes between evaluations: a CTE holding one must stay materialized.
VOLATILE = {"random", "rand", "gen_random_uuid", "uuid", "uuidv4", "uuidv7", "nextval",
            "setseed", "currval"}


# Functions that hold still within a statement but not between statements (the clock, the
# transaction, the statement's text): a driver, a statement of its own, sees other values.
PER_STATEMENT = {"now", "get_current_timestamp", "transaction_timestamp", "txid_current",
                 "current_transaction_id", "current_query"}
PER_STATEMENT_NODES = (exp.CurrentTimestamp, exp.CurrentTime, exp.CurrentDate,
                       exp.CurrentDatetime, exp.Localtime, exp.Localtimestamp)

_DUCKDB = DuckDB()


def has_call(e: exp.Expression) -> bool:
    return any(call_name(n) is not None for n in e.walk())


def number_parameters(sql: str) -> str:
    """`?` -> `$1`, `$2`, ... in the order of the text, as DuckDB binds them: reordering AND
    operands must not reorder bound values. Numbered on the text's tokens, not on the tree:
    sqlglot keeps a SELECT's clauses in an order of its own (its WITH and LIMIT after its
    WHERE), so numbering the tree bound a CTE's `?` to a later value."""
    out, end, n = [], 0, 0
    for token in _DUCKDB.tokenize(sql):
        if token.token_type == TokenType.PLACEHOLDER and token.text == "?":
            n += 1
            out += [sql[end:token.start], f"${n}"]
            end = token.end + 1
    return "".join(out) + sql[end:]


def volatile(e: exp.Expression) -> bool:
    """Draws random values (or a sample), so two evaluations see different rows."""
    for node in e.walk():
        if isinstance(node, exp.Rand | exp.TableSample):
            return True
        if isinstance(node, exp.Func) and node.sql_name().lower() in VOLATILE:
            return True
        if isinstance(node, exp.Anonymous) and node.name.lower() in VOLATILE:
            return True
    return False


def per_statement(e: exp.Expression) -> bool:
    """Reads a value that another statement would see otherwise (now(), current_date, ...)
    where it may reach a prompt: in a call's arguments or in a projection, not in a WHERE
    alone (which selects the same rows a moment later)."""
    return any(_per_statement_value(n) and _may_reach_a_prompt(n) for n in e.walk())


def _per_statement_value(node: exp.Expression) -> bool:
    if isinstance(node, PER_STATEMENT_NODES):
        return True
    if isinstance(node, exp.Anonymous):
        return node.name.lower() in PER_STATEMENT
    return isinstance(node, exp.Func) and node.sql_name().lower() in PER_STATEMENT


def _may_reach_a_prompt(node: exp.Expression) -> bool:
    while node.parent is not None:
        if call_name(node.parent) is not None or (
                isinstance(node.parent, exp.Select) and node.arg_key == "expressions"):
            return True
        node = node.parent
    return False


def null_calls_to_nulls(tree: exp.Expression) -> exp.Expression:
    """A call with a NULL literal for its prompt (text, labels) becomes a typed NULL.

    It is NULL without a model call, and DuckDB folds it so when it plans the query as
    written, and drops what it decides: WHERE x AND llm_filter(NULL) reads no rows. As a
    site, the calls beside it were computed first (8 calls where the query as written made
    none)."""
    for node in reversed(list(tree.find_all(exp.Anonymous))):  # (inner calls first)
        if call_name(node) is None:
            continue
        try:
            site = resolve(node, 0)
        except (Unsupported, ValueError):
            continue  # (find_sites says why)
        if null_call(site):
            node.replace(exp.cast(exp.null(), site.signature.returns, dialect="duckdb"))
    return tree


def inline_llm_ctes(tree: exp.Expression) -> exp.Expression:
    """CTEs holding LLM calls become NOT MATERIALIZED.

    DuckDB 2.0 materializes a CTE, computing every column for every row before the query
    filters it (measured: a CTE's UDF column ran on all 100,000 rows for a query that kept
    100). Inlined, the query's filters and column pruning reach the calls. Equal for
    deterministic expressions, which is why CTEs with volatile functions stay as they are.
    """
    for with_ in tree.find_all(exp.With):
        if with_.args.get("recursive"):
            continue
        for cte in with_.expressions:
            if has_call(cte.this) and not volatile(cte.this):
                cte.set("materialized", False)
    return tree


def _inner(join: exp.Join) -> bool:
    kind = (join.args.get("kind") or "").upper()
    return (not join.args.get("side") and kind in ("", "INNER", "CROSS")
            and not join.args.get("method") and not join.args.get("using"))


def llm_conjuncts_to_where(tree: exp.Expression) -> exp.Expression:
    """In a SELECT whose joins are all inner, ON operands with LLM calls move to WHERE.

    For inner joins ON and WHERE conditions are interchangeable, and in WHERE an LLM
    predicate is guarded by every other condition of the query, not only its join's."""
    for select in tree.find_all(exp.Select):
        joins = select.args.get("joins") or []
        if not joins or not all(_inner(j) for j in joins):
            continue
        moved = []
        for join in joins:
            on = join.args.get("on")
            if on is None or not has_call(on):
                continue
            keep = []
            for o in _conjuncts(on):
                (moved if has_call(o) else keep).append(o)
            join.set("on", _and(keep) if keep else exp.true())
        if moved:
            where = select.args.get("where")
            parts = ([where.this] if where is not None else []) + moved
            select.set("where", exp.Where(this=_and(parts)))
    return tree


def _conjuncts(e: exp.Expression) -> list[exp.Expression]:
    inner = e.unnest() if isinstance(e, exp.Paren) else e
    if isinstance(inner, exp.And):
        return _conjuncts(inner.this) + _conjuncts(inner.expression)
    return [e]


def _and(parts: list[exp.Expression]) -> exp.Expression:
    out = exp.Paren(this=parts[0])
    for p in parts[1:]:
        out = exp.And(this=out, expression=exp.Paren(this=p))
    return out


def having_on_keys_to_where(tree: exp.Expression) -> exp.Expression:
    """In a SELECT with GROUP BY, HAVING conjuncts that read the grouping keys alone (no
    aggregate) move to WHERE.

    Such a conjunct has one value on all rows of a group, so it drops the same groups from
    WHERE, and DuckDB moves it there itself when it runs the query as written. Left in
    HAVING, the drivers computed the calls inside the aggregates on the rows of every group
    (SELECT cat, avg(llm_filter_score(x)) ... GROUP BY cat HAVING llm_filter(cat): the
    scores of every category, for the few that pass). Not under ROLLUP, CUBE or GROUPING
    SETS (their subtotal rows read NULL keys), nor without GROUP BY (an aggregate over no
    rows still returns its row)."""
    for s in list(tree.find_all(exp.Select)):
        having, group = s.args.get("having"), s.args.get("group")
        if having is None or group is None or any(
                group.args.get(k) for k in ("rollup", "cube", "grouping_sets", "totals")) \
                or any(isinstance(g, exp.Rollup | exp.Cube | exp.GroupingSets)
                       for g in group.expressions):
            continue
        if not group.args.get("all") and not group.expressions:
            continue
        keep, moved = [], []
        for c in _conjuncts(having.this):
            on_keys = _on_keys(c, s, group)
            if on_keys is None:
                keep.append(c)
            else:
                moved.append(on_keys)
        if not moved:
            continue
        where = s.args.get("where")
        s.set("where", exp.Where(this=_and(([where.this] if where is not None else []) + moved)))
        s.set("having", exp.Having(this=_and(keep)) if keep else None)
    return tree


def _row_level(e: exp.Expression) -> bool:
    """Evaluates the same on a row as on its group, given its columns: no aggregate, window,
    subquery, volatile function, or function unknown to sqlglot (it may aggregate)."""
    return not volatile(e) and not any(
        isinstance(n, exp.AggFunc | exp.Window | exp.Query | exp.Subquery | exp.Star)
        or (isinstance(n, exp.Anonymous) and call_name(n) is None) for n in e.walk())


def _on_keys(c: exp.Expression, s: exp.Select, group: exp.Group) -> exp.Expression | None:
    """A HAVING conjunct as a WHERE conjunct of the same rows, or None where it reads an
    aggregate or where its names may bind otherwise in WHERE.

    In HAVING, DuckDB binds a name to the FROM's column where that column is a grouping
    key and to the select list's alias otherwise; in WHERE, to the column where there is
    one. A name bare in GROUP BY means the same in both (the column, or where there is none
    the alias); an alias of a name no key reads is replaced by its expression."""
    if not _row_level(c):
        return None
    aliases = {p.alias: p.this for p in s.expressions if isinstance(p, exp.Alias)}
    if group.args.get("all"):
        keys = [p.unalias() for p in s.expressions if _row_level(p)]
        bare: set[str] = set()
    else:
        keys = []
        for g in group.expressions:
            i = int_literal(g)
            keys.append(s.expressions[i - 1].unalias() if i is not None and
                        1 <= i <= len(s.expressions) else g)
        bare = {g.name for g in group.expressions if isinstance(g, exp.Column) and not g.table}
    keyed = {n.name for k in keys for n in k.walk() if isinstance(n, exp.Column)}
    out = c.copy()
    for col in list(out.find_all(exp.Column)):
        name, expr = col.name, aliases.get(col.name)
        if col.table or expr is None or name in bare or (
                isinstance(expr, exp.Column) and expr.name == name):
            continue
        if name in keyed or not _row_level(expr):
            return None  # (the grouping key of that name, or an alias of an aggregate)
        col.replace(exp.Paren(this=expr.copy()))
    if group.args.get("all"):
        # DuckDB's GROUP BY ALL also groups by the columns HAVING reads outside aggregates
        # (SELECT nullif(g, a) AS k ... GROUP BY ALL HAVING f(k) has a group per g and a):
        # out of HAVING, the groups would merge, unless each is a select column already.
        own = {p.unalias().name for p in s.expressions if isinstance(p.unalias(), exp.Column)}
        if any(col.name not in own for col in out.find_all(exp.Column)):
            return None
    return out


# ---- predicate pushdown into subqueries with LLM calls ------------------------------------

def _plain(s: exp.Expression) -> bool:
    """A SELECT whose rows are its FROM's rows, filtered: filtering before or after it is
    the same (no grouping, DISTINCT, LIMIT, windows or set operation)."""
    if not isinstance(s, exp.Select):
        return False
    if any(s.args.get(k) for k in ("group", "having", "qualify", "distinct", "limit",
                                   "offset")):
        return False
    return not any(isinstance(n, exp.AggFunc | exp.Window) for e in s.expressions
                   for n in e.walk())


def _outputs(s: exp.Select) -> tuple[dict[str, exp.Expression], bool]:
    """The subquery's columns by name, and whether a `*` passes its FROM's columns through."""
    named: dict[str, exp.Expression] = {}
    star = False
    for p in s.expressions:
        if isinstance(p, exp.Star):
            star = not s.args.get("joins")
        elif isinstance(p, exp.Alias):
            named[p.alias] = p.this
        elif isinstance(p, exp.Column) and not isinstance(p.this, exp.Star):
            named[p.name] = p
    return named, star


def _cte_uses(tree: exp.Expression) -> dict[str, int]:
    uses: dict[str, int] = {}
    for t in tree.find_all(exp.Table):
        if not t.args.get("db"):
            uses[t.name] = uses.get(t.name, 0) + 1
    return uses


def _ctes_in_scope(select: exp.Select) -> dict[str, exp.CTE]:
    out: dict[str, exp.CTE] = {}
    node: exp.Expression | None = select
    while node is not None:
        w = node.args.get("with_") if isinstance(node, exp.Query) else None
        if w is not None and not w.args.get("recursive"):
            for cte in w.expressions:
                out.setdefault(cte.alias, cte)
        node = node.parent
    return out


def _source(item: exp.Expression, select: exp.Select, uses: dict[str, int]
            ) -> tuple[exp.Select, str] | None:
    """A FROM item that is a subquery (or a CTE used once) with LLM calls: (its SELECT, the
    name the query reads it by)."""
    if isinstance(item, exp.Subquery) and item.alias:
        body, name = item.this, item.alias
    elif isinstance(item, exp.Table) and not item.args.get("db"):
        cte = _ctes_in_scope(select).get(item.name)
        if cte is None or uses.get(item.name, 0) != 1:
            return None
        body, name = cte.this, item.alias_or_name
    else:
        return None
    if not _plain(body) or not has_call(body):
        return None
    return body, name


def push_filters_into_llm_subqueries(tree: exp.Expression) -> exp.Expression:
    """A WHERE conjunct on the columns of a subquery (or a CTE used once) holding LLM calls is
    copied into that subquery's WHERE.

    DuckDB 2.0 does not push a filter below a projection with a Python UDF (measured: a
    filter on a derived table's plain column ran after its UDF column was computed for every
    row), so the calls would run on rows the query then drops. The conjunct stays where it
    was too, so only rows the query drops anyway are dropped earlier. Pushed only through
    inner joins or the preserved side of LEFT joins, and never a conjunct that reads an LLM
    column or calls a volatile function."""
    uses = _cte_uses(tree)
    for select in list(tree.find_all(exp.Select)):
        where = select.args.get("where")
        if where is None or select.args.get("from_") is None:
            continue
        joins = select.args.get("joins") or []
        if any((j.args.get("side") or "").upper() in ("RIGHT", "FULL") or j.args.get("method")
               for j in joins):
            continue
        items = [(select.args["from_"].this, True)] + [
            (j.this, not j.args.get("side") and (j.args.get("kind") or "").upper()
             in ("", "INNER", "CROSS")) for j in joins]
        for item, pushable in items:
            found = _source(item, select, uses) if pushable else None
            if found is None:
                continue
            body, name = found
            named, star = _outputs(body)
            for c in _conjuncts(where.this):
                pushed = _pushed(c, name, named, star, alone=not joins)
                if pushed is not None:
                    body.where(pushed, copy=False)
    return tree


def _pushed(c: exp.Expression, name: str, named: dict[str, exp.Expression], star: bool,
            alone: bool) -> exp.Expression | None:
    """The conjunct in the subquery's own terms, or None when it cannot be pushed."""
    if has_call(c) or volatile(c) or any(isinstance(n, exp.Query | exp.Subquery)
                                          for n in c.walk()):
        return None
    cols = list(c.find_all(exp.Column))
    if not cols:
        return None
    out = c.copy()
    for col in list(out.find_all(exp.Column)):
        if col.table.lower() != name.lower() and not (not col.table and alone):
            return None
        inner = named.get(col.name)
        if inner is None and star:
            inner = exp.column(col.name)
        if inner is None or has_call(inner) or volatile(inner):
            return None
        col.replace(exp.Paren(this=inner.copy()))
    return out


def root_query(tree: exp.Expression) -> exp.Query | None:
    """The query whose rows are the statement's: a SELECT or set operation, or the one a
    CREATE TABLE ... AS or INSERT ... SELECT writes. None for anything else."""
    if isinstance(tree, exp.Query):
        return tree
    if isinstance(tree, exp.Create) and (tree.args.get("kind") or "").upper() == "TABLE":
        body = tree.expression
        return body if isinstance(body, exp.Query) else None
    if isinstance(tree, exp.Insert):
        body = tree.expression
        return body if isinstance(body, exp.Query) else None
    return None


def top_level_selects(root: exp.Query) -> list[exp.Select]:
    """SELECTs every row of which reaches the result: the root, or the branches of a root
    UNION [ALL] without ORDER BY / LIMIT of its own (those can stop a branch early). Not
    an INTERSECT's or EXCEPT's: their rows reach the result only as the other branch
    decides, and DuckDB does not run a branch that cannot (one beside an empty INTERSECT
    branch): computed ahead, its calls were made for nothing."""
    if isinstance(root, exp.Select):
        return [root]
    if isinstance(root, exp.Union) and not root.args.get("limit") \
            and not root.args.get("order") and not root.args.get("offset"):
        return top_level_selects(root.this) + top_level_selects(root.expression)
    if isinstance(root, exp.Subquery) and isinstance(root.this, exp.Query):
        return top_level_selects(root.this)
    return []


# ---- after the guard rule ------------------------------------------------------------------

def _order_key(o: exp.Ordered, s: exp.Select) -> exp.Expression:
    """An ORDER BY key in terms of the FROM's columns (aliases and ordinals resolved)."""
    e = o.this
    i = int_literal(e)
    if i is not None and 1 <= i <= len(s.expressions):
        return s.expressions[i - 1].unalias()
    if isinstance(e, exp.Column) and not e.table:
        for p in s.expressions:
            if isinstance(p, exp.Alias) and p.alias == e.name:
                return p.this
    return e


def first_rows_before_calls(tree: exp.Expression) -> exp.Expression:
    """`SELECT DISTINCT ON (<keys>) <LLM calls> ... [ORDER BY <o>]` also gets
    `QUALIFY row_number() OVER (PARTITION BY <keys> ORDER BY <o>) = 1`. DuckDB computes a
    projection's calls on every row before DISTINCT ON keeps one a key (200 calls for 3
    rows), and after a QUALIFY only on the rows it keeps. The rows are the same: DISTINCT ON
    keeps each key's first row in the ORDER BY's order (any one without it)."""
    for s in list(tree.find_all(exp.Select)):
        distinct = s.args.get("distinct")
        on = distinct.args.get("on") if distinct is not None else None
        if on is None or s.args.get("qualify") or aggregated(s) or has_window(s):
            continue
        order = s.args.get("order")
        written = [*on.expressions, *(o.this for o in order.expressions)] if order else \
            list(on.expressions)
        if not any(any(is_lookup(n) for n in p.walk()) for p in s.expressions) or \
                not _qualify_keeps_the_rows(s, written):
            continue
        keys = [as_copy(_order_key(exp.Ordered(this=k), s)) for k in on.expressions]
        window = exp.Window(this=exp.RowNumber(), partition_by=keys)
        if order is not None:
            window.set("order", _resolved_order(order, s))
        s.set("qualify", exp.Qualify(this=exp.EQ(this=window,
                                                 expression=exp.Literal.number(1))))
    return tree


def _resolved_order(order: exp.Order, s: exp.Select) -> exp.Order:
    """The ORDER BY in terms of the FROM's columns, for a window over them."""
    keys = []
    for o in order.expressions:
        key = o.copy()
        key.set("this", as_copy(_order_key(o, s)))
        keys.append(key)
    return exp.Order(expressions=keys)


def limits_into_union_branches(tree: exp.Expression) -> exp.Expression:
    """`q1 UNION ALL q2 ... LIMIT k [OFFSET s]` with no ORDER BY: every branch holding LLM
    calls gets LIMIT k + s too. The union may return any k rows, and DuckDB computes a
    branch's calls on all of its rows before the union's LIMIT (300 calls for LIMIT 1),
    but on k rows under the branch's own LIMIT."""
    for union in list(tree.find_all(exp.Union)):
        k = int_literal(union.args.get("limit"))
        offset = union.args.get("offset")
        skip = 0 if offset is None else int_literal(offset)
        if k is None or skip is None or union.args.get("distinct") or union.args.get("order"):
            continue
        for branch in _union_branches(union):
            if isinstance(branch, exp.Select) and branch.args.get("limit") is None \
                    and has_call(branch):
                branch.set("limit", exp.Limit(expression=exp.Literal.number(k + skip)))
    return tree


def _union_branches(union: exp.Union) -> list[exp.Expression]:
    """The queries a UNION ALL chain combines (through parentheses and nested UNION ALLs
    without a LIMIT or ORDER BY of their own)."""
    out = []
    for side in (union.this, union.expression):
        while isinstance(side, exp.Subquery) and not _own_clauses(side):
            side = side.this
        if isinstance(side, exp.Union) and not side.args.get("distinct") \
                and not _own_clauses(side):
            out += _union_branches(side)
        else:
            out.append(side)
    return out


def _own_clauses(q: exp.Expression) -> bool:
    """Its own ORDER BY, LIMIT or OFFSET (a parenthesized query's are on its Subquery)."""
    return any(q.args.get(a) for a in ("order", "limit", "offset"))


# The clauses a SELECT may have for random_top_rows_into_subquery to move its rows' part.
_ROWS_PART = ("from_", "where", "order", "limit", "offset")


def _random_top_rows(s: exp.Select) -> bool:
    """SELECT <calls> FROM <one source> [WHERE] ORDER BY <volatile keys that read no column>
    LIMIT k [OFFSET s], and no other clause."""
    order, offset = s.args.get("order"), s.args.get("offset")
    others = [k for k, v in s.args.items() if v and k not in (*_ROWS_PART, "expressions",
                                                                "with_")]
    return order is not None and int_literal(s.args.get("limit")) is not None \
        and (offset is None or int_literal(offset) is not None) and not others \
        and any(has_call(e) for e in s.expressions) and not aggregated(s) \
        and not has_window(s) \
        and all(volatile(o) and not o.find(exp.Column) for o in order.expressions)


def random_top_rows_into_subquery(tree: exp.Expression) -> exp.Expression:
    """`SELECT <calls> FROM src [WHERE w] ORDER BY random() LIMIT k [OFFSET s]` draws its
    rows in a subquery, `(SELECT * FROM src WHERE w ORDER BY random() LIMIT k OFFSET s)`,
    and computes its calls over those k rows. DuckDB computes a projection's calls on every
    row before a top-k by an expression, and the QUALIFY of top_rows_before_calls cannot
    help here: a window may not be ordered by a volatile key (the query as written made
    1,000 calls for LIMIT 5 over 1,000 rows). Only where every key is volatile and reads
    no column, so that the order the subquery draws is the result's order."""
    for s in list(tree.find_all(exp.Select)):
        if not _random_top_rows(s):
            continue
        rows = exp.Select(expressions=[exp.Star()])
        for part in _ROWS_PART:
            rows.set(part, s.args.get(part))
            s.set(part, None)
        name = rows.args["from_"].this.alias_or_name
        alias = exp.TableAlias(this=exp.to_identifier(name)) if name else None
        s.set("from_", exp.From(this=exp.Subquery(this=rows, alias=alias)))
    return tree


def _qualify_keeps_the_rows(s: exp.Select, keys: list[exp.Expression]) -> bool:
    """Whether a QUALIFY over `keys` (ORDER BY or DISTINCT ON keys) keeps the rows the query
    keeps: not where a projection yields several rows per input row (UNNEST; the QUALIFY
    would run before it), nor where a key is an ordinal into a `*` not yet expanded."""
    if any(isinstance(n, exp.Unnest | exp.Explode) or (isinstance(n, exp.Anonymous)
           and n.name.lower() in ("unnest", "generate_subscripts"))
           for p in s.expressions for n in p.walk()):
        return False
    star = any(p.is_star or isinstance(p, exp.Columns) for p in s.expressions)
    return not (star and any(int_literal(k) is not None for k in keys))


def _top_rows_first(s: exp.Select, order: exp.Order) -> bool:
    """Whether DuckDB takes the top rows by plain columns before a subquery (or CTE) with
    calls computes them, which a window would undo: it needs the subquery's every row
    (SELECT f(d.c) FROM (SELECT id, g(x) AS c FROM t) d ORDER BY id LIMIT 1 computed g on
    every row under the QUALIFY, on one without)."""
    if s.args.get("joins") or s.args.get("from_") is None or not all(
            isinstance(_order_key(o, s), exp.Column) for o in order.expressions):
        return False
    item = s.args["from_"].this
    if isinstance(item, exp.Table) and not item.args.get("db"):
        cte = _ctes_in_scope(s).get(item.name)
        item = cte.this if cte is not None else item
    return isinstance(item, exp.Query | exp.Subquery) and any(is_lookup(n) for n in item.walk())


def top_rows_before_calls(tree: exp.Expression) -> exp.Expression:
    """`SELECT <LLM calls> ... ORDER BY <expressions> LIMIT k` also gets
    `QUALIFY row_number() OVER (ORDER BY <the same>) <= k`; with OFFSET s, `BETWEEN s + 1
    AND s + k` in place of the OFFSET, so that the rows skipped are not computed either
    (with the OFFSET kept, DuckDB computed the calls of the s rows before the k).

    DuckDB 2.0 computes a projection's UDF on every row before a top-k by an expression, but
    only on the k rows after a QUALIFY (measured: 200 rows against 3). The result is the
    same k rows (or, among ties at the boundary, other rows as allowed by the ORDER BY).
    Keys that are plain columns get it too: DuckDB takes the top-k first over its own
    tables, but not over an Arrow or pandas table (measured: 300 calls against 1)."""
    for s in list(tree.find_all(exp.Select)):
        k = int_literal(s.args.get("limit"))
        order = s.args.get("order")
        offset = s.args.get("offset")
        skip = 0 if offset is None else int_literal(offset)
        if k is None or skip is None or order is None or aggregated(s) or has_window(s) \
                or s.args.get("distinct") or s.args.get("qualify"):
            continue
        # Only where a select column's calls are no ORDER BY key: the keys are computed on
        # every row anyway, and the window would make DuckDB compute a subquery's columns
        # first too (SELECT *, f(x) AS k FROM <subquery with calls> ORDER BY k LIMIT 2: 23
        # calls where the query as written made 14).
        calls = [i for i, p in enumerate(s.expressions) if any(is_lookup(n) for n in p.walk())]
        if all(reads_projection(order, s, i) for i in calls) or \
                not _qualify_keeps_the_rows(s, [o.this for o in order.expressions]) or \
                _top_rows_first(s, order):
            continue
        window = exp.Window(this=exp.RowNumber(), order=_resolved_order(order, s))
        if skip:  # the LIMIT k then keeps the k rows the QUALIFY keeps
            kept = exp.Between(this=window, low=exp.Literal.number(skip + 1),
                               high=exp.Literal.number(k + skip))
            s.set("offset", None)
        else:
            kept = exp.LTE(this=window, expression=exp.Literal.number(k))
        qualify = exp.Qualify(this=kept)
        qualify.meta[TOP_ROWS] = True  # the planner's own: drivers know to see through it
        qualify.meta[SKIPPED] = skip  # the OFFSET it took over (an incremental step's)
        s.set("qualify", qualify)
    return tree
