"""A randomized differential test of the planner: seeded random queries over small random
tables, each run through the planner and as written (planner=False) on the stand-in model.

Both must give the same rows (in the same order where the query's ORDER BY determines it;
as multisets otherwise; where a LIMIT without a total order leaves the rows open, the same
count of rows, each a row of the query without its LIMIT), the same column names, the same
kind of error, and the planner must make no more model calls than the query as written,
nor give up on a query (its own error, a rewrite DuckDB rejects). Not counted: calls that
the planner's order of AND / OR operands costs where the written order costs the same (SQL
leaves that order open; run.ranker chooses it), a row error as written in a call whose
value cannot change the result (the planner does not evaluate it; counted apart), a CREATE
TABLE AS's column names (sqlglot's text of its query, see Planner.named_as_written), and
the KNOWN seeds.

The grammar: llm_filter / llm_filter_score / llm_complete / llm_classify (calls nested in
calls, NULL and row-error arguments, system := a column) in select lists, WHERE (AND / OR
/ NOT / CASE / if / coalesce with plain predicates), ORDER BY (expressions, aliases,
places; DESC, NULLS FIRST / LAST; ties broken or not) with LIMIT / OFFSET / PERCENT,
GROUP BY [ALL | ROLLUP] / HAVING / aggregates over calls, DISTINCT, DISTINCT ON, inner,
left, right and full joins, derived tables (some with their own ORDER BY ... LIMIT), CTEs
used once and twice, IN / EXISTS / scalar subqueries, UNION [ALL] / INTERSECT / EXCEPT
[ALL], windows (frames, calls in PARTITION BY) and QUALIFY, bound parameters ($n and ?,
in LIMIT too), FROM-first queries, prompts built from several columns; run by execute(),
as a relation (con.sql) and as CREATE TABLE AS.

CI runs CI_SEEDS; offline, as many as wanted (--big: now and then thousands of rows):

    python -m tests.test_planner_fuzz --seeds 0:3000 [--big] [--verbose] [--show]
"""

from __future__ import annotations

import argparse
import logging
import math
import random
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass

import pytest

import llmdb
from llmdb.planner import LEARNED
from llmdb.planner import run as planner_run

STANDIN = "hash-standin"
WORDS = ["fig", "kiwi", "lime", "pear", "o'k", "Äpfel", "", " sp "]
LABELS = ["['a', 'b']", "['yes', 'no', 'maybe']", "['x', 'y']"]


# ---- the tables ----------------------------------------------------------------------------

def _lit(v: object) -> str:
    if v is None:
        return "NULL"
    if isinstance(v, str):
        return "'" + v.replace("'", "''") + "'"
    return str(v)


def _values(rows: list[tuple], types: list[str]) -> str:
    if not rows:  # an empty table of the same columns
        nulls = ", ".join(f"NULL::{t}" for t in types)
        return f"SELECT {nulls} LIMIT 0"
    return "VALUES " + ", ".join("(" + ", ".join(_lit(v) for v in r) + ")" for r in rows)


def world(rng: random.Random, big: bool = False) -> list[str]:
    """t(id, a, b, s, g): id unique (rows in shuffled order), a with NULLs and repeats;
    u(uid, tid, n, w): tid mostly ids of t (some missing, some NULL); v(vg, note): vg unique."""
    def word(p_null: float = 0.12) -> str | None:
        return None if rng.random() < p_null else rng.choice(WORDS)

    def maybe(v: int, p_null: float = 0.12) -> int | None:
        return None if rng.random() < p_null else v

    nt = rng.choice([0, 3, 30, 60, 120, 200, 200, 5000 if big else 200])
    ids = list(range(nt))
    rng.shuffle(ids)
    t = [(i, maybe(rng.randrange(6)), rng.randrange(-3, 12), word(), rng.randrange(4))
         for i in ids]
    nu = rng.choice([0, 3, 15, 40, 90, 90, 3000 if big else 90])
    u = [(j, None if rng.random() < 0.1 else rng.randrange(max(1, nt + 3)),
          maybe(rng.randrange(5)), word()) for j in range(nu)]
    rng.shuffle(u)
    v = [(g, word(0.2)) for g in range(rng.choice([0, 2, 4, 5]))]
    cols = {"t": (["id", "a", "b", "s", "g"], ["INTEGER"] * 3 + ["VARCHAR", "INTEGER"], t),
            "u": (["uid", "tid", "n", "w"], ["INTEGER"] * 3 + ["VARCHAR"], u),
            "v": (["vg", "note"], ["INTEGER", "VARCHAR"], v)}
    out = []
    for name, (names, types, rows) in cols.items():
        body = _values(rows, types)
        casts = ", ".join(f"CAST(col{i} AS {t}) AS {n}" for i, (n, t) in
                          enumerate(zip(names, types, strict=True)))
        aliases = ", ".join(f"col{i}" for i in range(len(names)))
        out.append(f"CREATE OR REPLACE TABLE {name} AS SELECT {casts} FROM ({body}) "
                   f"AS x({aliases})")
    return out


# ---- scopes: what a query's FROM offers ----------------------------------------------------

BASE = {
    "t": ({"id": "int", "a": "int", "b": "int", "s": "str", "g": "int"}, ["id"]),
    "u": ({"uid": "int", "tid": "int", "n": "int", "w": "str"}, ["uid"]),
    "v": ({"vg": "int", "note": "str"}, ["vg"]),
}


@dataclass
class Source:
    alias: str
    item: str  # the FROM item's SQL
    cols: dict[str, str]  # name -> int | str | float | bool
    keys: list[str]  # columns unique together (empty: rows may repeat)
    kind: str  # t | u | v: which join keys it has


@dataclass
class Scope:
    sources: list[Source]
    qualified: bool

    def ref(self, src: Source, col: str) -> str:
        return f"{src.alias}.{col}" if self.qualified else col

    def cols(self, typ: str | None = None) -> list[str]:
        return [self.ref(s, c) for s in self.sources for c, t in s.cols.items()
                if typ is None or t == typ]

    def keys(self) -> list[str] | None:
        """Expressions unique together over the FROM's rows; None when rows may repeat."""
        out = []
        for s in self.sources:
            if not s.keys:
                return None
            out += [self.ref(s, k) for k in s.keys]
        return out


@dataclass
class Query:
    sql: str
    check: str  # ordered | multiset | subset | count
    params: list | None = None
    unlimited: str | None = None  # for subset: the query without its top-level LIMIT
    unlimited_params: list | None = None
    api: str = "execute"  # execute | sql (a relation) | ctas (CREATE TABLE AS, then read)
    tables: list[str] | None = None  # a regression case's own (else fixed_tables())


