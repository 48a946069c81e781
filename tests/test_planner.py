"""The minimal-calls planner on the deterministic stand-in model: for every query shape, the
same result as plain DuckDB with the same functions, and exactly the minimal number of model
calls, computed from the table data (tests/planner_shapes.py)."""

from __future__ import annotations

import re

import duckdb
import pytest

import llmdb
from llmdb.planner import LEARNED
from llmdb.planner.run import with_values_used

from .planner_shapes import SHAPES, STANDIN, Oracle, load, make_tables

ROWS = 2000


@pytest.fixture(scope="module")
def env():
    LEARNED.clear()
    con = llmdb.connect(model=STANDIN, cache=False)
    plain = duckdb.connect()
    plain.execute("SET enable_progress_bar = false")
    plain_session = llmdb.register(plain, model=STANDIN, cache=False)
    for c in (con, plain):
        make_tables(c, ROWS)
    data = load(plain, Oracle())
    yield con, plain, plain_session, data
    con.close()
    plain.close()


def calls_of(session, run) -> tuple[object, int]:
    before = session.stats()["total"]["model_rows"]
    out = run()
    return out, session.stats()["total"]["model_rows"] - before


def order_of(con, sql):
    """The planner's order of the calls, as `first(a, b)` over their SQL texts."""
    p = con.planner.plan(sql)
    rank = {s.key: s.order for s in p.sites} if p else {}
    return lambda a, b: rank[a] < rank[b]


def canonical(rows, ordered):
    return rows if ordered else sorted(rows, key=repr)


@pytest.mark.parametrize("shape", SHAPES, ids=[s.name for s in SHAPES])
def test_shape(env, shape):
    con, plain, plain_session, data = env
    order = order_of(con, shape.sql)
    got, calls = calls_of(con.session, lambda: con.execute(shape.sql).fetchall())
    names = [d[0] for d in con.description]
    want, naive = calls_of(plain_session, lambda: plain.execute(shape.sql).fetchall())
    assert canonical(got, shape.ordered) == canonical(want, shape.ordered)
    # Columns are named as written (an unaliased call after its text, not its rewrite).
    assert names == [d[0] for d in plain.description]
    if shape.fallback:
        assert con.planner.plan(shape.sql) is None
        assert calls == naive
    else:
        assert calls == shape.minimal(data, order), f"naive DuckDB made {naive}"


def test_top_rows_of_an_arrow_table_cost_k_calls(env):
    """ORDER BY a plain column LIMIT k over a registered Arrow table: DuckDB computes a
    projection before its top-k there (not over its own tables), so the planner's QUALIFY
    keeps it to k calls."""
    import pyarrow as pa

    con, _, _, _ = env
    con.register("arrow_t", pa.table({"i": list(range(300)), "p": [f"row {i}" for i in
                                                                  range(300)]}))
    q = "SELECT i, llm_complete(p, max_tokens := 2) AS a FROM arrow_t ORDER BY i LIMIT 2"
    got, calls = calls_of(con.session, lambda: con.execute(q).fetchall())
    assert [r[0] for r in got] == [0, 1] and calls == 2
    con.unregister("arrow_t")


def test_a_filter_and_its_score_share_one_call_per_row(env):
    """llm_filter is llm_filter_score >= 0.5: the WHERE's filter computes the scores the
    SELECT reads (without the result cache too), and the answers are plain DuckDB's."""
    con, plain, plain_session, data = env
    q = ("SELECT id, llm_filter_score(x) AS s FROM t WHERE id < 40 AND llm_filter(x) "
         "ORDER BY id")
    got, calls = calls_of(con.session, lambda: con.execute(q).fetchall())
    assert got == plain.execute(q).fetchall()
    assert calls == len({r["x"] for r in data.t if r["id"] < 40})


@pytest.mark.parametrize("draw", ["WHERE random() < 0.02", "USING SAMPLE 5 ROWS"])
def test_a_query_drawing_rows_computes_only_the_rows_it_returns(env, draw):
    """A driver run before the query would draw other rows than the query does: such
    queries compute their calls lazily, one evaluation of the draw."""
    con, _, _, _ = env
    q = f"SELECT id, x, llm_complete(x, max_tokens := 2) AS a FROM t {draw}"
    got, calls = calls_of(con.session, lambda: con.execute(q).fetchall())
    assert got and calls == len({r[1] for r in got})


@pytest.mark.parametrize("clock", ["now()", "current_timestamp", "get_current_time()",
                                   "localtimestamp", "epoch_ms(transaction_timestamp())"])
def test_a_prompt_reading_the_clock_is_computed_once_a_row(env, clock):
    """now() and its kin hold still within a statement but not between statements: a driver
    run before the query read another time, and its calls were thrown away (twice the
    calls of the query as written)."""
    con, _, _, _ = env
    q = f"SELECT x, llm_complete(x || {clock}, max_tokens := 2) FROM t WHERE id < 50"
    got, calls = calls_of(con.session, lambda: con.execute(q).fetchall())
    assert len(got) == 50 and calls == len({x for x, _ in got})


