"""The persistent result cache: across process restarts, shared by concurrent processes,
bounded with LRU eviction, keyed on everything that changes an answer, never holding failures
or unseeded samples."""

from __future__ import annotations

import random
import threading
import time

import pytest

import llmdb
from llmdb.result_cache import ResultCache, request_key

from .sql_support import (
    cache_entries,
    child_result,
    finish_child,
    last_query,
    run_child,
    start_child,
)

pytestmark = pytest.mark.usefixtures("eng", "own_cache_dir")

CHILD = """
import json, sys
import llmdb
first, count = int(sys.argv[1]), int(sys.argv[2])
con = llmdb.connect(threads=1)  # the default cache: $LLMDB_CACHE_DIR/results.sqlite
rows = con.execute(
    "SELECT i, llm_complete('Name thing number ' || i || '.', max_tokens := 6) "
    f"FROM range({first}, {first + count}) t(i) ORDER BY i").fetchall()
print("RESULT", json.dumps({"rows": rows, "stats": con.stats()["total"]}))
"""


@pytest.fixture
def con(tmp_path):
    c = llmdb.connect(cache_path=str(tmp_path / "cache.sqlite"))
    yield c
    c.close()


def _entries(tmp_path) -> int:
    return cache_entries(tmp_path / "cache.sqlite")


# ---- across processes ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """Two processes on one cache at the same time: rows 0-7 and 4-11 (12 distinct)."""
    cache_dir = tmp_path_factory.mktemp("shared-cache")
    procs = [start_child(CHILD, cache_dir, "0", "8"), start_child(CHILD, cache_dir, "4", "8")]
    return cache_dir, [finish_child(p) for p in procs]


def test_two_processes_use_one_cache_at_once(two_processes):
    cache_dir, outs = two_processes
    for out, first in zip(outs, (0, 4), strict=True):
        assert len(out.splitlines()) == 1, out  # the result alone: no DuckDB bar on stdout
        result = child_result(out)
        assert [i for i, _ in result["rows"]] == list(range(first, first + 8))
        assert all(isinstance(answer, str) for _, answer in result["rows"])
        assert result["stats"]["calls"] + result["stats"]["cache_hits"] == 8
    assert cache_entries(cache_dir / "results.sqlite") == 12


def test_hit_after_a_process_restart(two_processes):
    cache_dir, outs = two_processes
    again = child_result(run_child(CHILD, cache_dir, "0", "12"))
    assert again["stats"]["calls"] == 0 and again["stats"]["cache_hits"] == 12
    answers = dict(map(tuple, again["rows"]))
    for out in outs:  # the same answers the first processes printed
        assert all(answers[i] == answer for i, answer in child_result(out)["rows"])


# ---- size limit ----------------------------------------------------------------------------

def _put_in_order(cache: ResultCache, keys: list[str], value: str = "x" * 97) -> None:
    for key in keys:
        cache.put(key, value)
        time.sleep(0.002)  # distinct last-used times


def _keys(cache: ResultCache) -> set[str]:
    return {k for k, in cache._db.execute("SELECT key FROM results").fetchall()}


def test_size_limit_evicts_the_least_recently_used(tmp_path):
    cache = ResultCache(tmp_path / "lru.sqlite", max_bytes=256 << 10)
    keys = [f"k{i:03d}" for i in range(200)]
    value = "x" * 1000
    _put_in_order(cache, keys[:100], value)  # about 100 KB: within the limit
    assert len(_keys(cache)) == 100
    assert len(cache.get_many(keys[:5])) == 5  # used again: now the newest
    _put_in_order(cache, keys[100:], value)
    survivors = _keys(cache)
    assert 100 < len(survivors) < 200
    # Evicted: the least recently used, in order (a prefix of keys[5:]); the five used
    # again and the newest stayed.
    evicted = [k for k in keys if k not in survivors]
    assert evicted == keys[5 : 5 + len(evicted)]
    cache.close()


def test_size_limit_is_kept_while_writing(tmp_path):
    cache = ResultCache(tmp_path / "lru.sqlite", max_bytes=64 << 10)
    keys = [f"{i:03d}" for i in range(600)]
    for key in keys:
        cache.put(key, "x" * 97)
    survivors = _keys(cache)
    assert len(survivors) < 600
    assert keys[0] not in survivors and keys[-1] in survivors
    cache.close()