class Gen:
    def __init__(self, rng: random.Random):
        self.r = rng
        self.calls = 0  # call sites so far (queries are kept to a few)
        self.max_calls = rng.choice([1, 2, 3, 4, 5])
        self.params: list | None = None
        self.param_style = "?"
        self.sub = 0

    # ---- helpers ---------------------------------------------------------------------------

    def p(self, prob: float) -> bool:
        return self.r.random() < prob

    def pick(self, xs):
        return self.r.choice(xs)

    def choose(self, *makers):
        """One of the makers' results; only the chosen one runs (it may use up calls and
        parameters)."""
        return self.r.choice(makers)()

    def can_call(self) -> bool:
        return self.calls < self.max_calls

    def param(self, value) -> str:
        if self.params is None:
            return _lit(value)
        self.params.append(value)
        return f"${len(self.params)}"  # (renumbered in text order by bind())

    # ---- prompts and calls -----------------------------------------------------------------

    def prompt(self, sc: Scope, depth: int = 0) -> str:
        strs, ints = sc.cols("str"), sc.cols("int")
        choices = []
        if strs:
            c = self.pick(strs)
            choices += [c, c, f"'Q: ' || {c}", f"upper({c})", f"coalesce({c}, 'none')"]
            if ints:
                i = self.pick(ints)
                choices += [f"{c} || ' ' || CAST({i} AS VARCHAR)", f"concat({c}, '/', {i})",
                            f"CASE WHEN {i} > 2 THEN {c} ELSE 'other' END"]
            if len(strs) > 1:
                choices.append(f"{strs[0]} || ' & ' || {strs[1]}")
            if self.params is not None:
                choices.append(f"{self.param(self.pick(['p: ', 'q: ']))} || {c}")
        if ints:
            choices += [f"'n' || {self.pick(ints)}", f"CAST({self.pick(ints)} % 3 AS VARCHAR)"]
        keys = sc.keys()
        if keys and strs:  # a prompt per row: no two rows share an answer
            choices += [f"{self.pick(strs)} || {keys[0]}"] * 2
        if self.p(0.03):
            return self.pick(["NULL", "NULL::VARCHAR"])
        if depth < 2 and self.can_call() and self.p(0.12):
            return self.call(sc, "str", depth + 1)
        return self.pick(choices) if choices else "'constant'"

    def call(self, sc: Scope, typ: str, depth: int = 0) -> str:
        self.calls += 1
        pr = self.prompt(sc, depth + 1)
        system = ""
        if self.p(0.1):
            strs = sc.cols("str")
            system = f", system := {self.pick(['be strict', *strs] if strs else ['x'])}"
            system = system.replace(":= be strict", ":= 'be strict'")
        if typ == "bool":
            return f"llm_filter({pr}{system})"
        if typ == "float":
            return f"llm_filter_score({pr}{system})"
        if self.p(0.35):
            labels = self.pick(LABELS)
            if self.p(0.02):
                labels = self.pick(["NULL", "['a', 'a']"])  # NULL; a row error
            return f"llm_classify({pr}, {labels}{system})"
        k = self.pick([1, 1, 2, 3])
        if self.params is not None and self.p(0.2):
            k = self.param(k)
        elif self.p(0.01):
            k = 0  # a row error
        return f"llm_complete({pr}, max_tokens := {k}{system})"

    # ---- predicates and values ---------------------------------------------------------------

    def plain_pred(self, sc: Scope) -> str:
        ints, strs = sc.cols("int"), sc.cols("str")
        if ints and (not strs or self.p(0.6)):
            c = self.pick(ints)
            k = self.r.randrange(-1, 8)
            if self.p(0.2):
                return f"{c} > {self.param(k)}"
            return self.pick([f"{c} % 3 = {k % 3}", f"{c} IS NULL",
                              f"{c} IS NOT NULL", f"{c} BETWEEN {k} AND {k + 3}",
                              f"{c} IN ({k}, {k + 1})", f"{c} IS DISTINCT FROM {k}",
                              f"{c} <= {k}", f"{c} > {k}"])
        if strs:
            c = self.pick(strs)
            w = self.pick(WORDS)
            if self.p(0.2):
                return f"{c} = {self.param(w)}"
            return self.pick([f"{c} = {_lit(w)}", f"{c} LIKE '%i%'", f"{c} IS NULL",
                              f"{c} < 'm'", f"{c} IS NOT NULL", f"length({c}) > 3"])
        return self.pick(["TRUE", "FALSE", "NULL::BOOLEAN"])

    def llm_pred(self, sc: Scope, depth: int) -> str:
        roll = self.r.random()
        if roll < 0.4:
            return self.call(sc, "bool", depth)
        if roll < 0.55:
            return f"{self.call(sc, 'float', depth)} > {self.pick(['0.3', '0.5', '0.7'])}"
        if roll < 0.65:
            self.calls += 1
            labels = self.pick(LABELS)
            first = labels.split("'")[1]
            return f"llm_classify({self.prompt(sc, depth + 1)}, {labels}) = '{first}'"
        if roll < 0.75:
            return f"{self.call(sc, 'str', depth)} > 'w5'"
        if roll < 0.82:
            return f"length({self.call(sc, 'str', depth)}) > 4"
        if roll < 0.9:
            return f"NOT {self.call(sc, 'bool', depth)}"
        return f"{self.call(sc, 'bool', depth)} IS NULL"

    def pred(self, sc: Scope, depth: int = 0, subqueries: bool = False) -> str:
        roll = self.r.random()
        if depth >= 3:
            roll = min(roll, 0.59)
        if roll < 0.3 or not self.can_call() and roll < 0.6:
            return self.plain_pred(sc)
        if roll < 0.6:
            return self.llm_pred(sc, depth)
        if roll < 0.68:
            return f"NOT ({self.pred(sc, depth + 1, subqueries)})"
        if roll < 0.8:
            return f"({self.pred(sc, depth + 1, subqueries)} AND {self.pred(sc, depth + 1)})"
        if roll < 0.9:
            return f"({self.pred(sc, depth + 1)} OR {self.pred(sc, depth + 1, subqueries)})"
        if roll < 0.94:
            return (f"CASE WHEN {self.pred(sc, depth + 1)} THEN {self.pred(sc, depth + 1)} "
                    f"ELSE {self.pred(sc, depth + 1)} END")
        if roll < 0.96:
            return f"coalesce({self.pred(sc, depth + 1)}, {self.pick(['TRUE', 'FALSE'])})"
        if subqueries:
            return self.subquery_pred(sc)
        return self.plain_pred(sc)

    def subquery_pred(self, sc: Scope) -> str:
        self.sub += 1
        a = f"sq{self.sub}"
        inner = Scope([Source(a, f"u AS {a}", *BASE["u"], "u")], True)
        ts = [s for s in sc.sources if s.kind == "t" and "id" in s.cols]
        vs = [s for s in sc.sources if "g" in s.cols]
        ints = sc.cols("int")
        roll = self.r.random()
        if ts and roll < 0.3:
            outer = sc.ref(ts[0], "id")
            neg = "NOT " if self.p(0.2) else ""
            return f"{outer} {neg}IN (SELECT {a}.tid FROM u AS {a} WHERE {self.pred(inner, 1)})"
        if ts and roll < 0.6:
            outer = sc.ref(ts[0], "id")
            neg = "NOT " if self.p(0.25) else ""
            return (f"{neg}EXISTS (SELECT 1 FROM u AS {a} WHERE {a}.tid = {outer} AND "
                    f"{self.pred(inner, 1)})")
        if ts and sc.cols("str") and roll < 0.4:
            labels = self.pick(LABELS)
            self.calls += 1
            return (f"{self.pick(sc.cols('str'))} IN (SELECT llm_classify({a}.w, {labels}) "
                    f"FROM u AS {a} WHERE {self.pred(inner, 1)})")
        if vs and roll < 0.75:
            vi = Scope([Source(a, f"v AS {a}", *BASE["v"], "v")], True)
            return (f"{sc.ref(vs[0], 'g')} IN (SELECT {a}.vg FROM v AS {a} WHERE "
                    f"{self.pred(vi, 1)})")
        if ints:
            return (f"{self.pick(ints)} < (SELECT count(*) FROM u AS {a} WHERE "
                    f"{self.pred(inner, 1)})")
        return self.plain_pred(sc)

    def scalar_subquery(self, sc: Scope) -> str:
        self.sub += 1
        a = f"sq{self.sub}"
        inner = Scope([Source(a, f"u AS {a}", *BASE["u"], "u")], True)
        ts = [s for s in sc.sources if s.kind == "t" and "id" in s.cols]
        corr = f" AND {a}.tid = {sc.ref(ts[0], 'id')}" if ts and self.p(0.6) else ""
        agg = self.choose(lambda: "count(*)", lambda: f"max({self.value(inner, 'str', 1)})",
                          lambda: f"sum(CASE WHEN {self.pred(inner, 1)} THEN 1 ELSE 0 END)")
        return f"(SELECT {agg} FROM u AS {a} WHERE {self.pred(inner, 1)}{corr})"

    def value(self, sc: Scope, typ: str, depth: int = 0) -> str:
        cols = sc.cols(typ)
        roll = self.r.random()
        if typ == "bool":
            return self.pred(sc, depth + 1)
        if depth >= 2 and (roll >= 0.6 or not self.can_call()):
            if cols and self.p(0.8):
                return self.pick(cols)
            return {"int": "7", "str": "'lit'", "float": "0.5"}[typ]
        if roll < 0.25 and cols:
            return self.pick(cols)
        if roll < 0.6 and self.can_call():
            if typ == "int":
                return self.choose(
                    lambda: f"length({self.call(sc, 'str', depth)})",
                    lambda: f"{self.call(sc, 'bool', depth)}::INTEGER",
                    lambda: f"coalesce({self.pick(cols)}, length({self.call(sc, 'str', depth)}))"
                    if cols else "0")
            if typ == "float":
                return self.choose(lambda: self.call(sc, "float", depth),
                                   lambda: f"round({self.call(sc, 'float', depth)}, 2)")
            return self.choose(lambda: self.call(sc, "str", depth),
                               lambda: self.call(sc, "str", depth),
                               lambda: f"coalesce({self.call(sc, 'str', depth)}, 'none')",
                               lambda: f"upper({self.call(sc, 'str', depth)})")
        if roll < 0.72:
            return (f"CASE WHEN {self.pred(sc, depth + 1)} THEN {self.value(sc, typ, depth + 1)}"
                    f" ELSE {self.value(sc, typ, depth + 1)} END")
        if roll < 0.77:
            return (f"if({self.pred(sc, depth + 1)}, {self.value(sc, typ, depth + 1)}, "
                    f"{self.value(sc, typ, depth + 1)})")
        if roll < 0.81 and sc.cols("int"):
            return (f"CASE {self.pick(sc.cols('int'))} % 3 WHEN 0 THEN "
                    f"{self.value(sc, typ, depth + 1)} WHEN {self.value(sc, 'int', depth + 1)} "
                    f"THEN {self.value(sc, typ, depth + 1)} END")
        if roll < 0.84 and typ != "float":
            return f"nullif({self.value(sc, typ, depth + 1)}, {self.value(sc, typ, depth + 1)})"
        if roll < 0.9 and typ != "float":
            fn = self.pick(["coalesce", "ifnull"])
            return f"{fn}({self.value(sc, typ, depth + 1)}, {self.value(sc, typ, depth + 1)})"
        if typ == "int":
            if cols:
                return self.pick([f"{self.pick(cols)} + 1", f"abs({self.pick(cols)})"])
            return str(self.r.randrange(5))
        if typ == "str":
            return self.prompt(sc, depth)
        return self.pick(["0.25", "NULL::DOUBLE"])

    # ---- FROM ----------------------------------------------------------------------------

    def base(self, name: str, alias: str | None = None) -> Source:
        cols, keys = BASE[name]
        alias = alias or name
        item = name if alias == name else f"{name} AS {alias}"
        return Source(alias, item, dict(cols), list(keys), name)

    def derived(self, alias: str) -> tuple[Source, str]:
        """A subquery over t with calls: (the source, its body)."""
        sc = Scope([self.base("t")], False)
        cols = {"id": "int", "s": "str", "g": "int", "a": "int"}
        items = ["id", "s", "g", "a"]
        for i in range(self.r.randrange(1, 3)):
            typ = self.pick(["str", "float", "bool", "int"])
            items.append(f"{self.value(sc, typ)} AS c{i}")
            cols[f"c{i}"] = typ
        where = f" WHERE {self.pred(sc)}" if self.p(0.5) else ""
        body = f"SELECT {', '.join(items)} FROM t{where}"
        if self.p(0.15):  # its own top rows (determined: id is unique)
            body += f" ORDER BY {self.pick(['id', 'id DESC', 's NULLS FIRST, id'])} " \
                    f"LIMIT {self.pick([1, 5, 20])}"
        return Source(alias, f"({body}) AS {alias}", cols, ["id"], "t"), body

    def from_clause(self, allow_join: bool = True) -> tuple[Scope, str, str]:
        """(scope, FROM text, WITH text)."""
        roll = self.r.random()
        with_ = ""
        if roll < 0.4:
            src = [self.base(self.pick(["t", "t", "t", "u", "v"]))]
            return Scope(src, self.p(0.3)), f"FROM {src[0].item}", with_
        if roll < 0.55:
            d, _ = self.derived("d")
            return Scope([d], self.p(0.5)), f"FROM {d.item}", with_
        if roll < 0.7:
            d, body = self.derived("c")
            mat = self.pick(["", "", "MATERIALIZED ", "NOT MATERIALIZED "])
            with_ = f"WITH c AS {mat}({body}) "
            src = Source("c", "c", d.cols, d.keys, "t")
            if allow_join and self.p(0.35):  # the CTE used twice
                c2 = Source("c2", "c AS c2", dict(d.cols), list(d.keys), "t")
                on = self.pick(["c.id = c2.id", "c.id = c2.id + 1", "c.g = c2.g AND c.id < c2.id"])
                return Scope([src, c2], True), f"FROM c JOIN c AS c2 ON {on}", with_
            return Scope([src], self.p(0.4)), "FROM c", with_
        if not allow_join:
            src = [self.base("t")]
            return Scope(src, False), "FROM t", with_
        left = self.base("t") if self.p(0.7) else self.derived("d")[0]
        kind = self.pick(["JOIN", "JOIN", "LEFT JOIN", "INNER JOIN", "LEFT JOIN", "RIGHT JOIN",
                          "FULL JOIN"])
        if self.p(0.75):
            right = self.base("u")
            on = f"{left.alias}.id = u.tid"
        else:
            right = self.base("v")
            on = f"{left.alias}.g = v.vg"
        sc = Scope([left, right], True)
        if self.p(0.3):
            on += f" AND {self.pred(Scope([left, right], True), 1)}"
        text = f"FROM {left.item} {kind} {right.item} ON {on}"
        if self.p(0.15) and right.kind == "u":  # a third table
            v = self.base("v")
            k3 = self.pick(["JOIN", "LEFT JOIN"])
            text += f" {k3} v ON {left.alias}.g = v.vg"
            sc = Scope([left, right, v], True)
        return sc, text, with_

    # ---- ORDER BY ----------------------------------------------------------------------------

    def order_keys(self, sc: Scope, n: int) -> list[str]:
        out = []
        for _ in range(n):
            roll = self.r.random()
            if roll < 0.5:
                e = self.pick(sc.cols()) if sc.cols() else "1"
            elif roll < 0.8 and self.can_call():
                e = self.value(sc, self.pick(["float", "str", "int"]), 1)
            else:
                e = self.value(sc, self.pick(["int", "str"]), 1)
            out.append(e + self.direction())
        return out

    def direction(self) -> str:
        return self.pick(["", "", " DESC", " ASC"]) + self.pick(["", "", " NULLS FIRST",
                                                                " NULLS LAST"])

    def limit(self) -> str:
        roll = self.r.random()
        bound = self.param if self.params is not None and self.p(0.5) else str
        if roll < 0.6:
            out = f" LIMIT {bound(self.pick([0, 1, 2, 3, 5, 10]))}"
        elif roll < 0.75:
            out = f" LIMIT {self.pick([1, 10, 30, 50])} PERCENT"
        else:
            out = f" LIMIT {bound(self.pick([1, 2, 4]))}"
            return out + f" OFFSET {bound(self.pick([1, 2, 5]))}"
        return out

    # ---- queries -------------------------------------------------------------------------

    def query(self) -> Query:
        if self.p(0.1):
            self.params = []
            self.param_style = self.pick(["?", "$"])
        roll = self.r.random()
        if roll < 0.42:
            q = self.simple()
        elif roll < 0.58:
            q = self.grouped()
        elif roll < 0.72:
            q = self.setop()
        elif roll < 0.84:
            q = self.windowed()
        elif roll < 0.92:
            q = self.distinct_on()
        else:
            q = self.distinct()
        if self.params is not None:
            q.sql, q.params = self.bind(q.sql)
            if q.unlimited is not None:
                q.unlimited, q.unlimited_params = self.bind(q.unlimited)
        roll = self.r.random()
        if roll < 0.08:
            q.api = "sql"
        elif roll < 0.13 and q.check != "subset":
            q.api = "ctas"
        return q

    def bind(self, sql: str) -> tuple[str, list]:
        """The query's parameters in text order (generation order is not the text's), as
        `?` or as `$n` numbered by first use; and their values."""
        values: list = []
        first: dict[int, int] = {}

        def number(m: re.Match) -> str:
            n = int(m[1])
            if self.param_style == "?":
                values.append(self.params[n - 1])
                return "?"
            if n not in first:
                values.append(self.params[n - 1])
                first[n] = len(values)
            return f"${first[n]}"

        return re.sub(r"\$(\d+)", number, sql), values

    def items(self, sc: Scope, n: int) -> tuple[list[str], list[str]]:
        """Select items and their output names."""
        items, names = [], []
        for i in range(n):
            roll = self.r.random()
            if roll < 0.35 and sc.cols():
                c = self.pick(sc.cols())
                items.append(c)
                names.append(c.split(".")[-1])
                continue
            if roll < 0.42:
                e = self.scalar_subquery(sc)
            else:
                e = self.value(sc, self.pick(["str", "str", "bool", "float", "int"]))
            if self.p(0.8):
                items.append(f"{e} AS o{i}")
                names.append(f"o{i}")
            else:
                items.append(e)
                names.append(e)
        return items, names

    def simple(self) -> Query:
        sc, from_, with_ = self.from_clause()
        items, names = self.items(sc, self.r.randrange(1, 4))
        star = self.p(0.1)
        if star:
            items = ["*"] + items
        where = f" WHERE {self.pred(sc, 0, subqueries=True)}" if self.p(0.75) else ""
        head = f"{with_}SELECT {', '.join(items)} {from_}{where}"
        if self.p(0.05):  # DuckDB's FROM-first form
            head = f"{with_}{from_} SELECT {', '.join(items)}{where}"
        roll = self.r.random()
        keys = sc.keys()
        if roll < 0.35 and keys is not None:  # a total order
            order = self.order_keys(sc, self.r.randrange(0, 3)) + [
                k + self.direction() for k in keys]
            if self.p(0.3):  # by an output column: its alias or its place
                i = self.r.randrange(len(names))
                ref = names[i] if names[i].startswith("o") and self.p(0.5) or star else \
                    str(i + 1)
                order.insert(0, ref + self.direction())
            if self.p(0.6):
                body = f"{head} ORDER BY {', '.join(order)}"
                return Query(body + self.limit(), "ordered")
            return Query(f"{head} ORDER BY {', '.join(order)}", "ordered")
        if roll < 0.6:  # an order with ties
            order = self.order_keys(sc, self.r.randrange(1, 3))
            body = f"{head} ORDER BY {', '.join(order)}"
            if self.p(0.7):
                return Query(body + self.limit(), "subset", unlimited=body)
            return Query(body, "multiset")
        if roll < 0.75:  # LIMIT without ORDER BY
            return Query(head + self.limit(), "subset", unlimited=head)
        return Query(head, "multiset")

    def grouped(self) -> Query:
        sc, from_, with_ = self.from_clause()
        keys = []
        for _ in range(self.r.randrange(0, 3)):
            if self.p(0.5) and sc.cols():
                keys.append(self.pick(sc.cols()))
            else:
                keys.append(self.value(sc, self.pick(["str", "bool", "int"]), 1))
        aggs = []
        for i in range(self.r.randrange(1, 3)):
            aggs.append(self.aggregate(sc) + f" AS m{i}")
        items = [f"{k} AS k{i}" for i, k in enumerate(keys)] + aggs
        where = f" WHERE {self.pred(sc, 0, subqueries=True)}" if self.p(0.5) else ""
        group = ""
        if keys:
            roll = self.r.random()
            named = ", ".join(f"k{i}" for i in range(len(keys)))
            group = " GROUP BY " + (named if roll < 0.45 else f"ROLLUP ({named})"
                                    if roll < 0.55 else "ALL")
        having = ""
        if keys and self.p(0.4):
            having = " HAVING " + self.choose(
                lambda: "count(*) > 1", lambda: f"bool_or({self.pred(sc, 1)})",
                lambda: f"{self.aggregate(sc)} IS NOT NULL",
                lambda: "llm_filter('group ' || CAST(k0 AS VARCHAR))")
        head = f"{with_}SELECT {', '.join(items)} {from_}{where}{group}{having}"
        n = len(items)
        if keys and self.p(0.6):
            order = ", ".join(f"{i}{self.direction()}" for i in range(1, n + 1))
            body = f"{head} ORDER BY {order}"
            if self.p(0.5):
                return Query(body + self.limit(), "ordered")
            return Query(body, "ordered")
        if keys and self.p(0.3):
            body = f"{head} ORDER BY m0 DESC"
            return Query(body + self.limit(), "subset", unlimited=body)
        return Query(head, "multiset")

    def aggregate(self, sc: Scope) -> str:
        roll = self.r.random()
        if roll < 0.12:
            return "count(*)"
        if roll < 0.25:
            return f"count(DISTINCT {self.value(sc, 'str', 1)})"
        if roll < 0.4:
            return f"sum({self.value(sc, 'int', 1)})"
        if roll < 0.5:
            return f"max({self.value(sc, 'str', 1)})"
        if roll < 0.6:
            return f"round(avg({self.value(sc, 'float', 1)}), 6)"
        if roll < 0.7:
            return f"bool_or({self.pred(sc, 1)})"
        if roll < 0.82:
            return f"count(*) FILTER (WHERE {self.pred(sc, 1)})"
        if roll < 0.9:
            return f"sum(CASE WHEN {self.pred(sc, 1)} THEN 1 ELSE 0 END)"
        return f"min({self.value(sc, 'int', 1)})"

    def branch(self, types: list[str]) -> str:
        sc, from_, with_ = self.from_clause(allow_join=self.p(0.3))
        items = [self.value(sc, t, 1) if self.p(0.7) or not sc.cols(t) else self.pick(sc.cols(t))
                 for t in types]
        where = f" WHERE {self.pred(sc)}" if self.p(0.6) else ""
        body = f"SELECT {', '.join(items)} {from_}{where}"
        if with_:
            body = f"{with_}{body}"
        if self.p(0.15) and sc.keys() is not None:  # its own top rows, determined
            order = ", ".join(sc.keys())
            return f"({body} ORDER BY {order} LIMIT {self.pick([1, 3])})"
        return f"({body})" if with_ or self.p(0.2) else body

    def setop(self) -> Query:
        types = [self.pick(["str", "int", "bool"]) for _ in range(self.r.randrange(1, 3))]
        op = self.pick(["UNION", "UNION ALL", "UNION ALL", "INTERSECT", "EXCEPT",
                        "EXCEPT ALL", "INTERSECT ALL"])
        parts = [self.branch(types), self.branch(types)]
        body = f"{parts[0]} {op} {parts[1]}"
        if self.p(0.25):
            body = f"{body} {self.pick(['UNION ALL', 'UNION'])} {self.branch(types)}"
        roll = self.r.random()
        if roll < 0.3:
            order = ", ".join(f"{i}{self.direction()}" for i in range(1, len(types) + 1))
            q = f"{body} ORDER BY {order}"
            return Query(q + (self.limit() if self.p(0.6) else ""), "ordered")
        if roll < 0.6:
            return Query(body + self.limit(), "subset", unlimited=body)
        return Query(body, "multiset")

    def windowed(self) -> Query:
        sc, from_, with_ = self.from_clause()
        keys = sc.keys()
        part = self.pick(sc.cols("int") or sc.cols())
        if keys is None:
            return self.simple()
        okeys = self.order_keys(sc, self.r.randrange(0, 2)) + keys
        frame = self.pick(["", "", " ROWS BETWEEN 1 PRECEDING AND CURRENT ROW"])
        if self.p(0.15) and self.can_call():  # partitioned by a call
            part = self.call(sc, self.pick(["bool", "str"]))
        win = f"OVER (PARTITION BY {part} ORDER BY {', '.join(okeys)}{frame})"
        fn = self.choose(lambda: "row_number()", lambda: "rank()", lambda: "dense_rank()",
                         lambda: "count(*)", lambda: f"sum({self.value(sc, 'int', 1)})",
                         lambda: f"max({self.value(sc, 'str', 1)})")
        items, _ = self.items(sc, self.r.randrange(1, 3))
        items.append(f"{fn} {win} AS rn")
        where = f" WHERE {self.pred(sc)}" if self.p(0.5) else ""
        qualify = ""
        if self.p(0.5):
            qualify = f" QUALIFY row_number() {win} <= {self.pick([1, 2])}"
        elif self.p(0.3):
            qualify = f" QUALIFY {self.pred(sc, 1)}"
        head = f"{with_}SELECT {', '.join(items)} {from_}{where}{qualify}"
        if self.p(0.5):
            order = ", ".join(k + self.direction() for k in keys)
            return Query(f"{head} ORDER BY {order}" + (self.limit() if self.p(0.5) else ""),
                         "ordered")
        return Query(head, "multiset")

    def distinct_on(self) -> Query:
        sc, from_, with_ = self.from_clause()
        keys = sc.keys()
        on = [self.pick(sc.cols()) if self.p(0.7) else self.value(sc, "str", 1)
              for _ in range(self.r.randrange(1, 3))]
        items, _ = self.items(sc, self.r.randrange(1, 3))
        where = f" WHERE {self.pred(sc)}" if self.p(0.5) else ""
        head = f"{with_}SELECT DISTINCT ON ({', '.join(on)}) {', '.join(items)} {from_}{where}"
        if keys is not None and self.p(0.75):
            order = on + self.order_keys(sc, self.r.randrange(0, 2)) + keys
            q = f"{head} ORDER BY {', '.join(order)}"
            return Query(q + (self.limit() if self.p(0.3) else ""), "ordered")
        return Query(head, "count")

    def distinct(self) -> Query:
        sc, from_, with_ = self.from_clause()
        items, _ = self.items(sc, self.r.randrange(1, 3))
        where = f" WHERE {self.pred(sc, 0, subqueries=True)}" if self.p(0.6) else ""
        head = f"{with_}SELECT DISTINCT {', '.join(items)} {from_}{where}"
        if self.p(0.5):
            return Query(f"{head} ORDER BY ALL" + (self.limit() if self.p(0.5) else ""),
                         "ordered")
        if self.p(0.3):
            return Query(head + self.limit(), "subset", unlimited=head)
        return Query(head, "multiset")