@pytest.mark.parametrize("clock", ["now() > TIMESTAMP '2000-01-01'",
                                   "current_date > DATE '2000-01-01'"])
def test_a_where_reading_the_clock_keeps_its_calls_planned(env, clock):
    """A WHERE that reads the clock selects the same rows a moment later: its calls need
    not be lazy, which cost a call per distinct x of DuckDB's vector (97) where the first
    rows passing took 4."""
    con, _, _, _ = env
    q = "SELECT id FROM t WHERE {}llm_filter(x) LIMIT 3"
    want, calls_without = calls_of(con.session, lambda: con.execute(q.format("")).fetchall())
    got, calls = calls_of(con.session, lambda: con.execute(q.format(clock + " AND ")
                                                           ).fetchall())
    assert len(got) == len(want) == 3 and calls == calls_without


@pytest.mark.parametrize("query,literal,params", [
    ("SELECT id FROM t WHERE cat = ? AND llm_filter(x) LIMIT 3", "1", [1]),
    ("SELECT id, ? AS tag FROM t WHERE cat = ? AND llm_filter(x) LIMIT 3", "'a', 1", ["a", 1]),
    ("SELECT id FROM t WHERE cat = $c AND llm_filter(x || $s) LIMIT 3", "1, '!'",
     {"c": 1, "s": "!"}),
])
def test_bound_parameters_keep_the_calls_planned(env, query, literal, params):
    """Bound parameters made every site lazy (drivers ran without their values): the
    filter then cost a call per distinct x of DuckDB's vector (97) where LIMIT 3 asked for
    the first rows passing. Now the drivers get the values they use (DuckDB refuses
    others), and the query costs what it costs with the values written in."""
    con, _, _, _ = env
    values = iter(literal.split(", "))
    written = re.sub(r"\?|\$[a-z]", lambda _: next(values), query)
    want, calls_written = calls_of(con.session, lambda: con.execute(written).fetchall())
    got, calls = calls_of(con.session, lambda: con.execute(query, params).fetchall())
    assert sorted(got) == sorted(want) and len(got) == 3 and calls == calls_written


def test_a_driver_gets_the_values_of_the_placeholders_it_uses():
    """DuckDB refuses values a statement does not use: a driver that uses some of its
    query's placeholders gets theirs, renumbered in their order."""
    con = duckdb.connect()
    sql, values = with_values_used("SELECT $3 AS c, $2 + 1 AS b", ["unused", 1, "c"])
    assert values == [1, "c"] and con.execute(sql, values).fetchall() == [("c", 2)]
    sql, values = with_values_used("SELECT $k AS k", {"k": 7, "other": 8})
    assert values == {"k": 7} and con.execute(sql, values).fetchall() == [(7,)]
    assert with_values_used("SELECT $1 + $2", (1, 2)) == ("SELECT $1 + $2", [1, 2])
    assert with_values_used("SELECT 1", [1]) == ("SELECT 1", None)


@pytest.mark.parametrize("query", [
    "SELECT id, x, llm_complete(x, max_tokens := 2) AS a FROM t WHERE id % 2 = 0 "
    "ORDER BY random() LIMIT 3",
    "SELECT r.*, llm_complete(r.x, max_tokens := 2) FROM t AS r WHERE r.cat = 1 "
    "ORDER BY random() LIMIT 2 OFFSET 1",
])
def test_top_rows_in_a_random_order_cost_k_calls(env, query):
    """`ORDER BY random() LIMIT k`, the way to try a prompt on a few rows: DuckDB computes
    the calls of every row before its top-k, and refuses the QUALIFY other orders get (a
    window cannot be ordered by random()): the query as written made a call per distinct x
    (97) for 3 rows."""
    con, plain, _, _ = env
    got, calls = calls_of(con.session, lambda: con.execute(query).fetchall())
    names = [d[0] for d in con.description]
    assert names == [d[0] for d in plain.execute(query).description]
    assert len(got) == (3 if "LIMIT 3" in query else 2) and calls == len({r[1] for r in got})
    for row in got:  # the rows the WHERE keeps, each with its own answer
        assert row[0] % 2 == 0 if "id % 2" in query else row[3] == 1
        assert row[-1] == plain.execute("SELECT llm_complete(?, max_tokens := 2)",
                                        [row[1]]).fetchall()[0][0]


