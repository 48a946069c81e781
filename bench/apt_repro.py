"""Apt-Serve's evaluation (OPT-13B on one A100-40GB) in the simulator, beside the paper's numbers.

Prints one JSON object per result line, then readable tables:
- Figure 8: effective throughput (the highest request rate with >= 90% of requests meeting
  both TTFT and P99 TBT SLOs, by bisection) of vLLM-style FCFS and of Apt-Serve on ShareGPT,
  HumanEval and LongBench, and their ratio (the paper: 2.3x, 1.7x, 2.8x, averaged over
  OPT-13B/30B/66B);
- ablations: the effective throughput of the hybrid cache alone (vLLM's FCFS on the hybrid
  cache), adaptive scheduling alone (apt on a KV-only cache) and both (apt);
- Table 4 (apt on a KV-only vs the hybrid cache) and Table 5 (FCFS vs adaptive scheduling,
  both on the hybrid cache) at the paper's rates and Gamma CVs, and again at the same
  multiples of our vLLM's effective throughput as the paper's rates are of its vLLM's on
  ShareGPT (2.6 req/s, its Fig. 2a): 3 / 2.6 and 6 / 2.6.

Setup (bench/policies.py's opt13b-a100): the opt13b-a100 cost model, 12 GB of cache (915
blocks of 16 tokens), hidden cache at half the KV bytes, vLLM 0.5.0's C = P = 2,048 and 256
sequences, Apt-Serve's SLOs per dataset (Table 3), 1,000 requests per trace (Sec. 6.2).
Attainment is counted as Apt-Serve's client counts it: a request meets its SLOs when its TTFT
and the 99th percentile of its gaps after the first token are within them, over all requests.

`--quick` runs 300 requests and fewer bisection steps (a minute or so on two cores).
`--output-scale S` and `--eos-mean N` shorten every output as an EOS before max_tokens would
(workloads.early_eos; prompts kept, the reference length the cap): a sensitivity analysis of
the paper's unstated output lengths, off by default (the traces generate the references).
Each effective-throughput line also gives, at the 90% rate and over the busy time, the
generated tokens/s (the preset's per-request term caps decode at 1 / (n_decode + tokens) =
~573 tokens/s), the share of step time in that term, and the share of the cache in use:
which of the two binds.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from policies import setup  # noqa: E402

from llmdb.engine.costmodel import load_cost_model  # noqa: E402
from llmdb.engine.research.sim import simulate  # noqa: E402
from llmdb.engine.research.workloads import (  # noqa: E402
    EarlyEos,
    RequestSpec,
    dataset,
    early_eos,
)

ROOT = Path(__file__).resolve().parent.parent
PRESET = "opt13b-a100"
DATASETS = ("sharegpt", "humaneval", "longbench")

# Each variant: (policy, hybrid cache?).
VARIANTS = {
    "vllm": ("fcfs", False),  # vLLM 0.5.0: FCFS, prefill first, no chunking, KV cache only
    "fcfs-hybrid": ("fcfs-hybrid", True),  # the hybrid cache alone (Table 5's "FCFS")
    "apt-kv": ("apt", False),  # adaptive scheduling alone (Table 4's "KV Cache")
    "apt": ("apt", True),  # both: Apt-Serve
}

# The paper's figures. Fig. 8: apt over vLLM at 90% attainment, averaged over three models.
PAPER_FIG8 = {"sharegpt": 2.3, "humaneval": 1.7, "longbench": 2.8}
PAPER_VLLM_SHAREGPT_RATE = 2.6  # Sec. 3.1 / Fig. 2a: vLLM's 90% point on ShareGPT, OPT-13B
# Tables 4 and 5: (dataset, rate, CV) -> (KV cache, hybrid) and (FCFS, adaptive), in %.
PAPER_TABLE4 = {
    ("sharegpt", 3.0, 1): (99.5, 99.5), ("sharegpt", 3.0, 5): (94.7, 95.9),
    ("sharegpt", 3.0, 10): (75.1, 78.2), ("sharegpt", 6.0, 1): (65.7, 67.3),
    ("sharegpt", 6.0, 5): (66.7, 67.7), ("sharegpt", 6.0, 10): (57.1, 58.4),
    ("longbench", 1.5, 1): (96.6, 98.2), ("longbench", 1.5, 5): (70.0, 76.0),
    ("longbench", 1.5, 10): (43.4, 50.8), ("longbench", 3.0, 1): (70.0, 77.6),
    ("longbench", 3.0, 5): (58.8, 64.8), ("longbench", 3.0, 10): (35.6, 42.5),
}
PAPER_TABLE5 = {
    ("sharegpt", 3.0, 1): (26.4, 99.5), ("sharegpt", 3.0, 5): (59.7, 95.9),
    ("sharegpt", 3.0, 10): (11.9, 78.2), ("sharegpt", 6.0, 1): (20.0, 67.3),
    ("sharegpt", 6.0, 5): (18.1, 67.7), ("sharegpt", 6.0, 10): (9.9, 58.4),
    ("longbench", 1.5, 1): (11.8, 98.2), ("longbench", 1.5, 5): (10.8, 76.0),
    ("longbench", 1.5, 10): (5.4, 50.8), ("longbench", 3.0, 1): (4.8, 77.6),
    ("longbench", 3.0, 5): (4.6, 64.8), ("longbench", 3.0, 10): (4.2, 42.5),
}
PAPER_RATES = {"sharegpt": (3.0, 6.0), "longbench": (1.5, 3.0)}
CVS = (1, 5, 10)
TARGET = 0.9
REFERENCE = EarlyEos()  # outputs the datasets' reference lengths (the default)


def trace(workload: str, rate: float, cv: float, requests: int, seed: int,
          eos: EarlyEos) -> list[RequestSpec]:
    """The requests every variant runs at this rate: the dataset's, outputs shortened by eos."""
    _, context, _ = setup(PRESET, workload)
    specs = dataset(workload, requests, rate, cv=cv, context=context, seed=seed)
    return early_eos(specs, eos, seed)


