"""Shared helpers of the SQL/DataFrame tests: the engine, references and child processes."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pyarrow as pa

MODEL = "smollm2-135m"
REPO = Path(__file__).resolve().parent.parent
RESULT_MARK = "RESULT "


def column_values(df: Any, name: str) -> list:
    """A pandas, polars or pyarrow column as Python values, None for NULL (pandas' NaN too)."""
    if type(df).__module__.startswith("pandas"):
        import pandas as pd

        return [None if pd.isna(v) else v for v in df[name].tolist()]
    if type(df).__module__.startswith("polars"):
        return df[name].to_list()
    return df.column(name).to_pylist()


def engine():
    """The process's shared engine: the one every llmdb connection in the process uses."""
    from llmdb.engine.process_engines import shared_engine

    return shared_engine(MODEL)


def release_engine() -> None:
    """Stop the shared engine, so that later tests may start it with their own options."""
    from llmdb.engine.process_engines import shutdown_engines

    shutdown_engines()


def start_engine():
    """The shared engine in fp32 (where batching never changes tokens, so that SQL answers can
    be compared with the engine's own). Started once and kept for the next test module; an
    engine running with other options is stopped first."""
    from llmdb.engine.process_engines import shared_engine

    try:
        return shared_engine(MODEL, dtype="fp32")
    except ValueError:  # another dtype is running
        release_engine()
        return shared_engine(MODEL, dtype="fp32")


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


_shared: Path | None = None


def isolated_cache_dir(path: Path) -> Path:
    """`path` as an LLMDB_CACHE_DIR of its own. The C++ kernels are built under that
    directory too, which takes seconds each time, and the bundled GGUF is dequantized into
    its weights/, about 7 s for each process that starts an engine: its kernels/ and weights/
    are the whole test session's, built once; the result cache is this directory's own."""
    global _shared
    if _shared is None:
        _shared = Path(tempfile.mkdtemp(prefix="llmdb-test-cache-"))
        atexit.register(shutil.rmtree, _shared, True)
    path.mkdir(parents=True, exist_ok=True)
    for name in ("kernels", "weights"):
        (_shared / name).mkdir(exist_ok=True)
        if not (path / name).exists():
            (path / name).symlink_to(_shared / name, target_is_directory=True)
    return path


def child_env(cache_dir: Path) -> dict[str, str]:
    return dict(os.environ, LLMDB_CACHE_DIR=str(isolated_cache_dir(cache_dir)),
                PYTHONUNBUFFERED="1")


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
    """The JSON a child printed after RESULT_MARK (other output may surround it)."""
    lines = [line for line in out.splitlines() if line.startswith(RESULT_MARK)]
    assert lines, f"the child printed no result:\n{out[-2000:]}"
    return json.loads(lines[-1][len(RESULT_MARK):])


def register_rows(con: Any, rows: list) -> None:
    """Table t(i, p): the rows in order."""
    con.register("t", pa.table({"i": list(range(len(rows))), "p": pa.array(rows, pa.string())}))


def column(con: Any, expr: str) -> list:
    """expr over t, in row order."""
    return [r[0] for r in con.execute(f"SELECT {expr} FROM t ORDER BY i").fetchall()]