def generate(seed: int, big: bool = False) -> tuple[list[str], Query]:
    """The tables and the query of one seed (big: now and then, tables of thousands of
    rows, which DuckDB reads in several vectors and threads)."""
    rng = random.Random(seed)
    tables = world(rng, big)
    return tables, Gen(rng).query()


# ---- running both ways -------------------------------------------------------------------

@dataclass
class Outcome:
    rows: list | None
    error: BaseException | None
    calls: int
    names: list[str] | None


def run(con, sql: str, params: list | None, api: str = "execute") -> Outcome:
    before = con.stats()["total"]["model_rows"]
    try:
        if api == "sql":  # a relation
            rel = con.sql(sql, params=params)
            rows, names = rel.fetchall(), rel.columns
        else:
            if api == "ctas":
                sql = f"CREATE OR REPLACE TABLE fuzz_result AS {sql}"
            cur = con.execute(sql, params) if params is not None else con.execute(sql)
            if api == "ctas":
                cur = con.execute("SELECT * FROM fuzz_result")
            rows = cur.fetchall()
            names = [d[0] for d in con.description]
        err = None
    except Exception as e:  # noqa: BLE001 - compared with the other side's
        rows, names, err = None, None, e
    return Outcome(rows, err, con.stats()["total"]["model_rows"] - before, names)


