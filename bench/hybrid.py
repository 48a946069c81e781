"""The hybrid KV/hidden cache (Apt-Serve) on the real engine, KV-only vs hybrid.

Two measurements, each one JSON line per result, on OPT shapes with seeded random weights
(bench/random_model.py; the directories are written once under --models and reused):

capacity: under one fixed cache budget, `--capacity-requests` requests of about `--prompt`
  + `--output` tokens (each uniform over half to 1.5 times) are submitted at once, KV-only
  vs hybrid under two policies: apt (its knapsack weighs re-projection time against memory
  with the engine's cost model) and vLLM's FCFS, whose hybrid form (fcfs-hybrid) admits a
  request as hidden states when its K/V do not fit; apt with rho taken as 0, so that
  memory alone decides; and FCFS with every request in hidden form (fcfs_all_hidden): the
  concurrency the hybrid cache allows, in the same admission order as fcfs_kv.
  From the first step after which the next waiting request does not fit, the mean number of
  requests running over `--steps` steps is the concurrency at saturation; the line also gives
  the tokens held and the share of running requests in hidden form. Default: the OPT-1.3B
  shape, 128 MiB of cache. On a CPU re-projection is dear (the estimated rho for OPT-125m is
  0.1 ms a token, against a ~40 ms decode step), so apt rightly keeps most requests in KV
  form there.

slo: SLO attainment vs request rate on --slo-shape (OPT-125m): ShareGPT-like lengths (lognormal
  with the published means and deviations, times --scale, so that a 2-core CPU serves them at
  a few requests a second), Poisson arrivals, every request RT with the stated SLOs (CPU
  scale: DESIGN.md's TTFT 1.0 s, P99 TBT 0.25 s), apt with the hybrid cache vs fcfs with KV
  only (vLLM's policy), under a cache budget that holds about --cache-requests average
  requests in KV form (or --slo-cache-mb). One line per (policy, rate, trace), with --seeds
  N > 1 a mean line per (policy, rate) over N traces (their arrivals and lengths drawn from
  seeds --seed to --seed + N - 1), then each policy's effective throughput (the highest rate
  whose mean attainment is >= 90%, interpolated between measured rates) and the ratio.

On a GPU (--device cuda) use the OPT-13B shape, an A100-40GB's 12 GB of cache and, for the
SLO sweep, ShareGPT's full lengths with Apt-Serve's SLOs for it (Table 3: TTFT 1 s, P99 TBT
1 s), one policy a call where a call's time is limited:
  python bench/hybrid.py --device cuda --only capacity --shape opt-13b --cache-mb 12000 \
      --capacity-requests 256 --prompt 96 --output 96
  python bench/hybrid.py --device cuda --only slo --slo-shape opt-13b --slo-cache-mb 12000 \
      --scale 1 --ttft 1 --tbt 1 --rates 1 2 3 4 6 --slo-requests 100 --policies fcfs
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import threading
import time
from pathlib import Path

import numpy as np
import torch

from llmdb.engine.device import default_dtype, resolve_device
from llmdb.engine.engine import LLMEngine
from llmdb.engine.params import SamplingParams
from llmdb.engine.research.workloads import LENGTHS, arrivals, lognormal

ROOT = Path(__file__).resolve().parent
TARGET = 0.9


def model_dir(shape: str, root: Path) -> Path:
    from random_model import write_random_model

    # (drawn on the GPU where there is one: a 13B shape's weights in seconds, not minutes)
    return write_random_model(shape, root / shape, seed=0, dtype=torch.bfloat16)


def free_device_memory() -> None:
    """An engine's weights and pool, gone before the next engine is made: two 13B engines do
    not fit one GPU (the runner and its CUDA graphs hold each other, so gc must run)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def kv_bytes_per_token(shape: str, device: str) -> int:
    """K and V of one token over all layers, in the dtype the engine takes on `device` (bf16
    on GPUs and bf16 CPUs, fp32 on other CPUs)."""
    from random_model import SHAPES

    s = SHAPES[shape]
    itemsize = torch.empty(0, dtype=default_dtype(resolve_device(device))).element_size()
    return 2 * s.layers * s.kv_heads * s.dim * itemsize