def attainment(variant: str, workload: str, rate: float, cv: float, requests: int,
               seed: int, eos: EarlyEos = REFERENCE) -> dict:
    """One simulated trace: SLO attainment and its TTFT and P99 TBT parts; and, over the
    time the engine is busy (a step's end to the next's while it holds blocks), the
    generated tokens/s, the share of step time in the per-request term and the share of the
    cache in use: which of the decode cap and memory binds."""
    policy, hybrid = VARIANTS[variant]
    cfg, _, (ttft, tbt) = setup(PRESET, workload)
    if not hybrid:
        cfg = replace(cfg, hidden_ratio=None)
    cm = load_cost_model(PRESET)
    seqs = []  # requests in each step
    res = simulate(trace(workload, rate, cv, requests, seed, eos), policy, cm, cfg,
                   observe=lambda out: seqs.append(len(out.scheduled)))
    rs = res.requests
    busy = [(t1 - t0, blocks) for (t0, blocks), (t1, _) in itertools.pairwise(res.memory)
            if blocks]
    busy_s = sum(dt for dt, _ in busy) or float("inf")
    return {"attainment": res.attainment(ttft, tbt),
            "ttft_ok": sum(r.ttft <= ttft for r in rs) / len(rs),
            "tbt_ok": sum(r.finished and r.p99_tbt <= tbt for r in rs) / len(rs),
            "evictions": res.evictions,
            "busy_tokens_per_s": sum(len(r.token_times) for r in rs) / busy_s,
            # n_decode and n_prefill carry the same per-request term in this preset
            "per_request_share": sum(seqs) * cm.coefficients["n_decode"] / busy_s,
            "cache_used": sum(dt * b for dt, b in busy) / busy_s / cfg.num_blocks}


