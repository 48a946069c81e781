"""Engine throughput on the standard workload: 400 chat prompts x 64 greedy tokens.

Each engine runs in its own subprocess so that its peak RSS (children included) is measured.
Prints one JSON line per engine. Peers (--peer llama_cpp|transformers|vllm) run from the
.venv-peers environment that bench/peers/setup.sh builds, on the same token ids, and get the
same weights: the GGUF dequantized by our loader and exported as a bf16 HF directory.

With --shape (needed for --device cuda) every engine instead runs a directory of random
weights of that model's shape (bench/random_model.py; the GPU machine has neither the bundled
GGUF nor the internet), on one of three workloads: standard (the same 400 prompts, as token
ids stored in bench/data/), fixed (--rows x --prompt-len random ids, --max-tokens each),
nanovllm (nano-vllm's bench.py: 256 rows, prompt and output lengths uniform in [100, 1024])
or bulk (4,000 rows of the standard prompts, outputs of 16 to 112 tokens: a SQL job whose
rows outnumber the running slots, so most steps mix prefills with decodes).
Engines: llmdb, --peer transformers (batched `generate`, same python) and --bare (the bare
decoder with one CUDA graph per step, bench/bare_decoder.py: the ceiling).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEERS_PY = ROOT / ".venv-peers" / "bin" / "python"
STANDARD_PROMPTS = ROOT / "bench" / "data" / "review_prompts_smollm2.json"
sys.path.insert(0, str(ROOT / "bench"))

from workload import review_messages  # noqa: E402


def commit() -> str:
    """The short hash of HEAD; LLMDB_COMMIT names it where the tree has no .git (the GPU
    machine gets a copy of the working tree)."""
    if os.environ.get("LLMDB_COMMIT"):
        return os.environ["LLMDB_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                       text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_llmdb(prompts_file: str, max_tokens: int, dtype: str | None, threads: int | None) -> dict:
    t_start = time.perf_counter()
    from llmdb.engine.cache.kv_cache import KVCache
    from llmdb.engine.engine import LLMEngine
    from llmdb.engine.params import SamplingParams

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
    try:
        import psutil
    except ImportError:  # the GPU machine's python may lack it: RSS is then reported as 0
        return

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


def bundled_prompts(rows: int) -> tuple[list[dict], object]:
    """The standard rows as the bundled SmolLM2 tokenizer encodes them (chat template applied),
    and the loaded model (its weights feed the peers' HF export)."""
    from llmdb.engine.models import load_model
    from llmdb.engine.registry import resolve_model

    loaded = load_model(resolve_model("smollm2-135m"))
    tok = loaded.tokenizer
    prompts = []
    for messages in review_messages(rows):
        text = tok.apply_chat_template(messages)
        prompts.append({"text": text, "token_ids": tok.encode(text)})
    return prompts, loaded


def write_standard_prompts(path: Path = STANDARD_PROMPTS) -> Path:
    """Stores the 400 standard prompts' token ids, for machines without the bundled model."""
    prompts, _ = bundled_prompts(400)
    rows = ",\n".join(json.dumps(p["token_ids"], separators=(",", ":")) for p in prompts)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        '{"source": "bench/workload.py review_messages(400), SmolLM2-135M-Instruct chat '
        'template and tokenizer (bench/throughput.py --write-standard-prompts)",\n'
        f'"rows": [\n{rows}\n]}}\n')
    return path


def run_bundled(args: argparse.Namespace) -> None:
    """The CPU benchmark on the bundled SmolLM2 GGUF (the original behaviour and output)."""
    from llmdb.engine.models.export import export_hf
    from llmdb.engine.registry import resolve_model

    gguf = resolve_model("smollm2-135m")
    prompts, loaded = bundled_prompts(args.rows)
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
        # The peers run in the dtype llmdb ran in (fp32 on a CPU without native bf16).
        peer_dtype = (result or {}).get("dtype") or "bfloat16"
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
               "--threads", str(args.threads or os.cpu_count()), "--dtype", peer_dtype]
        result = measure(cmd)
        if result:
            print(json.dumps({**common, **result, "engine": peer}), flush=True)


# ---- random-weight shapes, on a CPU or a GPU ---------------------------------------------------


