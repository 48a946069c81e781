"""Persistent result cache: SQLite in WAL mode, so several processes can use one file at once.

A DuckDB file would not do: only one process may open it for writing. Entries are JSON
values under a hash key (see request_key); each is written as soon as its request completes,
so a killed job resumes where it stopped (and rows cut short keep their tokens so far under
batch.partial_key). The file is kept under a size limit by evicting the least recently used
entries.

The limit is on disk, WAL and shared-memory (-shm) files included. An entry's own bytes (its
key and JSON value) are a fraction of what it takes there: the key is stored twice (the
table and its primary-key index), the LRU index adds a row, pages are partly filled. Short
answers under 64-character keys took 2.8x their bytes, so a cache held to 1 GiB of entries
grew to 2.8 GiB of file. So each write checks the pages in use (the file's header, whoever
wrote before), a trim scales the entries' bytes by the pages they fill, the WAL is
checkpointed at a sixteenth of the limit (at most SQLite's default 4 MiB) and truncated to
that, writes and a trim's deletions go in transactions that each fit that point, a WAL left
over its share (two such points) is cut back at once, and a file created here returns its
freed pages to the file system (auto_vacuum=INCREMENTAL).
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from llmdb.kernels.host import cache_dir

DEFAULT_MAX_BYTES = 1 << 30
MAX_WAL_BYTES = 4 << 20  # SQLite's default checkpoint point (1,000 pages of 4 KiB)
# Pages a row takes in a transaction, less its value's overflow pages: one of the table and
# one of each index.
_ROW_PAGES = 3
_WAL_HEADER, _FRAME_HEADER = 32, 24  # (bytes: the WAL holds frames, each a page and these)
BUSY_TIMEOUT_MS = 30_000
TRIM_TO = 0.9  # of the limit, so that a trim is followed by many writes before the next
# Pages of a file with no entries: its schema, the table and the table's two indexes (and,
# with auto_vacuum, a pointer map).
_EMPTY_PAGES = 4
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
        self._db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_MS / 1000,
                                   check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA auto_vacuum=INCREMENTAL")  # (takes effect in a new file)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._page_size = self._pragma("page_size")
        wal_bytes = min(MAX_WAL_BYTES, max_bytes // 16)
        self._wal_pages = max(1, wal_bytes // self._page_size)
        self._db.execute(f"PRAGMA wal_autocheckpoint={self._wal_pages}")
        self._db.execute(f"PRAGMA journal_size_limit={wal_bytes}")
        self._step = max(1, self._wal_pages // 4)  # entries or pages a trim's transaction
        # The WAL passes its checkpoint point by the transaction that reaches it (a
        # put_many's are split to fit the point, a trim's are quarters of it), so it takes
        # two.
        self._wal_share = _WAL_HEADER + 2 * self._wal_pages * (self._page_size + _FRAME_HEADER)
        self._db.executescript(_SCHEMA)
        self._vacuums = self._pragma("auto_vacuum") != 0
        self._empty_pages = _EMPTY_PAGES + self._vacuums
        # The entries' share of the limit, in bytes of pages: less the file's fixed pages
        # and the WAL's share. (Less the -shm file too: see _budget.)
        self._fixed_budget = max_bytes - self._wal_share - self._empty_pages * self._page_size
        self._wal = self.path.with_name(self.path.name + "-wal")
        self._shm = self.path.with_name(self.path.name + "-shm")

    def _budget(self) -> int:
        """The entries' share of the limit now. The -shm file (the WAL's index) is 32 KiB
        while the file is open, and grows by 32 KiB per 4,096 pages a transaction puts in
        the WAL (96 KiB after one of 40 MB), and never shrinks until the last connection
        closes: read from the file, not assumed."""
        try:
            shm = self._shm.stat().st_size
        except FileNotFoundError:
            shm = 0
        return self._fixed_budget - shm

    def _pragma(self, name: str) -> int:
        return self._db.execute(f"PRAGMA {name}").fetchone()[0]

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
        """Store these (key, value) pairs and remove the `delete` keys. The rows go in
        transactions that each fit the WAL's checkpoint point (a row alone if it does not),
        the deletions with the first (a row and the partial entry it replaces: one)."""
        now = time.time()
        rows = []
        for key, value in items:
            blob = json.dumps(value, separators=(",", ":"))
            rows.append((key, blob, len(blob) + len(key), now))
        with self._lock:
            deleting = [(k,) for k in delete]
            for part in self._fitting_parts(rows):
                self._write(part, deleting)
                deleting = []
                # Checked at every write, from the file (two pragmas that read its header),
                # not counted by this object: processes that each wrote fewer rows than a
                # count's period (a job of 200 rows per `llmdb sql`) never trimmed a shared
                # file at all.
                if self._used_bytes() > self._budget():
                    self._trim()
            self._keep_wal_in_share()

    def _fitting_parts(self, rows: list[tuple[str, str, int, float]]) -> list[list]:
        """`rows` in runs whose pages fit the WAL's checkpoint point. (Written in one
        transaction, 400 rows at a 200 KB limit left a WAL of 28 pages, where its share is
        6: 1.3x the limit on disk.)"""
        parts: list[list] = [[]]
        pages = 0
        for row in rows:
            need = _ROW_PAGES + row[2] // self._page_size
            if parts[-1] and pages + need > self._wal_pages:
                parts.append([])
                pages = 0
            parts[-1].append(row)
            pages += need
        return parts

    def _write(self, rows: list[tuple[str, str, int, float]], delete: list[tuple[str]]) -> None:
        self._db.execute("BEGIN")  # (autocommit otherwise: a commit per row)
        try:
            self._db.executemany("INSERT OR REPLACE INTO results (key, value, size, "
                                 "last_used) VALUES (?,?,?,?)", rows)
            self._db.executemany("DELETE FROM results WHERE key = ?", delete)
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def _keep_wal_in_share(self) -> None:
        """A transaction larger than the checkpoint point leaves the WAL file over its
        share until the next write restarts it: cut it back now. Below a limit of about
        800 KB even one row's can be (a page split wrote 12 pages, where the point is 3 at
        200 KB), and so can another process's. Without waiting for other processes' readers
        (busy_timeout 0): with one reading, the checkpoint stops short and a later write
        cuts the WAL back."""
        try:
            if self._wal.stat().st_size <= self._wal_share:
                return
        except FileNotFoundError:
            return
        self._db.execute("PRAGMA busy_timeout=0")
        try:
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        finally:
            self._db.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")

    def _used_bytes(self) -> int:
        """Bytes of the pages holding entries. (Free pages are left out: a file made before
        auto_vacuum keeps them, and counted they would make every trim evict nearly
        everything.)"""
        used = self._pragma("page_count") - self._pragma("freelist_count") - self._empty_pages
        return used * self._page_size

    def _trim(self) -> None:
        """Over the limit: evict least recently used entries until the files hold 90% of it
        (less the WAL's share), and give the freed pages back."""
        total = self._db.execute("SELECT COALESCE(SUM(size), 0) FROM results").fetchone()[0]
        # Disk bytes per entry byte; 1 in a file of a few pages, where pages are mostly empty.
        scale = max(1.0, self._used_bytes() / total) if total else 1.0
        limit = self._budget() / scale  # in entry bytes
        if total <= limit:
            return
        target = total - int(limit * TRIM_TO)
        # The shortest least-recently-used prefix whose sizes add up to `target`.
        keys = [k for k, in self._db.execute(
            "SELECT key FROM (SELECT key, SUM(size) OVER (ORDER BY last_used, key ROWS "
            "UNBOUNDED PRECEDING) - size AS before FROM results) WHERE before < ?", (target,))]
        # Deleted a few at a time: a transaction's pages pass through the WAL, and one
        # deleting 10% of the entries touched most pages of the key index (random keys),
        # which took the files to 1.3x the limit until the checkpoint. An entry's deletion
        # changes a page or two of the table and of each index.
        for i in range(0, len(keys), self._step):
            self._db.execute("BEGIN")
            self._db.executemany("DELETE FROM results WHERE key = ?",
                                 [(k,) for k in keys[i : i + self._step]])
            self._db.execute("COMMIT")
        self._give_back()

    def _give_back(self) -> None:
        """Return the free pages to the file system: moved to the end and cut off, a step
        at a time (the file shrinks at the checkpoint, in WAL mode). A file made before
        auto_vacuum keeps them for reuse."""
        free = self._pragma("freelist_count")
        while self._vacuums and free:
            # (executescript: execute steps the pragma once, which frees one page)
            self._db.executescript(f"PRAGMA incremental_vacuum({self._step})")
            free, before = self._pragma("freelist_count"), free
            if free >= before:  # (no progress: never loop for ever)
                break
        self._db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()

    def clear(self) -> int:
        with self._lock:
            n = self._db.execute("DELETE FROM results").rowcount
            self._give_back()
            self._keep_wal_in_share()
            return n

    def stats(self) -> dict[str, int]:
        with self._lock:
            n, size = self._db.execute(
                "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM results").fetchone()
        return {"entries": n, "bytes": size, "max_bytes": self.max_bytes}

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __del__(self) -> None:
        # Dropped by its last user: closed now. (sqlite3's connection is in a reference
        # cycle with its statement cache, so it closed at some later garbage collection.)
        db = getattr(self, "_db", None)
        if db is not None:
            db.close()


# Held by the sessions using them (Session.cache): a file no session uses any more is closed.
# Held here, every cache_path a process ever used kept its database, WAL and shared-memory
# files open for good (a service with a cache per job: three descriptors a job, and the
# disk of its deleted files never freed).
_caches: weakref.WeakValueDictionary[tuple[Path, int], ResultCache] = \
    weakref.WeakValueDictionary()
_caches_lock = threading.Lock()


def open_cache(path: str | Path | None = None,
               max_bytes: int = DEFAULT_MAX_BYTES) -> ResultCache:
    """One ResultCache per file per process, while someone holds it."""
    resolved = (Path(path) if path is not None else default_cache_path()).resolve()
    with _caches_lock:
        cache = _caches.get((resolved, max_bytes))
        if cache is None:
            cache = _caches[resolved, max_bytes] = ResultCache(resolved, max_bytes)
        return cache
