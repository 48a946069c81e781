"""InferMax Sec. 5.1 ("Can evictions be optimal?") with our cost model, and each policy's gap.

B = 4 requests, each with input I and output O = 4, all present at t = 0; M = max(2I, I+O-1)
tokens of cache (two prompts fit, only one request can hold its whole sequence), C = 4096,
P = 512, the llama2-7b-a100 preset. Per I: the optimal schedule with evictions forbidden
(ef), then without (started from the better of sarathi's schedule and the ef optimum), and
every policy in the simulator on the same workload. JSON lines:

  {"name": "optimal_evictions", "I", "evictions", "latency", "ef_latency", "status", ...}
  {"name": "optimal_gap", "policy", "I", "latency", "bound", "gap_pct", "status", ...}
  {"name": "optimal_threshold", ...}   (the last I that evicts, the first that does not)

Latencies in ms; gap_pct is a policy's latency over the solver's bound (an upper bound on
its distance from the optimum: exact when the status is OPTIMAL). "proof" says what the
statuses establish: evicting is optimal once an evicting schedule beats the proved ef
optimum; not evicting is optimal once the bound with evictions allowed reaches the ef
latency. Solves are wall-clock limited (--budget in all, --max-time each): the I whose
answer is still open go first; where a policy's evicting schedule already beats the ef
optimum, the solve only tightens the bound and gets what is left. On this shared 2-core
machine the default run takes ~9 minutes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from llmdb.engine.costmodel import preset
from llmdb.engine.research.optimal import solve
from llmdb.engine.research.schedules import sim_config
from llmdb.engine.research.sim import simulate
from llmdb.engine.research.workloads import RequestSpec
from llmdb.engine.sched.policies import POLICIES

NUM_REQUESTS, OUTPUT_LEN = 4, 4  # InferMax's B and O
# The bound comes from coefficients rounded down to integer units, at most ~2e-4 below the
# exact cost: a bound this close to the ef latency settles the question.
BOUND_TOL = 1e-4


def ms(seconds: float) -> float:
    return round(seconds * 1e3, 4)


def proof(evictions: int, latency: float, ef_latency: float, ef_status: str, status: str,
          bound: float) -> str:
    if evictions and latency < ef_latency * (1 - 1e-9):
        return "evicts (proved)" if ef_status == "OPTIMAL" else "evicts (ef not proved)"
    if status == "OPTIMAL" or bound >= ef_latency * (1 - BOUND_TOL):
        return "no eviction (proved)"
    return "no eviction found (not proved)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inputs", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256])
    ap.add_argument("--preset", default="llama2-7b-a100")
    ap.add_argument("-C", type=int, default=4096)
    ap.add_argument("-P", type=int, default=512)
    ap.add_argument("--budget", type=float, default=540.0,
                    help="seconds for all the solves with evictions allowed")
    ap.add_argument("--max-time", type=float, default=240.0, help="seconds per solve at most")
    ap.add_argument("--settled-time", type=float, default=30.0,
                    help="seconds kept aside for each I already settled by a policy")
    ap.add_argument("--workers", type=int, default=1)
    args = ap.parse_args()

    cm = preset(args.preset)
    started = time.perf_counter()
    # Phase 1, cheap: the optimum without evictions (the relaxation is tight there: about a
    # second each) and every policy in the simulator.
    ef, sims = {}, {}
    for inp in args.inputs:
        M = max(2 * inp, inp + OUTPUT_LEN - 1)
        ef[inp] = solve([(inp, OUTPUT_LEN)] * NUM_REQUESTS, cm, C=args.C, P=args.P, M=M,
                        forbid_evictions=True, time_limit_s=args.max_time,
                        workers=args.workers)
        specs = [RequestSpec(0.0, inp, OUTPUT_LEN, "RT", f"r{i}") for i in range(NUM_REQUESTS)]
        sims[inp] = {p: simulate(specs, p, cm, sim_config(args.C, args.P, M)) for p in POLICIES}
    # Phase 2: with evictions allowed. Where a policy's evicting schedule already beats the
    # ef optimum, evicting is proved optimal by example and the solve only tightens the
    # bound, so the open questions go first and get the time; the largest I first, whose
    # proofs are the shortest (refilling a long prompt is clearly costly: 50 s at I = 256,
    # 2-3 minutes at I = 64 on this machine).
    settled = {inp for inp in args.inputs if ef[inp].status == "OPTIMAL" and any(
        r.evictions and r.end_time < ef[inp].latency for r in sims[inp].values())}
    order = (sorted((i for i in args.inputs if i not in settled), reverse=True)
             + [i for i in args.inputs if i in settled])
    free, spent = {}, 0.0
    for k, inp in enumerate(order):
        left = len(order) - k
        reserve = args.settled_time * sum(1 for i in order[k + 1:] if i in settled)
        share = ((args.budget - spent - reserve) if inp not in settled
                 else (args.budget - spent) / left)
        M = max(2 * inp, inp + OUTPUT_LEN - 1)
        free[inp] = solve([(inp, OUTPUT_LEN)] * NUM_REQUESTS, cm, C=args.C, P=args.P, M=M,
                          hint_steps=ef[inp].steps, workers=args.workers,
                          time_limit_s=max(10.0, min(args.max_time, share)))
        spent += free[inp].solve_s
        print(f"I={inp}: {free[inp].status} in {free[inp].solve_s:.0f} s",
              file=sys.stderr, flush=True)

    verdicts: dict[int, str] = {}
    for inp in args.inputs:
        e, f = ef[inp], free[inp]
        verdicts[inp] = proof(f.evictions, f.latency, e.latency, e.status, f.status, f.bound)
        print(json.dumps({
            "name": "optimal_evictions", "I": inp, "evictions": f.evictions,
            "latency": ms(f.latency), "ef_latency": ms(e.latency), "status": f.status,
            "ef_status": e.status, "bound": ms(f.bound), "ef_bound": ms(e.bound),
            "M": max(2 * inp, inp + OUTPUT_LEN - 1), "batches": len(f.schedule),
            "proof": verdicts[inp], "hint": f.hint, "solve_s": round(f.solve_s, 1),
            "ef_solve_s": round(e.solve_s, 1),
        }), flush=True)
        for policy, sim in sims[inp].items():
            print(json.dumps({
                "name": "optimal_gap", "policy": policy, "I": inp,
                "latency": ms(sim.end_time), "bound": ms(f.bound),
                "gap_pct": round(100 * (sim.end_time - f.bound) / f.bound, 2),
                "status": f.status, "best": ms(f.latency),
                "evictions": sim.evictions, "batches": sim.steps,
            }), flush=True)
    evicting = [i for i, v in verdicts.items() if v.startswith("evicts")]
    not_evicting = [i for i, v in verdicts.items() if not v.startswith("evicts")]
    print(json.dumps({
        "name": "optimal_threshold", "preset": args.preset, "B": NUM_REQUESTS,
        "O": OUTPUT_LEN, "C": args.C, "P": args.P,
        "evicts_up_to": max(evicting, default=None),
        "no_eviction_from": min(not_evicting, default=None),
        "all_proved": all("(proved)" in v for v in verdicts.values()),
        "infermax": "evicts for I <= 32, not for I >= 64",
        "wall_s": round(time.perf_counter() - started, 1),
    }), flush=True)


if __name__ == "__main__":
    main()