def test_size_limit_holds_on_disk_wal_and_shm_included(tmp_path):
    """The limit is on the files, not on the entries' own bytes: short answers under real
    keys took 3x their bytes on disk (both indexes, page overhead) and the WAL and its
    32 KiB -shm index came on top (1.02x the limit when the -shm was left out),
    and a trim's deletions went through the WAL at once (1.4x the limit until the
    checkpoint). Rows are written one transaction each, as a query's rows complete, while
    another thread watches the files."""
    limit = 1 << 20
    path = tmp_path / "disk.sqlite"
    files = [path, tmp_path / "disk.sqlite-wal", tmp_path / "disk.sqlite-shm"]

    def on_disk() -> int:
        return sum(f.stat().st_size for f in files if f.exists())

    peak, done = [0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], on_disk())
            time.sleep(0.0005)

    cache = ResultCache(path, max_bytes=limit)
    rng = random.Random(0)
    keys = [request_key("row", i) for i in range(12_000)]
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for key in keys:
            cache.put(key, rng.choice([True, False, "Paris", "The answer is 42."]))
    finally:
        done.set()
        watcher.join()
    assert peak[0] <= limit
    assert len(cache.get_many(keys[-500:])) == 500
    assert cache.stats()["entries"] > 2500  # evicted to 90%, not to almost nothing
    cache.clear()  # the pages go back to the file system
    assert on_disk() < limit / 4
    cache.close()


def test_size_limit_holds_for_many_short_writers(tmp_path):
    """Jobs of a few hundred rows each, one process (here: one cache object) after another,
    on one file: each checks the file, where a count of its own writes never reached the
    period of a check."""
    limit = 200_000
    path = tmp_path / "jobs.sqlite"
    for job in range(20):
        cache = ResultCache(path, max_bytes=limit)
        for i in range(200):
            cache.put(request_key(job, i), "answer " * 5)
        cache.close()
    assert sum(f.stat().st_size for f in tmp_path.iterdir() if f.name != "jobs.sqlite-shm") \
        <= limit


@pytest.mark.parametrize("rows_per_put", [1, 400])
def test_size_limit_holds_after_every_put_at_a_small_limit(tmp_path, rows_per_put):
    """At 200 KB the WAL's sixteenth of the limit is 3 pages, where one row's transaction
    writes up to 12 (a split) and a put_many of 400 rows wrote 28 (1.3x the limit after
    it). The files, WAL and -shm included, are within the limit after every put: no
    margin."""
    limit = 200_000
    path = tmp_path / "small.sqlite"
    files = [path, tmp_path / "small.sqlite-wal", tmp_path / "small.sqlite-shm"]
    cache = ResultCache(path, max_bytes=limit)
    keys = [request_key("row", i) for i in range(4000)]
    worst = 0
    for i in range(0, len(keys), rows_per_put):
        cache.put_many([(key, "answer " * 5) for key in keys[i : i + rows_per_put]])
        worst = max(worst, sum(f.stat().st_size for f in files if f.exists()))
    assert worst <= limit
    assert len(cache.get_many(keys[-100:])) == 100  # the newest kept: evicted to 90%
    assert cache.stats()["entries"] > 250
    cache.close()


# ---- what the key covers -------------------------------------------------------------------

BASE = "llm_complete('Name a color.', max_tokens := 4)"
VARIANTS = [
    "llm_complete('Name a color.', max_tokens := 5)",
    "llm_complete('Name a color.', max_tokens := 4, system := 'Be brief.')",
    "llm_complete('Name a color.', max_tokens := 4, stop := ['zzz'])",
    "llm_complete('Name a color.', max_tokens := 4, temperature := 0.7, seed := 1)",
    "llm_complete('Name a color!', max_tokens := 4)",
    # The same rendered prompt as llm_filter('Name a color.'), but another function.
    "llm_complete('Name a color.' || chr(10) || chr(10) || 'Answer with yes or no.', "
    "max_tokens := 4)",
    "llm_filter('Name a color.')",
    "llm_classify('Name a color.', ['red', 'blue'], instruction := 'Pick one.')",
    "llm_classify('Name a color.', ['red', 'green'], instruction := 'Pick one.')",
]