def _canon(v):
    if isinstance(v, float):
        return "nan" if math.isnan(v) else round(v, 6)
    if isinstance(v, tuple | list):
        return tuple(_canon(x) for x in v)
    return v


def canonical(rows: list) -> list:
    return [_canon(r) for r in rows]


def multiset(rows: list) -> list:
    return sorted(canonical(rows), key=repr)


def error_kind(e: BaseException | None) -> str | None:
    """A failed row is one kind whether it comes as llmdb's error (raised by the planner's
    prefetch, or by execute) or as DuckDB's around the UDF's (a relation's fetch)."""
    if e is None:
        return None
    if isinstance(e, llmdb.LLMError) or "LLMError:" in str(e):
        return "row error"
    return type(e).__name__


class _Fallbacks(logging.Handler):
    """The planner's warnings (it logs its own errors before running a query as written)."""

    def __init__(self, seen: list[str]):
        super().__init__(logging.WARNING)
        self.seen = seen

    def emit(self, record: logging.LogRecord) -> None:
        cause = record.exc_info[1] if record.exc_info else None
        self.seen.append(f"{record.getMessage()} ({cause!r})" if cause else record.getMessage())


class Pair:
    """Two connections over identical tables: through the planner, and as written."""

    def __init__(self):
        LEARNED.clear()
        self.on = llmdb.connect(model=STANDIN, cache=False)
        self.off = llmdb.connect(model=STANDIN, cache=False, planner=False)
        # Where the planner gives up on a query it should plan (its own error, or a rewrite
        # DuckDB rejects), the query still runs as written: right rows, a planner bug.
        self.fallbacks: list[str] = []
        self.unreached = 0  # row errors as written that the planner never evaluated
        self._log = _Fallbacks(self.fallbacks)
        logging.getLogger("llmdb.planner").addHandler(self._log)
        binds = self.on.planner.binds

        def checked(p, parameters):
            ok = binds(p, parameters)
            if not ok:
                try:
                    self.on._con.execute(f"EXPLAIN {p.sql}", parameters)
                except Exception as e:  # noqa: BLE001 - its message, for the report
                    self.fallbacks.append(f"rewrite rejected: {str(e).splitlines()[0]}")
            return ok

        self.on.planner.binds = checked

    def load(self, tables: list[str]) -> None:
        for c in (self.on, self.off):
            for s in tables:
                c.execute(s)

    def close(self) -> None:
        logging.getLogger("llmdb.planner").removeHandler(self._log)
        self.on.close()
        self.off.close()

    def check(self, q: Query) -> list[str]:
        """The discrepancies between the two runs of q (empty: none)."""
        self.fallbacks.clear()
        got = run(self.on, q.sql, q.params, q.api)
        want = run(self.off, q.sql, q.params, q.api)
        self.last = got, want
        out = [f"planner fell back: {f}" for f in self.fallbacks]
        if got.error is None and error_kind(want.error) == "row error":
            # A failing call whose value cannot change the result (its guard is not TRUE,
            # or an AND sibling ranked first decides the row) is not evaluated, so raises
            # nothing: SQL leaves the evaluation order open. Counted apart.
            self.unreached += 1
            return out
        if error_kind(got.error) != error_kind(want.error):
            out.append(f"errors differ: planner {got.error!r} / as written {want.error!r}")
        if got.error is not None or want.error is not None:
            return out
        # A CTAS names its columns as sqlglot writes its query back (documented in
        # Planner.named_as_written): an unaliased `x IS NOT NULL` is `(NOT (x IS NULL))`.
        if got.names != want.names and q.api != "ctas":
            out.append(f"column names differ: {got.names} / {want.names}")
        if q.check == "ordered" and q.api != "ctas":  # (a table's rows have no order)
            if canonical(got.rows) != canonical(want.rows):
                out.append(f"ordered rows differ:\n  planner {got.rows[:8]}\n  written "
                           f"{want.rows[:8]}")
        elif q.check in ("multiset", "ordered"):
            if multiset(got.rows) != multiset(want.rows):
                out.append(f"rows differ:\n  planner {multiset(got.rows)[:8]}\n  written "
                           f"{multiset(want.rows)[:8]}")
        elif q.check == "count":
            if len(got.rows) != len(want.rows):
                out.append(f"row counts differ: {len(got.rows)} / {len(want.rows)}")
        elif q.check == "subset":
            if len(got.rows) != len(want.rows):
                out.append(f"row counts differ: {len(got.rows)} / {len(want.rows)}")
            full = run(self.off, q.unlimited, q.unlimited_params)
            if full.error is None:
                extra = Counter(canonical(got.rows)) - Counter(canonical(full.rows))
                if extra:
                    out.append(f"rows not in the unlimited query: {list(extra)[:5]}")
        if got.calls > want.calls:
            # The planner evaluates the LLM operands of an AND / OR in the order its cost
            # model ranks them (run.ranker), which on some data takes more calls than the
            # order written: documented, so not counted where the written order does not.
            again = written_order(lambda: run(self.on, q.sql, q.params, q.api))
            if again.calls > want.calls:
                out.append(f"extra calls: planner {got.calls} > as written {want.calls}")
        return out


