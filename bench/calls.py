"""Model calls of the planner's query suite: llmdb against the minimum and plain DuckDB.

The suite is tests/planner_shapes.py (AND, OR, NOT and NULLs, several LLM predicates,
ORDER BY + LIMIT, joins, CTEs, subqueries, GROUP BY, HAVING, windows, UNION, CASE, nested
calls). Per query, with the result cache off:
- llmdb_calls: rows the model computed for an llmdb.Connection (the planner on);
- minimal_calls: the minimum, computed in Python from the table data (tests/planner_shapes);
- naive_calls: plain DuckDB with the same functions (llmdb.register on a duckdb connection).
By default the deterministic stand-in model (hash-standin) on 100,000 rows; --real runs the
bundled model on a few hundred rows (the suite's completions generate 1-2 tokens). Prints one
JSON line per query, then a summary line; exits 1 unless llmdb == minimal everywhere.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import duckdb

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import llmdb  # noqa: E402
from llmdb.planner import LEARNED  # noqa: E402
from tests.planner_shapes import SHAPES, STANDIN, Oracle, load, make_tables  # noqa: E402


def order_of(con: llmdb.Connection, sql: str):
    p = con.planner.plan(sql)
    rank = {s.key: s.order for s in p.sites} if p else {}
    return lambda a, b: rank[a] < rank[b]


def timed_calls(session, run) -> tuple[list, int, float]:
    before = session.stats()["total"]["model_rows"]
    t0 = time.perf_counter()
    rows = run()
    return rows, session.stats()["total"]["model_rows"] - before, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--real", action="store_true", help="the bundled model, not the stand-in")
    ap.add_argument("--rows", type=int, default=None,
                    help="rows of table t (default 100,000; 300 with --real)")
    ap.add_argument("--only", nargs="*", default=None, help="run only these shapes")
    ap.add_argument("--threads", type=int, default=None, help="engine threads (--real)")
    args = ap.parse_args()
    model = "smollm2-135m" if args.real else STANDIN
    rows = args.rows or (300 if args.real else 100_000)

    LEARNED.clear()
    engine = {"threads": args.threads} if args.real and args.threads else {}
    con = llmdb.connect(model=model, cache=False, progress=False, **engine)
    plain = duckdb.connect()
    plain.execute("SET enable_progress_bar = false")
    plain_session = llmdb.register(plain, model=model, cache=False)
    for c in (con, plain):
        make_tables(c, rows)
    data = load(plain, Oracle(model))

    ok = True
    totals = {"llmdb": 0, "minimal": 0, "naive": 0}
    for shape in SHAPES:
        if shape.fallback or (args.only and shape.name not in args.only):
            continue
        order = order_of(con, shape.sql)
        got, calls, llmdb_s = timed_calls(con.session, lambda s=shape: con.execute(s.sql)
                                          .fetchall())
        want, naive, naive_s = timed_calls(plain_session, lambda s=shape: plain.execute(s.sql)
                                           .fetchall())
        minimal = shape.minimal(data, order)
        same = (got == want) if shape.ordered else sorted(got, key=repr) == sorted(want,
                                                                                    key=repr)
        ok &= same and calls == minimal
        for k, v in (("llmdb", calls), ("minimal", minimal), ("naive", naive)):
            totals[k] += v
        print(json.dumps({"name": "calls", "query": shape.sql, "shape": shape.name,
                          "llmdb_calls": calls, "minimal_calls": minimal,
                          "naive_calls": naive, "same_result": same,
                          "llmdb_s": round(llmdb_s, 3), "naive_s": round(naive_s, 3),
                          "rows": rows, "model": model}), flush=True)
    print(json.dumps({"name": "calls_summary", "model": model, "rows": rows,
                      "llmdb_equals_minimal_everywhere": ok,
                      **{f"total_{k}_calls": v for k, v in totals.items()}}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
