"""The planner of one connection: plan a statement, prefetch its calls, run EXPLAIN LLM.

plan() is pure (the statement's tree in, a Plan out); Planner.rewrite checks the rewrite on the
connection and Planner.prefetch runs the Plan's steps there (on the query's helper thread, so
Ctrl-C interrupts them like the query); Planner.prepare does both and returns the SQL to
execute (con.sql() prefetches when the relation is read). Anything the planner does not
understand runs as written.
"""

from __future__ import annotations

import itertools
import logging
import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import duckdb
import sqlglot
from sqlglot import exp
from sqlglot.errors import SqlglotError

from llmdb.functions import DEFAULT_PARAMS, argument_error
from llmdb.session import QueryCancelled, Session

from . import drivers, memo
from .callsites import Site, Unsupported, find_sites, without_priority
from .drivers import Fill, Incremental, Learn, Placement, Step
from .guards import Predicate, rewrite_sites
from .learned import DEFAULT_PASS_RATE, LEARNED, Learned
from .memo import QueryRun, Runs, SiteCounts, freeze
from .rules import (
    first_rows_before_calls,
    having_on_keys_to_where,
    inline_llm_ctes,
    limits_into_union_branches,
    llm_conjuncts_to_where,
    null_calls_to_nulls,
    number_parameters,
    per_statement,
    push_filters_into_llm_subqueries,
    random_top_rows_into_subquery,
    root_query,
    top_level_selects,
    top_rows_before_calls,
    volatile,
)

KEPT_HISTORY = 64
_QUICK_CHECK = re.compile(r"llm_(complete|filter|classify)", re.IGNORECASE)

logging.getLogger("sqlglot").setLevel(logging.ERROR)  # it warns about syntax it passes through
log = logging.getLogger("llmdb.planner")


@dataclass
class Plan:
    qid: int
    sql: str  # the rewritten statement
    dry_sql: str  # its query alone (a CTAS or INSERT without the write), for dry runs
    written_sql: str  # the statement's query as written (sqlglot's text of a CTAS's query)
    # Its columns are aliases and plain columns, which the rewrite names alike.
    names_kept: bool
    sites: list[Site]
    predicates: list[Predicate]
    steps: list[Step]
    placements: dict[int, Placement]
    notes: list[str] = field(default_factory=list)
    parameters: Any = None  # the values of its placeholders (drivers bind those they use)
    statement: str = ""  # the statement's text as the user wrote it

    @property
    def has_lazy(self) -> bool:
        return any(p.kind == "lazy" for p in self.placements.values())

    @property
    def writes(self) -> bool:
        """A CREATE TABLE AS or INSERT: it runs as soon as it is submitted."""
        return self.dry_sql != self.sql


@dataclass
class Prepared:
    """A planned statement on the connection (Planner.rewrite), its calls made by
    Planner.prefetch."""

    plan: Plan
    run: QueryRun
    sql: str  # what to run: the rewrite, its columns named as the statement names them
    done: set[int] = field(default_factory=set)  # the plan's steps already run


# ---- predicate order ---------------------------------------------------------------------

def call_cost(site: Site) -> float:
    """Relative cost of one call, in prompt prefills: a classify scores each label, and a
    generated token costs about half a short prompt's prefill here (decode steps are
    memory-bound, prefill is batched into large matrix products)."""
    if site.function == "llm_classify":  # each label under each rotation of the labels
        labels = site.arg("labels")
        return float(len(labels.expressions) ** 2) if isinstance(labels, exp.Array) else 4.0
    if site.function == "llm_complete":
        n = site.arg("max_tokens")
        tokens = int(n.this) if isinstance(n, exp.Literal) and n.this.isdigit() \
            else DEFAULT_PARAMS.max_tokens
        return 1.0 + 0.5 * tokens
    return 2.0  # a filter asks with both answer orders


