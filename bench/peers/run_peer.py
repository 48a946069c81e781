"""Run the standard throughput workload on one peer engine and print one JSON line.

Runs inside .venv-peers (see bench/peers/setup.sh), not the project's venv: the peers
pin their own torch and transformers. Every engine gets the same token ids, greedy
decoding and exactly --max-tokens generated tokens per row (EOS ignored), so the figures
compare engine speed, not how long each model happened to talk.

The last line on stdout is the result; everything else, the engines' own logging
included, goes to stderr.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

ENGINES = ("llama_cpp", "transformers", "vllm")


@dataclass
class Prompt:
    text: str
    token_ids: list[int]


@dataclass
class RunResult:
    """What one engine measured; main() turns it into the JSON line."""

    startup_s: float
    elapsed_s: float
    generated_tokens: int
    dtype: str
    version: str
    outputs: list[list[int]]
    extra: dict[str, Any] = field(default_factory=dict)


def log(msg: str) -> None:
    print(f"[run_peer] {msg}", file=sys.stderr, flush=True)


def load_prompts(path: str, limit: int | None) -> list[Prompt]:
    """Read PROMPTS.json: a list of {"text": ..., "token_ids": [...]} objects."""
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    prompts = [Prompt(text=r["text"], token_ids=[int(t) for t in r["token_ids"]]) for r in raw]
    if limit is not None:
        prompts = prompts[:limit]
    if not prompts:
        raise SystemExit(f"no prompts in {path}")
    return prompts


def count_generated(outputs: list[list[int]], max_tokens: int, engine: str) -> int:
    """Total generated tokens; fails loudly unless every row has exactly max_tokens.

    A row that stopped early would make the engine look faster per row and slower per
    token than it is, so a short row is an error, not a footnote.
    """
    bad = [(i, len(o)) for i, o in enumerate(outputs) if len(o) != max_tokens]
    if bad:
        raise RuntimeError(f"{engine}: rows with != {max_tokens} generated tokens: {bad[:10]}")
    return sum(len(o) for o in outputs)


def run_llama_cpp(args: argparse.Namespace, prompts: list[Prompt]) -> RunResult:
    """One row at a time through llama-cpp-python's token generator, greedy."""
    if not args.gguf:
        raise SystemExit("--engine llama_cpp needs --gguf")
    import llama_cpp

    t_start = time.perf_counter()
    # verbose=False crashes on this machine (it swaps the C library's stderr); the logs
    # go to stderr anyway.
    llm = llama_cpp.Llama(
        model_path=args.gguf,
        n_ctx=2048,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        n_batch=512,
        verbose=True,
    )
    startup_s = time.perf_counter() - t_start

    outputs: list[list[int]] = []
    t0 = time.perf_counter()
    for p in prompts:
        # generate() yields one sampled token per step and never stops on EOS itself (the
        # completion API does that), so taking max_tokens items ignores EOS as required.
        # temp=0 selects the greedy sampler. With reset=True it keeps the KV cache of the
        # previous row's longest common prefix (the shared system prompt): that is the
        # library's normal behaviour for a loop like this one, and it is left on.
        row: list[int] = []
        for tok in llm.generate(p.token_ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            row.append(tok)
            if len(row) == args.max_tokens:
                break
        outputs.append(row)
    t1 = time.perf_counter()

    return RunResult(
        startup_s=startup_s,
        elapsed_s=t1 - t0,
        generated_tokens=count_generated(outputs, args.max_tokens, "llama_cpp"),
        dtype=_gguf_dtype(llm),
        version=importlib.metadata.version("llama-cpp-python"),
        outputs=outputs,
        extra={"prefix_caching": True, "batching": "per-row loop"},
    )


def _gguf_dtype(llm: Any) -> str:
    """The weight type llama.cpp reports for the file, e.g. 'Q4_1'."""
    try:
        # desc() reads like 'llama ?B Q4_1'; its last word is the file's weight type.
        return "gguf:" + llm._model.desc().split()[-1]
    except Exception:  # the private helper moved: the type is informative only
        return "gguf"


def run_transformers(args: argparse.Namespace, prompts: list[Prompt]) -> RunResult:
    """Batched generate() in --dtype, left padding, batch size --batch-size."""
    if not args.hf_dir:
        raise SystemExit("--engine transformers needs --hf-dir")
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.hf_dir, dtype=getattr(torch, args.dtype))
    model.eval()
    startup_s = time.perf_counter() - t_start

    gen_cfg = model.generation_config
    pad_id = gen_cfg.pad_token_id
    if pad_id is None:
        eos = gen_cfg.eos_token_id
        pad_id = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0

    outputs: list[list[int]] = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for start in range(0, len(prompts), args.batch_size):
            batch = prompts[start : start + args.batch_size]
            width = max(len(p.token_ids) for p in batch)
            # Left padding: every row's last prompt token sits in the last column, where
            # generate() appends, and the mask keeps the pads out of attention.
            ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, p in enumerate(batch):
                ids[row, width - len(p.token_ids) :] = torch.tensor(p.token_ids)
                mask[row, width - len(p.token_ids) :] = 1
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                min_new_tokens=args.max_tokens,
                max_new_tokens=args.max_tokens,
                pad_token_id=pad_id,
            )
            # min_new_tokens masks EOS until max_tokens, so every row has the full width.
            outputs.extend(out[:, width:].tolist())
    t1 = time.perf_counter()

    return RunResult(
        startup_s=startup_s,
        elapsed_s=t1 - t0,
        generated_tokens=count_generated(outputs, args.max_tokens, "transformers"),
        dtype=args.dtype,
        version=transformers.__version__,
        outputs=outputs,
        extra={"prefix_caching": False, "batch_size": args.batch_size},
    )


