"""Progress on stderr for jobs past a few dozen rows, and the engine-options clash."""

from __future__ import annotations

import pytest

import llmdb


def _query(con: llmdb.Connection, rows: int) -> list:
    return con.execute(
        "SELECT llm_complete('Count to ' || i, max_tokens := 2) FROM range(?) t(i)", [rows]
    ).fetchall()


def test_progress_bar_for_long_jobs_only(tmp_path, capfd):
    con = llmdb.connect(cache=False, progress=True)
    _query(con, 8)
    assert "row" not in capfd.readouterr().err  # a few rows: no bar
    _query(con, 40)
    err = capfd.readouterr().err
    assert "llm:" in err and "/40" in err
    quiet = llmdb.connect(cache=False, progress=False)
    _query(quiet, 40)
    assert capfd.readouterr().err == ""


def test_contradicting_engine_options_raise():
    con = llmdb.connect(cache=False)
    _query(con, 1)  # the shared engine is running with its defaults
    running = con.session.backend().engine.dtype
    other = "fp32" if str(running) == "torch.bfloat16" else "bf16"
    with pytest.raises(ValueError, match="already runs with"):
        llmdb.connect(dtype=other)
