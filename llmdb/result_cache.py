"""Persistent result cache: SQLite in WAL mode, so several processes can use one file at once.

A DuckDB file would not do: only one process may open it for writing. Entries are JSON
values under a hash key (see request_key); each is written as soon as its request completes,
so a killed job resumes where it stopped (and rows cut short keep their tokens so far under
batch.partial_key). The file is kept under a size limit by evicting the least recently used
entries.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from llmdb.kernels.host import cache_dir

DEFAULT_MAX_BYTES = 1 << 30
_SCHEMA = """
CREATE TABLE IF NOT EXISTS results (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL,
    size INTEGER NOT NULL,
    last_used REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS results_lru ON results (last_used);
"""


def default_cache_path() -> Path:
    return cache_dir() / "results.sqlite"


def request_key(*parts: Any) -> str:
    """A stable hash of everything that determines an answer."""
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


class ResultCache:
    def __init__(self, path: str | Path | None = None, max_bytes: int = DEFAULT_MAX_BYTES):
        self.path = Path(path) if path is not None else default_cache_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        # One connection shared by this process's threads, serialized by the lock;
        # other processes coordinate through SQLite's own locking (busy_timeout).
        self._db = sqlite3.connect(self.path, timeout=30, check_same_thread=False,
                                   isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self._writes_since_trim = 0

    def get_many(self, keys: list[str]) -> dict[str, Any]:
        """The cached values among `keys`; their entries become most recently used."""
        found: dict[str, Any] = {}
        unique = list(dict.fromkeys(keys))
        with self._lock:
            for i in range(0, len(unique), 500):
                chunk = unique[i : i + 500]
                marks = ",".join("?" * len(chunk))
                rows = self._db.execute(
                    f"SELECT key, value FROM results WHERE key IN ({marks})", chunk).fetchall()
                found.update((k, json.loads(v)) for k, v in rows)
            if found:
                now = time.time()
                self._db.executemany("UPDATE results SET last_used = ? WHERE key = ?",
                                     [(now, k) for k in found])
        return found

    def put(self, key: str, value: Any) -> None:
        self.put_many([(key, value)])

    def put_many(self, items: list[tuple[str, Any]], delete: Sequence[str] = ()) -> None:
        """Store these (key, value) pairs and remove the `delete` keys, in one transaction."""
        now = time.time()
        rows = []
        for key, value in items:
            blob = json.dumps(value, separators=(",", ":"))
            rows.append((key, blob, len(blob) + len(key), now))
        with self._lock:
            self._db.execute("BEGIN")  # (autocommit otherwise: a commit per row)
            try:
                self._db.executemany("INSERT OR REPLACE INTO results (key, value, size, "
                                     "last_used) VALUES (?,?,?,?)", rows)
                self._db.executemany("DELETE FROM results WHERE key = ?", [(k,) for k in delete])
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
            self._writes_since_trim += len(rows)
            if self._writes_since_trim >= 256:
                self._trim()

    def _trim(self) -> None:
        """Evict least recently used entries until the total is under 90% of the limit."""
        self._writes_since_trim = 0
        total = self._db.execute("SELECT COALESCE(SUM(size), 0) FROM results").fetchone()[0]
        if total <= self.max_bytes:
            return
        target = total - int(self.max_bytes * 0.9)
        # The shortest least-recently-used prefix whose sizes add up to `target`.
        self._db.execute(
            "DELETE FROM results WHERE key IN (SELECT key FROM (SELECT key, SUM(size) OVER "
            "(ORDER BY last_used, key ROWS UNBOUNDED PRECEDING) - size AS before "
            "FROM results) WHERE before < ?)", (target,))

    def trim(self) -> None:
        with self._lock:
            self._trim()

    def clear(self) -> int:
        with self._lock:
            return self._db.execute("DELETE FROM results").rowcount

    def stats(self) -> dict[str, int]:
        with self._lock:
            n, size = self._db.execute(
                "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM results").fetchone()
        return {"entries": n, "bytes": size, "max_bytes": self.max_bytes}

    def close(self) -> None:
        with self._lock:
            self._db.close()


_caches: dict[tuple[Path, int], ResultCache] = {}
_caches_lock = threading.Lock()


def open_cache(path: str | Path | None = None,
               max_bytes: int = DEFAULT_MAX_BYTES) -> ResultCache:
    """One ResultCache per file per process."""
    resolved = (Path(path) if path is not None else default_cache_path()).resolve()
    with _caches_lock:
        key = (resolved, max_bytes)
        if key not in _caches:
            _caches[key] = ResultCache(resolved, max_bytes)
        return _caches[key]