def run_vllm(args: argparse.Namespace, prompts: list[Prompt]) -> RunResult:
    """vLLM's offline LLM, all prompts as token ids in one generate() call."""
    if not args.hf_dir:
        raise SystemExit("--engine vllm needs --hf-dir")
    # vLLM-CPU reads these when the engine is built. Without a KV-cache size it sizes the
    # cache from free memory, which on a shared 24 GiB machine is neither small nor stable.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.vllm_kv_gib))
    # "auto" keeps one core for vLLM's scheduler process and binds OpenMP to the rest:
    # one thread on this 2-core machine (measured 282 tok/s, against 479 with both cores).
    # Bind --threads cores explicitly, so every engine runs with the same thread count.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")
    # vLLM-CPU wants Intel's OpenMP runtime preloaded (its worker warns otherwise); the
    # intel-openmp wheel it depends on puts one in the venv's lib/, and the engine
    # processes it spawns inherit the variable. A caller's own OpenMP preload wins.
    iomp = os.path.join(sys.prefix, "lib", "libiomp5.so")
    preload = os.environ.get("LD_PRELOAD", "")
    if "omp" not in preload and os.path.exists(iomp):
        os.environ["LD_PRELOAD"] = f"{iomp}:{preload}" if preload else iomp
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t_start = time.perf_counter()
    llm = LLM(
        model=args.hf_dir,
        dtype=args.dtype,
        max_model_len=2048,
        seed=0,
        enable_prefix_caching=not args.no_prefix_caching,
    )
    startup_s = time.perf_counter() - t_start
    cache_cfg = llm.llm_engine.vllm_config.cache_config

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    inputs = [TokensPrompt(prompt_token_ids=p.token_ids) for p in prompts]
    t0 = time.perf_counter()
    # No progress bar: it would redraw inside the measured window.
    results = llm.generate(inputs, params, use_tqdm=False)
    t1 = time.perf_counter()

    outputs = [list(r.outputs[0].token_ids) for r in results]
    return RunResult(
        startup_s=startup_s,
        elapsed_s=t1 - t0,
        generated_tokens=count_generated(outputs, args.max_tokens, "vllm"),
        dtype=args.dtype,
        version=importlib.metadata.version("vllm-cpu"),
        outputs=outputs,
        extra={
            "prefix_caching": bool(cache_cfg.enable_prefix_caching),
            "kv_cache_gib": int(os.environ["VLLM_CPU_KVCACHE_SPACE"]),
            "omp_threads_bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
            "ld_preload": os.environ.get("LD_PRELOAD", ""),
        },
    )


RUNNERS: dict[str, Callable[[argparse.Namespace, list[Prompt]], RunResult]] = {
    "llama_cpp": run_llama_cpp,
    "transformers": run_transformers,
    "vllm": run_vllm,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", required=True, choices=ENGINES)
    ap.add_argument("--prompts", required=True, help="PROMPTS.json")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--gguf", help="GGUF file (llama_cpp)")
    ap.add_argument("--hf-dir", help="HF model directory (transformers, vllm)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                    help="transformers and vLLM: the dtype llmdb runs in on this CPU (fp32 "
                         "where it has no native bf16, which the peers would emulate slowly)")
    ap.add_argument("--limit", type=int, help="run only the first N prompts")
    ap.add_argument("--batch-size", type=int, default=64, help="transformers batch size")
    ap.add_argument("--vllm-kv-gib", type=int, default=4, help="vLLM-CPU KV-cache size")
    ap.add_argument("--no-prefix-caching", action="store_true", help="vLLM: turn it off")
    ap.add_argument(
        "--save-tokens", help="write the generated token ids (a list per row) to this JSON file"
    )
    args = ap.parse_args(argv)
    if args.max_tokens < 1 or args.threads < 1:
        ap.error("--max-tokens and --threads must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Engines print to stdout from C code and from child processes (vLLM's engine core),
    # which a Python-level redirect would miss. Point fd 1 at stderr for the whole run,
    # children included, and keep a private copy of the real stdout for the result.
    sys.stdout.flush()
    result_fd = os.dup(1)
    os.dup2(2, 1)

    prompts = load_prompts(args.prompts, args.limit)
    log(f"{args.engine}: {len(prompts)} rows x {args.max_tokens} tokens, {args.threads} threads")
    res = RUNNERS[args.engine](args, prompts)

    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    line = {
        "name": "throughput",
        "engine": args.engine,
        "rows": len(prompts),
        "gen_tok_per_s": round(res.generated_tokens / res.elapsed_s, 3),
        "prompt_tok_per_s": round(prompt_tokens / res.elapsed_s, 3),
        "rows_per_s": round(len(prompts) / res.elapsed_s, 4),
        "startup_s": round(res.startup_s, 3),
        "generated_tokens": res.generated_tokens,
        "dtype": res.dtype,
        "threads": args.threads,
        "version": res.version,
        "elapsed_s": round(res.elapsed_s, 3),
        "prompt_tokens": prompt_tokens,
        "max_tokens": args.max_tokens,
        **res.extra,
    }
    if args.save_tokens:
        # For checking that the engines agree, e.g. against llmdb's own output.
        with open(args.save_tokens, "w", encoding="utf-8") as f:
            json.dump(res.outputs, f)
    with os.fdopen(result_fd, "w") as out:
        out.write(json.dumps(line) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
