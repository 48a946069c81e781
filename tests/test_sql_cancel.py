"""Cancellation and resume: Ctrl-C mid-query frees everything and the engine keeps serving;
a process killed mid-query leaves its finished rows in the cache, and a rerun computes only
the rest."""

from __future__ import annotations

import json
import signal
import sqlite3
import threading
import time
from pathlib import Path

import duckdb
import pytest

import llmdb
from llmdb import batch
from llmdb.engine.params import SamplingParams
from llmdb.session import Options, Session

from .sql_support import (
    cache_entries,
    chat,
    child_result,
    finish_child,
    run_child,
    start_child,
    start_engine,
)


def long_query(rows: int) -> str:
    return ("SELECT llm_complete('Write a long story about the number ' || i || '.', "
            f"max_tokens := 64) FROM range({rows}) t(i)")


SIGINT_CHILD = f"""
import json, os, signal, threading, time
import llmdb
from llmdb import batch
from llmdb.engine.params import SamplingParams
from llmdb.engine.process_engines import shared_engine

# Steps of at most 128 tokens, so that Ctrl-C never waits long for the current one; no
# prefix cache, so that a prompt run alone is computed the same way before and after.
con = llmdb.connect(cache=False, max_num_batched_tokens=128, enable_prefix_caching=False)
eng = shared_engine("smollm2-135m")
msgs = [{{"role": "user", "content": "Say hi."}}]
ref = eng.generate([msgs], SamplingParams(max_tokens=3))[0].text

def announce():  # once the query's requests hold blocks of the engine
    while eng.pool.num_free == eng.pool.num_blocks:
        time.sleep(0.01)
    print("RUNNING", flush=True)

threading.Thread(target=announce, daemon=True).start()
try:
    con.execute("{long_query(200)}").fetchall()
    raise SystemExit("the query finished before the interrupt")
except KeyboardInterrupt:
    pass
interrupted = con.stats()["total"]
assert not eng.has_unfinished, "requests were left in the engine"
assert eng.pool.num_free == eng.pool.num_blocks, (
    f"blocks leaked: {{eng.pool.num_free}} of {{eng.pool.num_blocks}} free")
assert not eng._results, f"results left uncollected: {{list(eng._results)}}"
assert not batch._inflight, "in-flight entries leaked"
got = con.execute("SELECT llm_complete('Say hi.', max_tokens := 3)").fetchall()[0][0]
assert got == ref, (got, ref)
got = con.sql("SELECT llm_complete('Say hi.', max_tokens := 3)").fetchall()[0][0]
assert got == ref, (got, ref)
print("OK", json.dumps(interrupted), flush=True)

# Ctrl-C again, and exit at once: the engine may still be inside a step then, which must not
# abort the process ("terminate called without an active exception").
def interrupt_when_busy():
    while not eng.has_unfinished:
        time.sleep(0.01)
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGINT)

threading.Thread(target=interrupt_when_busy, daemon=True).start()
try:
    con.execute("{long_query(200)}").fetchall()
except KeyboardInterrupt:
    pass
"""


@pytest.fixture(scope="module", autouse=True)
def eng():
    return start_engine()


def test_sigint_mid_query_frees_blocks_and_engine_keeps_serving(tmp_path):
    """Ctrl-C on Connection.execute(...).fetchall(): KeyboardInterrupt, no request, block,
    result or in-flight entry left behind, the same answers after; then a second Ctrl-C and
    an immediate exit, which must not crash the process (the child returns 0)."""
    proc = start_child(SIGINT_CHILD, tmp_path / "cache")
    try:
        assert proc.stdout.readline().strip() == "RUNNING"  # the rows hold blocks
        time.sleep(1.0)  # the 200 rows are being computed, far from done
        proc.send_signal(signal.SIGINT)
        out = finish_child(proc, timeout=60)
    finally:
        proc.kill()
    [line] = [line for line in out.splitlines() if line.startswith("OK ")]
    interrupted = json.loads(line[3:])
    # All 200 rows had been sent to the model; the interrupt stopped them far from their end.
    assert interrupted["calls"] == 200 and interrupted["generated_tokens"] < 200 * 64


