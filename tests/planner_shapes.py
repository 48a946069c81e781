"""Query shapes for the planner, each with its minimal number of model calls computed from
the table data alone (not by asking the planner). Shared by tests/test_planner.py and
bench/calls.py.

A shape's `minimal(data, order)` gets the tables as Python rows and a function that says
which of the shape's LLM predicates the planner evaluates first, where that matters (the
issue defines minimal for the planner's chosen order). The model's answers come from
`Oracle`: the row-level SQL functions on a session of their own (no planner, no cache).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import duckdb

from llmdb import functions
from llmdb.session import Options, Session

STANDIN = "hash-standin"


class Oracle:
    """What the model answers, asked one distinct prompt at a time (memoized)."""

    def __init__(self, model: str = STANDIN):
        self.session = Session(Options(model=model, cache=False))
        self._memo: dict[tuple, Any] = {}

    def _ask(self, name: str, *args: Any) -> Any:
        key = (name, *[tuple(a) if isinstance(a, list) else a for a in args])
        if key not in self._memo:
            fn = getattr(functions, name)
            self._memo[key] = fn(self.session, *[[a] for a in args])[0]
        return self._memo[key]

    def filter(self, p: str | None) -> bool | None:
        return self._ask("llm_filter", p, None, None, None)

    def score(self, p: str | None) -> float | None:
        return self._ask("llm_filter_score", p, None, None, None)

    def complete(self, p: str | None, max_tokens: int) -> str | None:
        return self._ask("llm_complete", p, max_tokens, 0.0, 1.0, None, None, None, None, None)


@dataclass
class Data:
    t: list[dict]
    u: list[dict]
    oracle: Oracle

    def __post_init__(self) -> None:
        self.t_by_id = {r["id"]: r for r in self.t}
        self.u_ids = {r["id"] for r in self.u}

    def t_joined_u(self) -> list[tuple[dict, dict]]:
        """(t, u) row pairs with t.id = u.id."""
        return [(self.t_by_id[u["id"]], u) for u in self.u if u["id"] in self.t_by_id]


# first(a, b): whether the planner evaluates the call with SQL text `a` before the one with `b`.
Order = Callable[[str, str], bool]


@dataclass
class Shape:
    name: str
    sql: str
    minimal: Callable[[Data, Order], int]
    ordered: bool = False  # results compared in order (the query has ORDER BY)
    fallback: bool = False  # the planner must leave this one as written


def load(con: duckdb.DuckDBPyConnection, oracle: Oracle) -> Data:
    def rows(table: str) -> list[dict]:
        cur = con.execute(f"SELECT * FROM {table} ORDER BY id")
        names = [d[0] for d in cur.description]
        return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]
    return Data(rows("t"), rows("u"), oracle)


def make_tables(con: duckdb.DuckDBPyConnection, n: int) -> None:
    """t(id, x, y, cat, m): x repeats every 97 rows, y every 13, m is NULL every 11th row;
    u(id, k, z): every 7th id of t."""
    con.execute(f"""CREATE OR REPLACE TABLE t AS SELECT range::INTEGER AS id,
        'review ' || (range % 97) AS x, 'topic ' || (range % 13) AS y,
        (range % 5)::INTEGER AS cat,
        CASE WHEN range % 11 = 0 THEN NULL ELSE (range % 3)::INTEGER END AS m
        FROM range({n})""")
    con.execute(f"""CREATE OR REPLACE TABLE u AS SELECT (range * 7)::INTEGER AS id,
        (range % 4)::INTEGER AS k, 'note ' || (range % 31) AS z
        FROM range({max(1, n // 7)})""")


# ---- helpers for the minimal counts ------------------------------------------------------

def distinct(values) -> int:
    return len({v for v in values if v is not None})


def until_k(rows: list[dict], passes: Callable[[dict], bool], k: int,
            arg: Callable[[dict], Any]) -> int:
    """Distinct arguments of the rows, in order, up to the k-th that passes."""
    seen, passed = set(), 0
    for r in rows:
        if passed >= k:
            break
        seen.add(arg(r))
        passed += bool(passes(r))
    return len(seen)


def two_predicates(rows: list[dict], first_arg, second_arg, first_pred, second_pred,
                   swap: bool, op: str = "and") -> int:
    """Calls of `p1 op p2` over rows when p1 runs first (or p2, when swap)."""
    if swap:
        first_arg, second_arg, first_pred, second_pred = (second_arg, first_arg, second_pred,
                                                         first_pred)
    first = {first_arg(r) for r in rows}
    if op == "and":
        second = {second_arg(r) for r in rows if first_pred(r) is True}
    else:
        second = {second_arg(r) for r in rows if first_pred(r) is not True}
    return len(first) + len(second)


def _shapes() -> list[Shape]:
    S = []

    def add(name: str, sql: str, minimal, **kw) -> None:
        S.append(Shape(name, " ".join(sql.split()), minimal, **kw))

    add("and", "SELECT id FROM t WHERE id % 7 = 0 AND llm_filter(x)",
        lambda d, o: distinct(r["x"] for r in d.t if r["id"] % 7 == 0))
    add("or", "SELECT id FROM t WHERE id % 7 = 0 AND (llm_filter(x) OR cat = 1)",
        lambda d, o: distinct(r["x"] for r in d.t if r["id"] % 7 == 0 and r["cat"] != 1))
    add("not", "SELECT id FROM t WHERE NOT (llm_filter(y) AND id % 3 = 0) AND cat = 2",
        lambda d, o: distinct(r["y"] for r in d.t if r["cat"] == 2 and r["id"] % 3 == 0))
    # m is NULL on some rows: `m = 1 OR f` needs f where m = 1 is FALSE or NULL.
    add("or_null_3vl", "SELECT id FROM t WHERE id < 400 AND (m = 1 OR llm_filter(x))",
        lambda d, o: distinct(r["x"] for r in d.t if r["id"] < 400 and r["m"] != 1))
    # In a value context NULL AND f differs from FALSE AND f: f is needed unless m = 1 is FALSE.
    add("and_value_3vl", "SELECT id, (m = 1 AND llm_filter(y)) AS v FROM t WHERE id < 300",
        lambda d, o: distinct(r["y"] for r in d.t
                              if r["id"] < 300 and (r["m"] is None or r["m"] == 1)))
    add("not_or_3vl", "SELECT id FROM t WHERE id < 500 AND NOT (m = 0 OR llm_filter(x))",
        lambda d, o: distinct(r["x"] for r in d.t if r["id"] < 500 and r["m"] == 1
                              or r["id"] < 500 and r["m"] == 2))

    def two_and(d: Data, o: Order) -> int:
        rows = [r for r in d.t if r["id"] % 5 == 0]
        return two_predicates(rows, lambda r: r["x"], lambda r: r["y"],
                              lambda r: d.oracle.filter(r["x"]),
                              lambda r: d.oracle.filter(r["y"]),
                              swap=not o("LLM_FILTER(x)", "LLM_FILTER(y)"))
    add("two_llm_and", "SELECT id FROM t WHERE id % 5 = 0 AND llm_filter(x) AND llm_filter(y)",
        two_and)

    def two_or(d: Data, o: Order) -> int:
        rows = [r for r in d.t if r["id"] % 5 == 0]
        return two_predicates(rows, lambda r: r["x"], lambda r: r["y"],
                              lambda r: d.oracle.filter(r["x"]),
                              lambda r: d.oracle.score(r["y"]) > 0.7,
                              swap=not o("LLM_FILTER(x)", "LLM_FILTER_SCORE(y)"),
                              op="or")
    add("two_llm_or",
        "SELECT id FROM t WHERE id % 5 = 0 AND (llm_filter(x) OR llm_filter_score(y) > 0.7)",
        two_or)
    add("order_by_limit", "SELECT id, x FROM t WHERE llm_filter(x) ORDER BY id DESC LIMIT 5",
        lambda d, o: until_k(sorted(d.t, key=lambda r: -r["id"]),
                             lambda r: d.oracle.filter(r["x"]), 5, lambda r: r["x"]),
        ordered=True)
    add("order_by_limit_offset",
        "SELECT id FROM t WHERE cat = 3 AND llm_filter(y || ' ' || x) ORDER BY id LIMIT 4 "
        "OFFSET 2",
        lambda d, o: until_k([r for r in d.t if r["cat"] == 3],
                             lambda r: d.oracle.filter(f"{r['y']} {r['x']}"), 6,
                             lambda r: f"{r['y']} {r['x']}"),
        ordered=True)
    add("limit_scan_order", "SELECT id, y FROM t WHERE llm_filter(y || x) LIMIT 3",
        lambda d, o: until_k(d.t, lambda r: d.oracle.filter(r["y"] + r["x"]), 3,
                             lambda r: r["y"] + r["x"]),
        ordered=True)
    add("join_on", "SELECT t.id, u.z FROM t JOIN u ON t.id = u.id AND "
        "llm_filter(t.x || ' / ' || u.z) WHERE u.k = 1",
        lambda d, o: distinct(f"{t['x']} / {u['z']}" for t, u in d.t_joined_u()
                              if u["k"] == 1))
    add("left_join_on", "SELECT u.id, t.x FROM u LEFT JOIN t ON t.id = u.id AND "
        "llm_filter(t.y)",
        lambda d, o: distinct(t["y"] for t, _ in d.t_joined_u()))
    add("cte", "WITH s AS (SELECT id, x, llm_filter_score(x) AS sc FROM t) "
        "SELECT id, sc FROM s WHERE id % 50 = 0",
        lambda d, o: distinct(r["x"] for r in d.t if r["id"] % 50 == 0))
    add("derived_table", "SELECT * FROM (SELECT id, x FROM t WHERE cat = 1) s "
        "WHERE llm_filter(s.x) AND s.id < 500",
        lambda d, o: distinct(r["x"] for r in d.t if r["cat"] == 1 and r["id"] < 500))
    add("in_subquery", "SELECT count(*) FROM u WHERE id IN "
        "(SELECT id FROM t WHERE id % 3 = 0 AND llm_filter(x))",
        # Only t rows whose id is in u can change the count (DuckDB finds them too).
        lambda d, o: distinct(r["x"] for r in d.t if r["id"] % 3 == 0 and r["id"] in d.u_ids))
    add("exists_correlated", "SELECT count(*) FROM u WHERE EXISTS "
        "(SELECT 1 FROM t WHERE t.id = u.id AND llm_filter(t.x))",
        lambda d, o: distinct(t["x"] for t, _ in d.t_joined_u()))
    add("scalar_subquery", "SELECT id, (SELECT count(*) FROM u WHERE llm_filter(u.z)) AS n "
        "FROM t WHERE id < 3",
        lambda d, o: distinct(u["z"] for u in d.u))
    add("group_by_filter_agg", "SELECT cat, count(*) FILTER (WHERE llm_filter(x)) AS n "
        "FROM t WHERE id < 1000 GROUP BY cat",
        lambda d, o: distinct(r["x"] for r in d.t if r["id"] < 1000))
    add("group_by_llm_key", "SELECT llm_classify(y, ['a', 'b']) AS c, count(*) AS n "
        "FROM t WHERE id % 2 = 0 GROUP BY c",
        lambda d, o: distinct(r["y"] for r in d.t if r["id"] % 2 == 0))
    add("having", "SELECT cat, count(*) AS n FROM t GROUP BY cat "
        "HAVING llm_filter('category ' || cat)",
        lambda d, o: distinct(r["cat"] for r in d.t))
    add("select_order_by_limit", "SELECT id, llm_complete(x, max_tokens := 2) AS c FROM t "
        "WHERE cat = 2 ORDER BY id LIMIT 7",
        lambda d, o: distinct(r["x"] for r in [r for r in d.t if r["cat"] == 2][:7]),
        ordered=True)

    def top_by_score(d: Data, o: Order) -> int:
        rows = [r for r in d.t if r["id"] < 200]
        top = sorted(rows, key=lambda r: (-d.oracle.score(r["x"]), r["id"]))[:3]
        return distinct(r["x"] for r in rows) + distinct(r["x"] for r in top)
    add("order_by_llm_score", "SELECT id, llm_complete(x, max_tokens := 2) AS c FROM t "
        "WHERE id < 200 ORDER BY llm_filter_score(x) DESC, id LIMIT 3",
        top_by_score, ordered=True)
    add("case_when", "SELECT id, CASE WHEN cat = 0 THEN llm_complete(x, max_tokens := 2) "
        "WHEN llm_filter(y) THEN 'yes' ELSE 'no' END AS v FROM t WHERE id < 300",
        lambda d, o: distinct(r["x"] for r in d.t if r["id"] < 300 and r["cat"] == 0)
        + distinct(r["y"] for r in d.t if r["id"] < 300 and r["cat"] != 0))
    add("union", "SELECT x AS v FROM t WHERE id < 100 AND llm_filter(x) "
        "UNION SELECT z FROM u WHERE llm_filter(z)",
        lambda d, o: distinct([r["x"] for r in d.t if r["id"] < 100] + [u["z"] for u in d.u]))
    add("window", "SELECT id, rank() OVER (PARTITION BY cat ORDER BY llm_filter_score(x), id) "
        "AS r FROM t WHERE id % 10 = 0",
        lambda d, o: distinct(r["x"] for r in d.t if r["id"] % 10 == 0))
    add("same_call_twice", "SELECT id, llm_filter(x) AS f FROM t WHERE id < 150 AND "
        "llm_filter(x)",
        lambda d, o: distinct(r["x"] for r in d.t if r["id"] < 150))

    def nested(d: Data, o: Order) -> int:
        xs = {r["x"] for r in d.t if r["id"] < 40}
        return len(xs) + distinct(d.oracle.complete(x, 2) for x in xs)
    add("nested_calls", "SELECT id FROM t WHERE id < 40 AND "
        "llm_filter(llm_complete(x, max_tokens := 2))", nested)
    add("coalesce", "SELECT id, coalesce(CASE WHEN cat = 1 THEN y END, "
        "llm_complete(x, max_tokens := 1)) AS v FROM t WHERE id < 100",
        lambda d, o: distinct(r["x"] for r in d.t if r["id"] < 100 and r["cat"] != 1))
    add("sampling_without_seed", "SELECT id, llm_complete(x, max_tokens := 1, "
        "temperature := 0.7) AS c FROM t WHERE id < 5",
        lambda d, o: 5, fallback=True)
    return S


SHAPES = _shapes()