@pytest.mark.parametrize("query,most", [  # (at most LIMIT + OFFSET calls a branch)
    ("SELECT llm_complete(x, max_tokens := 2) FROM t UNION ALL SELECT 'z' LIMIT 2", 2),
    ("SELECT 'z' UNION ALL (SELECT llm_complete(x, max_tokens := 2) FROM t WHERE id > 5 "
     "UNION ALL SELECT llm_complete(x, max_tokens := 3) FROM t) LIMIT 2 OFFSET 1", 6),
])
def test_a_union_all_under_a_limit_computes_at_most_limit_rows_a_branch(env, query, most):
    con, plain, _, _ = env
    got, calls = calls_of(con.session, lambda: con.execute(query).fetchall())
    assert len(got) == len(plain.execute(query).fetchall()) == 2
    assert 0 < calls <= most


@pytest.mark.parametrize("query", [
    "SELECT DISTINCT ON (id % 3) id, x, llm_complete(x, max_tokens := 2) AS a FROM t "
    "ORDER BY id % 3, id",
    "SELECT DISTINCT ON (k) id % 4 AS k, id, x, llm_complete(x, max_tokens := 2) AS a "
    "FROM t ORDER BY k, id DESC",
])
def test_distinct_on_computes_the_rows_it_keeps(env, query):
    """DuckDB computed a projection's calls on every row before DISTINCT ON kept one a key
    (200 calls for 3 rows); the planner's QUALIFY keeps them to the rows kept."""
    con, plain, _, _ = env
    got, calls = calls_of(con.session, lambda: con.execute(query).fetchall())
    assert got == plain.execute(query).fetchall()
    assert calls == len({r[-2] for r in got})


@pytest.mark.parametrize("query", [
    # A parenthesized union's own ORDER BY / LIMIT / OFFSET is not the outer LIMIT's.
    "SELECT 'a' AS v UNION ALL ((SELECT llm_complete(x, max_tokens := 2) FROM t UNION ALL "
    "SELECT 'z') ORDER BY 1 DESC LIMIT 3) LIMIT 5",
    "SELECT 'a' AS v UNION ALL ((SELECT llm_complete(x, max_tokens := 2) FROM t UNION ALL "
    "SELECT 'z') ORDER BY 1 LIMIT 2 OFFSET 20) LIMIT 5",
    # LIMIT n PERCENT is not n rows.
    "SELECT id, llm_complete(x, max_tokens := 2) AS a FROM t ORDER BY id LIMIT 1 PERCENT",
    "SELECT llm_complete(x, max_tokens := 2) AS a FROM t UNION ALL SELECT 'z' "
    "LIMIT 1 PERCENT",
    # UNNEST yields rows after a QUALIFY would run: no QUALIFY there.
    "SELECT id, unnest(CASE WHEN id < 3 THEN []::INT[] ELSE [id] END) AS n, "
    "llm_complete(x, max_tokens := 2) AS a FROM t ORDER BY id LIMIT 3",
    "SELECT DISTINCT ON (cat) cat, id, unnest(CASE WHEN id < 10 THEN []::INT[] ELSE [id] END)"
    " AS n, llm_complete(x, max_tokens := 2) AS a FROM t ORDER BY cat, id",
    # An ordinal into a `*` is not the projection list's.
    "SELECT DISTINCT ON (cat) *, llm_complete(x, max_tokens := 2) AS a FROM t "
    "ORDER BY cat, 1 DESC",
    "SELECT *, llm_complete(x, max_tokens := 2) AS a FROM t ORDER BY 2, id LIMIT 3",
])
def test_top_rows_rules_keep_the_querys_rows(env, query):
    """Shapes a helper's review found the QUALIFY and UNION ALL rules got wrong."""
    con, plain, _, _ = env
    assert sorted(con.execute(query).fetchall(), key=repr) == \
        sorted(plain.execute(query).fetchall(), key=repr)


def test_create_table_as(env):
    con, plain, plain_session, data = env
    sql = "CREATE OR REPLACE TABLE r AS SELECT id FROM t WHERE id % 9 = 0 AND llm_filter(x)"
    _, calls = calls_of(con.session, lambda: con.execute(sql))
    plain.execute(sql)
    assert con.execute("SELECT * FROM r ORDER BY id").fetchall() == \
        plain.execute("SELECT * FROM r ORDER BY id").fetchall()
    assert calls == len({r["x"] for r in data.t if r["id"] % 9 == 0})


def test_unaliased_calls_keep_their_written_names(env):
    """As DuckDB names them when run as written: in a relation, a CTAS's table, with
    bound parameters; the rows keep the query's order."""
    con, plain, _, _ = env
    sql = ("SELECT id, llm_complete('Say ' || x, max_tokens := 2), llm_filter(x) AS f "
           "FROM t WHERE id < 40 ORDER BY id DESC")
    want = plain.sql(sql)
    rel = con.sql(sql)
    assert rel.columns == want.columns and rel.columns[1].startswith("llm_complete(")
    assert rel.fetchall() == want.fetchall()
    con.execute(f"CREATE OR REPLACE TABLE named AS {sql}")
    assert con.sql("SELECT * FROM named").columns == want.columns
    con.execute("SELECT id, llm_filter(x) FROM t WHERE id < ?", [10])
    assert [d[0] for d in con.description] == ["id", "llm_filter(x)"]