def test_interrupt_in_process_then_both_query_paths_work(eng):
    con = llmdb.connect(cache=False)
    budget = eng.scheduler.max_num_batched_tokens
    eng.scheduler.max_num_batched_tokens = 64  # short steps: the interrupt lands quickly
    timer = threading.Timer(1.0, con.interrupt)  # a user's cancel from another thread
    timer.start()
    try:
        with pytest.raises(llmdb.QueryCancelled, match="(?i)interrupt|cancel") as e:
            con.execute(long_query(16)).fetchall()
        assert isinstance(e.value, duckdb.Error)  # still what plain DuckDB code catches
    finally:
        timer.join()
        eng.scheduler.max_num_batched_tokens = budget
    assert not eng.has_unfinished
    assert eng.pool.num_free == eng.pool.num_blocks, "blocks leaked"
    assert not batch._inflight
    ref = eng.generate([chat("Say hi.")], SamplingParams(max_tokens=3))[0].text
    # A lazy relation is a new query too: the old cancel token must not stop it.
    assert con.sql("SELECT llm_complete('Say hi.', max_tokens := 3)").fetchall()[0][0] == ref
    assert con.execute("SELECT llm_complete('Say hi.', max_tokens := 3)").fetchall()[0][0] == ref
    con.close()


RESUME_CHILD = """
import json, sys
import llmdb
from llmdb import batch
n, max_num_seqs, path, max_tokens = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
batch.CHECKPOINT_EVERY_S = float(sys.argv[5])
engine_options = {"max_num_seqs": max_num_seqs} if max_num_seqs else {}
con = llmdb.connect(cache_path=path, **engine_options)
print("START", flush=True)
rows = con.execute(
    "SELECT i, llm_complete('Write one sentence about the number ' || i || '.', "
    f"max_tokens := {max_tokens}) AS c FROM range({n}) t(i) ORDER BY i").fetchall()
print("RESULT", json.dumps({"stats": con.stats()["total"], "rows": rows}))
"""


def _entries_or_zero(path: Path) -> int:
    try:
        return cache_entries(path) if path.exists() else 0
    except sqlite3.OperationalError:  # the child has not created the table yet
        return 0


def test_sigkill_mid_query_then_rerun_computes_only_missing_rows(tmp_path):
    n = 60
    path = tmp_path / "results.sqlite"
    # Four rows at a time, so that completed rows reach the cache in small waves.
    proc = start_child(RESUME_CHILD, tmp_path, str(n), "4", str(path), "16", "1000")
    try:
        assert proc.stdout.readline().strip() == "START"
        deadline = time.monotonic() + 90
        while _entries_or_zero(path) < 10:
            assert proc.poll() is None, "the child ended before it was killed"
            assert time.monotonic() < deadline, "no rows reached the cache"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGKILL
    before = cache_entries(path)
    assert 10 <= before < n, f"{before} entries: the kill did not land mid-query"

    out = child_result(run_child(RESUME_CHILD, tmp_path, str(n), "0", str(path), "16", "1000"))
    assert [r[0] for r in out["rows"]] == list(range(n)), "rows were lost"
    assert all(isinstance(r[1], str) for r in out["rows"])
    assert out["stats"]["cache_hits"] == before
    assert out["stats"]["calls"] == n - before
    assert cache_entries(path) == n


def _partials(path: Path) -> dict[str, list]:
    db = sqlite3.connect(path, timeout=30)
    try:
        rows = db.execute("SELECT key, value FROM results WHERE key LIKE '%:partial'")
        return {k: json.loads(v) for k, v in rows.fetchall()}
    finally:
        db.close()


def test_a_cancelled_query_saves_its_rows_tokens_and_the_rerun_goes_on_from_them(eng, tmp_path):
    """No row of a batch had finished when the query was cancelled: the rerun still pays only
    for the tokens the first run did not generate, and answers as an uninterrupted run."""
    query = long_query(6).replace("max_tokens := 64", "max_tokens := 24")
    fresh = llmdb.connect(cache=False)
    expected = fresh.execute(query).fetchall()
    full = fresh.stats()["last_query"]
    fresh.close()

    path = tmp_path / "results.sqlite"
    con = llmdb.connect(cache_path=path)

    def interrupt_part_way():
        while not any(len(r.output_ids) >= 8 for r in list(eng._requests.values())):
            time.sleep(0.005)
        con.interrupt()

    interrupter = threading.Thread(target=interrupt_part_way)
    interrupter.start()
    with pytest.raises(llmdb.QueryCancelled):
        con.execute(query).fetchall()
    interrupter.join()
    saved = _partials(path)
    assert cache_entries(path) == len(saved) == 6, "a row finished, or one saved nothing"
    assert all(5 <= len(outs[0]) < 24 for outs in saved.values()), saved

    assert con.execute(query).fetchall() == expected
    rerun = con.stats()["last_query"]
    assert rerun["calls"] == 6 and rerun["cache_hits"] == 0
    # (the first run's blocks may serve the resumed tokens: only prompt tokens count)
    assert rerun["cached_tokens"] <= rerun["prompt_tokens"]
    assert rerun["resumed_tokens"] == sum(len(outs[0]) for outs in saved.values())
    assert rerun["generated_tokens"] + rerun["resumed_tokens"] == full["generated_tokens"]
    assert not _partials(path), "the answers' partial entries were left behind"
    assert cache_entries(path) == 6
    con.close()


