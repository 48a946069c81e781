"""SQL-layer throughput: `SELECT llm_complete(prompt) FROM t` against the engine alone.

Workloads (the engine benchmark's review prompts, chat-formatted by llmdb):
- unique: 400 distinct rows x 64 tokens;
- half_dup: 400 rows, each prompt twice (200 distinct) x 64 tokens;
- 10k: 10,000 distinct rows x 8 tokens (five DuckDB vectors).
Per workload, in one process on one shared engine: the engine alone on the same rendered
prompts (every row, duplicates included), then the SQL query with the result cache off
(calls counted here), cold (empty cache file) and warm (the same query again). The engine's
prefix cache is off, so that no pass reuses another's prompt blocks.
overhead_pct = (engine_only_rows_per_s / rows_per_s - 1) x 100. Prints one JSON line per
(workload, cache) pair.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from workload import review_messages  # noqa: E402

import llmdb  # noqa: E402
from llmdb.engine.params import SamplingParams  # noqa: E402
from llmdb.engine.process_engines import shared_engine  # noqa: E402
from llmdb.session import Session  # noqa: E402

WORKLOADS = {"unique": (400, 400, 64), "half_dup": (400, 200, 64), "10k": (10_000, 10_000, 8)}


def texts(rows: int, distinct: int) -> list[str]:
    base = [m[0]["content"] for m in review_messages(distinct)]
    return [base[i * distinct // rows] for i in range(rows)]


def run_sql(con: llmdb.Connection, max_tokens: int) -> tuple[float, dict]:
    t0 = time.perf_counter()
    rows = con.execute(f"SELECT id, llm_complete(prompt, max_tokens := {max_tokens}) AS answer "
                       "FROM t ORDER BY id").fetchall()
    elapsed = time.perf_counter() - t0
    assert all(a is not None for _, a in rows)
    return elapsed, con.stats()["last_query"]


def connection(table: pa.Table, **options) -> llmdb.Connection:
    con = llmdb.connect(progress=False, **options)
    con.register("t", table)
    return con


def bench(name: str, rows: int, distinct: int, max_tokens: int, tmp: Path, config: dict) -> None:
    prompts = texts(rows, distinct)
    table = pa.table({"id": list(range(rows)), "prompt": prompts})
    backend = Session().backend()
    engine = shared_engine("smollm2-135m")
    rendered = [backend.render_chat(p, None) for p in prompts]
    # The first pass over a workload touches KV-cache pages for the first time (the pool is
    # mapped lazily) and would make whichever path runs first look slower: not timed.
    engine.generate(rendered, SamplingParams(max_tokens=max_tokens))
    t0 = time.perf_counter()
    engine.generate(rendered, SamplingParams(max_tokens=max_tokens))
    engine_only = rows / (time.perf_counter() - t0)

    def line(cache: str, elapsed: float, stats: dict, **extra) -> None:
        rps = rows / elapsed
        print(json.dumps({
            "name": "sql_throughput", "workload": name, "cache": cache,
            "rows_per_s": round(rps, 2), "engine_only_rows_per_s": round(engine_only, 2),
            "overhead_pct": round((engine_only / rps - 1) * 100, 1), "calls": stats["calls"],
            "cache_hits": stats["cache_hits"], "dedup_hits": stats["dedup_hits"],
            "distinct_prompts": distinct, "elapsed_s": round(elapsed, 2), **extra,
            "config": {**config, "rows": rows, "max_tokens": max_tokens},
        }), flush=True)

    con = connection(table, cache=False)
    elapsed, stats = run_sql(con, max_tokens)
    line("off", elapsed, stats)
    con.close()

    con = connection(table, cache=True, cache_path=str(tmp / f"{name}.sqlite"))
    cold, stats = run_sql(con, max_tokens)
    line("cold", cold, stats)
    warm, stats = run_sql(con, max_tokens)
    line("warm", warm, stats, warm_cache_speedup=round(cold / warm, 1))
    con.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workload", action="append", choices=list(WORKLOADS),
                    help="run only these (default: all)")
    args = ap.parse_args()
    # Prefix caching off: every pass runs the same prompts, and a later pass would otherwise
    # reuse the earlier passes' prompt blocks and look faster than the first.
    engine = shared_engine("smollm2-135m", enable_prefix_caching=False)
    engine.generate(["warm up"], SamplingParams(max_tokens=2))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                            capture_output=True).stdout.strip()
    config = {"commit": commit, "dtype": str(engine.dtype).removeprefix("torch."),
              "max_num_seqs": engine.scheduler.max_num_seqs,
              "max_num_batched_tokens": engine.scheduler.max_num_batched_tokens,
              "prefix_caching": engine.pool.enable_prefix_caching}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.workload or list(WORKLOADS):
            bench(name, *WORKLOADS[name], Path(tmp), config)


if __name__ == "__main__":
    main()
