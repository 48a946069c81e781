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


def test_the_bar_shows_single_rows_after_a_big_jump(monkeypatch, capfd):
    """tqdm by default adapts how many rows it waits for to the steps it saw: after 600 rows
    at once (a batch finishing together) it ignored the next ~90 single rows. The bar is
    redrawn by time alone, at most 1 / PROGRESS_REFRESH_S times a second, and ends on the
    query's rows."""
    import re
    import time

    from llmdb import session as session_module
    from llmdb.session import PROGRESS_REFRESH_S, Options, Session

    closed_at = []

    class Bar(session_module.tqdm):
        def close(self) -> None:
            if not self.disable:  # (tqdm closes again when it is collected)
                closed_at.append(self.n)
            super().close()

    monkeypatch.setattr(session_module, "tqdm", Bar)
    session = Session(Options(progress=True, cache=False))
    session.progress_add(1000)
    time.sleep(PROGRESS_REFRESH_S)
    session.progress_done(600)
    for _ in range(3):
        time.sleep(PROGRESS_REFRESH_S)
        session.progress_done(1)
    shown = [int(n) for n in re.findall(r"(\d+)/1000", capfd.readouterr().err)]
    assert shown[-4:] == [600, 601, 602, 603]
    # Rows finishing fast: a few redraws a second, not one per row.
    start = time.perf_counter()
    for _ in range(393):
        session.progress_done(1)
        time.sleep(0.001)
    session.progress_done(4)
    elapsed = time.perf_counter() - start
    redraws = len(re.findall(r"\d+/1000", capfd.readouterr().err))
    assert redraws <= elapsed / PROGRESS_REFRESH_S + 1, (redraws, elapsed)
    assert closed_at == [1000]
