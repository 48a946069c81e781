"""EXPLAIN LLM's model-time estimate against the model time the query then takes.

Workload: the first rows of samples.reviews (Amazon fine-food reviews, cut to 400 characters)
on the bundled model, result cache off. Per query: EXPLAIN LLM first (the planner's estimate,
knowing only what earlier queries of this run taught it), then the query itself, every query
once ("cold") and then every query again ("warm", after its own first run); actual_s is
the time its calls spent in the model (llm_stats' engine_s). The estimate is the cost
model's simulation times the scale the planner learned from the batches run before it
(time_scale; 1 for the first query). One JSON line per query:
{"name": "explain", "query": ..., "est_s": ..., "actual_s": ..., "error_pct": ...} plus the
estimated and actual calls and tokens, and a summary line. The cost model is the calibrated
one (`llmdb calibrate`), or the file given with --cost-model.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import llmdb
from llmdb.engine.costmodel import CostModel
from llmdb.planner import LEARNED
from llmdb.planner.estimate import calibrated, cost_model, use_cost_model

# SmolLM2 answers "yes" with probability below one half to most of these reviews, so an
# llm_filter passes almost nothing; thresholds on llm_filter_score keep about half the rows.
LIKED = "llm_filter_score('Does the reviewer like the product? Review: ' || review)"
QUERIES = [
    ("filter_120", "SELECT id FROM r WHERE id <= 120 AND "
     "llm_filter('Is this review positive? ' || review)"),
    ("complete_40", "SELECT id, llm_complete('Summarize in five words: ' || review, "
     "max_tokens := 8) AS s FROM r WHERE id <= 40"),
    ("classify_60", "SELECT llm_classify(review, ['positive', 'negative', 'mixed']) AS c, "
     "count(*) AS n FROM r WHERE id <= 60 GROUP BY c"),
    ("two_scores_150", f"SELECT id FROM r WHERE id <= 150 AND {LIKED} > 0.33 AND "
     "llm_filter_score('Is this text about food? ' || review) > 0.25"),
    ("first_20_liked", f"SELECT id FROM r WHERE {LIKED} > 0.35 ORDER BY id DESC LIMIT 20"),
    ("score_then_complete", "SELECT id, llm_complete('Name the product in two words: ' "
     "|| review, max_tokens := 4) AS p FROM r WHERE id BETWEEN 200 AND 300 AND "
     "llm_filter_score('Is this review positive? ' || review) > 0.3"),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cost-model", type=Path, default=None,
                    help="a calibration JSON (default: the calibrated one of this machine)")
    ap.add_argument("--threads", type=int, default=None,
                    help="engine threads (as the calibration was made with)")
    ap.add_argument("--only", nargs="*", default=None)
    args = ap.parse_args()
    if args.cost_model is not None:
        cm = CostModel.from_dict(json.loads(args.cost_model.read_text()))
        cm.source = f"calibration file {args.cost_model}"
        use_cost_model(cm)
    if not calibrated(cost_model()):
        print("no calibrated cost model: run `llmdb calibrate` (or pass --cost-model)",
              file=sys.stderr)
        return 2
    engine = {"threads": args.threads} if args.threads else {}
    con = llmdb.connect(cache=False, progress=False, **engine)
    con.execute("CREATE TABLE r AS SELECT row_number() OVER () AS id, "
                "left(review, 400) AS review FROM samples.reviews")
    # Warm-up: the engine's first steps pay one-off costs the cost model does not have; what
    # the planner learned from them (a time scale) is forgotten.
    con.execute("SELECT llm_complete('Say hi', max_tokens := 2)").fetchall()
    LEARNED.clear()

    errors: dict[str, list[float]] = {"cold": [], "warm": []}
    # cold: the first run of each query (its predicates' pass rates and output lengths not
    # yet seen); warm: the same query again, estimated with what the first run taught.
    runs = [(name, sql, "cold") for name, sql in QUERIES] + \
        [(name, sql, "warm") for name, sql in QUERIES]
    for name, sql, when in runs:
        if args.only and name not in args.only:
            continue
        scale, batches = LEARNED.time_scale("smollm2-135m")
        report = con.explain_report(sql)
        est = report.total("est")
        t0 = time.perf_counter()
        con.execute(sql).fetchall()
        wall = time.perf_counter() - t0
        actual = con.stats()["last_query"]
        err = 100.0 * (est.model_s - actual["engine_s"]) / actual["engine_s"]
        errors[when].append(abs(err))
        print(json.dumps({
            "name": "explain", "query": sql, "shape": name, "run": when,
            "est_s": round(est.model_s, 3), "actual_s": round(actual["engine_s"], 3),
            "error_pct": round(err, 1), "query_s": round(wall, 3),
            "est_calls": est.calls, "actual_calls": actual["calls"],
            "est_prompt_tokens": est.prompt_tokens,
            "actual_prompt_tokens": actual["prompt_tokens"],
            "est_output_tokens": est.output_tokens,
            "actual_output_tokens": actual["generated_tokens"],
            "actual_cached_tokens": actual["cached_tokens"],
            "priority": report.priority, "time_scale": round(scale, 3),
            "time_scale_batches": batches}), flush=True)
    for when, errs in errors.items():
        print(json.dumps({"name": "explain_summary", "run": when, "queries": len(errs),
                          "mean_abs_error_pct": round(sum(errs) / len(errs), 1),
                          "max_abs_error_pct": round(max(errs), 1),
                          "within_30_pct": sum(e <= 30 for e in errs),
                          "cost_model": cost_model().source}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
