"""An interactive (RT) request that arrives while a bulk job's (BE) requests fill the engine:
how long it waits, per scheduling policy, and what it costs the job. One JSON line per policy.
Steps do not depend on the machine's load; seconds do.

    python bench/interactive_beside_bulk.py [--rows 200] [--max-tokens 16] [--max-num-seqs 32]
        [--policies priority sarathi bros] [--device cpu] [--sql]

--sql: the same through SQL: `SELECT id, llm_complete(p, max_tokens := N) FROM t` over the rows
on one connection (BE: the planner classes it bulk) and, SQL_DELAY_S later, a one-row query
on another connection to the same engine (RT), each timed (seconds only).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput import commit  # noqa: E402

WARM_STEPS = 3  # the job's steps before the interactive request arrives
SQL_DELAY_S = 3.0  # --sql: the bulk query's head start


def run(policy: str, args: argparse.Namespace) -> dict:
    from llmdb.engine.engine import LLMEngine
    from llmdb.engine.params import SamplingParams

    engine = LLMEngine("smollm2-135m", device=args.device, max_num_seqs=args.max_num_seqs,
                       policy=policy)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    bulk = [[{"role": "user", "content": f"Write a haiku about the number {i}."}]
            for i in range(args.rows)]
    t0 = time.perf_counter()
    for m in bulk:
        engine.add_request(m, params, priority="BE")
    for _ in range(WARM_STEPS):
        engine.step()
    t_rt = time.perf_counter()
    first: list[float] = []
    rt = engine.add_request([{"role": "user", "content": "What is the capital of France?"}],
                            params, priority="RT",
                            on_token=lambda t: first or first.append(time.perf_counter()))
    steps, first_step, done_step, done_s = 0, None, None, None
    while engine.has_unfinished:
        engine.step()
        steps += 1
        if first_step is None and first:
            first_step = steps
        if done_step is None and engine.wait(rt, timeout=0) is not None:
            done_step, done_s = steps, time.perf_counter() - t_rt
    return {"name": "interactive_beside_bulk", "policy": policy, "commit": commit(),
            "rt_first_token_steps": first_step, "rt_done_steps": done_step,
            "bulk_steps": WARM_STEPS + steps, "rt_ttft_s": round(first[0] - t_rt, 3),
            "rt_latency_s": round(done_s, 3), "bulk_s": round(time.perf_counter() - t0, 3),
            "rows": args.rows, "max_tokens": args.max_tokens,
            "max_num_seqs": args.max_num_seqs, "device": args.device}


def run_sql(policy: str, args: argparse.Namespace) -> dict:
    import threading

    import llmdb

    options = {"cache": False, "progress": False, "policy": policy, "device": args.device,
               "max_num_seqs": args.max_num_seqs}
    bulk, interactive = llmdb.connect(**options), llmdb.connect(**options)
    bulk.execute("CREATE TABLE t AS SELECT range AS id, 'Write a haiku about the number ' "
                 f"|| range AS p FROM range({args.rows})")
    t0 = time.perf_counter()
    bulk_s: list[float] = []

    def bulk_query() -> None:
        bulk.execute(f"SELECT id, llm_complete(p, max_tokens := {args.max_tokens}) FROM t"
                     ).fetchall()
        bulk_s.append(time.perf_counter() - t0)

    job = threading.Thread(target=bulk_query)
    job.start()
    time.sleep(SQL_DELAY_S)
    t1 = time.perf_counter()
    interactive.execute("SELECT llm_complete('What is the capital of France?', "
                        f"max_tokens := {args.max_tokens})").fetchall()
    rt_s = time.perf_counter() - t1
    job.join()
    return {"name": "interactive_beside_bulk_sql", "policy": policy, "commit": commit(),
            "rt_query_s": round(rt_s, 3), "bulk_query_s": round(bulk_s[0], 3),
            "rt_after_s": SQL_DELAY_S, "rows": args.rows, "max_tokens": args.max_tokens,
            "max_num_seqs": args.max_num_seqs, "device": args.device}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--policies", nargs="+", default=["priority", "sarathi", "bros"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sql", action="store_true", help="through SQL: see the module's doc")
    args = ap.parse_args()
    if args.sql and len(args.policies) > 1:  # (a process runs one engine per model)
        for policy in args.policies:
            subprocess.run([sys.executable, __file__, *sys.argv[1:], "--policies", policy],
                           check=True)
        return
    for policy in args.policies:
        print(json.dumps((run_sql if args.sql else run)(policy, args)), flush=True)


if __name__ == "__main__":
    main()