def written_order(work):
    """work() with the planner keeping LLM operands of AND / OR in their written order."""
    saved = planner_run.ranker
    planner_run.ranker = lambda sites, model, learned: (lambda operand, op: 0.0)
    try:
        return work()
    finally:
        planner_run.ranker = saved


# ---- regression cases (minimized from fuzzing) -------------------------------------------

def fixed_tables() -> list[str]:
    """Small tables for the regression cases: t of 40 rows, u of 25 (some tid not in t,
    some NULL), v of 4."""
    words = "['fig', 'kiwi', NULL, 'lime', 'pear', 'o''k', '', 'fig', 'Äpfel']"
    return [
        "CREATE OR REPLACE TABLE t AS SELECT range::INTEGER AS id, CASE WHEN range % 7 = 0 "
        "THEN NULL ELSE (range % 5)::INTEGER END AS a, (range % 11 - 2)::INTEGER AS b, "
        f"{words}[range % 9 + 1] AS s, (range % 4)::INTEGER AS g FROM range(40)",
        "CREATE OR REPLACE TABLE u AS SELECT range::INTEGER AS uid, CASE WHEN range % 10 = 9 "
        "THEN NULL ELSE (range * 3 % 45)::INTEGER END AS tid, (range % 5)::INTEGER AS n, "
        f"{words}[range % 7 + 1] AS w FROM range(25)",
        "CREATE OR REPLACE TABLE v AS SELECT range::INTEGER AS vg, 'note ' || range AS note "
        "FROM range(4)",
    ]


