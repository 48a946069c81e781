"""The host's work in a decode step outside the model: scheduling, input building, sampling
bookkeeping and output handling, at N running requests.

On a GPU the model runs asynchronously and this work is what the host must finish within a
step's device time (with launch-ahead it overlaps the device; without, the device waits for
it). Here it is measured on any machine: a tiny random Llama (bench/random_model.py) runs
every step for real, on the CPU, and the time spent inside the model's forward and
vocabulary projection, and in the sampler's tensor math (device work on a GPU), is subtracted
from each step's wall time. With --stub-model the model returns fixed tensors instead, as
a GPU host sees it (the CPU model's cache traffic and threads slow the host's own work down
by a third here). One JSON line per N.

    python bench/host_overhead.py --running 64 256 512 [--stub-model] [--launch-ahead]
    python bench/host_overhead.py --fill-blocks 4 32 64 [--fill-chunk 512]  # fill alone
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from random_model import write_random_model  # noqa: E402
from throughput import commit  # noqa: E402


def measure(model_dir: Path, running: int, steps: int, policy: str, launch_ahead: bool,
            stub_model: bool = False) -> dict:
    import torch

    from llmdb.engine.compute import run_on_compute_thread
    from llmdb.engine.engine import LLMEngine
    from llmdb.engine.params import SamplingParams

    kwargs = {"launch_ahead": launch_ahead} if launch_ahead else {}  # (older engines lack it)
    engine = LLMEngine(str(model_dir), device="cpu", dtype="fp32", kv_cache_bytes=512 << 20,
                       max_num_seqs=max(running, 1), policy=policy, **kwargs)
    rng = random.Random(0)
    vocab = engine.config.vocab_size
    params = SamplingParams(max_tokens=steps + 10, ignore_eos=True)
    for _ in range(running):
        engine.add_request([rng.randrange(3, vocab) for _ in range(rng.randrange(20, 60))],
                           params)
    while any(not r.is_decode for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefills done: every step from here is `running` decodes
    model, runner = engine.model, engine.runner
    inside = {"model": 0.0, "sampling": 0.0}

    def timed(fn, what):
        def run(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                inside[what] += time.perf_counter() - t
        return run

    forward, logits = runner.forward, model.logits
    if stub_model:  # what a GPU host sees: the model costs the host (almost) nothing
        hidden = torch.zeros(running, engine.config.hidden_size)
        scores = torch.randn(running, vocab, generator=torch.Generator().manual_seed(0))

        def forward(inputs):
            return hidden[: inputs.input_ids.shape[0]]

        def logits(h):
            return scores[: h.shape[0]]

    runner.forward, model.logits = timed(forward, "model"), timed(logits, "model")
    # The sampler's tensor math (an argmax over the vocabulary per row) is device work on a
    # GPU but runs inline here: timed apart, so what is left is the host's own work.
    runner_module = sys.modules[type(runner).__module__]
    sample = runner_module.sample
    runner_module.sample = timed(sample, "sampling")

    def loop() -> list[float]:  # on the compute thread, as engine.step() runs it
        host = []
        for _ in range(steps):
            t, before = time.perf_counter(), sum(inside.values())
            engine._step()
            host.append(time.perf_counter() - t - (sum(inside.values()) - before))
        return host

    try:
        host = run_on_compute_thread(loop)
    finally:
        runner_module.sample = sample  # (the next N's engine wraps it afresh)
    return {"name": "host_overhead", "running": running, "steps": steps, "policy": policy,
            "launch_ahead": launch_ahead, "model": "stub" if stub_model else "tiny-llama",
            "host_ms_per_step": round(1000 * statistics.mean(host), 3),
            # The median shrugs off the VM's hiccups (a step of 5x the others now and then).
            "host_ms_per_step_median": round(1000 * statistics.median(host), 3),
            "sampling_ms_per_step": round(1000 * inside["sampling"] / steps, 3),
            "model_ms_per_step": round(1000 * inside["model"] / steps, 3),
            "threads": torch.get_num_threads(), "commit": commit()}


def measure_fill(running: int, blocks: int, chunk: int = 0, repeats: int = 500) -> dict:
    """StepBuffers.fill alone for `running` decodes over about `blocks` blocks each, and a
    prefill chunk of `chunk` tokens (a mixed step) if chunk > 0."""
    import torch

    from llmdb.engine.step_inputs import StepBuffers

    bs = 16
    n = running + (chunk > 0)
    buffers = StepBuffers(torch.device("cpu"), running + chunk, n, 4 * blocks + chunk // bs + 1)
    rng = random.Random(0)
    starts = [rng.randrange(blocks * bs // 2, blocks * bs * 3 // 2) for _ in range(running)]
    qlens = [1] * running
    if chunk:
        starts.append(0)
        qlens.append(chunk)
    tables = [list(range(i * 4 * blocks, i * 4 * blocks + (s + q) // bs + 1))
              for i, (s, q) in enumerate(zip(starts, qlens, strict=True))]
    args = ([5] * sum(qlens), qlens, starts, [f"r{i}" for i in range(n)], tables, [], bs)
    for _ in range(10):
        buffers.fill(*args)
    t = time.perf_counter()
    for _ in range(repeats):
        buffers.fill(*args)
    return {"name": "host_overhead_fill", "running": running, "blocks_per_seq": blocks,
            "prefill_chunk": chunk, "fill_us": round(1e6 * (time.perf_counter() - t) / repeats, 1),
            "commit": commit()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--running", type=int, nargs="+", default=[64, 256, 512])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--policy", default="sarathi")
    ap.add_argument("--launch-ahead", action="store_true",
                    help="the GPU's way: read each step after launching the next")
    ap.add_argument("--stub-model", action="store_true",
                    help="replace the model's forward and logits by fixed tensors: the host's "
                         "work without the CPU model's caches and threads in its way")
    ap.add_argument("--fill-blocks", type=int, nargs="+",
                    help="time StepBuffers.fill alone at these blocks per sequence instead")
    ap.add_argument("--fill-chunk", type=int, default=0,
                    help="with --fill-blocks: a prefill chunk of this many tokens joins the "
                         "decodes (a mixed step)")
    args = ap.parse_args(argv)
    import torch

    if args.fill_blocks:
        for blocks in args.fill_blocks:
            for n in args.running:
                print(json.dumps(measure_fill(n, blocks, args.fill_chunk)), flush=True)
        return 0

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_random_model("tiny-llama", Path(tmp) / "m", dtype=torch.float32,
                                       device="cpu")
        for n in args.running:
            print(json.dumps(measure(model_dir, n, args.steps, args.policy,
                                     args.launch_ahead, args.stub_model)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
