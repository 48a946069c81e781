"""An interactive (RT) request that arrives while a bulk job's (BE) requests fill the engine:
how long it waits, per scheduling policy, and what it costs the job. One JSON line per policy.
Steps do not depend on the machine's load; seconds do.

    python bench/interactive_beside_bulk.py [--rows 200] [--max-tokens 16] [--max-num-seqs 32]
        [--policies priority sarathi bros] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput import commit  # noqa: E402

WARM_STEPS = 3  # the job's steps before the interactive request arrives


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--policies", nargs="+", default=["priority", "sarathi", "bros"])
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    for policy in args.policies:
        print(json.dumps(run(policy, args)), flush=True)


if __name__ == "__main__":
    main()