# Each was wrong before its fix; the comment says what a user saw.
REGRESSIONS: dict[str, Query] = {
    # Bound values went to the wrong `?` where a CTE (or a LIMIT) comes before the WHERE
    # in the text but not in sqlglot's tree: no rows (a = 30, id > 1), or a conversion
    # error where the types differ.
    "params_in_text_order": Query(
        "WITH c AS (SELECT id, s FROM t WHERE a = ?) SELECT id, llm_filter(s) AS f FROM c "
        "WHERE id > ? ORDER BY id", "ordered", [1, 30]),
    "params_limit_in_text_order": Query(
        "SELECT id, llm_filter(s) AS f FROM t WHERE id > ? ORDER BY id LIMIT ?", "ordered",
        [30, 3]),
    # Under LIMIT 0 (how tools learn a query's columns) DuckDB computes nothing; the
    # planner's drivers computed the WHERE's calls on every row (7 calls here, not 0).
    "limit_0": Query("SELECT s, count(*) AS n FROM t WHERE llm_filter(s) GROUP BY s LIMIT 0",
                     "ordered"),
    "limit_0_distinct_on": Query(
        "SELECT DISTINCT ON (g) g, llm_complete(s, max_tokens := 1) AS c FROM t "
        "WHERE llm_filter_score(s) > 0.2 ORDER BY g, id LIMIT 0", "ordered"),
    # A driver filtered by a site's guard (f(x) is in f(y)'s): DuckDB merged it into the
    # query's WHERE and evaluated it first, so f(x) ran on rows the WHERE drops.
    "guard_after_where": Query(
        "SELECT id, (llm_filter(s) OR llm_filter(s || '!')) AS f FROM t WHERE id % 10 = 0",
        "multiset"),
    # ... or pushed a guard's condition on one table below the join, computing it on rows
    # the join drops (38 calls where the query as written made 28).
    "guard_after_join": Query(
        "SELECT count(*) AS n FROM t JOIN u ON t.id = u.tid WHERE CASE WHEN "
        "llm_filter(t.s || t.id) THEN llm_filter(u.w || u.uid) END", "multiset"),
    "guard_after_where_in_aggregate": Query(
        "SELECT g, count(*) FILTER (WHERE llm_filter(s) OR llm_filter(s || '!')) AS n FROM t "
        "WHERE id % 10 = 0 GROUP BY g", "multiset"),
    # DuckDB runs no INTERSECT branch beside an empty one; the planner's drivers computed
    # the other branch's calls first (7 calls, not 0).
    "intersect_branch_not_ahead": Query(
        "SELECT s FROM t WHERE llm_filter(s) INTERSECT SELECT w FROM u WHERE w = 'nothing'",
        "multiset"),
    # The top-rows QUALIFY kept the OFFSET's rows too, and DuckDB computed their calls (8
    # calls where the query as written made 2)...
    "offset_rows_not_computed": Query(
        "SELECT id, llm_complete(s, max_tokens := 1) AS c FROM t ORDER BY b, id "
        "LIMIT 2 OFFSET 6", "ordered"),
    # ... and where the WHERE's calls are evaluated in order, the rows to reach are still
    # LIMIT + OFFSET.
    "offset_with_ordered_where": Query(
        "SELECT id, llm_complete(s, max_tokens := 1) AS c FROM t WHERE llm_filter(s || id) "
        "ORDER BY id DESC LIMIT 2 OFFSET 3", "ordered"),
    # DuckDB filters groups by a HAVING on their keys before it aggregates; the planner's
    # drivers computed the calls in the aggregates for every group (39 calls, not 22).
    "having_on_keys": Query(
        "SELECT g, round(avg(llm_filter_score(s || id)), 6) AS m FROM t GROUP BY g "
        "HAVING llm_filter('group ' || g) AND count(*) > 1", "multiset"),
    # ORDER BY plain columns LIMIT k over a subquery (or CTE) with calls: DuckDB takes the
    # top rows first, but the planner's top-rows QUALIFY (a window) made it compute the
    # subquery's calls on every row (36 calls where the query as written made 2).
    "top_rows_over_a_subquery": Query(
        "SELECT id, llm_filter(c) AS f FROM (SELECT id, llm_complete(s || id, "
        "max_tokens := 1) AS c FROM t) d ORDER BY id DESC LIMIT 1", "ordered"),
    "top_rows_over_a_cte": Query(
        "WITH c AS (SELECT id, llm_complete(s || id, max_tokens := 1) AS c FROM t) "
        "SELECT id, llm_filter(c) AS f FROM c ORDER BY id LIMIT 2", "ordered"),
    # A call on a NULL prompt is NULL: DuckDB folds it and drops the rows it decides, but
    # the planner computed the calls beside it first (35 calls where the query as written
    # made none).
    "null_prompt_folds": Query(
        "SELECT id FROM t WHERE llm_filter(s || id) AND llm_filter(NULL)", "multiset"),
    # NULLIF(a, b) is NULL where a is: DuckDB left b uncomputed on a join's unmatched rows
    # (of a larger t), the planner's driver computed it on every row (200 calls for 29).
    "nullif_second_argument": Query(
        "SELECT t.id, nullif(u.w, llm_complete(t.s || t.id, max_tokens := 1)) AS o FROM t "
        "LEFT JOIN u ON t.id = u.tid", "multiset", tables=[
            "CREATE OR REPLACE TABLE t AS SELECT range::INTEGER AS id, 'x' || (range % 9) "
            "AS s FROM range(200)",
            "CREATE OR REPLACE TABLE u AS SELECT range::INTEGER AS uid, (range * 7 % 203)"
            "::INTEGER AS tid, 'w' || (range % 5) AS w FROM range(90)"]),
    # Evaluating a WHERE call in order under LIMIT, the prefix queries carried the select
    # list, whose correlated subquery DuckDB joined (and called the model in) on every row
    # of the prefix, though no prefix reads it (22 calls where the query as written made 7).
    "ordered_where_prefix_without_select_list_calls": Query(
        "SELECT t.id, (SELECT max(u.w) FROM u WHERE NOT llm_filter('n' || u.uid) AND "
        "u.tid = t.id) AS m FROM t WHERE t.s < 'm' AND llm_filter('n' || t.a) "
        "LIMIT 1 OFFSET 2", "ordered"),
    # ... but not where it reads columns that are no select column of their own: DuckDB's
    # GROUP BY ALL groups by those too (a group per g and a here), and out of HAVING the
    # groups merged (one row for k = 0 where DuckDB has six).
    "having_with_group_by_all_keeps_its_groups": Query(
        "SELECT nullif(g, a) AS k, count(*) AS n FROM t GROUP BY ALL "
        "HAVING llm_filter('group ' || k) ORDER BY ALL", "ordered"),
    "having_on_key_aliases": Query(
        "SELECT s AS k, count(*) FILTER (WHERE llm_filter(s || id)) AS n FROM t "
        "GROUP BY ALL HAVING llm_filter('group ' || k)", "multiset"),
}


