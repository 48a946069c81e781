"""Each rewrite rule of the planner on its own, on parsed SQL (no database, no model)."""

from __future__ import annotations

import sqlglot
from sqlglot import exp

from llmdb.planner.callsites import Unsupported, find_sites
from llmdb.planner.guards import rewrite_sites
from llmdb.planner.placement import main_lookups, placement
from llmdb.planner.rules import (
    having_on_keys_to_where,
    inline_llm_ctes,
    llm_conjuncts_to_where,
    null_calls_to_nulls,
    number_parameters,
    push_filters_into_llm_subqueries,
    root_query,
    top_level_selects,
    top_rows_before_calls,
)


def parse(sql: str) -> exp.Expression:
    return sqlglot.parse_one(sql, read="duckdb")


def sql(tree: exp.Expression) -> str:
    return tree.sql("duckdb")


def test_number_parameters_in_text_order():
    assert number_parameters("SELECT ? FROM t WHERE a = ? AND (b = ? OR c = ?)") == \
        "SELECT $1 FROM t WHERE a = $2 AND (b = $3 OR c = $4)"
    # A CTE's and a LIMIT's in their places too (sqlglot's tree has them after the WHERE),
    # and not a `?` in a string or a comment.
    assert number_parameters("WITH c AS (SELECT ? AS x) SELECT '?' /* ? */, x FROM c "
                             "WHERE x = ? LIMIT ?") == \
        "WITH c AS (SELECT $1 AS x) SELECT '?' /* ? */, x FROM c WHERE x = $2 LIMIT $3"


def test_only_ctes_with_calls_are_inlined():
    tree = inline_llm_ctes(parse(
        "WITH a AS (SELECT llm_filter(x) AS f FROM t), b AS (SELECT 1 AS one), "
        "c AS (SELECT llm_filter(x) AS f, random() AS r FROM t) SELECT * FROM a, b, c"))
    assert "a AS NOT MATERIALIZED" in sql(tree)
    assert "b AS (" in sql(tree) and "c AS (" in sql(tree)  # no calls; a volatile function


def test_filters_are_pushed_into_subqueries_with_calls():
    tree = push_filters_into_llm_subqueries(parse(
        "SELECT * FROM (SELECT id AS k, x, llm_complete(x) AS c FROM t) s "
        "WHERE s.k % 50 = 0 AND c = 'yes' AND k > 3"))
    inner = tree.find(exp.Subquery).this
    assert sql(inner.args["where"]) == "WHERE (id) % 50 = 0 AND (id) > 3"
    assert "s.k % 50 = 0" in sql(tree.args["where"])  # the outer query keeps its filter


def test_filters_are_not_pushed_into_a_null_supplying_side_or_a_grouping():
    for q in ["SELECT * FROM u LEFT JOIN (SELECT id, llm_filter(x) AS f FROM t) s "
              "ON u.id = s.id WHERE s.id IS NULL",
              "SELECT * FROM (SELECT id, count(*) AS n, llm_filter(x) AS f FROM t "
              "GROUP BY id, x) s WHERE id < 3",
              "SELECT * FROM (SELECT id, llm_filter(x) AS f FROM t LIMIT 10) s WHERE id < 3"]:
        tree = push_filters_into_llm_subqueries(parse(q))
        assert tree.find(exp.Subquery).this.args.get("where") is None, q


def test_a_cte_used_twice_is_not_pushed_into():
    tree = push_filters_into_llm_subqueries(parse(
        "WITH s AS (SELECT id, llm_filter(x) AS f FROM t) "
        "SELECT * FROM s WHERE id < 3 UNION ALL SELECT * FROM s WHERE id > 7"))
    assert tree.find(exp.CTE).this.args.get("where") is None


def test_calls_on_a_null_prompt_are_null():
    tree = null_calls_to_nulls(parse(
        "SELECT llm_filter(NULL), llm_classify(NULL, ['a', 'b']), llm_complete(llm_complete("
        "NULL::VARCHAR), max_tokens := 2), llm_classify(x, NULL), llm_filter(x), "
        "llm_complete(NULL, max_tokens := 'two'), llm_filter(NULL, system := x) FROM t"))
    # Not where another argument is not a literal that passes its check: that may raise.
    assert sql(tree) == (
        "SELECT CAST(NULL AS BOOLEAN), CAST(NULL AS TEXT), CAST(NULL AS TEXT), "
        "LLM_CLASSIFY(x, NULL), LLM_FILTER(x), LLM_COMPLETE(NULL, max_tokens := 'two'), "
        "LLM_FILTER(NULL, system := x) FROM t")