def test_bound_parameters_keep_their_places(env):
    """`?` values bind in text order; the rewrite reorders operands, so it numbers them."""
    con, plain, plain_session, data = env
    sql = "SELECT id FROM t WHERE llm_filter(x) AND cat = ? AND id < ?"
    got, calls = calls_of(con.session, lambda: con.execute(sql, [2, 300]).fetchall())
    want = plain.execute(sql, [2, 300]).fetchall()
    assert sorted(got) == sorted(want)
    assert calls == len({r["x"] for r in data.t if r["cat"] == 2 and r["id"] < 300})


def test_relation_api_goes_through_the_planner(env):
    con, plain, plain_session, data = env
    sql = "SELECT id FROM t WHERE id % 7 = 0 AND llm_filter(x)"
    rel, calls = calls_of(con.session, lambda: con.sql(sql).fetchall())
    assert sorted(rel) == sorted(plain.execute(sql).fetchall())
    assert calls == len({r["x"] for r in data.t if r["id"] % 7 == 0})
    # With bound parameters too (the planner binds them to check its rewrite).
    sql = "SELECT id FROM t WHERE id % 11 = ? AND llm_filter(x)"
    rel, calls = calls_of(con.session, lambda: con.sql(sql, params=[0]).fetchall())
    assert sorted(rel) == sorted(plain.execute(sql, [0]).fetchall())
    assert calls == len({r["x"] for r in data.t if r["id"] % 11 == 0})
    assert sql in con.planner.history  # planned, not run as written


def test_planner_off_runs_as_written(env):
    con, plain, plain_session, data = env
    off = llmdb.connect(model=STANDIN, cache=False, planner=False)
    make_tables(off, 200)
    sql = "SELECT id FROM t WHERE id % 7 = 0 AND llm_filter(x)"
    _, calls = calls_of(off.session, lambda: off.execute(sql).fetchall())
    assert calls == len({r["x"] for r in data.t if r["id"] < 200})  # every row: DuckDB's way
    off.close()


def test_learned_selectivity_orders_predicates(env):
    """After a run, the predicate that passed fewer rows goes first in an AND."""
    con, plain, plain_session, data = env
    LEARNED.clear()
    # Both filters cost the same; written first, the one that passes more rows.
    dense, sparse = "llm_filter(x)", "llm_filter('never ' || y)"
    rate = {p: plain.execute(f"SELECT avg({p}::INT) FROM t WHERE id < 500").fetchone()[0]
            for p in (dense, sparse)}
    assert rate[sparse] < rate[dense] - 0.1  # the premise (stand-in: about 0.15 and 0.33)
    sql = f"SELECT id FROM t WHERE id < 500 AND {dense} AND {sparse}"
    keys = "LLM_FILTER(x)", "LLM_FILTER('never ' || y)"
    first = {s.key: s.order for s in con.planner.plan(sql).sites}
    assert first[keys[0]] < first[keys[1]]  # nothing learned yet: as written
    con.execute(sql).fetchall()
    again = {s.key: s.order for s in con.planner.plan(sql).sites}
    assert again[keys[1]] < again[keys[0]]


def test_learned_keeps_the_call_sites_used_last(env, monkeypatch):
    """A long-running process whose queries write literals into their calls (a notebook's
    f-strings) meets new call sites and predicates in every query: what the planner learns
    keeps the ones used last, not every one it ever saw."""
    from llmdb.planner import learned as learned_module

    con = env[0]
    monkeypatch.setattr(learned_module, "KEPT_KEYS", 4)
    store = learned_module.Learned()
    monkeypatch.setattr(con.planner, "learned", store)
    model = con.session.options.model

    def run(k: int) -> None:
        con.execute(f"SELECT llm_complete('say {k} ' || x, max_tokens := 2) FROM t "
                    f"WHERE id < 20 AND llm_filter('ask {k} ' || x) AND llm_filter('{k}' || y)"
                    ).fetchall()

    def known(k: int) -> bool:
        return store.pass_rate(f"{model}\x1fLLM_FILTER('ask {k} ' || x)") is not None

    for k in range(12):
        run(k)
    for table in (store._passes, store._values, store._lengths):
        assert len(table) == 4
    assert store.output_lengths(f"{model}\x1fLLM_COMPLETE('say 11 ' || x, max_tokens := 2)")
    assert known(10) and not known(9)  # two predicates a query: the last two queries'
    store.pass_rate(f"{model}\x1fLLM_FILTER('ask 10 ' || x)")  # read: now the newest
    run(12)
    assert known(10) and not known(11)