def ranker(sites: list[Site], model: str, learned: Learned
           ) -> Callable[[exp.Expression, str], float]:
    """Lower ranks run first. AND: the classic order for independent predicates, by
    (1 - pass rate) / cost descending (cheap and selective first); OR: by pass rate / cost
    descending (a TRUE decides the OR, so likely-TRUE and cheap first)."""
    by_node = {id(s.node): s for s in sites}

    def rank(operand: exp.Expression, op: str) -> float:
        cost = sum(call_cost(by_node[id(n)]) for n in operand.walk() if id(n) in by_node)
        rate = learned.pass_rate(f"{model}\x1f{operand.sql('duckdb')}")
        rate = DEFAULT_PASS_RATE if rate is None else rate
        benefit = (1.0 - rate) if op == "and" else rate
        return -benefit / max(cost, 1e-9)

    return rank


# ---- planning ----------------------------------------------------------------------------

def plan(sql: str, qid: int, model: str, *, namespace: int = 0, parameters: Any = None,
         learned: Learned = LEARNED) -> Plan | None:
    """The rewritten statement and its prefetch steps; None: run the statement as written.
    Its site lookups are the UDFs memo.register made for `namespace`."""
    return plan_or_reason(sql, qid, model, namespace=namespace, parameters=parameters,
                          learned=learned)[0]


def plan_or_reason(sql: str, qid: int, model: str, *, namespace: int = 0,
                   parameters: Any = None, learned: Learned = LEARNED
                   ) -> tuple[Plan | None, str]:
    """The plan, or None and why the statement runs as written."""
    if not _QUICK_CHECK.search(sql):
        return None, "no LLM calls"
    try:
        return _plan(sql, qid, namespace, model, parameters, learned), ""
    except Unsupported as e:
        return None, str(e)
    except Exception as e:  # noqa: BLE001 - a planner bug must not fail a query
        log.warning("planner failed on a query; it runs as written", exc_info=True)
        return None, f"planner error ({type(e).__name__}: {e})"


def _plan(sql: str, qid: int, namespace: int, model: str, parameters: Any,
          learned: Learned) -> Plan:
    statement = sql
    try:
        statements = sqlglot.parse(number_parameters(sql) if parameters else sql,
                                   read="duckdb")
    except SqlglotError as e:
        raise Unsupported(f"sqlglot cannot parse it ({str(e).splitlines()[0]})") from None
    if len(statements) != 1 or statements[0] is None:
        raise Unsupported("not exactly one statement")
    tree = statements[0]
    written = root_query(tree)
    if written is None:
        raise Unsupported("not a query (SELECT, set operation, CREATE TABLE AS, INSERT)")
    written_sql = sql if written is tree else written.sql("duckdb")
    names_kept = isinstance(written, exp.Select) and all(  # (t.* is a Column of a Star)
        isinstance(e, exp.Alias) or (isinstance(e, exp.Column) and not e.is_star)
        for e in written.expressions)
    draws = volatile(tree)
    per_statement_values = per_statement(tree)
    null_calls_to_nulls(tree)
    inline_llm_ctes(tree)
    push_filters_into_llm_subqueries(tree)
    llm_conjuncts_to_where(tree)
    having_on_keys_to_where(tree)
    limits_into_union_branches(tree)
    random_top_rows_into_subquery(tree)
    sites = find_sites(tree)
    if not sites:
        raise Unsupported("no LLM calls")
    tree, sites, predicates = rewrite_sites(tree, sites, qid, namespace,
                                            ranker(sites, model, learned))
    top_rows_before_calls(tree)
    first_rows_before_calls(tree)
    root = root_query(tree)
    # Drivers read the query's rows before it runs: where the query draws random values (or
    # a sample) they would draw other rows, computing calls for rows the query then leaves
    # out; where it reads the clock (or the transaction) they would read other values,
    # computing other prompts. Every site stays lazy then.
    lazy = ("the query draws random values or a sample" if draws else
            "the query reads the clock or its transaction (now(), current_date, ...)"
            if per_statement_values else None)
    tops = [] if lazy else top_level_selects(root)
    steps, placements = drivers.plan_steps(tree, root, tops, sites, predicates)
    if lazy:
        placements = {i: replace(p, why=lazy) for i, p in placements.items()}
    sql = tree.sql("duckdb")
    dry_sql = sql if root is tree else root.sql("duckdb")  # a query: its one text
    return Plan(qid, sql, dry_sql, written_sql, names_kept, sites, predicates, steps,
                placements, parameters=parameters, statement=statement)


