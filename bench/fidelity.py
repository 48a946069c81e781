"""Simulator fidelity: one online workload on the real engine and in the simulator.

200 requests (Poisson arrivals; prompts lognormal mean 100 / std 60 tokens of random ids,
outputs lognormal mean 32 / std 16, generated to exactly that length) run on the engine
with its background loop, each submitted at its arrival time; the simulator replays the same
requests with the same scheduler settings and the engine's cost model (calibrated for its
model, dtype and device when `llmdb calibrate` has run, else an estimate: the line says
which). Prints one JSON line with the mean per-request latency error (target <= 15%) and TTFT
errors.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import numpy as np

from llmdb.engine.costmodel import engine_cost_model
from llmdb.engine.engine import LLMEngine
from llmdb.engine.params import SamplingParams
from llmdb.engine.research.sim import SimConfig, simulate
from llmdb.engine.research.workloads import RequestSpec, arrivals, lognormal


def workload(n: int, rate: float, seed: int) -> list[RequestSpec]:
    rng = np.random.default_rng(seed)
    times = arrivals(rng, rate, n)
    prompts = np.clip(np.round(lognormal(rng, 100, 60, n)), 4, 1000).astype(int)
    outputs = np.clip(np.round(lognormal(rng, 32, 16, n)), 1, 256).astype(int)
    return [RequestSpec(float(t), int(p), int(o), "BE", f"f{i}")
            for i, (t, p, o) in enumerate(zip(times, prompts, outputs, strict=True))]


def run_engine(engine: LLMEngine, specs: list[RequestSpec], seed: int) -> dict[str, tuple]:
    """(latency, ttft) per request, measured from its arrival."""
    rng = np.random.default_rng(seed + 1)
    prompts = {s.request_id: rng.integers(1000, 40000, s.prompt_len).tolist() for s in specs}
    done: dict[str, tuple] = {}
    lock = threading.Lock()
    engine.start_background_loop()
    start = time.perf_counter()
    ids = []
    for s in specs:
        delay = start + s.arrival - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        params = SamplingParams(max_tokens=s.output_len, ignore_eos=True)
        ids.append((s.request_id, engine.add_request(prompts[s.request_id], params)))
    for name, rid in ids:
        r = engine.wait(rid)
        with lock:
            done[name] = (r.usage.total_s, r.usage.ttft_s)
    engine.stop_background_loop()
    return done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    specs = workload(args.requests, args.rate, args.seed)
    engine = LLMEngine()
    engine.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2))  # warm up
    real = run_engine(engine, specs, args.seed)
    cm = getattr(engine, "cost_model", None) or engine_cost_model(engine)
    sched = engine.scheduler
    cfg = SimConfig(num_blocks=engine.pool.num_blocks, block_size=engine.pool.block_size,
                    max_num_batched_tokens=sched.max_num_batched_tokens,
                    max_prefill_tokens=sched.max_prefill_tokens,
                    max_num_seqs=sched.max_num_seqs)
    sim = {m.request_id: (m.latency, m.ttft)
           for m in simulate(specs, sched.policy.name, cm, cfg).requests}
    lat_err = [abs(sim[k][0] - v[0]) / v[0] for k, v in real.items()]
    ttft_err = [abs(sim[k][1] - v[1]) / v[1] for k, v in real.items() if v[1]]
    print(json.dumps({
        "name": "sim_fidelity", "requests": len(specs), "rate": args.rate,
        "policy": sched.policy.name, "cost_model": cm.source,
        "latency_error_pct": round(100 * statistics.mean(lat_err), 1),
        "ttft_error_pct": round(100 * statistics.mean(ttft_err), 1),
        "mean_latency_real_s": round(statistics.mean(v[0] for v in real.values()), 3),
        "mean_latency_sim_s": round(statistics.mean(v[0] for v in sim.values()), 3),
        "signed_latency_error_pct": round(100 * statistics.mean(
            (sim[k][0] - v[0]) / v[0] for k, v in real.items()), 1),
    }))


if __name__ == "__main__":
    main()