def test_sigkill_before_any_row_finished_then_rerun_goes_on_from_the_saved_tokens(tmp_path):
    """All rows run together and none has finished when the process is killed outright:
    what the last checkpoint saved is not paid for again."""
    n, max_tokens = 16, 48
    path = tmp_path / "results.sqlite"
    proc = start_child(RESUME_CHILD, tmp_path, str(n), "0", str(path), str(max_tokens), "0.2")
    try:
        assert proc.stdout.readline().strip() == "START"
        deadline = time.monotonic() + 90
        saved: dict[str, list] = {}
        while len(saved) < n or min(len(outs[0]) for outs in saved.values()) < 4:
            assert proc.poll() is None, "the child ended before it was killed"
            assert time.monotonic() < deadline, "no tokens were saved"
            time.sleep(0.02)
            try:
                saved = _partials(path) if path.exists() else {}
            except sqlite3.OperationalError:  # the child has not created the table yet
                pass
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    saved = _partials(path)
    assert cache_entries(path) == len(saved) == n, "rows finished before the kill"

    out = child_result(run_child(RESUME_CHILD, tmp_path, str(n), "0", str(path),
                                 str(max_tokens), "1000"))
    assert [r[0] for r in out["rows"]] == list(range(n)), "rows were lost"
    assert all(isinstance(r[1], str) and r[1] for r in out["rows"])
    assert out["stats"]["calls"] == n and out["stats"]["cache_hits"] == 0
    assert out["stats"]["resumed_tokens"] == sum(len(outs[0]) for outs in saved.values())
    assert not _partials(path) and cache_entries(path) == n


def test_ctrl_c_in_a_dataframe_call_saves_its_rows_tokens(eng, tmp_path, monkeypatch):
    """A DataFrame call runs its batch on the caller's thread, where Ctrl-C arrives as a
    KeyboardInterrupt (SQL's is a QueryCancelled): the rows' tokens are saved all the same.
    The interrupt is raised where the caller's thread waits for the rows (the main thread's
    signal cannot be aimed at a test run by pytest-xdist)."""
    import pandas as pd

    monkeypatch.setattr(batch, "CHECKPOINT_EVERY_S", 1000.0)  # only the interrupt saves
    wait = batch._Batch.report_progress

    def ctrl_c_part_way(self):
        if any(len(r.output_ids) >= 8 for r in list(eng._requests.values())):
            raise KeyboardInterrupt
        wait(self)

    monkeypatch.setattr(batch._Batch, "report_progress", ctrl_c_part_way)
    session = Session(Options.from_kwargs(cache_path=tmp_path / "results.sqlite",
                                          progress=False))
    df = pd.DataFrame({"x": [f"the number {i}" for i in range(6)]})
    with pytest.raises(KeyboardInterrupt):
        llmdb.complete(df, "Write a long story about {x}.", max_tokens=40, session=session)
    saved = _partials(tmp_path / "results.sqlite")
    assert len(saved) == 6 and all(len(outs[0]) >= 5 for outs in saved.values()), saved
    assert not eng.has_unfinished


def test_ctrl_c_in_the_cli_exits_130_with_a_message(tmp_path):
    """`llmdb sql` cancelled by SIGINT (whether during start-up or mid-query) says so and exits
    with 130 at once (cli.entry): no traceback, no wait for the engine to wind down."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "LLMDB_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.Popen(
        [sys.executable, "-c", "from llmdb.cli import entry; entry()", "sql", "--no-cache",
         "--no-progress", long_query(200)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    time.sleep(8)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "llmdb: cancelled" in err and "Traceback" not in err