def effective_rate(variant: str, workload: str, requests: int, seed: int,
                   bisect_steps: int, eos: EarlyEos = REFERENCE, start: float = 0.25) -> dict:
    """The highest rate with attainment >= 90%: double from `start` to bracket it, then
    bisect. Returns the rate, the (rate, attainment) points seen, and what binds at that rate
    (attainment's busy-time figures)."""
    seen = {}
    lo, hi = 0.0, start
    while hi < 1e3:
        seen[hi] = attainment(variant, workload, hi, 1.0, requests, seed, eos)
        if seen[hi]["attainment"] < TARGET:
            break
        lo, hi = hi, hi * 2
    for _ in range(bisect_steps):
        mid = (lo + hi) / 2
        seen[mid] = attainment(variant, workload, mid, 1.0, requests, seed, eos)
        lo, hi = (mid, hi) if seen[mid]["attainment"] >= TARGET else (lo, mid)
    at = seen.get(lo, {})
    return {"variant": variant, "workload": workload, "rate_at_90": lo,
            **{f"{k}_at_90": round(at.get(k, 0.0), 3)
               for k in ("busy_tokens_per_s", "per_request_share", "cache_used")},
            "curve": [(round(r, 3), round(a["attainment"], 3)) for r, a in sorted(seen.items())]}


def _call(job: tuple) -> dict:
    fn, args = job
    return fn(*args)


def run_all(jobs: list[tuple], workers: int) -> list[dict]:
    if workers <= 1:
        return [_call(j) for j in jobs]
    with ProcessPoolExecutor(workers) as pool:
        return list(pool.map(_call, jobs))


def table_rows(kind: str, paper: dict, ours_rates: dict[str, tuple[float, float]],
               variants: tuple[str, str], requests: int, seed: int, workers: int,
               eos: EarlyEos) -> list[dict]:
    """Attainment of two variants at the paper's (dataset, rate, CV) points and at our
    scaled rates (the same multiples of our vLLM's effective throughput)."""
    points = []
    for (wl, rate, cv), ref in paper.items():
        k = PAPER_RATES[wl].index(rate)
        points.append((wl, rate, cv, "paper rate", ref))
        multiple = PAPER_RATES["sharegpt"][k] / PAPER_VLLM_SHAREGPT_RATE
        points.append((wl, ours_rates[wl][k], cv, f"scaled x{multiple:.2f}", ref))
    jobs = [(attainment, (v, wl, rate, cv, requests, seed, eos))
            for wl, rate, cv, _, _ in points for v in variants]
    results = iter(run_all(jobs, workers))
    rows = []
    for wl, rate, cv, which, ref in points:
        a, b = next(results), next(results)
        rows.append({"name": kind, "workload": wl, "rate": round(rate, 3), "cv": cv,
                     "rates": which, variants[0]: round(100 * a["attainment"], 1),
                     variants[1]: round(100 * b["attainment"], 1),
                     f"paper_{variants[0]}": ref[0], f"paper_{variants[1]}": ref[1],
                     f"{variants[0]}_ttft_ok": round(100 * a["ttft_ok"], 1),
                     f"{variants[0]}_tbt_ok": round(100 * a["tbt_ok"], 1),
                     f"{variants[1]}_ttft_ok": round(100 * b["ttft_ok"], 1),
                     f"{variants[1]}_tbt_ok": round(100 * b["tbt_ok"], 1)})
    return rows


