"""Launch-ahead: the engine schedules and launches step N+1 before it reads step N, the
pending tokens of N taken from its samples on the device. GPUs run this way by default; on
the CPU it is asked for, and here it must give what the step-by-step engine gives: the same
tokens, texts, stops, scores, log-probabilities and seeded samples, with preemption,
aborts and the hidden cache, and no block left behind."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from llmdb.engine.engine import LLMEngine
from llmdb.engine.params import SamplingParams
from llmdb.engine.sched.request import PENDING_TOKEN
from llmdb.engine.sched.scheduler import SchedulerOutput

from .helpers import CHAT_QUESTIONS, assert_same_tokens, chat
from .test_engine import _mixed_prompts

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from random_model import write_random_model  # noqa: E402


@pytest.fixture
def ahead(engine):
    """The shared fp32 engine, launching ahead; put back as it was afterwards."""
    saved = engine.launch_ahead
    yield engine
    engine.launch_ahead = saved
    assert engine._in_flight is None
    assert engine.pool.num_free == engine.pool.num_blocks


def _run_both(engine: LLMEngine, submit) -> dict[bool, list]:
    """submit(engine) -> request ids, run to the end step by step and launching ahead."""
    got = {}
    for launch_ahead in (False, True):
        engine.launch_ahead = launch_ahead
        ids = submit(engine)
        got[launch_ahead] = [engine.wait(i) for i in ids]
    return got


def _prompt(engine: LLMEngine, i: int) -> list[int]:
    q = CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)] + " Answer in detail." * (i % 3)
    return engine.encode_prompt(chat(q))


MIXED = [
    SamplingParams(max_tokens=1, ignore_eos=True),
    SamplingParams(max_tokens=2, ignore_eos=True),
    SamplingParams(max_tokens=9),  # may stop at EOS: its extra launched token is dropped
    SamplingParams(max_tokens=24, stop=[".", "\n"]),
    SamplingParams(max_tokens=16, ignore_eos=True, logprobs=3),
    SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=16, temperature=1.2, top_k=20, seed=11),
    SamplingParams(max_tokens=30, ignore_eos=True),
]


def test_mixed_requests_give_what_the_step_by_step_engine_gives(ahead):
    def submit(eng):
        ids = [eng.add_request(_prompt(eng, i), p) for i, p in enumerate(MIXED)]
        ids.append(eng.add_score_request(chat("The capital of France is"), " Paris, a city."))
        ids.append(eng.add_choice_request(_prompt(eng, 3), [330, 1401, 17]))
        return ids

    got = _run_both(ahead, submit)
    assert any(r.finish_reason == "stop" for r in got[True][: len(MIXED)])
    for i, (a, b) in enumerate(zip(got[False], got[True], strict=True)):
        if i < len(MIXED):
            assert_same_tokens(ahead, _prompt(ahead, i), a.token_ids, b.token_ids)
        if a.token_ids == b.token_ids:
            assert (a.text, a.finish_reason) == (b.text, b.finish_reason)
        assert b.finish_reason in ("stop", "length")
        assert b.usage.generated_tokens == len(b.token_ids)
        assert PENDING_TOKEN not in b.token_ids
    lp_a, lp_b = got[False][4].logprobs, got[True][4].logprobs
    assert len(lp_b) == 16 and all(len(top) == 3 for _, top in lp_b)
    assert [c for c, _ in lp_b] == pytest.approx([c for c, _ in lp_a], abs=1e-4)
    for k in (-2, -1):  # the score and the choice
        a, b = got[False][k], got[True][k]
        assert b.continuation_logprobs == pytest.approx(a.continuation_logprobs, abs=1e-4)
        assert b.candidate_logprobs == pytest.approx(a.candidate_logprobs, abs=1e-4)


def test_requests_that_end_by_length_are_not_run_again(ahead):
    """A request whose pending token is its last (max_tokens) is held, not launched once
    more: launching ahead takes as many steps as running step by step."""
    prompts = [_prompt(ahead, i) for i in range(6)]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (1, 3, 3, 8, 8, 13)]
    steps = {}
    for launch_ahead in (False, True):
        ahead.launch_ahead = launch_ahead
        before = ahead.runner.steps
        results = ahead.generate(prompts, params)
        steps[launch_ahead] = ahead.runner.steps - before
        assert [len(r.token_ids) for r in results] == [1, 3, 3, 8, 8, 13]
    assert steps[True] == steps[False]


def test_results_arrive_one_step_late(ahead):
    ahead.launch_ahead = True
    rid = ahead.add_request(_prompt(ahead, 0), SamplingParams(max_tokens=4, ignore_eos=True))
    req = ahead._requests[rid]
    ahead.step()  # the prefill: launched, not read
    assert req.output_ids == [PENDING_TOKEN] and ahead._in_flight is not None
    ahead.step()  # the first decode launched from the pending token; the prefill read
    assert len(req.output_ids) == 2 and req.output_ids[0] != PENDING_TOKEN
    assert req.output_ids[1] == PENDING_TOKEN
    assert len(ahead.wait(rid).token_ids) == 4


def test_the_step_log_names_what_each_call_launched(ahead):
    """One entry per step call; launching ahead, the last call only reads (on the CPU
    nothing is a captured graph)."""
    prompt = _prompt(ahead, 0)
    try:
        for launch_ahead, kinds in ((False, ["eager"] * 4), (True, ["eager"] * 4 + ["none"])):
            ahead.launch_ahead, ahead.step_log = launch_ahead, []
            ahead.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))
            assert [k for k, _, _ in ahead.step_log] == kinds
            assert all(0 <= host <= wall for _, wall, host in ahead.step_log)
    finally:
        ahead.step_log = None


def test_preemption_and_abort_while_a_step_is_in_flight(ahead):
    prompts = [_prompt(ahead, i) for i in range(5)]
    params = SamplingParams(max_tokens=14, ignore_eos=True)
    ahead.launch_ahead = False
    ref = [r.token_ids for r in ahead.generate(prompts, params)]
    ahead.launch_ahead = True
    ids = [ahead.add_request(p, params) for p in prompts]
    for _ in range(5):
        ahead.step()
    assert ahead._in_flight is not None
    with ahead._cond:  # the newest two lose their blocks while their tokens are pending
        for _ in range(2):
            ahead.scheduler.preempt(SchedulerOutput(), ahead.scheduler.running[-1])
    ahead.abort(ids[0])
    results = [ahead.wait(i) for i in ids]
    assert results[0].finish_reason == "abort"
    for p, r, got in zip(prompts[1:], ref[1:], results[1:], strict=True):
        assert_same_tokens(ahead, p, r, got.token_ids)


def test_a_small_pool_preempts_and_never_overflows():
    eng = LLMEngine("smollm2-135m", dtype="fp32", kv_cache_bytes=36 * 16 * 46080,
                    launch_ahead=True)  # 36 blocks
    assert eng.describe()["launch_ahead"] is True
    prompts = _mixed_prompts(eng, 8)  # 41 to 106 tokens: with 16 new ones, 46 blocks' worth
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    eng.launch_ahead = False
    # As in test_engine's: references from one batch that fits the pool, 7 (the request
    # the small pool preempts) among them.
    refs = (0, 5, 7)
    ref = dict(zip(refs, [r.token_ids for r in eng.generate([prompts[i] for i in refs], params)],
                   strict=True))
    eng.launch_ahead = True
    ids = [eng.add_request(p, params) for p in prompts]
    preempted = set()
    while eng.has_unfinished:
        eng.step()
        assert eng.pool.num_free >= 0
        preempted |= {r.request_id for r in eng.scheduler.running if r.num_preemptions}
    results = [eng.wait(i) for i in ids]
    assert preempted, "the workload was meant to overflow the pool"
    for i, r in ref.items():
        assert_same_tokens(eng, prompts[i], r, results[i].token_ids)
    assert eng.pool.num_free == eng.pool.num_blocks


@pytest.mark.parametrize("shape", ["tiny-opt", "tiny-llama-mha"])
def test_apt_with_hidden_cache(tmp_path, shape):
    """apt switching requests between KV and hidden caches under memory pressure."""
    path = write_random_model(shape, tmp_path / shape, seed=5, dtype=torch.float32,
                              device="cpu")
    rng = random.Random(1)
    prompts = [[rng.randrange(4, 280) for _ in range(rng.randrange(2, 30))]
               for _ in range(12)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    got = {}
    for launch_ahead in (False, True):
        eng = LLMEngine(str(path), device="cpu", dtype="float32", kv_cache_bytes=1 << 18,
                        block_size=4, policy="apt", launch_ahead=launch_ahead)
        kinds = set()
        ids = [eng.add_request(p, params) for p in prompts]
        while eng.has_unfinished:
            eng.step()
            kinds |= {r.cache_type for r in eng.scheduler.running}
        got[launch_ahead] = [eng.wait(i).token_ids for i in ids]
        assert kinds == {"kv", "hidden"}, "the pool was meant to be short"
        assert eng.pool.num_free == eng.pool.num_blocks
    for p, a, b in zip(prompts, got[False], got[True], strict=True):
        assert_same_tokens(eng, p, a, b)


def test_a_last_request_stopping_on_a_token_leaves_no_step_unread(ahead):
    """Its stop token is read after the next step was launched for it: that step, of
    finished requests only, is read at once, not left in flight with the engine idle."""
    ahead.launch_ahead = True
    prompt = _prompt(ahead, 0)
    first = ahead.generate([prompt], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    r = ahead.generate([prompt], SamplingParams(max_tokens=3,
                                                stop_token_ids=[first.token_ids[1]]))[0]
    assert r.finish_reason == "stop" and r.token_ids == first.token_ids[:2]
    assert not ahead.has_unfinished and ahead._in_flight is None
