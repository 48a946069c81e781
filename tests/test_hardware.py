"""The threads an engine takes unless told (engine/hardware.py)."""

from __future__ import annotations

import os

from llmdb.engine.hardware import default_threads


def test_omp_num_threads_where_set(monkeypatch):
    # Ray sets it to a worker's CPUs: two workers on two cores take one thread each.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert default_threads() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert default_threads() == 3
    for outer_four in ("4,2", " 4"):  # as OpenMP reads them: nested levels, spaces
        monkeypatch.setenv("OMP_NUM_THREADS", outer_four)
        assert default_threads() == 4


def test_else_the_cpus_this_process_may_run_on(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert default_threads() == len(os.sched_getaffinity(0))
    for unusable in ("", "0", "-1", "two", "\u00b2"):  # ("²": a digit int() refuses)
        monkeypatch.setenv("OMP_NUM_THREADS", unusable)
        assert default_threads() == len(os.sched_getaffinity(0))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})  # a taskset of one CPU
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert default_threads() == 1