def engine(path: Path, args, policy: str, hidden: bool, cache_bytes: int) -> LLMEngine:
    return LLMEngine(str(path), device=args.device, kv_cache_bytes=cache_bytes, policy=policy,
                     hidden_cache=hidden, max_num_seqs=256,
                     rt_slo_ttft_s=args.ttft, rt_slo_tbt_s=args.tbt)


# ---- capacity ---------------------------------------------------------------------------------

# mode: (policy, hidden cache on, re-projection weighed by the cost model's rho, every request
# in hidden form). fcfs_all_hidden against fcfs_kv is the cache's capacity alone: the same
# admission order, each request in one form or the other; apt's knapsack also chooses which
# requests run, and under scarcer memory it keeps the ones with the least memory.
CAPACITY_MODES = {"apt_kv": ("apt", False, True, False), "apt_hybrid": ("apt", True, True, False),
                  "apt_hybrid_memory_only": ("apt", True, False, False),
                  "fcfs_kv": ("fcfs", False, True, False),
                  "fcfs_hybrid": ("fcfs-hybrid", True, True, False),
                  "fcfs_all_hidden": ("fcfs", True, True, True)}
# ratio: (hybrid mode, its KV-only baseline)
CAPACITY_RATIOS = {"apt": ("apt_hybrid", "apt_kv"),
                   "apt_memory_only": ("apt_hybrid_memory_only", "apt_kv"),
                   "fcfs": ("fcfs_hybrid", "fcfs_kv"),
                   "fcfs_all_hidden": ("fcfs_all_hidden", "fcfs_kv")}


