"""Shared helpers of the SQL/DataFrame tests: the engine, references and child processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

MODEL = "smollm2-135m"
REPO = Path(__file__).resolve().parent.parent
RESULT_MARK = "RESULT "


def engine():
    """The process's shared engine: the one every llmdb connection in the process uses."""
    from llmdb.engine.shared import shared_engine

    return shared_engine(MODEL)


def release_engine() -> None:
    """Stop the shared engine, so that later tests may start it with their own options."""
    from llmdb.engine.shared import shutdown_engines

    shutdown_engines()


def chat(prompt: str, system: str | None = None) -> list[dict]:
    messages = [{"role": "user", "content": prompt}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    return messages


def rendered(prompt: str, system: str | None = None) -> str:
    """The prompt under the model's chat template, as llmdb renders it."""
    return engine().tokenizer.apply_chat_template(chat(prompt, system))


def last_query(con: Any) -> dict:
    return json.loads(con.execute("SELECT llm_stats()").fetchall()[0][0])["last_query"]


def cache_entries(path: Path) -> int:
    import sqlite3

    db = sqlite3.connect(path, timeout=30)
    try:
        return db.execute("SELECT COUNT(*) FROM results").fetchall()[0][0]
    finally:
        db.close()


def child_env(cache_dir: Path) -> dict[str, str]:
    return dict(os.environ, LLMDB_CACHE_DIR=str(cache_dir), PYTHONUNBUFFERED="1")


def start_child(code: str, cache_dir: Path, *args: str) -> subprocess.Popen:
    """A fresh Python process running `code` (sys.argv[1:] = args) in the repository."""
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO,
                            env=child_env(cache_dir), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish_child(proc: subprocess.Popen, timeout: float = 120) -> str:
    """The child's stdout; fails the test (with its stderr) unless it exits with 0."""
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"child exited with {proc.returncode}:\n{err[-3000:]}"
    return out


def run_child(code: str, cache_dir: Path, *args: str, timeout: float = 120) -> str:
    return finish_child(start_child(code, cache_dir, *args), timeout)


def child_result(out: str) -> Any:
    """The JSON a child printed after RESULT_MARK (DuckDB may print progress around it)."""
    lines = [line for line in out.splitlines() if line.startswith(RESULT_MARK)]
    assert lines, f"the child printed no result:\n{out[-2000:]}"
    return json.loads(lines[-1][len(RESULT_MARK):])


def start_engine():
    """A fresh fp32 shared engine for a test module (fp32: batching never changes tokens, so
    SQL answers can be compared with the engine's own), after stopping any earlier one."""
    from llmdb.engine.shared import shared_engine

    release_engine()
    return shared_engine(MODEL, dtype="fp32")