def print_tables(eff: dict, t4: list[dict], t5: list[dict]) -> None:
    print("\nFigure 8 and ablations: req/s at 90% SLO attainment (OPT-13B, A100-40GB)")
    print(f"{'dataset':<10}" + "".join(f"{v:>13}" for v in VARIANTS)
          + f"{'apt/vllm':>10}{'paper':>7}")
    ratios = []
    for wl in DATASETS:
        r = {v: eff[(v, wl)]["rate_at_90"] for v in VARIANTS}
        ratio = r["apt"] / r["vllm"] if r["vllm"] else float("nan")
        ratios.append(ratio)
        print(f"{wl:<10}" + "".join(f"{r[v]:>13.3f}" for v in VARIANTS)
              + f"{ratio:>9.2f}x{PAPER_FIG8[wl]:>6.1f}x")
    print(f"{'mean':<10}" + " " * 13 * len(VARIANTS)
          + f"{sum(ratios) / len(ratios):>9.2f}x{sum(PAPER_FIG8.values()) / 3:>6.1f}x")
    for title, rows, (a, b) in (("Table 4: apt, KV-only vs hybrid cache (% attainment)", t4,
                                 ("apt-kv", "apt")),
                                ("Table 5: FCFS vs adaptive, hybrid cache (% attainment)", t5,
                                 ("fcfs-hybrid", "apt"))):
        print(f"\n{title}")
        print(f"{'dataset':<10}{'rates':<13}{'req/s':>7}{'CV':>4}{a:>13}{b:>9}"
              f"{'paper ' + a:>19}{'paper ' + b:>12}")
        for r in rows:
            print(f"{r['workload']:<10}{r['rates']:<13}{r['rate']:>7.3f}{r['cv']:>4}"
                  f"{r[a]:>13.1f}{r[b]:>9.1f}{r['paper_' + a]:>19.1f}{r['paper_' + b]:>12.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="300 requests a trace and 4 bisection steps (about a minute)")
    ap.add_argument("--requests", type=int, default=None, help="requests a trace (1,000)")
    ap.add_argument("--bisect-steps", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--output-scale", type=float, default=1.0,
                    help="outputs max(1, round(reference x S)) (sensitivity; default 1)")
    ap.add_argument("--eos-mean", type=float, default=None,
                    help="each token is EOS with probability 1/N, capped at the reference")
    args = ap.parse_args()
    eos = EarlyEos(args.output_scale, args.eos_mean)
    requests = args.requests or (300 if args.quick else 1000)
    steps = args.bisect_steps or (4 if args.quick else 6)
    t0 = time.perf_counter()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                            capture_output=True).stdout.strip()
    config = {"commit": commit, "preset": PRESET, "requests": requests, "seed": args.seed,
              "bisect_steps": steps, "output_scale": eos.scale, "eos_mean": eos.eos_mean}
    for wl in DATASETS:  # the lengths every variant sees (the same at every rate)
        specs = trace(wl, 1.0, 1.0, requests, args.seed, eos)
        ref = trace(wl, 1.0, 1.0, requests, args.seed, REFERENCE)
        print(json.dumps({"name": "trace", "workload": wl,
                          "prompt_mean": round(sum(s.prompt_len for s in specs) / requests, 1),
                          "output_mean": round(sum(s.output_len for s in specs) / requests, 1),
                          "reference_mean": round(sum(s.output_len for s in ref) / requests, 1),
                          "config": config}), flush=True)

    jobs = [(effective_rate, (v, wl, requests, args.seed, steps, eos))
            for wl in DATASETS for v in VARIANTS]
    eff = {}
    for res in run_all(jobs, args.workers):
        eff[(res["variant"], res["workload"])] = res
        print(json.dumps({"name": "effective_throughput", **res, "config": config}),
              flush=True)
    ratios = {}
    for wl in DATASETS:
        base = eff[("vllm", wl)]["rate_at_90"]
        ratios[wl] = {v: round(eff[(v, wl)]["rate_at_90"] / base, 2) if base else None
                      for v in VARIANTS if v != "vllm"}
        print(json.dumps({"name": "ratio_over_vllm", "workload": wl, **ratios[wl],
                          "paper_apt": PAPER_FIG8[wl]}), flush=True)
    mean = sum(r["apt"] for r in ratios.values()) / len(ratios)
    print(json.dumps({"name": "mean_apt_over_vllm", "ours": round(mean, 2),
                      "paper": round(sum(PAPER_FIG8.values()) / 3, 2)}), flush=True)

    scale = [r / PAPER_VLLM_SHAREGPT_RATE for r in PAPER_RATES["sharegpt"]]
    ours_rates = {wl: tuple(eff[("vllm", wl)]["rate_at_90"] * s for s in scale)
                  for wl in PAPER_RATES}
    t4 = table_rows("table4", PAPER_TABLE4, ours_rates, ("apt-kv", "apt"), requests,
                    args.seed, args.workers, eos)
    t5 = table_rows("table5", PAPER_TABLE5, ours_rates, ("fcfs-hybrid", "apt"), requests,
                    args.seed, args.workers, eos)
    for row in t4 + t5:
        print(json.dumps(row), flush=True)
    print_tables(eff, t4, t5)
    print(f"\nwall {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