def standard_workload(rows: int, max_tokens: int, vocab: int) -> list[dict]:
    """The standard rows from bench/data (ids folded into a smaller vocabulary, if any)."""
    stored = json.loads(STANDARD_PROMPTS.read_text())["rows"]
    if rows > len(stored):
        raise SystemExit(f"the standard workload has {len(stored)} rows, not {rows}")
    return [{"token_ids": [t % vocab for t in ids], "max_tokens": max_tokens}
            for ids in stored[:rows]]


def fixed_workload(rows: int, prompt_len: int, max_tokens: int, vocab: int, seed: int
                   ) -> list[dict]:
    """rows x prompt_len seeded random ids: every row the same shape, no shared prefixes."""
    rng = random.Random(seed)
    return [{"token_ids": [rng.randrange(vocab) for _ in range(prompt_len)],
             "max_tokens": max_tokens} for _ in range(rows)]


def nanovllm_workload(rows: int = 256) -> list[dict]:
    """nano-vllm's bench.py: seed(0), ids in [0, 10000], prompt and output lengths uniform in
    [100, 1024], drawn in its order (all prompts, then all outputs), so that 256 rows give its
    published total of 133,966 output tokens. It samples at temperature 0.6; we decode
    greedily with ignore_eos, which generates the same number of tokens."""
    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))]
               for _ in range(rows)]
    return [{"token_ids": p, "max_tokens": rng.randint(100, 1024)} for p in prompts]