def with_values_used(sql: str, parameters: Any) -> tuple[str, Any]:
    """A driver's SQL and the values of the placeholders it uses ($1, $name), renumbered in
    their order: DuckDB refuses values a statement does not use, and a driver uses some
    of its query's."""
    if not parameters:
        return sql, None
    tree = sqlglot.parse_one(sql, read="duckdb")
    used = [p for p in tree.find_all(exp.Placeholder) if p.this is not None]
    if not used:
        return sql, None
    if isinstance(parameters, dict):
        return sql, {p.name: parameters[p.name] for p in used}
    values = list(parameters)
    numbers = sorted({int(p.name) for p in used})
    if numbers == list(range(1, len(values) + 1)):
        return sql, values
    renumbered = {n: k for k, n in enumerate(numbers, 1)}
    for p in used:
        p.set("this", str(renumbered[int(p.name)]))
    return tree.sql("duckdb"), [values[n - 1] for n in numbers]


def bind_as_written(con: duckdb.DuckDBPyConnection, sql: str, parameters: Any = None) -> None:
    """Raise DuckDB's own error where DuckDB refuses the statement as written. llmdb runs
    sqlglot's text of a statement (the planner's rewrite, the per-row draws rename), and
    sqlglot reads more than DuckDB does: a `x -> ...` lambda (refused since DuckDB 1.3),
    a LIMIT before UNION ALL (moved into the first branch). Neither check runs the
    statement or folds a constant call into a model call: a query binds as a relation; a
    write is EXPLAINed without the optimizer (an INSERT's casts to its columns still fold
    theirs, a call the statement makes anyway, remembered for it by the query's memory)."""
    statements = con.extract_statements(sql)  # (a syntax error, as DuckDB reports it)
    if len(statements) == 1 and statements[0].type == duckdb.StatementType.SELECT:
        con.sql(sql, params=parameters)
        return
    optimizer = con.execute("SELECT current_setting('enable_optimizer')").fetchall()[0][0]
    con.execute("SET enable_optimizer = false")
    try:
        con.execute(f"EXPLAIN {sql}", parameters)
    finally:
        con.execute(f"SET enable_optimizer = {str(optimizer).lower()}")


def normalized(sql: str) -> str:
    """A query's identity for EXPLAIN's actuals: its text without spacing or a final ';'."""
    return " ".join(sql.strip().rstrip(";").split())


# ---- running -----------------------------------------------------------------------------