def test_key_changes_with_whatever_changes_the_answer(con, tmp_path):
    con.execute(f"SELECT {BASE}").fetchall()
    assert last_query(con)["cache_hits"] == 0
    con.execute(f"SELECT {BASE}").fetchall()
    assert last_query(con)["cache_hits"] == 1 and last_query(con)["calls"] == 0
    entries = _entries(tmp_path)
    for variant in VARIANTS:
        con.execute(f"SELECT {variant}").fetchall()
        stats = last_query(con)
        assert stats["cache_hits"] == 0 and stats["calls"] > 0, variant
        # A new entry (and a filter's or classify's calibration prior, where this process
        # has not computed it before).
        assert _entries(tmp_path) > entries, variant
        entries = _entries(tmp_path)
        con.execute(f"SELECT {variant}").fetchall()
        assert last_query(con)["cache_hits"] == 1, variant


def test_filter_and_filter_score_share_their_entry(con, tmp_path):
    score = con.execute("SELECT llm_filter_score('Say yes.')").fetchall()[0][0]
    entries = _entries(tmp_path)
    keep = con.execute("SELECT llm_filter('Say yes.')").fetchall()[0][0]
    assert last_query(con)["cache_hits"] == 1 and keep == (score >= 0.5)
    assert _entries(tmp_path) == entries


def test_a_rerun_over_cached_rows_pays_no_calibration(con):
    """A classify's calibration (labels x 2 x labels scorings) is cached with its rows: a
    new process (its in-memory priors empty) answering from the cache calls no model."""
    from llmdb import functions

    query = ("SELECT llm_classify(p, ['red', 'green', 'blue']) "
             "FROM (VALUES ('the sky'), ('grass')) v(p)")
    first = con.execute(query).fetchall()
    functions._priors.clear()  # as in a new process
    assert con.execute(query).fetchall() == first
    assert last_query(con)["calls"] == 0 and last_query(con)["cache_hits"] == 2


def test_unseeded_sampling_is_not_cached(con, tmp_path):
    query = "SELECT llm_complete('Name a color.', max_tokens := 4, temperature := 0.7)"
    for _ in range(2):
        con.execute(query).fetchall()
        assert last_query(con)["calls"] == 1 and last_query(con)["cache_hits"] == 0
    assert not (tmp_path / "cache.sqlite").exists() or _entries(tmp_path) == 0


def test_failed_calls_are_not_cached(con, tmp_path):
    query = "SELECT llm_complete(?, max_tokens := 4, on_error := 'null')"
    for _ in range(2):
        assert con.execute(query, ["word " * 9000]).fetchall() == [(None,)]
        assert last_query(con)["errors"] == 1 and last_query(con)["cache_hits"] == 0
    assert not (tmp_path / "cache.sqlite").exists() or _entries(tmp_path) == 0


def test_cache_clear_empties_it(con, tmp_path):
    query = "SELECT llm_complete('Name thing ' || i, max_tokens := 3) FROM range(3) t(i)"
    con.execute(query).fetchall()
    assert _entries(tmp_path) == 3
    assert con.execute("SELECT llm_cache_clear()").fetchall() == [(3,)]
    assert _entries(tmp_path) == 0
    con.execute(query).fetchall()
    assert last_query(con)["calls"] == 3 and last_query(con)["cache_hits"] == 0


def test_cache_off_neither_reads_nor_writes(tmp_path):
    cached = llmdb.connect()  # the default cache, under this test's LLMDB_CACHE_DIR
    cached.execute("SELECT llm_complete('Name a color.', max_tokens := 3)").fetchall()
    path = tmp_path / "cache" / "results.sqlite"  # (own_cache_dir's)
    assert cache_entries(path) == 1
    off = llmdb.connect(cache=False)
    off.execute("SELECT llm_complete('Name a color.', max_tokens := 3)").fetchall()
    assert last_query(off)["calls"] == 1 and last_query(off)["cache_hits"] == 0
    off.execute("SELECT llm_complete('Name a fruit.', max_tokens := 3)").fetchall()
    assert cache_entries(path) == 1
