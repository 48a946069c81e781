"""Engine throughput on the standard workload: 400 chat prompts x 64 greedy tokens.

Each engine runs in its own subprocess so that its peak RSS (children included) is measured.
Prints one JSON line per engine. Peers (--peer llama_cpp|transformers|vllm) run from the
.venv-peers environment that bench/peers/setup.sh builds, on the same token ids, and get the
same weights: the GGUF dequantized by our loader and exported as a bf16 HF directory.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEERS_PY = ROOT / ".venv-peers" / "bin" / "python"
sys.path.insert(0, str(ROOT / "bench"))

from workload import review_messages  # noqa: E402


def commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                       text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_llmdb(prompts_file: str, max_tokens: int, dtype: str | None, threads: int | None) -> dict:
    t_start = time.perf_counter()
    from llmdb.engine.cache.block_pool import KVCache
    from llmdb.engine.engine import LLMEngine
    from llmdb.engine.sampling import SamplingParams

    engine = LLMEngine("smollm2-135m", dtype=dtype, threads=threads)
    startup = time.perf_counter() - t_start
    prompts = [p["token_ids"] for p in json.loads(Path(prompts_file).read_text())]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    engine.generate([prompts[0]], SamplingParams(max_tokens=2))  # warm up kernels
    t0 = time.perf_counter()
    results = engine.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    gen = sum(r.usage.generated_tokens for r in results)
    import torch

    return {
        "rows": len(prompts),
        "gen_tok_per_s": round(gen / elapsed, 1),
        "prompt_tok_per_s": round(sum(map(len, prompts)) / elapsed, 1),
        "rows_per_s": round(len(prompts) / elapsed, 2),
        "startup_s": round(startup, 2),
        "engine_init_s": round(engine.startup_s, 2),
        "generated_tokens": gen,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "prefix_caching": engine.pool.enable_prefix_caching,
        "max_num_seqs": engine.scheduler.max_num_seqs,
        "max_num_batched_tokens": engine.scheduler.max_num_batched_tokens,
        "kv_cache_mb": engine.pool.num_blocks * KVCache.bytes_per_block(
            engine.config, engine.pool.block_size, engine.dtype) >> 20,
    }


def _peak_rss_mb(proc: subprocess.Popen, stop: threading.Event, peak: list[float]) -> None:
    import psutil

    try:
        root = psutil.Process(proc.pid)
    except psutil.NoSuchProcess:
        return
    while not stop.is_set():
        total = 0
        try:
            for p in [root, *root.children(recursive=True)]:
                try:
                    total += p.memory_info().rss
                except psutil.NoSuchProcess:
                    pass
        except psutil.NoSuchProcess:
            break
        peak[0] = max(peak[0], total / 2**20)
        stop.wait(0.05)


def measure(cmd: list[str]) -> dict | None:
    """Run one engine's subprocess; its last stdout line is its JSON result."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    stop, peak = threading.Event(), [0.0]
    watcher = threading.Thread(target=_peak_rss_mb, args=(proc, stop, peak), daemon=True)
    watcher.start()
    out, _ = proc.communicate()
    stop.set()
    watcher.join()
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        print(f"# {cmd[-1] if cmd else ''}: exited {proc.returncode}", file=sys.stderr)
        return None
    result = json.loads(lines[-1])
    result["peak_rss_mb"] = round(peak[0])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--peer", action="append", default=[],
                    choices=["llama_cpp", "transformers", "vllm"])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--prompts", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker == "llmdb":
        print(json.dumps(run_llmdb(args.prompts, args.max_tokens, args.dtype, args.threads)))
        return

    from llmdb.engine.models import load_model
    from llmdb.engine.models.export import export_hf
    from llmdb.engine.registry import resolve_model

    gguf = resolve_model("smollm2-135m")
    loaded = load_model(gguf)
    tok = loaded.tokenizer
    prompts = []
    for messages in review_messages(args.rows):
        text = tok.apply_chat_template(messages)
        prompts.append({"text": text, "token_ids": tok.encode(text)})
    work = Path(tempfile.mkdtemp(prefix="llmdb-bench-"))
    prompts_file = work / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    common = {"name": "throughput", "commit": commit(), "max_tokens": args.max_tokens}

    cmd = [sys.executable, __file__, "--worker", "llmdb", "--prompts", str(prompts_file),
           "--max-tokens", str(args.max_tokens)]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    result = measure(cmd)
    if result:
        print(json.dumps({**common, "engine": "llmdb", **result}), flush=True)

    if args.peer:
        hf_dir = export_hf(loaded, work / "hf")
    del loaded
    for peer in args.peer:
        marker = ROOT / ".venv-peers" / f"ok-{peer}"
        if not (PEERS_PY.exists() and marker.exists()):
            print(f"# skipping {peer}: not installed (run bash bench/peers/setup.sh)",
                  file=sys.stderr)
            continue
        cmd = [str(PEERS_PY), str(ROOT / "bench" / "peers" / "run_peer.py"), "--engine", peer,
               "--prompts", str(prompts_file), "--max-tokens", str(args.max_tokens),
               "--gguf", str(gguf), "--hf-dir", str(hf_dir),
               "--threads", str(args.threads or os.cpu_count())]
        result = measure(cmd)
        if result:
            print(json.dumps({**common, **result, "engine": peer}), flush=True)


if __name__ == "__main__":
    main()