# ---- CI ----------------------------------------------------------------------------------

CI_SEEDS = range(0, 450)  # about 35 s here

# Seeds of CI_SEEDS where the planner makes more calls than the query as written, for the
# reasons given (kinds the planner does not try to match).
KNOWN = {
    144: "order of evaluation: DuckDB evaluates a one-table conjunct below the join; the "
         "planner's guard ties it to the join's rows (16 calls, 13 as written)",
    159: "order of evaluation of two WHERE calls (58 calls, 57 as written)",
    165: "DuckDB folds the select list's classify on an empty subquery while it optimizes "
         "the planner's driver, its statistics making the argument constant (2 calls, 1 as "
         "written; 3 before the query as written remembered its calls)",
    318: "an empty table: DuckDB folds a call its statistics make constant (1 call, 0)",
    347: "order of evaluation of two WHERE calls (10 calls, 9 as written)",
}


@pytest.fixture(scope="module")
def pair():
    p = Pair()
    yield p
    p.close()


@pytest.mark.parametrize("name", list(REGRESSIONS))
def test_regression(pair, name):
    q = REGRESSIONS[name]
    pair.load(q.tables or fixed_tables())
    problems = pair.check(q)
    assert not problems, f"{name}: {q.sql} params={q.params}\n" + "\n".join(problems)


