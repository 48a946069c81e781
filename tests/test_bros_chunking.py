"""BROS (sched/policies/bros.py): an RT prefill that does not fit the time left whole takes the
largest chunk that does.

Proved: `largest_chunk(fits, n)` returns the largest m < n with fits(m) for monotone
predicates (random thresholds, against a linear scan), 0 when no m >= 1 fits, and only asks
about 0 < m < n, O(log n) times. In a Scheduler with policy "bros" and the llama2-7b-a100 cost
model, with RT requests decoding under a tight TBT SLO and an RT request waiting with a long
prompt, one step schedules every decode plus a prefill chunk of the waiting request that is
shorter than its prompt and is exactly the longest whose step time (the cost model on the
step's chunks, computed here independently) stays within the smallest residual; a prompt that
fits whole is not chunked.
"""

from __future__ import annotations

import math
import random

import pytest

from llmdb.engine.cache.block_pool import BlockPool
from llmdb.engine.costmodel import Chunk, preset
from llmdb.engine.params import SamplingParams
from llmdb.engine.sched.policies import make_policy
from llmdb.engine.sched.policies.bros import largest_chunk
from llmdb.engine.sched.request import Request
from llmdb.engine.sched.scheduler import Scheduler

SLO_TBT = 0.1
SLO_TTFT = 10.0
DECODERS = 4
PROMPT = 64  # the decoding requests' prompt length


def _scan(fits, n: int) -> int:
    return max((m for m in range(1, n) if fits(m)), default=0)


def test_largest_chunk_matches_a_linear_scan():
    rng = random.Random(0)
    for _ in range(500):
        n = rng.randint(0, 3000)
        threshold = rng.randint(-5, n + 5)
        asked: list[int] = []

        def fits(m, threshold=threshold, asked=asked):
            asked.append(m)
            return m <= threshold

        got = largest_chunk(fits, n)
        assert got == _scan(lambda m, t=threshold: m <= t, n), (n, threshold)
        assert all(0 < m < n for m in asked)
        assert len(asked) <= math.ceil(math.log2(max(n, 2))) + 1


@pytest.mark.parametrize("n", [0, 1, 2, 10, 4096])
def test_largest_chunk_is_zero_when_nothing_fits(n):
    assert largest_chunk(lambda m: False, n) == 0
    assert largest_chunk(lambda m: m <= 0, n) == 0
    assert largest_chunk(lambda m: True, n) == max(n - 1, 0)


def _rt(rid: str, ids: list[int], arrival: float) -> Request:
    r = Request(rid, ids, SamplingParams(max_tokens=8, ignore_eos=True), arrival=arrival)
    r.priority, r.slo_ttft_s, r.slo_tbt_s = "RT", SLO_TTFT, SLO_TBT
    return r


def _decoding_scheduler():
    """A bros scheduler with DECODERS RT requests that got their first token at t=0.02."""
    cm = preset("llama2-7b-a100")
    sched = Scheduler(BlockPool(2000, 16, enable_prefix_caching=False), 4096, 1024,
                      make_policy("bros"), max_prefill_tokens=4096, cost_model=cm)
    decoders = [_rt(f"d{i}", list(range(1000 * i, 1000 * i + PROMPT)), 0.0)
                for i in range(DECODERS)]
    for r in decoders:
        sched.add(r)
    out = sched.schedule(0.0)
    assert out.scheduled == [(r, PROMPT) for r in decoders]  # whole prompts: time to spare
    sched.update_from_output(out.scheduled, None, 0.02)  # what the engine does after it
    assert all(r.is_decode for r in decoders)
    return sched, cm, decoders


@pytest.mark.parametrize("prompt_len", [3000, 2000])
def test_long_rt_prefill_takes_the_largest_chunk_within_the_residual(prompt_len):
    sched, cm, decoders = _decoding_scheduler()
    waiting = _rt("long", list(range(50_000, 50_000 + prompt_len)), 0.02)
    sched.add(waiting)
    now = 0.03
    # The smallest residual is the decodes': their TBT SLO less the 10 ms since their token.
    # (The waiting request has its whole TTFT SLO ahead: one chunk under P, so k = 1.)
    budget = SLO_TBT - (now - 0.02)
    assert budget < SLO_TTFT - (now - waiting.arrival)

    def step_time(m: int) -> float:
        chunks = [Chunk(PROMPT, 1, True)] * DECODERS + ([Chunk(0, m, False)] if m else [])
        return cm.step_time(chunks)

    assert step_time(prompt_len) > budget, "the prompt was meant not to fit whole"
    expected = _scan(lambda m: step_time(m) <= budget, prompt_len)
    assert expected == largest_chunk(lambda m: step_time(m) <= budget, prompt_len)
    assert 0 < expected < prompt_len

    out = sched.schedule(now)
    assert out.scheduled == [(r, 1) for r in decoders] + [(waiting, expected)]
    assert not out.preempted
    assert cm.step_time(sched.costs(out.scheduled)) <= budget
    assert step_time(expected + 1) > budget  # one token more would miss the deadline
    assert waiting.num_computed == 0 and len(waiting.block_ids) == -(-expected // 16)


def test_rt_prefill_that_fits_whole_is_not_chunked():
    sched, cm, decoders = _decoding_scheduler()
    waiting = _rt("short", list(range(50_000, 50_300)), 0.02)
    sched.add(waiting)
    chunks = [Chunk(PROMPT, 1, True)] * DECODERS + [Chunk(0, 300, False)]
    assert cm.step_time(chunks) <= SLO_TBT - 0.01
    out = sched.schedule(0.03)
    assert out.scheduled == [(r, 1) for r in decoders] + [(waiting, 300)]
