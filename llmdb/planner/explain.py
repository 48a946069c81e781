"""EXPLAIN LLM: per call site, what the planned query will cost, and what it did last time.

Estimates come from a dry run of the plan (every driver and the query itself run, the model
replaced by values the sites returned before), DuckDB's cardinality estimate for the operator
that evaluates each call, a rendered and tokenized sample of the requests, the result cache,
and the engine's simulator with the cost model as its clock. Once the same query has run on
the connection, the report puts what it actually did next to each estimate.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields

import duckdb
import pyarrow as pa

from llmdb.functions import RT_MAX_CALLS

from .callsites import Site
from .estimate import SiteEstimate, calibrated, cost_model, estimate_site
from .guards import MAIN, tag
from .memo import QueryRun, SiteCounts
from .placement import Placement
from .run import Planner

MEASURES = ("rows", "distinct", "cache_hits", "calls", "calibration_calls", "prompt_tokens",
            "output_tokens", "model_s")
_LABELS = {"rows": "rows reaching it", "distinct": "distinct prompts",
           "cache_hits": "result-cache hits", "calls": "model calls",
           "calibration_calls": "calibration calls",
           "prompt_tokens": "prompt tokens", "output_tokens": "output tokens",
           "model_s": "model time (s)"}


@dataclass
class SiteReport:
    site: Site
    placement: Placement
    priority: str
    rows_duckdb: int | None
    est: SiteEstimate
    actual: SiteEstimate | None = None


@dataclass
class Report:
    query: str
    sites: list[SiteReport] = field(default_factory=list)
    priority: str | None = None
    priority_why: str = ""
    cost_model: str = ""
    engine: str = ""  # where the model runs, e.g. "cuda:0 (NVIDIA H100 80GB HBM3), bfloat16"
    notes: list[str] = field(default_factory=list)

    def total(self, which: str) -> SiteEstimate | None:
        parts = [getattr(s, which) for s in self.sites]
        if not parts or any(p is None for p in parts):
            return None
        out = SiteEstimate()
        for f in fields(SiteEstimate):
            if f.name == "batches":
                continue
            values = [getattr(p, f.name) for p in parts]
            if f.name == "model_s" and any(v is None for v in values):
                out.model_s = None
            else:
                setattr(out, f.name, sum(values))
        return out

    # ---- output --------------------------------------------------------------------------

    def table(self) -> pa.Table:
        rows = []
        for s in self.sites:
            rows.append(_row(str(s.site.id), s.site.function, s.site.key, _form(s), s.priority,
                             s.rows_duckdb, s.est, s.actual))
        if self.sites:
            rows.append(_row("total", "", "", "", self.priority or "", None,
                             self.total("est"), self.total("actual")))
        if not rows:
            rows.append(_row("", "", "; ".join(self.notes), "", "", None, None, None))
        return pa.Table.from_pylist(rows, schema=_SCHEMA)

    def text(self) -> str:
        if not self.sites:
            return "EXPLAIN LLM: " + ("; ".join(self.notes) or "no LLM calls") + "\n"
        has_actual = any(s.actual is not None for s in self.sites)
        lines = [f"EXPLAIN LLM  priority {self.priority} ({self.priority_why})",
                 f"engine: {self.engine}", f"cost model: {self.cost_model}"]
        lines += [f"note: {n}" for n in self.notes]
        for s in self.sites:
            lines.append("")
            lines.append(f"site {s.site.id}: {s.site.key}")
            lines.append(f"  evaluated: {_form(s)}; priority {s.priority}")
            lines += _measures(s.est, s.actual, has_actual, s.rows_duckdb)
        lines.append("")
        lines.append("total")
        lines += _measures(self.total("est"), self.total("actual"), has_actual, None)
        return "\n".join(lines) + "\n"


_FORMS = {"where": "prefetched: the rows passing its guard, one batch",
          "pre_agg": "prefetched: the rows passing WHERE, one batch",
          "output": "prefetched: the result rows, one batch",
          "incremental": "in query order, in batches, until the LIMIT is met"}


def _form(s: SiteReport) -> str:
    if s.placement.kind == "lazy":
        return f"lazily, on the rows DuckDB evaluates it on ({s.placement.why})"
    return _FORMS[s.placement.kind]


_SCHEMA = pa.schema([("site", pa.string()), ("function", pa.string()), ("call", pa.string()),
                     ("evaluated", pa.string()), ("priority", pa.string()),
                     ("rows_duckdb", pa.int64())]
                    + [(f"{m}_{w}", pa.float64() if m == "model_s" else pa.int64())
                       for m in MEASURES for w in ("est", "actual")])


def _row(site: str, function: str, call: str, form: str, priority: str,
         rows_duckdb: int | None, est: SiteEstimate | None, actual: SiteEstimate | None
         ) -> dict:
    row = {"site": site, "function": function, "call": call, "evaluated": form,
           "priority": priority, "rows_duckdb": rows_duckdb}
    for m in MEASURES:
        row[f"{m}_est"] = getattr(est, m) if est is not None else None
        row[f"{m}_actual"] = getattr(actual, m) if actual is not None else None
    return row


def _fmt(v: float | int | None, m: str) -> str:
    if v is None:
        return "n/a"
    return f"{v:.2f}" if m == "model_s" else f"{v:,}"


def _measures(est: SiteEstimate | None, actual: SiteEstimate | None, has_actual: bool,
              rows_duckdb: int | None) -> list[str]:
    out = []
    for m in MEASURES:
        e = _fmt(getattr(est, m) if est else None, m)
        if m == "rows" and rows_duckdb is not None:
            e += f" (DuckDB: {rows_duckdb:,} reach its operator)"
        line = f"  {_LABELS[m]:<18} est {e}"
        if has_actual:
            line += f"   actual {_fmt(getattr(actual, m) if actual else None, m)}"
        out.append(line)
    return out


# ---- building the report -----------------------------------------------------------------

def duckdb_rows(con: duckdb.DuckDBPyConnection, sql: str, sites: list[Site]) -> dict[int, int]:
    """Per site, DuckDB's estimated input rows of the operator evaluating its lookup (the
    one whose expressions carry the site's tag in the main role)."""
    try:
        plan = json.loads(con.execute(f"EXPLAIN (FORMAT JSON) {sql}").fetchall()[0][1])
    except (duckdb.Error, ValueError, IndexError):
        return {}
    markers = {s.id: f"'{tag(s.id, MAIN)}'" for s in sites}
    out: dict[int, int] = {}

    def card(node: dict) -> int:
        try:
            return int(node.get("extra_info", {}).get("Estimated Cardinality", 0))
        except (TypeError, ValueError):
            return 0

    def walk(node: dict) -> None:
        info = json.dumps(node.get("extra_info", {}))
        children = node.get("children", [])
        rows = max((card(c) for c in children), default=card(node))
        for site_id, marker in markers.items():
            if marker in info:
                out[site_id] = max(out.get(site_id, 0), rows)
        for c in children:
            walk(c)

    for root in plan if isinstance(plan, list) else [plan]:
        walk(root)
    return out