class Planner:
    def __init__(self, con: duckdb.DuckDBPyConnection, session: Session,
                 learned: Learned = LEARNED):
        self.con = con
        self.session = session
        self.learned = learned
        self.runs = Runs()
        self.udfs = memo.register(con, self.runs, session)
        self._qids = itertools.count(1)
        # What each recent query did, per site (the counts alone: a run's memo can be large).
        self.history: OrderedDict[str, dict[int, SiteCounts]] = OrderedDict()

    def plan(self, sql: str, parameters: Any = None) -> Plan | None:
        return self.plan_or_reason(sql, parameters)[0]

    def plan_or_reason(self, sql: str, parameters: Any = None) -> tuple[Plan | None, str]:
        return plan_or_reason(sql, next(self._qids), self.session.options.model,
                              namespace=self.session.id, parameters=parameters,
                              learned=self.learned)

    def rewrite(self, sql: str, parameters: Any = None) -> Prepared | None:
        """The statement planned and its rewrite bound, no call made yet (prefetch makes
        them); None: it runs as written."""
        p = self.plan(sql, parameters)
        if p is None or not self.binds(p, parameters):
            return None
        run = QueryRun(p.qid, p.sites, self.session, learned=self.learned)
        self.runs.put(run)
        self.history[normalized(sql)] = run.counts  # (filled as the query runs)
        while len(self.history) > KEPT_HISTORY:
            self.history.popitem(last=False)
        return Prepared(p, run, self.named_as_written(p, parameters))

    def prefetch(self, prepared: Prepared, whole: bool = True) -> None:
        """Make the calls of the prepared statement's steps ahead of running it: all of
        them (whole), or its ORDER BY ... LIMIT steps alone, whose calls any read of its rows
        needs (a relation built on a con.sql() relation). A step runs once."""
        p, run = prepared.plan, prepared.run
        self.runs.put(run)  # (read long after: other queries' runs may have pushed it out)
        steps = [(i, step) for i, step in enumerate(p.steps) if i not in prepared.done
                 and (whole or isinstance(step, Incremental))]
        for i, step in steps:
            self.execute_steps(p, run, [step])
            prepared.done.add(i)
        if whole and steps:
            self._learn_time_scale(p, run)

    def named_as_written(self, p: Plan, parameters: Any = None) -> str:
        """p.sql with the result columns named as the statement as written names them.
        DuckDB names an unaliased column after its expression's text, and the rewrite put a
        site lookup (`__llmdb_site_llm_complete(...)`, long and different each run) in
        place of each call: the rewritten query goes under a projection by position with
        the written names. Binding (DESCRIBE) calls no model. A CTAS's query part is named
        as sqlglot writes it back (an IF as a CASE, say), as its other columns were already."""
        if p.names_kept:
            return p.sql
        try:
            want, got = (
                [row[0] for row in self.con.execute(f"DESCRIBE {q}", parameters).fetchall()]
                for q in (p.written_sql, p.dry_sql))
        except duckdb.InterruptException:
            raise
        except duckdb.Error:  # (a statement DESCRIBE does not take: run it as rewritten)
            return p.sql
        if want == got or len(want) != len(got):
            return p.sql
        cols = ", ".join(f'#{i} AS "{name.replace(chr(34), chr(34) * 2)}"'
                         for i, name in enumerate(want, 1))
        named = f"SELECT {cols} FROM ({p.dry_sql}) AS __llmdb_named"
        if p.dry_sql == p.sql:
            return named
        if p.dry_sql not in p.sql:
            p.notes.append("columns keep the rewrite's names (its query part not found)")
            return p.sql
        return p.sql.replace(p.dry_sql, named, 1)

    def _learn_time_scale(self, p: Plan, run: QueryRun) -> None:
        """Compare the prefetched batches' model time with the cost model's (not a batch
        with failed rows: its time is that of the rows before the failure, or none)."""
        from .estimate import calibrated, cost_model, estimate_site

        backend = self.session.backend()
        if run.dry or backend.simulation() is None or not calibrated(cost_model(backend)):
            return
        for site in p.sites:
            c = run.counts[site.id]
            if site.id not in run.prefetched or c.model_s <= 0 or not c.computed or c.errors:
                continue
            sim = estimate_site(self.session, site, c, self.learned, observed=True).model_s
            if sim:
                self.learned.observe_time(backend.name, sim, c.model_s)

    def binds(self, p: Plan, parameters: Any) -> bool:
        """Whether DuckDB accepts the rewritten SQL (sqlglot regenerates it). Planning it
        may fold constant calls: a dry run answers those. A statement DuckDB rejects as
        written raises DuckDB's error about it."""
        bind_as_written(self.con, without_priority(p.statement), parameters)
        self.runs.put(QueryRun(p.qid, p.sites, self.session, dry=True, learned=self.learned))
        try:
            self.con.execute(f"EXPLAIN {p.sql}", parameters)
            return True
        except duckdb.InterruptException:
            raise
        except duckdb.Error as e:
            p.notes.append(f"rewritten SQL rejected ({type(e).__name__}); ran as written")
            return False

    def dry_run(self, p: Plan, dry: QueryRun) -> None:
        """Everything a run would do, with values drawn from what the sites returned
        before instead of model calls; dry.counts then hold the estimates."""
        self.runs.put(dry)
        self.execute_steps(p, dry)
        if p.has_lazy or any(m != "strict" and p.placements[i].kind == "incremental"
                             for i, m in dry.modes.items()):
            result = self.con.execute(p.dry_sql)
            while result.fetchmany(8192):
                pass

    # ---- steps ---------------------------------------------------------------------------

    def execute_steps(self, p: Plan, run: QueryRun, steps: list[Step] | None = None) -> None:
        """Prefetch the calls of the plan's steps (or of `steps`). A failed row raises its
        llmdb.LLMError and a cancel QueryCancelled, as themselves (the connection presents
        both as the DuckDB errors they are inside a query)."""
        values = p.parameters
        for step in p.steps if steps is None else steps:
            if isinstance(step, Fill):
                self._fill(run, step.site, step.sql, values)
            elif isinstance(step, Learn):
                if not run.dry:
                    self._learn(run, step, values)
            elif isinstance(step, Incremental):
                self._incremental(run, step, values)

    def _query(self, sql: str, values: Any = None) -> list[tuple] | None:
        """Rows of a driver query (given the values of the query's placeholders); None when
        it fails (its sites then stay lazy), except for a wrong argument type, which the
        query would meet too: raised as it is."""
        try:
            return self.con.execute(*with_values_used(sql, values)).fetchall()
        except duckdb.InterruptException:
            raise
        except duckdb.Error as e:
            if argument_error(e) is not None:
                raise
            if self.session.cancel.is_set():
                raise QueryCancelled("the query was cancelled") from None
            return None

    def _fill(self, run: QueryRun, site: Site, sql: str, values: Any) -> None:
        rows = self._query(sql, values)
        if rows is not None:
            run.fill(site, [(freeze(r[:-1]), r[-1]) for r in rows])

    def _learn(self, run: QueryRun, step: Learn, values: Any) -> None:
        row = self._query(step.sql, values)
        if row:
            passed, seen = row[0]
            self.learned.observe_passes(f"{self.session.options.model}\x1f{step.predicate.key}",
                                        passed or 0, seen or 0)

    def _incremental(self, run: QueryRun, step: Incremental, values: Any) -> None:
        for s in step.sites:
            run.modes[s.id] = "strict"
        n = step.target
        last: dict[int, int] = {}
        while True:
            for s in step.sites:
                rows = self._query(drivers.with_limit(step.site_sql[s.id], n), values)
                if rows is None:
                    return self._give_up(run, step)
                keyed = [(freeze(r[:-1]), r[-1]) for r in rows]
                run.fill(s, keyed, count_rows=False)
                last[s.id] = sum(c for _, c in keyed)
            counted = self._query(drivers.with_limit(step.count_sql, n), values)
            if counted is None:
                return self._give_up(run, step)
            total, passed = counted[0]
            if passed >= step.target or total < n:
                break
            n += step.target - passed
        for s in step.sites:  # rows it was evaluated on: those of the last (largest) prefix
            run.counts[s.id].rows += last.get(s.id, 0)
        return None

    def _give_up(self, run: QueryRun, step: Incremental) -> None:
        # Strict lookups are only right over a complete prefix: compute misses instead.
        for s in step.sites:
            run.modes[s.id] = "lazy"

    # ---- EXPLAIN -------------------------------------------------------------------------

    def last_counts(self, sql: str) -> dict[int, SiteCounts] | None:
        """Per site, what the query did when it last ran on this connection."""
        return self.history.get(normalized(sql))
