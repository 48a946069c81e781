"""What a killed job's rerun costs: a SQL job over N rows runs uninterrupted, then again in
a process killed outright (SIGKILL) part-way, then the rerun finishes it. One JSON line per
run: wall seconds of the query, rows answered from the cache, tokens generated and tokens
resumed from what the killed run saved; the rerun's answers are compared with the
uninterrupted run's.

    python bench/resume.py [--rows 400] [--max-tokens 64] [--kill-at 0.5]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput import commit  # noqa: E402

JOB = """
import json, sys, time
import llmdb
rows, max_tokens, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
con = llmdb.connect(cache_path=path, progress=False)
con.execute("SELECT llm_complete('Say hi.', max_tokens := 2)").fetchall()  # loads the model
print("START", flush=True)
t0 = time.perf_counter()
out = con.execute(
    "SELECT i, llm_complete('Write a short story about the number ' || i || '.', "
    f"max_tokens := {max_tokens}) FROM range({rows}) t(i) ORDER BY i").fetchall()
wall = time.perf_counter() - t0
print("RESULT " + json.dumps({"wall_s": wall, "stats": con.stats()["last_query"],
                              "answers": [a for _, a in out]}), flush=True)
"""


def run(args: argparse.Namespace, path: Path, kill_after: float | None = None) -> dict | None:
    proc = subprocess.Popen([sys.executable, "-c", JOB, str(args.rows), str(args.max_tokens),
                             str(path)], stdout=subprocess.PIPE, text=True, env=os.environ)
    assert proc.stdout.readline().strip() == "START"
    if kill_after is not None:
        time.sleep(kill_after)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        return None
    line = [x for x in proc.stdout.read().splitlines() if x.startswith("RESULT ")][-1]
    proc.wait()
    return json.loads(line[len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--kill-at", type=float, default=0.5,
                    help="kill the second run after this share of the first run's wall time")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        full = run(args, Path(tmp) / "full.sqlite")
        kill_after = full["wall_s"] * args.kill_at
        run(args, Path(tmp) / "killed.sqlite", kill_after)
        rerun = run(args, Path(tmp) / "killed.sqlite")
    same = sum(a == b for a, b in zip(full["answers"], rerun["answers"], strict=True))
    config = {"commit": commit(), "rows": args.rows, "max_tokens": args.max_tokens}
    for name, r in (("uninterrupted", full), ("rerun after kill", rerun)):
        s = r["stats"]
        print(json.dumps({"name": "resume", "run": name, "wall_s": round(r["wall_s"], 2),
                          "cache_hits": s["cache_hits"], "generated_tokens": s["generated_tokens"],
                          "resumed_tokens": s["resumed_tokens"], **config,
                          **({"killed_after_s": round(kill_after, 2), "answers_equal": same}
                             if r is rerun else {})}), flush=True)


if __name__ == "__main__":
    main()
