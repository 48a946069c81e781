"""Prefix reuse: 400 triage rows that share a ~400-token instruction.

Each prompt is the same rules (about 400 tokens) plus one real tweet (samples.tweets,
trimmed to about 20 tokens), chat-formatted; 2 tokens are generated per row (a triage
label). llmdb runs with prefix caching on and off (each in its own process, on the same
token ids); --peer vllm runs vLLM-CPU on the same ids with its prefix caching on and off.
Prints one JSON line per run, then the speedup of llmdb's prefix caching.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from throughput import PEERS_PY, commit, measure  # noqa: E402

TEAMS = ["billing", "outages", "accounts", "security", "sales", "press", "other"]


def instruction() -> str:
    """Triage rules, the same for every row (about 400 tokens)."""
    rules = [
        "You are the triage desk of a large company. Read the message below and answer with "
        "the one team that must handle it, written exactly as in this list: "
        + ", ".join(TEAMS) + ".",
    ]
    topics = [
        ("billing", "invoices, refunds, prices, payments, discounts or money owed"),
        ("outages", "a service, site or app that is down, slow or broken"),
        ("accounts", "logins, passwords, profile changes or closing an account"),
        ("security", "fraud, phishing, stolen data or suspicious activity"),
        ("sales", "buying, upgrading, partnerships or a request for a quote"),
        ("press", "journalists, interviews, news coverage or public statements"),
        ("other", "anything that fits none of the teams above"),
    ]
    for i, (team, what) in enumerate(topics, 1):
        rules.append(f"Rule {i}: messages about {what} go to {team}.")
    rules += [
        "Rule 8: when two teams could handle a message, prefer the one that can act fastest.",
        "Rule 9: do not explain your answer, do not apologize, and do not repeat the message.",
        "Rule 10: messages in any language are handled the same way.",
        "Rule 11: a message that only praises or thanks the company goes to other.",
        "Rule 12: a message from a reporter or a TV station goes to press, whatever it says.",
        "Rule 13: a message that threatens legal action goes to the team of its topic, and "
        "that team will involve the lawyers.",
        "Rule 14: a message about a product we do not sell goes to sales, who will say so.",
        "Rule 15: a message with several questions goes to the team of the first question.",
        "Rule 16: answer with one word.",
    ]
    return "\n".join(rules)


def prompts(rows: int) -> list[dict]:
    from llmdb.engine.models import load_model
    from llmdb.engine.registry import resolve_model
    from llmdb.samples import SAMPLES

    tok = load_model(resolve_model("smollm2-135m")).tokenizer
    tweets = SAMPLES["tweets"]().column("text").to_pylist()
    head = instruction()
    out = []
    for text in tweets[:rows]:
        short = tok.decode(tok.encode(text)[:20])
        rendered = tok.apply_chat_template(
            [{"role": "user", "content": f"{head}\n\nMessage: {short}"}])
        out.append({"text": rendered, "token_ids": tok.encode(rendered)})
    return out


def worker(prompts_file: str, caching: bool, max_tokens: int) -> dict:
    from llmdb.engine.engine import LLMEngine
    from llmdb.engine.params import SamplingParams

    engine = LLMEngine(enable_prefix_caching=caching)
    ids = [p["token_ids"] for p in json.loads(Path(prompts_file).read_text())]
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=1))  # warm up the kernels
    t0 = time.perf_counter()
    results = engine.generate(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    elapsed = time.perf_counter() - t0
    total = sum(r.usage.prompt_tokens for r in results)
    cached = sum(r.usage.cached_tokens for r in results)
    return {"rows_per_s": round(len(ids) / elapsed, 2), "elapsed_s": round(elapsed, 2),
            "prefill_tokens_computed": total - cached, "prefill_tokens_total": total,
            "mean_prompt_tokens": round(total / len(ids), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=2)
    ap.add_argument("--peer", action="append", default=[], choices=["vllm"])
    ap.add_argument("--worker", choices=["on", "off"], help=argparse.SUPPRESS)
    ap.add_argument("--prompts", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.prompts, args.worker == "on", args.max_tokens)))
        return
    work = Path(tempfile.mkdtemp(prefix="llmdb-prefix-"))
    prompts_file = work / "prompts.json"
    prompts_file.write_text(json.dumps(prompts(args.rows)))
    common = {"name": "prefix", "rows": args.rows, "max_tokens": args.max_tokens,
              "commit": commit()}
    speed = {}
    for mode in ("on", "off"):
        r = measure([sys.executable, __file__, "--worker", mode, "--prompts", str(prompts_file),
                     "--max-tokens", str(args.max_tokens)])
        if r:
            speed[mode] = r["rows_per_s"]
            print(json.dumps({**common, "engine": "llmdb", "prefix_caching": mode == "on",
                              **r}), flush=True)
    if len(speed) == 2:
        print(json.dumps({"name": "prefix_speedup", "engine": "llmdb",
                          "speedup": round(speed["on"] / speed["off"], 2)}), flush=True)
    if "vllm" in args.peer:
        if not (PEERS_PY.exists() and (ROOT / ".venv-peers" / "ok-vllm").exists()):
            print("# skipping vllm: not installed (run bash bench/peers/setup.sh)",
                  file=sys.stderr)
            return
        from llmdb.engine.models import load_model
        from llmdb.engine.models.export import export_hf
        from llmdb.engine.registry import resolve_model

        hf_dir = export_hf(load_model(resolve_model("smollm2-135m")), work / "hf")
        for caching in (True, False):
            cmd = [str(PEERS_PY), str(ROOT / "bench" / "peers" / "run_peer.py"), "--engine",
                   "vllm", "--prompts", str(prompts_file), "--max-tokens",
                   str(args.max_tokens), "--hf-dir", str(hf_dir), "--threads",
                   str(os.cpu_count())] + ([] if caching else ["--no-prefix-caching"])
            r = measure(cmd)
            if r:
                extra = {k: v for k, v in r.items()
                         if k not in ("name", "engine", "prefix_caching", "rows_per_s")}
                print(json.dumps({**common, "engine": "vllm", "prefix_caching": caching,
                                  "rows_per_s": round(r["rows_per_s"], 2), **extra}),
                      flush=True)


if __name__ == "__main__":
    main()
