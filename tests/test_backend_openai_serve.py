"""The openai backend against two real `llmdb serve` processes (the bundled model in fp32,
an API key, free loopback ports), started once for the module,
one engine thread each (two servers and this process share the machine's cores).

SQL through the two replicas must answer what the local engine answers (greedy, fp32, where
batching does not change tokens); with one server killed (SIGKILL) mid-query, the query
must complete on the other with every row answered once: the client's count of answers per
replica must add up to the rows, and match what each server's access log says it served.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("uvicorn", reason="uvicorn is not installed")
pytest.importorskip("fastapi", reason="fastapi is not installed")

import llmdb  # noqa: E402
from llmdb.backends.openai import OpenAIBackend  # noqa: E402

from .helpers import CHAT_QUESTIONS  # noqa: E402
from .openai_stub import free_port  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("eng", "own_cache_dir")]

MODEL = "smollm2-135m"
KEY_VAR = "LLMDB_TEST_SERVE_KEY"
KEY = "serve-test-key-8c1f"
MAX_TOKENS = 12
QUERY = f"SELECT q, llm_complete(q, max_tokens := {MAX_TOKENS}) AS a FROM questions ORDER BY q"
CHAT = "/v1/chat/completions"
_CHAT_LINE = re.compile(r'"POST /v1/chat/completions HTTP/1\.1" 200')


class ServeProcess:
    """`llmdb serve` in a child process, its log in a file."""

    def __init__(self, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.log = log
        env = dict(os.environ, LLMDB_API_KEY=KEY, PYTHONUNBUFFERED="1")
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "llmdb.cli", "serve", "--model", MODEL, "--dtype", "fp32",
                 "--threads", "1", "--host", "127.0.0.1", "--port", str(self.port)],
                stdout=out, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, f"llmdb serve exited:\n{self.log.read_text()}"
            try:
                if httpx.get(self.url.removesuffix("/v1") + "/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"llmdb serve did not start:\n{self.log_text()}"
            time.sleep(0.2)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def chat_requests_served(self) -> int:
        return len(_CHAT_LINE.findall(self.log_text()))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("serve-logs")
    procs = [ServeProcess(logs / f"server{i}.log") for i in range(2)]
    try:
        for p in procs:
            p.wait_ready()
        yield procs
    finally:
        for p in procs:
            p.stop()


@pytest.fixture(scope="module")
def questions() -> list[str]:
    return CHAT_QUESTIONS[:8]


def _table(con, questions: list[str]) -> None:
    con.execute("CREATE TABLE questions (q VARCHAR)")
    con.executemany("INSERT INTO questions VALUES (?)", [[q] for q in questions])


@pytest.fixture(scope="module")
def local_answers(eng, questions):
    """The local engine's greedy answers (and scores), the reference."""
    con = llmdb.connect(cache=False)
    _table(con, questions)
    out = {
        "complete": con.sql(QUERY).fetchall(),
        "classify": con.sql("SELECT q, llm_classify(q, ['question', 'instruction']) "
                            "FROM questions ORDER BY q LIMIT 2").fetchall(),
        "filter": con.sql("SELECT q, llm_filter_score('Is this about food? ' || q) "
                          "FROM questions ORDER BY q LIMIT 2").fetchall(),
    }
    con.close()
    return out


@pytest.fixture
def remote(servers, monkeypatch):
    monkeypatch.setenv(KEY_VAR, KEY)
    made = []

    def make(**kw) -> OpenAIBackend:
        b = OpenAIBackend(MODEL, [s.url for s in servers], api_key_env=KEY_VAR, **kw)
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


def test_sql_through_two_servers_equals_the_local_engine(servers, remote, local_answers,
                                                         questions, eng):
    before = [s.chat_requests_served() for s in servers]
    backend = remote(max_concurrency=4)
    con = llmdb.connect(backend=backend, cache=False)
    _table(con, questions)
    assert con.sql(QUERY).fetchall() == local_answers["complete"]
    # Both replicas took part, and each served what the client got from it.
    served = [s.chat_requests_served() - b for s, b in zip(servers, before, strict=True)]
    answered = [r.answered[CHAT] for r in backend.pool.replicas]
    assert sum(answered) == len(questions) and min(answered) > 0
    assert served == answered

    classify = con.sql("SELECT q, llm_classify(q, ['question', 'instruction']) "
                       "FROM questions ORDER BY q LIMIT 2").fetchall()
    assert classify == local_answers["classify"]
    scores = con.sql("SELECT q, llm_filter_score('Is this about food? ' || q) "
                     "FROM questions ORDER BY q LIMIT 2").fetchall()
    # Spellings of yes/no outside the top 20 logprobs are left out (the local engine reads
    # the whole vocabulary): close, not equal.
    for (q, got), (q_ref, want) in zip(scores, local_answers["filter"], strict=True):
        assert q == q_ref and got == pytest.approx(want, abs=0.01)
        assert (got >= 0.5) == (want >= 0.5)
    # /tokenize: the engine's own count, not an estimate.
    assert backend.count_tokens(["Hello, world"]) == [len(eng.tokenizer.encode("Hello, world"))]


def test_a_server_killed_mid_query_loses_no_row(servers, remote, local_answers, questions):
    """Runs last in the module: it kills one of the two servers."""
    victim, survivor = servers
    before = [s.chat_requests_served() for s in servers]
    backend = remote(max_concurrency=3)
    con = llmdb.connect(backend=backend, cache=False)
    _table(con, questions)
    result: list = []
    query = threading.Thread(target=lambda: result.append(con.sql(QUERY).fetchall()))
    query.start()
    dying, alive = backend.pool.replicas
    assert dying.url == victim.url
    deadline = time.monotonic() + 120
    # Mid-query: it has answered some rows and holds others right now (between one answer
    # and its next request it may briefly hold none).
    while True:
        held_at_kill = dying.in_flight
        if dying.answered[CHAT] >= 1 and held_at_kill > 0:
            break
        assert time.monotonic() < deadline and query.is_alive(), "the query ended too soon"
        time.sleep(0.001)
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(30)
    query.join(240)
    assert not query.is_alive(), "the query did not complete on the surviving server"

    assert result == [local_answers["complete"]], "a row was lost or answered wrongly"
    assert held_at_kill > 0 and dying.unreachable > 0, "no request was lost with the server"
    # Every row was answered exactly once: the killed server's answers before it died plus
    # the survivor's, which include the rows resubmitted from the killed one.
    assert dying.answered[CHAT] + alive.answered[CHAT] == len(questions)
    assert survivor.chat_requests_served() - before[1] == alive.answered[CHAT]
    assert victim.chat_requests_served() - before[0] >= dying.answered[CHAT]
    assert dying.down_until > time.monotonic()  # out of rotation
