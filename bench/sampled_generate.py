"""Generation with sampling against greedy, on the engine alone: what `temperature := 0.7`
(or top-p, top-k) costs a job. One JSON line per mode.

    python bench/sampled_generate.py [--rows 256] [--max-tokens 32] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput import commit  # noqa: E402

MODES = {
    "greedy": {},
    "t=0.7": {"temperature": 0.7},
    "t=0.7,top_p=0.9": {"temperature": 0.7, "top_p": 0.9},
    "t=1.0,top_k=50": {"temperature": 1.0, "top_k": 50},
    "t=1.0": {"temperature": 1.0},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()

    from llmdb.engine.engine import LLMEngine
    from llmdb.engine.params import SamplingParams

    engine = LLMEngine("smollm2-135m", device=args.device)
    prompts = [[{"role": "user", "content": f"Write a sentence about the number {i}."}]
               for i in range(args.rows)]
    engine.generate(prompts[:8], SamplingParams(max_tokens=4))  # warm-up
    for mode, options in MODES.items():
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, seed=1, **options)
        t0 = time.perf_counter()
        engine.generate(prompts, params)
        elapsed = time.perf_counter() - t0
        print(json.dumps({"name": "sampled_generate", "mode": mode, "commit": commit(),
                          "rows": args.rows, "max_tokens": args.max_tokens,
                          "elapsed_s": round(elapsed, 2),
                          "gen_tok_per_s": round(args.rows * args.max_tokens / elapsed, 1),
                          "device": str(engine.device), "dtype": str(engine.dtype)}),
              flush=True)


if __name__ == "__main__":
    main()
