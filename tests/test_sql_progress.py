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


def test_one_big_batch_moves_the_bar_before_its_rows_finish(monkeypatch):
    """Rows finishing together at the end of one batch used to leave the bar at 0% until
    then; rows in flight now count by their tokens."""
    import pyarrow as pa

    from llmdb import batch
    from llmdb.session import Options, Session

    monkeypatch.setattr(batch, "PROGRESS_EVERY_S", 0.0)  # report at every wait slice
    session = Session(Options(progress=True, cache=False))
    seen = []
    report = session.progress_partial

    def record(rows: float) -> None:
        seen.append((session._bar_done, rows, session._bar is not None))
        report(rows)

    monkeypatch.setattr(session, "progress_partial", record)
    rows = pa.table({"i": list(range(40))})
    llmdb.complete(rows, "Count from 1 to {i}, one number a line.", max_tokens=24,
                   session=session)
    assert any(done == 0 and partial > 0 and bar for done, partial, bar in seen), seen
    # The position reported never goes back: a finishing row's share becomes a whole row.
    positions = [done + partial for done, partial, _ in seen]
    assert all(b >= a - 1e-9 for a, b in zip(positions, positions[1:], strict=False)), seen


def test_a_jupyter_kernel_shows_the_bar_by_default(monkeypatch):
    """A notebook's stderr is not a terminal, yet it shows the bar's updates: the default
    (progress=None) shows it there, as in a terminal."""
    import sys
    import types

    from llmdb.session import Options, Session

    class ZMQInteractiveShell:  # what IPython's get_ipython() returns in a Jupyter kernel
        pass

    session = Session(Options(cache=False))
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    session.progress_add(100)
    assert session._bar is None  # a plain pipe: no bar
    fake = types.SimpleNamespace(get_ipython=lambda: ZMQInteractiveShell())
    monkeypatch.setitem(sys.modules, "IPython", fake)
    session.progress_add(1)
    assert session._bar is not None
    session.progress_done(101)
