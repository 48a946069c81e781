"""The bros policy keeps making progress where memory, the step's token budget or the
sequence slots are tight (a helper's stress audit found each of these stalled for ever), and
its answers are those of a roomy engine."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from llmdb.engine.engine import LLMEngine
from llmdb.engine.params import SamplingParams

from .helpers import assert_same_tokens

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from random_model import write_random_model  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(write_random_model("tiny-llama", tmp_path_factory.mktemp("bros") / "m", seed=3,
                                  dtype=torch.float32, device="cpu"))


@pytest.fixture(scope="module")
def roomy(model) -> LLMEngine:
    return LLMEngine(model, device="cpu", dtype="float32", threads=1)


def _run(engine: LLMEngine, requests, roomy: LLMEngine, max_steps: int, between=None) -> list:
    """The requests' results, each checked against the roomy engine's tokens."""
    running = []
    engine.scheduler.observers.append(lambda out: running.append(len(engine.scheduler.running)))
    ids = []
    for i, (prompt, params) in enumerate(requests):
        ids.append(engine.add_request(prompt, params, priority="RT"))
        if between is not None and i == 0:
            between(engine)
    for _ in range(max_steps):
        if not engine.has_unfinished:
            break
        engine.step()
    assert not engine.has_unfinished, "no progress: requests never finished"
    results = [engine.wait(i) for i in ids]
    for r, (prompt, params) in zip(results, requests, strict=True):
        assert_same_tokens(roomy, prompt, roomy.generate([prompt], params)[0].token_ids,
                           r.token_ids)
    assert engine.pool.num_free == engine.pool.num_blocks
    assert max(running) <= engine.scheduler.max_num_seqs
    return results


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 300) for _ in range(n)]


def test_a_waiting_request_without_a_free_slot_does_not_block_the_running_one(model, roomy):
    """One sequence slot: the more urgent waiting request used to take the step's budget,
    then be left out for want of a slot, and every step came out empty."""
    rng = random.Random(0)
    engine = LLMEngine(model, device="cpu", dtype="float32", policy="bros", max_num_seqs=1,
                       max_num_batched_tokens=16, threads=1)
    params = SamplingParams(max_tokens=2)
    _run(engine, [(_prompt(rng, 20), params), (_prompt(rng, 200), params)], roomy, 100)


def test_a_request_waiting_for_a_prefix_does_not_block_the_one_computing_it(model, roomy):
    rng = random.Random(0)
    engine = LLMEngine(model, device="cpu", dtype="float32", policy="bros", block_size=16,
                       max_num_batched_tokens=1, threads=1)
    prefix = _prompt(rng, 32)
    params = SamplingParams(max_tokens=2)
    _, second = _run(engine, [(prefix + [7, 8, 9, 10], params),
                              (prefix + _prompt(rng, 100), params)],
                     roomy, 400, between=lambda e: e.step())
    assert second.usage.cached_tokens == 32  # it waited for the prefix, not computed it


def test_prompts_that_do_not_fit_together_do_not_evict_each_other_for_ever(model, roomy):
    """A prefill's urgency counts its chunks left, so a preempted prompt came back more
    urgent than the one that evicted it, and evicted it in turn: 1,665 preemptions and no
    token in 5,000 steps."""
    rng = random.Random(0)
    engine = LLMEngine(model, device="cpu", dtype="float32", policy="bros", block_size=4,
                       kv_cache_bytes=100 * 4 * 768, max_num_batched_tokens=64,
                       enable_prefix_caching=False, threads=1)
    assert engine.pool.num_blocks == 100
    params = SamplingParams(max_tokens=1)
    _run(engine, [(_prompt(rng, n), params) for n in (65, 193, 193)], roomy, 200)
