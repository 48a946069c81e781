"""The SQL layer's own cost per interactive query: what llmdb adds to a small query before and
around its model calls, with the model taken out.

The model is the hash stand-in (llmdb.backends.standin: an answer per prompt at once), so
the times are llmdb's and DuckDB's alone: parsing and planning, the planner's binds and
prefetch, the query thread, the batch machinery. Per query shape, the median over --runs of
`con.execute(q).fetchall()` through the planner, as written (planner=False), and the same
query with the call replaced by its argument on plain DuckDB (the floor). The result cache
is off, so every run sends its rows to the stand-in. One JSON line per shape.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

import duckdb

import llmdb
from llmdb.backends.standin import STANDIN_MODEL

ROOT = Path(__file__).resolve().parent.parent
ROWS = 1_000

# (name, query with an llm call, the same query without it)
SHAPES = [
    ("one_row", "SELECT id, llm_complete(text, max_tokens := 16) AS a FROM t WHERE id = 7",
     "SELECT id, text AS a FROM t WHERE id = 7"),
    ("unaliased", "SELECT id, llm_complete(text) FROM t WHERE id = 7",
     "SELECT id, text FROM t WHERE id = 7"),
    ("filter_10", "SELECT id FROM t WHERE id < 10 AND llm_filter('Is it about ' || text)",
     "SELECT id FROM t WHERE id < 10 AND ('Is it about ' || text) IS NOT NULL"),
    ("classify_32", "SELECT llm_classify(text, ['a', 'b']) AS c, count(*) FROM t "
     "WHERE id < 32 GROUP BY c", "SELECT text AS c, count(*) FROM t WHERE id < 32 GROUP BY c"),
]


def median_ms(con, query: str, runs: int) -> float:
    con.execute(query).fetchall()  # warm: functions bound, the stand-in started
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        con.execute(query).fetchall()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1000, 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=50)
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    setup = (f"CREATE TABLE t AS SELECT range AS id, 'row number ' || range AS text "
             f"FROM range({ROWS})")
    planned = llmdb.connect(model=STANDIN_MODEL, cache=False)
    written = llmdb.connect(model=STANDIN_MODEL, cache=False, planner=False)
    plain = duckdb.connect()
    for con in (planned, written, plain):
        con.execute(setup)
    for name, query, floor in SHAPES:
        print(json.dumps({
            "name": "query_latency", "shape": name, "commit": commit, "runs": args.runs,
            "planned_ms": median_ms(planned, query, args.runs),
            "as_written_ms": median_ms(written, query, args.runs),
            "plain_duckdb_ms": median_ms(plain, floor, args.runs),
            "model": STANDIN_MODEL}), flush=True)


if __name__ == "__main__":
    main()