def actual(c: SiteCounts) -> SiteEstimate:
    return SiteEstimate(rows=c.rows, distinct=c.distinct, cache_hits=c.cache_hits,
                        calls=c.calls, calibration_calls=c.calibration_calls,
                        prompt_tokens=c.prompt_tokens,
                        output_tokens=c.generated_tokens, model_s=c.model_s,
                        batches=list(c.batches))


def explain(planner: Planner, sql: str) -> Report:
    report = Report(sql)
    backend = planner.session.backend()
    report.engine = backend.describe()
    cm = cost_model(backend)
    report.cost_model = cm.source if calibrated(cm) else \
        f"uncalibrated ({cm.source}): no time estimates"
    scale, n = planner.learned.time_scale(planner.session.options.model)
    if n and calibrated(cm):
        report.cost_model += f"; times x {scale:.2f}, learned from {n} batches run here"
    p, why = planner.plan_or_reason(sql)
    if p is None:
        report.notes.append(f"the query runs as written: {why}")
        return report
    if not planner.binds(p, None):
        report.notes += p.notes
        return report
    session = planner.session
    options_priority = session.options.priority
    dry = QueryRun(p.qid, p.sites, session, dry=True, learned=planner.learned)
    planner.dry_run(p, dry)
    duck = duckdb_rows(planner.con, p.dry_sql, p.sites)
    if options_priority:
        report.priority, report.priority_why = options_priority, "set on the connection"
    else:
        n = dry.total_requests()
        report.priority = "RT" if n <= RT_MAX_CALLS else "BE"
        report.priority_why = (f"estimated {n:,} model calls "
                               f"{'<=' if n <= RT_MAX_CALLS else '>'} {RT_MAX_CALLS}")
    last = planner.last_counts(sql)
    for site in p.sites:
        est = estimate_site(session, site, dry.counts[site.id], planner.learned)
        r = SiteReport(site, p.placements[site.id],
                       site.priority or report.priority or "", duck.get(site.id), est)
        if last is not None and site.id in last:
            r.actual = actual(last[site.id])
        report.sites.append(r)
    calibration = sum(s.est.calibration_calls for s in report.sites)
    if calibration:
        report.notes.append(
            f"model calls include {calibration:,} calibration calls: the content-free prior "
            "of each llm_filter/llm_classify template this process has not measured yet "
            "(measured once per template, then reused)")
    if last is not None:
        report.notes.append("actual: the last run of this query on this connection")
    return report
