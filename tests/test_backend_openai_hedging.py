"""Hedged requests (llmdb/backends/hedging.py): a row held by a replica that has stopped
answering is sent to an idle replica too, the first answer wins and the other copy is
cancelled; a replica that is merely slow, or capacity other rows wait for, is left alone.
Against scripted endpoints (tests/openai_stub.py); no model runs here."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

pytest.importorskip("uvicorn", reason="uvicorn is not installed")

from llmdb.backends import GenerationRequest  # noqa: E402
from llmdb.backends.hedging import StallRule  # noqa: E402
from llmdb.engine.params import SamplingParams  # noqa: E402

from .openai_stub import StubEndpoint, chat_answer  # noqa: E402


def _answering_after(seconds: float):
    async def handler(path, body):
        await asyncio.sleep(seconds)
        return 200, {}, chat_answer("ok " + body["messages"][-1]["content"])
    return handler


def _rows(backend, n: int, timeout: float = 60) -> tuple[list, float]:
    """n rows at once: their results in order, and the seconds until the last finished."""
    done = threading.Semaphore(0)
    t0 = time.monotonic()
    handles = [backend.submit(GenerationRequest([{"role": "user", "content": f"r{i}"}],
                                                SamplingParams(max_tokens=1)), done.release)
               for i in range(n)]
    for _ in handles:
        assert done.acquire(timeout=timeout), "a row never finished"
    return [backend.collect(h) for h in handles], time.monotonic() - t0


def _answered(backend) -> list[int]:
    return [sum(r.answered.values()) for r in backend.pool.replicas]


@pytest.mark.parametrize("hedging", [True, False])
def test_rows_held_by_a_hung_replica_go_to_an_idle_one(backends, hedging):
    """Before, the hung replica's rows waited for timeout_s (300 s by default) while the
    other replica sat idle."""
    with StubEndpoint(_answering_after(30)) as hung, \
            StubEndpoint(_answering_after(0.05)) as healthy:
        backend = backends([hung.url, healthy.url], timeout_s=4, stall_factor=3,
                           stall_s=0.2 if hedging else None)
        results, took = _rows(backend, 6)
        assert [r.text for r in results] == [f"ok r{i}" for i in range(6)]
        assert _answered(backend) == [0, 6], "a row was answered twice, or not at all"
        stuck = {s.body["messages"][-1]["content"] for s in hung.seen}
        assert len(stuck) == 3 and len(healthy.seen) == 6
        if hedging:
            # The stall time: 3 x the slowest answer (0.05 s and the round trip), at least
            # 0.2 s.
            assert took < 2.5
            assert backend.pool.replicas[0].down_until > time.monotonic(), \
                "three stalled rows in a row leave the rotation"
        else:
            assert took >= 4.0  # (the timeout, then a retry on the healthy replica)
        assert [r.in_flight for r in backend.pool.replicas] == [0, 0]


def test_the_first_answer_wins_and_the_other_copy_is_cancelled(backends):
    """A replica that is slow, not hung, answers first: the copy sent meanwhile is cancelled
    and the row is answered once, by it."""
    async def slow_then_fast(path, body):
        await asyncio.sleep(0.05 if body["messages"][-1]["content"] == "warm" else 1.0)
        return 200, {}, chat_answer("from the slow one")

    with StubEndpoint(slow_then_fast) as slow, StubEndpoint(_answering_after(3)) as slower:
        backend = backends([slow.url, slower.url], stall_s=0.2, stall_factor=1)
        done = threading.Event()
        handle = backend.submit(GenerationRequest([{"role": "user", "content": "warm"}],
                                                  SamplingParams(max_tokens=1)), done.set)
        assert done.wait(30) and backend.collect(handle).error is None
        [result], took = _rows(backend, 1)
        assert result.text == "from the slow one" and took < 2.5
        assert [len(slow.seen), len(slower.seen)] == [2, 1]  # the copy went out, and lost
        assert _answered(backend) == [2, 0]
        assert backend.pool.replicas[1].in_flight == 0


def test_a_copy_never_takes_a_slot_a_row_waits_for(backends):
    """With rows queued for the healthy replica's one slot, the hung replica's row is sent
    there only after them: the copy delays no row."""
    with StubEndpoint(_answering_after(30)) as hung, \
            StubEndpoint(_answering_after(0.1)) as healthy:
        backend = backends([hung.url, healthy.url], max_concurrency=1, stall_s=0.1,
                           stall_factor=1, timeout_s=20)
        results, took = _rows(backend, 6)
        assert all(r.error is None for r in results) and took < 5
        [stuck] = [s.body["messages"][-1]["content"] for s in hung.seen]
        order = [s.body["messages"][-1]["content"] for s in healthy.seen]
        assert len(order) == 6 and order[-1] == stuck, order


def test_a_busy_replica_answering_its_other_rows_is_not_hedged(backends):
    """A slow row on a replica that keeps answering its others is left to finish there:
    nothing is paid twice."""
    async def busy_handler(path, body):
        i = int(body["messages"][-1]["content"][1:])
        await asyncio.sleep(2.0 if i == 0 else 0.1 * i)  # an answer every 0.2 s, r0 last
        return 200, {}, chat_answer("ok")

    with StubEndpoint(busy_handler) as busy, StubEndpoint(_answering_after(0.05)) as idle:
        backend = backends([busy.url, idle.url], stall_s=1.0, stall_factor=1)
        results, took = _rows(backend, 20)
        assert all(r.error is None for r in results) and took >= 2.0
        assert "r0" in {s.body["messages"][-1]["content"] for s in busy.seen}
        assert len(busy.seen) + len(idle.seen) == 20


def test_the_stall_time_follows_the_slowest_recent_answer():
    rule = StallRule(floor_s=10, factor=3)
    assert rule.stall_s("/chat/completions") == 30  # nothing seen: 3 x the floor
    for s in (2, 4, 3):
        rule.observe("/chat/completions", s)
    rule.observe("/tokenize", 0.01)
    assert rule.stall_s("/chat/completions") == 12
    assert rule.stall_s("/tokenize") == 10  # the floor
    for _ in range(64):  # the slowest falls out of the window
        rule.observe("/chat/completions", 5)
    assert rule.stall_s("/chat/completions") == 15


def test_a_copy_goes_only_where_it_costs_no_row():
    """The rule's conditions one by one, on a pool's bookkeeping: the other replica must be
    in rotation, not stalled itself, and have a free slot that no request waits for."""
    from llmdb.backends.replicas import ReplicaLimits, ReplicaPool

    pool = ReplicaPool(["http://a:1/v1", "http://b:1/v1"],
                       ReplicaLimits(max_concurrency=2, stall_s=1.0, stall_factor=1))
    stalled, other = pool.replicas
    now = time.monotonic()
    other.in_flight, other.last_answer = 1, now  # busy, and answering
    assert pool._hedge_to(stalled, "/chat/completions", reserve=False) is other
    pool._waiting = 1  # a row waits for a slot: the free one is its
    assert pool._hedge_to(stalled, "/chat/completions", reserve=False) is None
    pool._waiting = 0
    other.in_flight = 2  # no free slot
    assert pool._hedge_to(stalled, "/chat/completions", reserve=False) is None
    other.in_flight, other.last_answer = 1, now - 5  # stalled itself
    assert pool._hedge_to(stalled, "/chat/completions", reserve=False) is None
    other.last_answer, other.down_until = now, now + 30  # out of rotation
    assert pool._hedge_to(stalled, "/chat/completions", reserve=False) is None
    other.down_until = 0.0
    assert pool._hedge_to(stalled, "/chat/completions") is other and other.in_flight == 2
    assert pool._hedge_to(stalled, "/chat/completions") is None  # (that slot is taken now)
    asyncio.run(pool.aclose())


def test_the_stall_time_scales_with_the_tokens_a_request_asks_for():
    """Recent answers of 2 tokens in 0.5 s say nothing of how long 2,000 take: the held
    request's max_tokens scales the slowest answer's time (never down)."""
    rule = StallRule(floor_s=1, factor=3)
    for _ in range(5):
        rule.observe("/chat/completions", 0.5, tokens=2)
    assert rule.stall_s("/chat/completions", tokens=2000) == pytest.approx(1500)
    assert rule.stall_s("/chat/completions", tokens=1) == 1.5  # (shorter: unscaled)
    assert rule.stall_s("/chat/completions") == 1.5
    rule.observe("/chat/completions", 8.0, tokens=400)  # the slowest sets the rate
    assert rule.stall_s("/chat/completions", tokens=2000) == pytest.approx(120)
    rule.observe("/tokenize", 0.01)  # no tokens generated: never scaled, the floor holds
    assert rule.stall_s("/tokenize", tokens=2000) == 1


def test_a_long_request_on_a_busy_replica_is_not_copied(backends):
    """Before, the stall time was 3 x the slowest recent answer whatever the held request
    asked: after short answers (0.05 s), a row asking 2,000 tokens of a replica generating
    them for 2 s was copied to the idle replica at 0.3 s and paid twice. The short answers
    asked for 2,000 tokens too, and stopped after 2: what they generated counts."""
    async def handler(path, body):
        await asyncio.sleep(2.0 if body["messages"][-1]["content"] == "long" else 0.05)
        return 200, {}, chat_answer("ok")  # (usage: 2 tokens generated)

    def row(content: str) -> str:
        done = threading.Event()
        handle = backend.submit(GenerationRequest([{"role": "user", "content": content}],
                                                  SamplingParams(max_tokens=2000)), done.set)
        assert done.wait(30)
        return handle

    with StubEndpoint(handler) as a, StubEndpoint(handler) as b:
        backend = backends([a.url, b.url], stall_s=0.2, stall_factor=3)
        for i in range(4):
            assert backend.collect(row(f"r{i}")).error is None
        assert backend.collect(row("long")).error is None
        copies = [s for s in a.seen + b.seen if s.body["messages"][-1]["content"] == "long"]
        assert len(copies) == 1, "the long row was sent twice"
