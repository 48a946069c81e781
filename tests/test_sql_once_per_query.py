"""A query pays for a call once, however often DuckDB evaluates it: an IN list or a WHERE's
CASE evaluates its call once per item or branch, and DuckDB hands a UDF 2,048 rows at a time.
A failed call fails again without the model for the rest of its query (not in the next one:
a failure may be transient), and with the result cache off an answer is reused for the rest
of its query (never in another). Alike on a plain DuckDB connection (llmdb.register) and on
llmdb.connect's, planned or not. The model is the hash stand-in."""

from __future__ import annotations

import threading
import time
from collections import Counter

import duckdb
import pyarrow as pa
import pytest

import llmdb
from llmdb import functions
from llmdb.backends.standin import StandinBackend

BAD = "bad row"


class Counting(StandinBackend):
    """The stand-in, counting the requests sent per row text; a request for the row BAD
    fails at submit (as a server's 503 would)."""

    name = "counting"

    def __init__(self) -> None:
        super().__init__()
        self.sent: Counter[str] = Counter()

    def submit(self, request, on_finish):
        row = next((r for r in ("good row", BAD, "other row") if r in request.prompt), "?")
        self.sent[row] += 1
        if row == BAD:
            raise ValueError("503 from the server")
        return super().submit(request, on_finish)


def _connect(kind: str, backend: Counting, **options):
    """A connection and the session that counts its calls."""
    if kind == "register":
        con = duckdb.connect()
        return con, llmdb.register(con, model="counting", backend=backend, **options)
    con = llmdb.connect(model="counting", backend=backend, planner=kind == "planned", **options)
    return con, con.session


KINDS = ["register", "as written", "planned"]
# Calls DuckDB evaluates more than once per row: each IN item and each CASE branch of a WHERE
# is a comparison of its own (a WHERE gets no common-subexpression elimination).
REPEATED = {
    "complete in a list": "llm_complete(p, max_tokens := 2) IN ('w1', 'w2', 'w3')",
    "filter in a case": "CASE WHEN llm_filter(p) THEN 1 WHEN NOT llm_filter(p) THEN 2 END = 3",
    "classify in a case": "CASE WHEN llm_classify(p, ['x', 'y']) = 'x' THEN 1 "
                          "WHEN llm_classify(p, ['x', 'y']) = 'y' THEN 2 END = 3",
}


def test_duckdb_evaluates_an_in_lists_call_once_per_item():
    """Why the query needs a memory: the UDF really is called again per item."""
    con = duckdb.connect()
    seen: list[int] = []
    con.create_function("f", lambda x: (seen.append(len(x)), x)[1], ["VARCHAR"], "VARCHAR",
                        type="arrow", side_effects=False)
    assert con.execute("SELECT x FROM (VALUES ('a'), ('b')) v(x) "
                       "WHERE f(x) IN ('c', 'd', 'e')").fetchall() == []
    assert seen == [2, 2, 2]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("where", REPEATED.values(), ids=REPEATED.keys())
def test_a_failed_call_reaches_the_model_once_per_query(tmp_path, kind, where):
    backend = Counting()
    con, session = _connect(kind, backend, cache_path=str(tmp_path / "cache.sqlite"),
                            on_error="null")
    con.execute("CREATE TABLE t AS SELECT * FROM (VALUES ('good row'), ('bad row')) v(p)")
    query = f"SELECT p FROM t WHERE {where}"
    for run in (1, 2):  # the next query tries again: the failure may have passed
        assert con.execute(query).fetchall() == []
        assert backend.sent[BAD] == run
        # Listed and counted once per query.
        assert con.execute("SELECT prompt FROM llm_errors()").fetchall() == [(BAD,)] * run
        assert session.stats()["total"]["errors"] == run
    con.close()


@pytest.mark.parametrize("kind", KINDS)
def test_without_the_cache_identical_calls_run_once_per_query(kind):
    """cache=False: no answer outlives its query, but within one query a call is paid once,
    however many DuckDB vectors (2,048 rows) repeat it."""
    backend = Counting()
    con, session = _connect(kind, backend, cache=False)
    con.register("t", pa.table({"p": ["good row", "other row", "good row"] * 2000}))
    query = "SELECT llm_complete(p, max_tokens := 2) AS c FROM t"
    first = con.execute(query).fetchall()
    assert backend.sent == {"good row": 1, "other row": 1}
    stats = session.stats()["last_query"]
    assert (stats["rows"], stats["calls"], stats["dedup_hits"]) == (6000, 2, 5998)
    assert con.execute(query).fetchall() == first
    assert backend.sent == {"good row": 2, "other row": 2}  # fresh answers for a new query
    con.close()


