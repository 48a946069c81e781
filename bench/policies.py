"""SLO attainment vs request rate for every scheduling policy, in the simulator.

For a cost-model preset and a workload, each policy's effective throughput is the highest
request rate at which >= 90% of requests meet both SLOs (TTFT, and P99 TBT), found by
bisection; the attainment curves go to bench/out/<preset>-<workload>.png. Prints one JSON
line per policy and the apt/fcfs ratio (Apt-Serve reports 2.3x vLLM's effective throughput,
averaged over OPT-13B/30B/66B and three datasets).

Setups: opt13b-a100 = OPT-13B on one A100-40GB (12 GB of KV cache after 26 GB of weights,
hidden cache at half the KV bytes, Apt-Serve's SLOs per dataset, vLLM 0.5.0's C = P = 2,048
and 256 sequences); cpu = SmolLM2-135M on
this machine (2 GiB of KV cache, C = P = 1024, TTFT 1.0 s / P99 TBT 0.25 s, no hidden
cache: SmolLM2's hidden state is larger than its KV); llama2-7b-a100 = InferMax's setup
(M = 100K tokens, C = 4096, P = 512).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

from llmdb.engine.costmodel import load_cost_model
from llmdb.engine.research.sim import SimConfig, simulate
from llmdb.engine.research.workloads import dataset
from llmdb.engine.sched.policies import POLICIES

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"

# Apt-Serve's Table 3 (OPT-13B, A100-40GB): (TTFT, P99 TBT) per dataset.
APT_SLOS = {"sharegpt": (1.0, 1.0), "humaneval": (0.5, 0.5), "longbench": (4.0, 1.0),
            "lmsys": (1.0, 1.0)}
OPT13B_KV_BYTES_PER_TOKEN = 2 * 40 * 5120 * 2
VLLM_MAX_BATCHED_TOKENS, VLLM_MAX_NUM_SEQS = 2048, 256


def setup(preset: str, workload: str) -> tuple[SimConfig, int, tuple[float, float]]:
    """(config, context length, SLOs) for a preset and workload."""
    if preset == "opt13b-a100":
        ttft, tbt = APT_SLOS.get(workload, (1.0, 1.0))
        blocks = int(12e9 / OPT13B_KV_BYTES_PER_TOKEN) // 16
        # Apt-Serve and its vLLM baseline are vLLM 0.5.0.post1 (its repository's README)
        # with the defaults: no chunked prefill, so max_num_batched_tokens = max(max_model_len,
        # 2048) = 2048 for OPT's 2,048-token context, and max_num_seqs = 256.
        return SimConfig(num_blocks=blocks, max_num_batched_tokens=VLLM_MAX_BATCHED_TOKENS,
                         max_prefill_tokens=VLLM_MAX_BATCHED_TOKENS,
                         max_num_seqs=VLLM_MAX_NUM_SEQS, hidden_ratio=0.5, slo_ttft_s=ttft,
                         slo_tbt_s=tbt), 2048, (ttft, tbt)
    if preset == "cpu":
        blocks = (2 << 30) // (30 * 3 * 64 * 2 * 2) // 16
        return SimConfig(num_blocks=blocks, max_num_batched_tokens=1024, max_prefill_tokens=1024,
                         max_num_seqs=512, slo_ttft_s=1.0, slo_tbt_s=0.25), 8192, (1.0, 0.25)
    if preset == "llama2-7b-a100":
        return SimConfig(num_blocks=100_000 // 16, max_num_batched_tokens=4096,
                         max_prefill_tokens=512, slo_ttft_s=1.0, slo_tbt_s=1.0), 4096, (1.0, 1.0)
    raise ValueError(f"no setup for preset {preset!r}")


def attainment(policy: str, rate: float, args, cfg, context, slos, cm) -> float:
    specs = dataset(args.workload, args.requests, rate, cv=args.cv, context=context,
                    seed=args.seed)
    return simulate(specs, policy, cm, cfg).attainment(*slos)


def effective_rate(policy: str, args, cfg, context, slos, cm) -> tuple[float, list]:
    """Highest rate with attainment >= 0.9 (bisection after doubling to bracket it)."""
    seen = []
    lo, hi = 0.0, args.start_rate
    while True:
        a = attainment(policy, hi, args, cfg, context, slos, cm)
        seen.append((hi, a))
        if a < 0.9 or hi > 1e4:
            break
        lo, hi = hi, hi * 2
    for _ in range(args.bisect_steps):
        mid = (lo + hi) / 2
        a = attainment(policy, mid, args, cfg, context, slos, cm)
        seen.append((mid, a))
        lo, hi = (mid, hi) if a >= 0.9 else (lo, mid)
    return lo, sorted(seen)


def plot(curves: dict[str, list], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy, pts in curves.items():
        ax.plot([r for r, _ in pts], [a * 100 for _, a in pts], marker="o", label=policy)
    ax.axhline(90, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="opt13b-a100",
                    choices=["opt13b-a100", "cpu", "llama2-7b-a100"])
    ap.add_argument("--workload", default="sharegpt",
                    choices=["sharegpt", "lmsys", "longbench", "humaneval"])
    ap.add_argument("--policy", action="append", choices=sorted(POLICIES))
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--cv", type=float, default=1.0, help="arrival burstiness (1 = Poisson)")
    ap.add_argument("--start-rate", type=float, default=0.5)
    ap.add_argument("--bisect-steps", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    cm = load_cost_model(args.preset)
    cfg, context, slos = setup(args.preset, args.workload)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                            capture_output=True).stdout.strip()
    config = {"commit": commit, "requests": args.requests, "cv": args.cv, "seed": args.seed,
              "num_blocks": cfg.num_blocks, "C": cfg.max_num_batched_tokens,
              "P": cfg.max_prefill_tokens, "cost_model": cm.source}
    rates, curves = {}, {}
    for policy in args.policy or sorted(POLICIES):
        t0 = time.perf_counter()
        rate, curves[policy] = effective_rate(policy, args, cfg, context, slos, cm)
        rates[policy] = rate
        print(json.dumps({"name": "effective_throughput", "preset": args.preset,
                          "workload": args.workload, "policy": policy,
                          "rate_at_90": round(rate, 3), "slo_ttft_s": slos[0],
                          "slo_tbt_s": slos[1], "wall_s": round(time.perf_counter() - t0, 1),
                          "config": config}), flush=True)
    if "apt" in rates and "fcfs" in rates:
        print(json.dumps({"name": "effective_throughput_ratio", "preset": args.preset,
                          "workload": args.workload,
                          "apt_over_fcfs": round(rates["apt"] / rates["fcfs"], 2)
                          if rates["fcfs"] > 0 else None}))
    png = OUT / f"{args.preset}-{args.workload}.png"
    if plot(curves, png, f"{args.preset}, {args.workload}: SLO attainment vs rate"):
        print(json.dumps({"name": "plot", "path": str(png.relative_to(ROOT))}))


if __name__ == "__main__":
    main()