def test_having_on_grouping_keys_moves_to_where():
    def moved(q: str) -> str:
        return sql(having_on_keys_to_where(parse(q)))

    assert moved("SELECT cat, avg(llm_filter_score(x)) FROM t GROUP BY cat "
                 "HAVING llm_filter(cat) AND count(*) > 1") == \
        "SELECT cat, AVG(LLM_FILTER_SCORE(x)) FROM t WHERE (LLM_FILTER(cat)) GROUP BY cat " \
        "HAVING (COUNT(*) > 1)"
    # An alias no key reads is its expression; a name bare in GROUP BY stays as it is.
    assert moved("SELECT s AS k, count(*) FROM t GROUP BY ALL HAVING llm_filter(k)") == \
        "SELECT s AS k, COUNT(*) FROM t WHERE (LLM_FILTER((s))) GROUP BY ALL"
    assert moved("SELECT s AS k, count(*) FROM t GROUP BY k HAVING llm_filter(k)") == \
        "SELECT s AS k, COUNT(*) FROM t WHERE (LLM_FILTER(k)) GROUP BY k"
    for q in ["SELECT s AS g, g, count(*) FROM t GROUP BY ALL HAVING llm_filter(g)",  # column
              "SELECT g, sum(a) AS m FROM t GROUP BY g HAVING m > 1 OR llm_filter(g)",
              "SELECT g, count(*) FROM t GROUP BY ROLLUP (g) HAVING llm_filter(g)",
              "SELECT count(*) FROM t HAVING llm_filter('x')",  # one row even of no rows
              "SELECT g FROM t GROUP BY g HAVING my_udf(g)",  # perhaps an aggregate
              # GROUP BY ALL also groups by the columns HAVING reads (a group per g, a).
              "SELECT nullif(g, a) AS k, count(*) FROM t GROUP BY ALL HAVING llm_filter(k)"]:
        assert moved(q) == sql(parse(q)), q


def test_llm_conjuncts_move_from_inner_joins_only():
    tree = llm_conjuncts_to_where(parse(
        "SELECT * FROM t JOIN u ON t.id = u.id AND llm_filter(u.z) WHERE t.id < 5"))
    assert sql(tree.args["joins"][0].args["on"]) == "(t.id = u.id)"
    assert "LLM_FILTER(u.z)" in sql(tree.args["where"])
    left = "SELECT * FROM t LEFT JOIN u ON t.id = u.id AND llm_filter(u.z)"
    assert sql(llm_conjuncts_to_where(parse(left))) == sql(parse(left))


def _rewritten(q: str) -> exp.Expression:
    tree = parse(q)
    tree, _, _ = rewrite_sites(tree, find_sites(tree), qid=1, namespace=0, rank=lambda o, op: 0.0)
    return tree


def test_top_rows_before_calls_adds_a_qualify_for_expression_keys():
    tree = top_rows_before_calls(_rewritten(
        "SELECT id, llm_complete(x) AS c FROM t ORDER BY length(x) DESC, id LIMIT 3 OFFSET 1"))
    q = tree.args["qualify"]
    # In place of the OFFSET: the rows it skips are not computed either.
    assert sql(q) == "QUALIFY ROW_NUMBER() OVER (ORDER BY LENGTH(x) DESC, id) BETWEEN 2 AND 4"
    assert tree.args.get("offset") is None and sql(tree.args["limit"]) == "LIMIT 3"
    # Plain keys too: DuckDB takes the top rows first from its own tables only.
    plain = top_rows_before_calls(_rewritten(
        "SELECT id, llm_complete(x) AS c FROM t ORDER BY id LIMIT 3"))
    assert sql(plain.args["qualify"]) == "QUALIFY ROW_NUMBER() OVER (ORDER BY id) <= 3"


def _placements(q: str) -> dict[str, str]:
    tree = top_rows_before_calls(_rewritten(q))
    root = root_query(tree)
    tops = top_level_selects(root)
    sites = {s.id: s.key for s in find_sites(parse(q))}
    return {sites[i]: placement(node, tops, root).kind
            for i, node in main_lookups(tree).items()}


def test_placements():
    assert _placements("SELECT llm_complete(x) FROM t WHERE a AND llm_filter(y)") == {
        "LLM_COMPLETE(x)": "output", "LLM_FILTER(y)": "where"}
    assert _placements("SELECT id FROM t WHERE llm_filter(y) ORDER BY id LIMIT 5") == {
        "LLM_FILTER(y)": "incremental"}
    assert _placements("SELECT cat, sum(llm_filter_score(x)) FROM t GROUP BY cat "
                       "HAVING llm_filter(cat) ORDER BY llm_filter_score(cat)") == {
        "LLM_FILTER_SCORE(x)": "pre_agg", "LLM_FILTER(cat)": "output",
        "LLM_FILTER_SCORE(cat)": "output"}
    assert _placements("SELECT * FROM (SELECT llm_filter(x) AS f FROM t) s") == {
        "LLM_FILTER(x)": "lazy"}
    assert _placements("SELECT a FROM t WHERE llm_filter(x) UNION ALL "
                       "SELECT b FROM u WHERE llm_filter(z)") == {
        "LLM_FILTER(x)": "where", "LLM_FILTER(z)": "where"}
    # LIMIT without ORDER BY keeps a table's first rows, but a join's come in any order.
    assert _placements("SELECT llm_complete(x) FROM t LIMIT 3") == {"LLM_COMPLETE(x)": "output"}
    assert _placements("SELECT llm_complete(x) FROM t JOIN u ON t.id = u.id LIMIT 3") == {
        "LLM_COMPLETE(x)": "lazy"}
    assert _placements("SELECT a FROM t WHERE llm_filter(x) INTERSECT "
                       "SELECT b FROM u WHERE llm_filter(z)") == {
        "LLM_FILTER(x)": "lazy", "LLM_FILTER(z)": "lazy"}


def test_unsupported_calls():
    for q in ["SELECT llm_complete(x, temperature := 0.8) FROM t",
              "SELECT llm_filter(x, nonsense := 1) FROM t",
              "SELECT llm_classify(x) FROM t"]:
        try:
            find_sites(parse(q))
        except Unsupported:
            continue
        raise AssertionError(q)
    [site] = find_sites(parse("SELECT llm_complete(x, temperature := 0.8, seed := 7) FROM t"))
    assert site.arg("seed").this == "7"