def test_on_a_plain_connection_the_queries_of_a_transaction_share_their_memory(tmp_path):
    """Without llmdb's connection, a query is known by its DuckDB transaction (see
    session.DUCKDB_QUERY): inside BEGIN ... COMMIT a failed call is tried again only after
    the transaction."""
    backend = Counting()
    con, _ = _connect("register", backend, cache_path=str(tmp_path / "cache.sqlite"),
                      on_error="null")
    query = "SELECT llm_complete('bad row', max_tokens := 2)"
    con.execute("BEGIN")
    for _ in range(2):
        assert con.execute(query).fetchall() == [(None,)]
    con.execute("COMMIT")
    assert backend.sent[BAD] == 1
    assert con.execute(query).fetchall() == [(None,)]
    assert backend.sent[BAD] == 2
    con.close()


class FailsSlowly(StandinBackend):
    """The stand-in, noting the threads that submit; a request for the row BAD fails at
    submit after a while (as a prompt too long for the context does once tokenized), long
    enough for another thread that meets the same call to wait for it."""

    name = "fails-slowly"

    def __init__(self) -> None:
        super().__init__()
        self.threads: set[int] = set()

    def submit(self, request, on_finish):
        self.threads.add(threading.get_ident())
        if BAD in request.prompt:
            time.sleep(0.5)
            raise ValueError("the prompt is longer than the context")
        return super().submit(request, on_finish)


def _four_row_groups(tmp_path, bad: str) -> str:
    """A file DuckDB scans on several threads, a row group each: 4 x 2,048 rows, each row
    group ending with a row of `bad`."""
    path = tmp_path / "t.parquet"
    duckdb.execute(f"COPY (SELECT CASE WHEN i % 2048 = 2047 THEN '{bad}' ELSE 'row ' || i END "
                   f"AS p FROM range(4 * 2048) r(i)) TO '{path}' (ROW_GROUP_SIZE 2048)")
    return f"'{path}'"


def _failures(kind: str, backend, threads: int, query: str, **options) -> tuple:
    """What the query's failed rows came to: counters, and the rows llm_errors() lists."""
    con, session = _connect(kind, backend, cache=False, on_error="null", **options)
    con.execute(f"SET threads = {threads}")
    con.execute(query).fetchall()
    s = session.stats()["last_query"]
    listed = con.execute("SELECT prompt, error FROM llm_errors()").fetchall()
    con.close()
    return (s["rows"], s["errors"], s["dedup_hits"], s["model_rows"]), listed


@pytest.mark.parametrize("kind", ["register", "as written"])  # (the planner: one batch)
def test_a_call_failing_on_two_threads_is_recorded_once(tmp_path, kind):
    """Each DuckDB thread meets the failing row; one computes it, the other waits for it.
    Reference: the same query on one thread."""
    query = f"SELECT count(llm_complete(p, max_tokens := 1)) FROM {_four_row_groups(tmp_path, BAD)}"
    backend = FailsSlowly()
    threaded = _failures(kind, backend, 2, query)
    assert len(backend.threads) == 2
    one_thread = _failures(kind, FailsSlowly(), 1, query)
    assert threaded == one_thread
    assert threaded[0] == (4 * 2048, 1, 3, 4 * 2047 + 1) and len(threaded[1]) == 1


@pytest.mark.parametrize("kind", ["register", "as written"])
def test_an_ill_formed_row_on_two_threads_is_recorded_once(tmp_path, kind, monkeypatch):
    """A row refused before any call (max_tokens < 0), met by two threads at once: its
    error is written slowly here, so that both are between checking and noting it."""
    describe = functions.describe_row
    monkeypatch.setattr(functions, "describe_row",
                        lambda *a: (time.sleep(0.5), describe(*a))[1])
    query = (f"SELECT count(llm_complete(p, max_tokens := CASE WHEN p = '{BAD}' THEN -1 "
             f"ELSE 1 END)) FROM {_four_row_groups(tmp_path, BAD)}")
    backend = FailsSlowly()
    threaded = _failures(kind, backend, 2, query)
    assert len(backend.threads) == 2
    assert threaded == _failures(kind, FailsSlowly(), 1, query)
    assert threaded[0] == (4 * 2048, 1, 3, 4 * 2047) and len(threaded[1]) == 1