def test_a_limit_without_order_over_a_join_computes_the_rows_it_returns(pair):
    """LIMIT without ORDER BY over a join: the select list's driver, a run of its own with
    another projection, joined in another order and kept other rows than the query, which
    then computed its own (8 calls where the query as written made 4). Such calls are
    computed as DuckDB reaches them now. The tables are the fuzz test's for seed 143 (on
    others the two runs happened to keep the same rows)."""
    pair.load(world(random.Random(143)))
    q = ("SELECT u.w, llm_complete(t.s || t.id, max_tokens := 1) AS c FROM t FULL JOIN u "
         "ON t.id = u.tid LIMIT 5")
    assert pair.check(Query(q, "count")) == []


def test_no_top_rows_qualify_where_every_select_call_is_a_key(pair):
    """ORDER BY a select column's call LIMIT k, over a CTE with calls: the call is computed
    on every row for the ORDER BY anyway, and the top-rows QUALIFY (a window) made DuckDB
    compute the CTE's calls on every row first too (23 calls where the query as written
    made 14). The tables are the fuzz test's for seed 40245."""
    pair.load(world(random.Random(40245)))
    q = ("WITH c AS (SELECT id, s, g, CASE WHEN llm_filter(upper(s)) THEN llm_filter_score("
         "'Q: ' || s) ELSE llm_filter_score('n' || g) END AS c1 FROM t) "
         "SELECT *, upper(llm_classify(s, ['x', 'y'])) AS o0 FROM c ORDER BY o0 DESC, id "
         "LIMIT 2")
    assert pair.check(Query(q, "ordered")) == []


def test_a_having_driver_prefetches_every_group_it_filters(pair):
    """HAVING with a call under ORDER BY ... LIMIT: the driver left the HAVING out (it
    reads the call) but kept the LIMIT, so it fetched the first 2 groups of all, not the
    groups the HAVING filters; the others were computed as DuckDB reached them (batches
    [2, 4, 2], not [8]). Found reading the drivers after the fuzz test's HAVING cases."""
    from llmdb.planner.run import normalized

    pair.load(fixed_tables())
    q = ("SELECT s, count(*) AS n FROM t GROUP BY s HAVING llm_filter(s || count(*)) "
         "ORDER BY s LIMIT 2")
    assert pair.check(Query(q, "ordered")) == []
    batches = [c.batches for c in pair.on.planner.history[normalized(q)].values()]
    assert batches == [[8]]


def test_concurrent_lookups_compute_a_tuple_once(monkeypatch):
    """DuckDB runs a query's pipelines on several threads: a scalar subquery that is also
    the ORDER BY key of the top-rows QUALIFY was evaluated twice at once, and both
    evaluations missed the memo and called the model (180 calls where the query as
    written made 90; the fuzz test's seed 135, now and then). A lookup that misses a tuple
    another thread is computing waits for it."""
    import threading
    import time

    from llmdb.planner import plan
    from llmdb.planner.guards import MAIN
    from llmdb.planner.memo import QueryRun
    from llmdb.session import Options, Session

    p = plan("SELECT llm_filter(x) FROM t", 1, STANDIN)
    run_ = QueryRun(1, p.sites, Session(Options(model=STANDIN, cache=False)))
    computed = []

    def slow(site, keys, counts, priority):
        computed.extend(keys)
        time.sleep(0.2)  # the other thread asks meanwhile
        return [True] * len(keys)

    monkeypatch.setattr(run_, "_call", slow)
    keys = [("a", None, None, None), ("b", None, None, None)]
    out = []
    threads = [threading.Thread(target=lambda: out.append(run_.lookup(0, MAIN, keys)))
               for _ in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert out == [[True, True]] * 2 and sorted(computed) == sorted(keys)


@pytest.mark.parametrize("seed", CI_SEEDS)
def test_random_query(pair, seed):
    if seed in KNOWN:
        pytest.skip(KNOWN[seed])
    tables, q = generate(seed)
    pair.load(tables)
    problems = pair.check(q)
    assert not problems, f"seed {seed}: {q.sql} params={q.params}\n" + "\n".join(problems)


# ---- offline -----------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0:200", help="START:STOP")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--big", action="store_true", help="now and then thousands of rows")
    ap.add_argument("--show", action="store_true", help="print the queries only")
    args = ap.parse_args(argv)
    start, stop = (int(x) for x in args.seeds.split(":"))
    if args.show:
        for seed in range(start, stop):
            _, q = generate(seed)
            print(seed, q.check, q.api, q.params, q.sql)
        return 0
    pair = Pair()
    stats = Counter()
    t0 = time.time()
    bad = 0
    for seed in range(start, stop):
        tables, q = generate(seed, args.big)
        pair.load(tables)
        try:
            problems = pair.check(q)
        except Exception as e:  # noqa: BLE001 - the harness's own failure, reported
            problems = [f"harness: {e!r}"]
        stats["queries"] += 1
        got, want = pair.last
        if want.error is not None:
            stats["errors: " + str(want.error).splitlines()[0][:70]] += 1
        else:
            stats["rows"] += len(want.rows)
            stats["calls as written"] += want.calls
            stats["calls planned"] += got.calls
        if problems:
            bad += 1
            print(f"--- seed {seed} [{q.check}, {q.api}] params={q.params}\n{q.sql}")
            for p in problems:
                print("   ", p)
            sys.stdout.flush()
        elif args.verbose:
            print(seed, "ok", q.sql[:150])
    for k, n in stats.most_common():
        print(f"{n:8d}  {k}")
    print(f"{pair.unreached} row errors as written that the planner did not reach")
    print(f"{stats['queries']} queries, {bad} with discrepancies, {time.time() - t0:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
