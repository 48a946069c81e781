"""The C++ CPU attention kernel alone (kernels/csrc/row_attention.cpp): prefill rows and
decodes at a model's head shape, GFLOP/s of its two products (Q x K and P x V). One JSON line
per case.

    python bench/cpu_attention.py [--heads 9 --kv-heads 3 --dim 64] [--dtype fp32|bf16]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from throughput import commit  # noqa: E402

from llmdb.kernels import cpu_ext  # noqa: E402

BLOCK = 16
# (name, each query row's visible keys): rows of one sequence's prompt, or decodes.
CASES = [
    ("prefill_1024_causal", list(range(1, 1025))),
    ("chunk_1024_over_500_cached", [500 + i for i in range(1, 1025)]),
    ("decode_12_over_200", [200] * 12),
    ("decode_32_over_2000", [2000] * 32),
]


def measure(name: str, ctx: list[int], heads: int, kv_heads: int, dim: int,
            dtype: torch.dtype, repeats: int) -> dict:
    torch.manual_seed(0)
    blocks = -(-max(ctx) // BLOCK)
    k, v = (torch.randn(blocks * BLOCK, kv_heads, dim).to(dtype) for _ in range(2))
    q = torch.randn(len(ctx), heads, dim).to(dtype)
    # Every row reads one sequence's blocks (a prompt's rows; decodes of one cached prefix).
    tables = torch.arange(blocks, dtype=torch.int64).repeat(len(ctx), 1)
    lens = torch.tensor(ctx, dtype=torch.int64)
    out = torch.empty_like(q)

    def run() -> None:
        cpu_ext.row_attention(q, k, v, tables, lens, BLOCK, dim ** -0.5, out)

    run()
    t = time.perf_counter()
    for _ in range(repeats):
        run()
    seconds = (time.perf_counter() - t) / repeats
    return {"name": "cpu_attention", "case": name, "ms": round(1000 * seconds, 3),
            "gflop_per_s": round(4 * sum(ctx) * heads * dim / seconds / 1e9, 1),
            "heads": heads, "kv_heads": kv_heads, "dim": dim, "dtype": str(dtype)[6:],
            "threads": torch.get_num_threads(), "commit": commit()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=9)  # SmolLM2-135M's shape
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args(argv)
    if cpu_ext.load_library() is None:
        print("no C++ compiler: the kernel cannot be built here", file=sys.stderr)
        return 1
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    for name, ctx in CASES:
        print(json.dumps(measure(name, ctx, args.heads, args.kv_heads, args.dim, dtype,
                                 args.repeats)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