def bulk_workload(rows: int, max_tokens: int, vocab: int, seed: int) -> list[dict]:
    """A SQL job over more rows than run at once: the standard prompts over and over, each
    pass with its ids shifted by one more (no prompt repeats; within a pass the rows share
    the template's prefix, as a query's rows do), outputs uniform in [max_tokens / 4,
    7 max_tokens / 4] (seeded). Rows end at different steps and new ones start in their
    place, so most steps mix prefill chunks with decodes, where the other workloads are
    decode steps after the first few (every row starts at once and runs to the end)."""
    stored = json.loads(STANDARD_PROMPTS.read_text())["rows"]
    rng = random.Random(seed)
    n = len(stored)
    return [{"token_ids": [(t + i // n) % vocab for t in stored[i % n]],
             "max_tokens": rng.randint(max(1, max_tokens // 4), max_tokens * 7 // 4)}
            for i in range(rows)]


def build_workload(args: argparse.Namespace, vocab: int) -> list[dict]:
    if args.workload == "standard":
        return standard_workload(args.rows or 400, args.max_tokens or 64, vocab)
    if args.workload == "bulk":
        return bulk_workload(args.rows or 4000, args.max_tokens or 64, vocab, args.seed)
    if args.workload == "fixed":
        return fixed_workload(args.rows or 400, args.prompt_len, args.max_tokens or 128, vocab,
                              args.seed)
    if vocab <= 10000:
        raise SystemExit(f"the nanovllm workload needs a vocabulary above 10000, not {vocab}")
    return nanovllm_workload(args.rows or 256)


def model_dir_for(args: argparse.Namespace) -> Path:
    """The random-weight directory of --shape: --model-dir, or a cache under the temp dir;
    written once, reused while its marker matches."""
    from random_model import DTYPES, is_complete

    out = Path(args.model_dir or Path(tempfile.gettempdir()) / "llmdb-random-models"
               / f"{args.shape}-seed{args.seed}")
    if not is_complete(out, args.shape, args.seed, DTYPES["bf16"]):
        # In a subprocess: generating on the GPU here would keep a CUDA context and cached
        # blocks in this process for the whole run, beside the engines'.
        subprocess.run([sys.executable, str(ROOT / "bench" / "random_model.py"), "--shape",
                        args.shape, str(out), "--seed", str(args.seed), "--dtype", "bf16"],
                       check=True)
    return out


def device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name()
    from llmdb.kernels.host import cpu_info

    return cpu_info().model


def _device_fields(device: str) -> dict:
    """What each worker reports about its device: its name and the peak memory allocated
    by this process (weights, caches, activations; the CUDA context not included)."""
    import torch

    cuda = device.startswith("cuda")
    return {"device": device_name(device),
            "peak_gpu_mem_mb": torch.cuda.max_memory_allocated() >> 20 if cuda else None}


def _read_rows(path: str) -> tuple[list[list[int]], list[int]]:
    rows = json.loads(Path(path).read_text())
    return [r["token_ids"] for r in rows], [r["max_tokens"] for r in rows]


def _rates(prompts: list[list[int]], generated: int, elapsed: float) -> dict:
    return {
        "rows": len(prompts),
        "gen_tok_per_s": round(generated / elapsed, 1),
        "prompt_tok_per_s": round(sum(map(len, prompts)) / elapsed, 1),
        "elapsed_s": round(elapsed, 3),
        "generated_tokens": generated,
        "prompt_tokens": sum(map(len, prompts)),
    }


def _step_timing(engine) -> dict | None:
    """The engine's cumulative step counters, where this engine version has them."""
    return engine.step_timing() if hasattr(engine, "step_timing") else None


def _step_kinds(log: list[tuple[str, float, float]]) -> dict:
    """Per kind of step (engine.step_log: "graph" for decode graphs, "mixed graph", "eager"),
    how many, and the median wall and host ms: the per-step averages above mix them, and a
    few long prefills hide what a decode step costs."""
    out: dict = {}
    for kind in ("graph", "mixed graph", "eager"):
        steps = [(wall, host) for k, wall, host in log if k == kind]
        if steps:
            key = kind.replace(" ", "_")
            out |= {f"{key}_steps": len(steps),
                    f"{key}_wall_ms_median": round(1000 * statistics.median(
                        w for w, _ in steps), 3),
                    f"{key}_host_ms_median": round(1000 * statistics.median(
                        h for _, h in steps), 3)}
    return out


def run_llmdb_dir(args: argparse.Namespace) -> dict:
    """llmdb on a model directory; host_ms_per_step is the scheduler + runner host time
    of the timed run's steps (the engine's step_timing counters, differenced)."""
    t_start = time.perf_counter()
    import torch

    from llmdb.engine.engine import LLMEngine
    from llmdb.engine.params import SamplingParams

    kwargs: dict = {"dtype": args.dtype or ("bf16" if args.device != "cpu" else None)}
    if "device" in inspect.signature(LLMEngine).parameters:  # engines before it ran on CPUs
        kwargs["device"] = args.device
    elif args.device != "cpu":
        raise SystemExit("this llmdb engine has no device= keyword: it runs only on the CPU")
    for key, value in (("max_num_seqs", args.max_num_seqs or args.rows_at_once),
                       ("max_num_batched_tokens", args.max_num_batched_tokens),
                       ("threads", args.threads)):
        if value:
            kwargs[key] = value
    if args.kv_cache_gib:
        kwargs["kv_cache_bytes"] = int(args.kv_cache_gib * 2**30)
    if args.launch_ahead != "auto":
        kwargs["launch_ahead"] = args.launch_ahead == "on"
    if args.batch_invariant:
        kwargs["batch_invariant"] = True
    engine = LLMEngine(str(args.model_dir), **kwargs)
    startup = time.perf_counter() - t_start
    graphs = getattr(engine.runner, "graphs", None)
    if args.mixed_graphs == "off" and graphs is not None and hasattr(graphs, "mixed_on"):
        graphs.mixed_on = False
    prompts, wants = _read_rows(args.prompts)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in wants]
    # Warm up on a few rows of real lengths (kernels compile for prefill and decode), with
    # every id shifted so that the timed run finds none of them in the prefix cache (by half
    # the vocabulary: the bulk workload's passes shift by one per pass).
    vocab = engine.config.vocab_size
    engine.generate([[(t + vocab // 2) % vocab for t in p] for p in prompts[:8]],
                    SamplingParams(max_tokens=4, ignore_eos=True))
    before = _step_timing(engine)
    if hasattr(engine, "step_log"):
        engine.step_log = []
    t0 = time.perf_counter()
    results = engine.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    after = _step_timing(engine)
    gen = sum(r.usage.generated_tokens for r in results)
    if gen != sum(wants):
        print(f"# llmdb generated {gen} tokens, not {sum(wants)}", file=sys.stderr)
    out = {**_rates(prompts, gen, elapsed), "startup_s": round(startup, 2),
           **_device_fields(args.device), "host_ms_per_step": None,
           "dtype": str(engine.dtype).removeprefix("torch."),
           "max_num_seqs": engine.scheduler.max_num_seqs,
           "max_num_batched_tokens": engine.scheduler.max_num_batched_tokens,
           "kv_cache_tokens": engine.pool.num_blocks * engine.pool.block_size}
    if "batch_invariant" in engine.describe():  # (engines before the mode have none)
        out["batch_invariant"] = engine.describe()["batch_invariant"]
    if before and after and after["steps"] > before["steps"]:
        steps = after["steps"] - before["steps"]
        out |= {"host_ms_per_step": round(1000 * (after["host_s"] - before["host_s"]) / steps, 3),
                "wall_ms_per_step": round(1000 * (after["wall_s"] - before["wall_s"]) / steps, 3),
                "steps": steps}
        if "device_idle_s" in after:  # the GPU waiting for the host between steps
            idle = after["device_idle_s"] - before["device_idle_s"]
            out |= {"device_idle_ms_per_step": round(1000 * idle / steps, 3),
                    "launch_ahead": engine.launch_ahead}
        if "graph_capture_s" in after:  # mixed graphs captured during the timed run
            out["graph_capture_s"] = round(after["graph_capture_s"]
                                           - before["graph_capture_s"], 3)
    out |= _step_kinds(getattr(engine, "step_log", None) or [])
    if args.device == "cpu":
        out["threads"] = torch.get_num_threads()
    return out


def run_transformers_dir(args: argparse.Namespace) -> dict:
    """Hugging Face generate, greedy, left padding, --rows-at-once rows a batch (default all);
    min_new_tokens = max_new_tokens so EOS never ends a row early. Rows of one batch all run
    to its longest output; only the tokens each row asked for are counted."""
    t_start = time.perf_counter()
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype)
    model = model.to(args.device).eval()
    startup = time.perf_counter() - t_start
    gen_cfg = model.generation_config
    eos = gen_cfg.eos_token_id
    pad = gen_cfg.pad_token_id
    if pad is None:
        pad = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
    prompts, wants = _read_rows(args.prompts)
    bs = args.rows_at_once or len(prompts)

    def generate(rows: list[list[int]], new: int) -> torch.Tensor:
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, p in enumerate(rows):
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        out = model.generate(input_ids=ids.to(args.device), attention_mask=mask.to(args.device),
                             do_sample=False, max_new_tokens=new, min_new_tokens=new,
                             pad_token_id=pad)
        return out[:, width:]

    with torch.inference_mode():
        generate(prompts[:8], 4)  # warm up
        t0 = time.perf_counter()
        for i in range(0, len(prompts), bs):
            new = max(wants[i : i + bs])
            out = generate(prompts[i : i + bs], new)
            if out.shape[1] != new:
                raise RuntimeError(f"transformers generated {out.shape[1]} tokens, not {new}")
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
    return {**_rates(prompts, sum(wants), elapsed), "startup_s": round(startup, 2),
            **_device_fields(args.device),
            "dtype": str(dtype).removeprefix("torch."), "batch_size": min(bs, len(prompts)),
            "version": transformers.__version__}


def run_bare_dir(args: argparse.Namespace) -> dict:
    """The bare decoder (bench/bare_decoder.py), --rows-at-once rows a batch (default all)."""
    import torch
    from bare_decoder import run_bare

    prompts, wants = _read_rows(args.prompts)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(args.dtype)  # None: bf16 on cuda
    res = run_bare(args.model_dir, prompts, wants, args.rows_at_once, device=args.device,
                   dtype=dtype)
    res.pop("tokens")
    res.pop("engine")
    return {**res, **_device_fields(args.device)}


WORKERS = {"llmdb-dir": run_llmdb_dir, "transformers": run_transformers_dir, "bare": run_bare_dir}


def _worker_cmd(worker: str, args: argparse.Namespace, prompts_file: Path, model_dir: Path
                ) -> list[str]:
    cmd = [sys.executable, __file__, "--worker", worker, "--prompts", str(prompts_file),
           "--model-dir", str(model_dir), "--device", args.device]
    for flag, value in (("--dtype", args.dtype), ("--threads", args.threads),
                        ("--rows-at-once", args.rows_at_once),
                        ("--max-num-seqs", args.max_num_seqs),
                        ("--max-num-batched-tokens", args.max_num_batched_tokens),
                        ("--kv-cache-gib", args.kv_cache_gib),
                        ("--launch-ahead", args.launch_ahead),
                        ("--mixed-graphs", args.mixed_graphs)):
        if value:
            cmd += [flag, str(value)]
    if args.batch_invariant:
        cmd.append("--batch-invariant")
    return cmd


def run_shape(args: argparse.Namespace) -> None:
    """Every engine on one random-weight model directory and one workload, one JSON line
    each, every engine in its own subprocess."""
    model_dir = model_dir_for(args) if args.shape else Path(args.model_dir)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rows = build_workload(args, vocab)
    work = Path(tempfile.mkdtemp(prefix="llmdb-bench-"))
    prompts_file = work / "prompts.json"
    prompts_file.write_text(json.dumps(rows))
    common = {"name": "throughput", "shape": args.shape or model_dir.name,
              "workload": args.workload, "commit": commit(),
              "max_tokens": max(r["max_tokens"] for r in rows)}
    engines = ([] if args.skip_llmdb else [("llmdb", "llmdb-dir")])
    engines += [("transformers", "transformers")] * ("transformers" in args.peer)
    engines += [("bare", "bare")] * args.bare
    for name, worker in engines:
        result = measure(_worker_cmd(worker, args, prompts_file, model_dir))
        if result:
            print(json.dumps({**common, "engine": name, **result}), flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from random_model import SHAPES

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=None,
                    help="rows (default: 400; nanovllm: 256; bulk: 4000)")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="tokens per row (default: 64; fixed: 128; nanovllm: its own)")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--peer", action="append", default=[],
                    choices=["llama_cpp", "transformers", "vllm"])
    ap.add_argument("--device", default="cpu", help="cpu or cuda (cuda needs --shape)")
    ap.add_argument("--shape", choices=list(SHAPES),
                    help="run random weights of this shape (bench/random_model.py)")
    ap.add_argument("--model-dir", help="where the --shape directory is written and reused "
                    "(default: under the temp dir); without --shape, an HF directory to run")
    ap.add_argument("--seed", type=int, default=0, help="weights and fixed-workload seed")
    ap.add_argument("--workload", default="standard",
                    choices=["standard", "fixed", "nanovllm", "bulk"])
    ap.add_argument("--prompt-len", type=int, default=128, help="fixed workload prompt length")
    ap.add_argument("--bare", action="store_true", help="also run the bare decoder")
    ap.add_argument("--skip-llmdb", action="store_true", help="run only the peers / --bare")
    ap.add_argument("--rows-at-once", type=int, default=None,
                    help="requests running at once: llmdb's max_num_seqs, the static batch of "
                         "transformers and --bare (default: all rows)")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="llmdb (over --rows-at-once)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="llmdb's token budget per step (default: 16384 on cuda)")
    ap.add_argument("--kv-cache-gib", type=float, default=None, help="llmdb's KV pool size")
    ap.add_argument("--mixed-graphs", choices=["on", "off"], default="on",
                    help="llmdb on CUDA: replay mixed steps from graphs, or run them eagerly")
    ap.add_argument("--launch-ahead", choices=["auto", "on", "off"], default="auto",
                    help="llmdb launches step N+1 before reading step N (auto: on GPUs)")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="llmdb with batch_invariant=True (on GPUs: Triton matmuls, attention "
                         "without split-KV, row-wise log-softmax and top-p sums: a request's "
                         "answer does not depend on its batch); with --shape or --model-dir "
                         "only (the bundled CPU run's answers never depend on it)")
    ap.add_argument("--write-standard-prompts", action="store_true",
                    help=f"regenerate {STANDARD_PROMPTS.relative_to(ROOT)} and exit")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--prompts", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.device != "cpu" and args.max_num_batched_tokens is None:
        args.max_num_batched_tokens = 16384
    return args


def _is_bundled_run(args: argparse.Namespace) -> bool:
    """The original CPU benchmark: the bundled GGUF, the standard workload, no GPU."""
    return (args.device == "cpu" and not args.shape and not args.model_dir and not args.bare
            and args.workload == "standard" and not args.skip_llmdb)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker == "llmdb":
        print(json.dumps(run_llmdb(args.prompts, args.max_tokens or 64, args.dtype,
                                   args.threads)))
        return
    if args.worker:
        print(json.dumps(WORKERS[args.worker](args)))
        return
    if args.write_standard_prompts:
        print(write_standard_prompts())
        return
    if _is_bundled_run(args):
        if args.batch_invariant:  # (run_bundled's engine would not be given it)
            raise SystemExit("--batch-invariant needs --shape or --model-dir: the bundled "
                             "CPU run's answers never depend on their batch")
        args.rows, args.max_tokens = args.rows or 400, args.max_tokens or 64
        run_bundled(args)
        return
    if not (args.shape or args.model_dir):
        raise SystemExit("--device cuda and --workload fixed|nanovllm need --shape")
    if set(args.peer) - {"transformers"}:
        raise SystemExit("with --shape only --peer transformers runs (the others need "
                         ".venv-peers: use the bundled CPU benchmark)")
    run_shape(args)


if __name__ == "__main__":
    main()
