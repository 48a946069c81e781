"""The guard rule against SQL's three-valued logic, exhaustively: for random boolean
expressions over nullable columns and LLM predicates, the rewritten expression (each call
replaced by `CASE WHEN <guard> THEN <its value> END`) equals the original on every
combination of TRUE, FALSE and NULL, in a WHERE (only TRUE counts) and in a SELECT (the
value counts). Equal everywhere means a call is NULLed only where its value cannot matter."""

from __future__ import annotations

import itertools
import random
import re

import duckdb
import pytest
import sqlglot
from sqlglot import exp

from llmdb.planner.callsites import find_sites
from llmdb.planner.guards import is_lookup, rewrite_sites

VALUES = ("TRUE", "FALSE", "NULL")
ATOMS = ("a", "b", "c", "llm_filter('p1')", "llm_filter('p2')")


def random_expr(rng: random.Random, depth: int) -> str:
    if depth == 0 or rng.random() < 0.25:
        return rng.choice(ATOMS)
    kind = rng.choice(["and", "or", "not", "case", "simple_case", "coalesce", "is_null",
                       "eq", "if", "and3"])
    e = lambda: random_expr(rng, depth - 1)  # noqa: E731
    return {
        "and": lambda: f"({e()} AND {e()})",
        "and3": lambda: f"({e()} AND {e()} AND {e()})",
        "or": lambda: f"({e()} OR {e()})",
        "not": lambda: f"(NOT {e()})",
        "case": lambda: f"(CASE WHEN {e()} THEN {e()} WHEN {e()} THEN {e()} ELSE {e()} END)",
        "simple_case": lambda: f"(CASE {e()} WHEN TRUE THEN {e()} ELSE {e()} END)",
        "coalesce": lambda: f"coalesce({e()}, {e()}, {e()})",
        "is_null": lambda: f"({e()} IS NULL)",
        "eq": lambda: f"({e()} = {e()})",
        "if": lambda: f"if({e()}, {e()}, {e()})",
    }[kind]()


def rewritten(sql: str) -> str:
    """The planner's rewrite with each lookup replaced by the value column of its call."""
    tree = sqlglot.parse_one(sql, read="duckdb")
    sites = find_sites(tree)
    tree, _, _ = rewrite_sites(tree, sites, qid=0, namespace=0, rank=lambda o, op: 0.0)
    for node in list(tree.walk()):
        if is_lookup(node):
            # The prompt literal 'pN' (inside the lookup's argument type check).
            prompt = next(lit.this for lit in node.expressions[2].find_all(exp.Literal)
                          if re.fullmatch(r"p\d+", lit.this))
            node.replace(exp.column("f" + prompt[1:]))
    return tree.sql("duckdb")


@pytest.fixture(scope="module")
def truth_table():
    con = duckdb.connect()
    rows = ", ".join(f"({', '.join(v)})" for v in itertools.product(VALUES, repeat=5))
    con.execute(f"CREATE TABLE tt AS SELECT * FROM (VALUES {rows}) v(a, b, c, f1, f2)")
    yield con
    con.close()


def original(sql: str) -> str:
    return sql.replace("llm_filter('p1')", "f1").replace("llm_filter('p2')", "f2")


@pytest.mark.parametrize("seed", range(8))
def test_guards_keep_three_valued_results(truth_table, seed):
    rng = random.Random(seed)
    for i in range(25):
        expr = random_expr(rng, 4 if i % 5 == 0 else 3)
        if "llm_filter" not in expr:
            continue
        # WHERE: the rows kept must be the same.
        q = f"SELECT rowid FROM tt WHERE {expr}"
        want = truth_table.execute(original(q) + " ORDER BY rowid").fetchall()
        got = truth_table.execute(rewritten(q) + " ORDER BY rowid").fetchall()
        assert got == want, expr
        # SELECT: the value itself must be the same.
        q = f"SELECT {expr} AS v FROM tt"
        want = truth_table.execute(
            original(q).replace(" FROM tt", ", rowid FROM tt") + " ORDER BY rowid").fetchall()
        got = truth_table.execute(
            rewritten(q).replace(" FROM tt", ", rowid FROM tt") + " ORDER BY rowid").fetchall()
        assert got == want, expr


def test_a_guard_is_as_tight_as_the_logic_allows():
    """`a AND f`: f only where a is TRUE; `a OR f`: only where a is not TRUE."""
    for sql, guard in [("SELECT 1 FROM tt WHERE a AND llm_filter('p1')", "(a)"),
                       ("SELECT 1 FROM tt WHERE a OR llm_filter('p1')",
                        "NOT ((a) IS TRUE)"),
                       ("SELECT (a AND llm_filter('p1')) FROM tt", "NOT ((a) IS FALSE)"),
                       ("SELECT 1 FROM tt WHERE NOT (a OR llm_filter('p1'))", "(a) IS FALSE")]:
        tree = sqlglot.parse_one(sql, read="duckdb")
        _, sites, _ = rewrite_sites(tree, find_sites(tree), qid=0, namespace=0,
                                    rank=lambda o, op: 0.0)
        assert " AND ".join(g.sql("duckdb") for g in sites[0].guard).strip("()") == \
            guard.strip("()"), sql
