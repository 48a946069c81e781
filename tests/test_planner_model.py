"""A few planner shapes on the bundled model (fp32, a few dozen rows, 2 generated tokens):
the same rows as plain DuckDB, and the minimal number of model calls."""

from __future__ import annotations

import duckdb
import pytest

import llmdb
from llmdb.planner import LEARNED

from .planner_shapes import SHAPES, Oracle, load, make_tables
from .sql_support import MODEL, release_engine, start_engine

ROWS = 30
NAMES = ("and", "order_by_limit", "case_when")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    start_engine()
    LEARNED.clear()
    con = llmdb.connect(cache=False, progress=False)
    plain = duckdb.connect()
    plain.execute("SET enable_progress_bar = false")
    plain_session = llmdb.register(plain, cache=False)
    for c in (con, plain):
        make_tables(c, ROWS)
    yield con, plain, plain_session, load(plain, Oracle(MODEL))
    con.close()
    plain.close()
    release_engine()


def _calls(session, run):
    before = session.stats()["total"]["model_rows"]
    out = run()
    return out, session.stats()["total"]["model_rows"] - before


@pytest.mark.parametrize("name", NAMES)
def test_shape_on_the_model(env, name):
    con, plain, plain_session, data = env
    shape = next(s for s in SHAPES if s.name == name)
    got, calls = _calls(con.session, lambda: con.execute(shape.sql).fetchall())
    want, naive = _calls(plain_session, lambda: plain.execute(shape.sql).fetchall())
    if not shape.ordered:
        got, want = sorted(got, key=repr), sorted(want, key=repr)
    assert got == want
    assert calls == shape.minimal(data, lambda a, b: True)
    assert calls <= naive