def capacity(path: Path, args, mode: str) -> dict:
    policy, hidden, with_rho, all_hidden = CAPACITY_MODES[mode]
    eng = engine(path, args, policy, hidden, args.cache_mb << 20)
    if not with_rho:  # the knapsack sees re-projection as free: memory alone decides
        cm = eng.scheduler.cost_model
        eng.scheduler.cost_model = dataclasses.replace(
            cm, coefficients={**cm.coefficients, "hidden_tokens": 0.0})
    rng = np.random.default_rng(args.seed)
    vocab = eng.config.vocab_size
    # Every prompt starts with the same tokens, as the rows of one SQL call share its
    # template's instruction (--shared-prefix; 0: none).
    shared = rng.integers(4, vocab, args.shared_prefix).tolist()
    # Lengths spread over [x/2, 3x/2] so that requests finish at different steps and the
    # pool stays full (a batch of equal requests fills and drains in waves).
    for _ in range(args.capacity_requests):
        prompt = int(rng.integers(args.prompt // 2, args.prompt * 3 // 2 + 1))
        output = int(rng.integers(args.output // 2, args.output * 3 // 2 + 1))
        rid = eng.add_request(shared + rng.integers(4, vocab, prompt).tolist(),
                              SamplingParams(max_tokens=output, ignore_eos=True))
        if all_hidden:  # fcfs keeps a request's cache type, preempted and readmitted too
            eng._requests[rid].cache_type = "hidden"
    running, tokens, hidden_share = [], [], []
    saturated = False
    t0 = time.perf_counter()
    while eng.has_unfinished and len(running) < args.steps:
        eng.step()
        s = eng.scheduler
        # Saturated from the first step after which the next waiting request does not fit.
        saturated = saturated or bool(s.waiting) and not s.fits(
            s.waiting[0], s.tokens_left(s.waiting[0]))
        if not saturated:
            continue
        running.append(len(s.running))
        tokens.append(sum(r.num_computed for r in s.running))
        hidden_share.append(sum(r.cache_type == "hidden" for r in s.running)
                            / max(1, len(s.running)))
    return {
        "name": "hybrid_capacity", "mode": mode, "shape": args.shape,
        "cache_mb": args.cache_mb, "kv_blocks": eng.pool.num_blocks,
        "requests": args.capacity_requests, "shared_prefix": args.shared_prefix,
        "prompt": args.prompt, "output": args.output,
        "steps": len(running), "mean_running": round(statistics.mean(running), 2),
        "max_running": max(running), "mean_tokens_held": round(statistics.mean(tokens)),
        "hidden_share": round(statistics.mean(hidden_share), 3),
        "s_per_step": round((time.perf_counter() - t0) / max(1, eng.runner.steps), 3),
        "device": eng.describe()["device"], "dtype": eng.describe()["dtype"],
    }


# ---- SLO attainment vs rate -----------------------------------------------------------------

def workload(n: int, rate: float, scale: float, seed: int, context: int):
    p_mean, p_std, o_mean, o_std = LENGTHS["sharegpt"]
    rng = np.random.default_rng(seed)
    times = arrivals(rng, rate, n)
    prompts = np.clip(np.round(lognormal(rng, p_mean * scale, p_std * scale, n)), 4, context // 2)
    outputs = np.clip(np.round(lognormal(rng, o_mean * scale, o_std * scale, n)), 1, context // 2)
    return [(float(t), int(p), int(o)) for t, p, o in zip(times, prompts, outputs, strict=True)]


def attainment(eng: LLMEngine, specs, args, seed: int) -> dict:
    """Each request submitted at its arrival time to the engine's background loop; a request
    attains when its TTFT and the P99 of its gaps between tokens meet the SLOs."""
    rng = np.random.default_rng(seed + 1)
    vocab = eng.config.vocab_size
    times: dict[int, list[float]] = {}
    lock = threading.Lock()

    def on_token(k: int):
        def record(tok):
            if tok is not None:
                with lock:
                    times[k].append(time.perf_counter())
        return record

    eng.start_background_loop()
    start = time.perf_counter()
    ids, arrived = [], []
    for k, (t, p, o) in enumerate(specs):
        delay = start + t - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        times[k] = []
        arrived.append(time.perf_counter())
        ids.append(eng.add_request(rng.integers(4, vocab, p).tolist(),
                                   SamplingParams(max_tokens=o, ignore_eos=True),
                                   on_token=on_token(k), priority="RT"))
    for rid in ids:
        eng.wait(rid)
    eng.stop_background_loop()
    ok, late, slow, max_gap = [], 0, 0, 0.0
    for k, t0 in enumerate(arrived):
        ts = times[k]
        gaps = np.diff(ts)
        p99 = float(np.percentile(gaps, 99)) if len(gaps) else 0.0
        max_gap = max(max_gap, float(gaps.max(initial=0.0)))
        late += not ts or ts[0] - t0 > args.ttft
        slow += p99 > args.tbt
        ok.append(bool(ts) and ts[0] - t0 <= args.ttft and p99 <= args.tbt)
    # Which SLO the misses broke, and the longest stall between two tokens of a request.
    return {"attainment": round(sum(ok) / len(ok), 3), "missed_ttft": late,
            "missed_tbt": slow, "max_gap_s": round(max_gap, 3),
            "mean_ttft_s": round(statistics.mean(times[k][0] - a for k, a in enumerate(arrived)
                                                 if times[k]), 3)}


def effective_throughput(points: list[tuple[float, float]]) -> float:
    """The highest rate at which attainment >= 90%, linear between measured rates."""
    points = sorted(points)
    best = 0.0
    for (r0, a0), (r1, a1) in zip([(0.0, 1.0), *points], points, strict=False):
        if a1 >= TARGET:
            best = r1
        elif a0 >= TARGET:
            return r0 + (r1 - r0) * (a0 - TARGET) / (a0 - a1)
        else:
            break
    return best


SLO_POLICIES = {"fcfs": False, "apt": True}  # policy: the hidden cache on


def slo_sweep(path: Path, args) -> None:
    if args.slo_cache_mb is not None:
        cache = args.slo_cache_mb << 20
    else:  # about --cache-requests average requests (a whole prompt, half the output)
        tokens = (LENGTHS["sharegpt"][0] + LENGTHS["sharegpt"][2] / 2) * args.scale
        per_token = kv_bytes_per_token(args.slo_shape, args.device)
        cache = int(args.cache_requests * tokens * per_token)
    results = {}
    for policy in args.policies:
        hidden = SLO_POLICIES[policy]
        eng = engine(path, args, policy, hidden, cache)
        eng.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=2))  # warm up
        points = []
        for rate in args.rates:
            # Near the knee one cascade of preemptions decides a trace (one seed's point
            # moved 52-87% between runs): the curve is the mean over --seeds traces.
            got = []
            for seed in range(args.seed, args.seed + args.seeds):
                specs = workload(args.slo_requests, rate, args.scale, seed,
                                 eng.config.max_context)
                res = attainment(eng, specs, args, seed)
                got.append(res["attainment"])
                print(json.dumps({"name": "hybrid_slo", "policy": policy,
                                  "hidden_cache": hidden, "rate": rate, "seed": seed, **res,
                                  "requests": len(specs), "scale": args.scale,
                                  "slo_ttft_s": args.ttft, "slo_tbt_s": args.tbt,
                                  "cache_mb": round(cache / 2**20, 1), "shape": args.slo_shape,
                                  "device": eng.describe()["device"]}), flush=True)
            mean = statistics.mean(got)
            points.append((rate, mean))
            if args.seeds > 1:
                print(json.dumps({"name": "hybrid_slo_mean", "policy": policy, "rate": rate,
                                  "seeds": args.seeds, "attainment": round(mean, 3),
                                  "min": min(got), "max": max(got)}), flush=True)
        results[policy] = effective_throughput(points)
        del eng
        free_device_memory()
    line = {"name": "hybrid_slo_effective_throughput", "shape": args.slo_shape,
            **{f"{p}_req_s": round(r, 3) for p, r in results.items()}}
    if results.get("fcfs") and "apt" in results:
        line["ratio"] = round(results["apt"] / results["fcfs"], 2)
    print(json.dumps(line))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["capacity", "slo"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--models", type=Path, default=ROOT / "out" / "models")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shape", default="opt-1.3b", help="capacity: the model shape")
    ap.add_argument("--cache-mb", type=int, default=128, help="capacity: the cache budget")
    ap.add_argument("--modes", nargs="+", choices=list(CAPACITY_MODES),
                    default=list(CAPACITY_MODES), help="capacity: the modes to run")
    ap.add_argument("--capacity-requests", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=64, help="capacity: each prompt's own tokens")
    ap.add_argument("--shared-prefix", type=int, default=0,
                    help="capacity: tokens every prompt starts with (a SQL template's)")
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--scale", type=float, default=0.25, help="slo: ShareGPT lengths times")
    ap.add_argument("--cache-requests", type=float, default=24)
    ap.add_argument("--slo-requests", type=int, default=150)
    ap.add_argument("--seeds", type=int, default=1,
                    help="slo: traces a point (seeds --seed on), attainment their mean")
    ap.add_argument("--rates", type=float, nargs="+", default=[4.0, 8.0, 12.0, 16.0, 24.0])
    ap.add_argument("--ttft", type=float, default=1.0)
    ap.add_argument("--tbt", type=float, default=0.25)
    ap.add_argument("--slo-shape", default="opt-125m", help="slo: the model shape")
    ap.add_argument("--slo-cache-mb", type=int, default=None,
                    help="slo: the cache budget (default: from --cache-requests)")
    ap.add_argument("--policies", nargs="+", choices=list(SLO_POLICIES),
                    default=list(SLO_POLICIES), help="slo: the policies to sweep")
    args = ap.parse_args(argv)
    if args.only in (None, "capacity"):
        path = model_dir(args.shape, args.models)
        running = {}
        for mode in args.modes:
            line = capacity(path, args, mode)
            free_device_memory()
            running[mode] = line["mean_running"]
            print(json.dumps(line), flush=True)
        ratios = {name: round(running[hybrid] / running[kv], 2)
                  for name, (hybrid, kv) in CAPACITY_RATIOS.items()
                  if hybrid in running and kv in running}
        print(json.dumps({"name": "hybrid_capacity_ratio", "shape": args.shape, **ratios}))
    if args.only in (None, "slo"):
        slo_sweep(model_dir(args.slo_shape, args.models), args)


if __name__ == "__main__":
    main()
