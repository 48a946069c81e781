"""Every scheduling policy, on the real engine and in the simulator."""

from __future__ import annotations

import random

import pytest

from llmdb.engine.cache.block_pool import BlockPool
from llmdb.engine.costmodel import preset
from llmdb.engine.engine import LLMEngine
from llmdb.engine.params import SamplingParams
from llmdb.engine.research.sim import SimConfig, simulate
from llmdb.engine.research.workloads import RequestSpec, be_batch, dataset
from llmdb.engine.sched.policies import POLICIES, make_policy
from llmdb.engine.sched.policies.bros import BASE_BATCH
from llmdb.engine.sched.policies.infermax import MIN_OBSERVATIONS, InferMaxPolicy
from llmdb.engine.sched.request import Request
from llmdb.engine.sched.scheduler import Scheduler

from .helpers import CHAT_QUESTIONS, assert_same_tokens, chat

PARAMS = SamplingParams(max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def small_engine() -> LLMEngine:
    """fp32, 48 blocks of 16 tokens: eight prompts of ~40-120 tokens overflow it."""
    return LLMEngine("smollm2-135m", dtype="fp32", kv_cache_bytes=48 * 16 * 46080)


@pytest.fixture(scope="module")
def prompts(small_engine) -> list[list[int]]:
    return [small_engine.encode_prompt(chat((q + " Answer briefly. ") * (1 + i % 3)))
            for i, q in enumerate(CHAT_QUESTIONS[:8])]


@pytest.fixture(scope="module")
def reference(small_engine, prompts) -> list[list[int]]:
    return [small_engine.generate([p], PARAMS)[0].token_ids for p in prompts]


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_policy_on_the_engine_keeps_tokens_and_frees_blocks(small_engine, prompts, reference,
                                                             policy):
    eng = small_engine
    default, eng.scheduler.policy = eng.scheduler.policy, make_policy(policy)
    try:
        ids = [eng.add_request(p, PARAMS, priority="RT" if i % 2 else "BE")
               for i, p in enumerate(prompts)]
        while eng.has_unfinished:
            eng.step()
            assert eng.pool.num_free >= 0
        results = [eng.wait(i) for i in ids]
    finally:
        eng.scheduler.policy = default
    for p, ref, r in zip(prompts, reference, results, strict=True):
        assert r.finish_reason == "length"
        assert_same_tokens(eng, p, ref, r.token_ids)
    assert eng.pool.num_free == eng.pool.num_blocks, "blocks leaked"


def _check_sim(result, specs) -> None:
    by_id = {s.request_id: s for s in specs}
    for m in result.requests:
        if m.request_id in by_id:
            assert m.finished and len(m.token_times) == by_id[m.request_id].output_len
        assert m.token_times == sorted(m.token_times)
        assert m.token_times[0] >= m.arrival


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_policy_in_the_simulator_completes_every_request(policy):
    specs = dataset("sharegpt", 60, rate=4.0, context=2048, seed=1)
    cfg = SimConfig(num_blocks=400, max_num_batched_tokens=2048, max_prefill_tokens=512,
                    hidden_ratio=0.5, slo_ttft_s=1.0, slo_tbt_s=1.0)
    result = simulate(specs, policy, preset("opt13b-a100"), cfg,
                      be_stream=lambda k, now: be_batch(8, now, batch_index=k), be_batches=2)
    _check_sim(result, specs)
    assert len(result.of("BE")) == 16 and all(m.finished for m in result.of("BE"))
    assert max(used for _, used in result.memory) <= cfg.num_blocks


def test_fcfs_never_mixes_prefill_and_decode():
    specs = dataset("lmsys", 40, rate=20.0, context=2048, seed=2)
    cfg = SimConfig(num_blocks=300, max_num_batched_tokens=2048)
    seen = []
    simulate(specs, "fcfs", preset("llama2-7b-a100"), cfg,
             observe=lambda out: seen.append({r.is_decode for r, _ in out.scheduled}))
    assert len(seen) > 10 and all(len(kinds) <= 1 for kinds in seen)
    assert {True} in seen and {False} in seen


def test_apt_offers_hidden_cache_only_where_it_saves_memory():
    specs = dataset("sharegpt", 80, rate=6.0, context=2048, seed=3)
    hidden_used = {}
    for ratio in (0.5, None):  # OPT (h = m/2) vs. an executor without a hidden cache
        cfg = SimConfig(num_blocks=300, hidden_ratio=ratio, max_num_batched_tokens=4096,
                        max_prefill_tokens=4096, slo_ttft_s=1.0, slo_tbt_s=1.0)
        kinds = set()

        def observe(out, kinds=kinds):
            kinds.update(r.cache_type for r, _ in out.scheduled)
            kinds.update("hidden" for _ in out.converted)  # hidden until this step

        _check_sim(simulate(specs, "apt", preset("opt13b-a100"), cfg, observe=observe), specs)
        hidden_used[ratio] = "hidden" in kinds
    assert hidden_used == {0.5: True, None: False}


def test_infermax_reserves_from_observed_output_lengths():
    policy = InferMaxPolicy()
    sched = Scheduler(BlockPool(100, 16, False), 512, 64, policy)
    req = Request("r", list(range(40)), SamplingParams(max_tokens=500))
    assert policy.reserve_tokens(sched, req) == 40  # no observations: the prompt only
    for n in range(1, MIN_OBSERVATIONS + 1):
        done = Request(f"d{n}", [1], SamplingParams(max_tokens=100))
        done.output_ids, done.finish_reason = [0] * (10 * n), "stop"
        policy.observe_finished(done)
    expected = sorted(10 * n for n in range(1, MIN_OBSERVATIONS + 1))[
        int(0.9 * MIN_OBSERVATIONS)]
    assert policy.reserve_tokens(sched, req) == 40 + expected


def test_infermax_keeps_a_histogram_of_output_lengths_not_every_one():
    """A server runs for days: the lengths it reserves from take memory bounded by the
    lengths there are, not by the requests served, and the reserve stays the quantile of
    every length observed."""
    policy = InferMaxPolicy()
    sched = Scheduler(BlockPool(100, 16, False), 512, 64, policy)
    req = Request("r", list(range(40)), SamplingParams(max_tokens=500))
    rng = random.Random(0)
    lengths = []
    for n in range(1, 5001):
        done = Request(f"d{n}", [1], SamplingParams(max_tokens=100))
        done.output_ids, done.finish_reason = [0] * rng.randint(1, 60), "length"
        lengths.append(len(done.output_ids))
        policy.observe_finished(done)
        if n in (MIN_OBSERVATIONS, 17, 100, 101, 5000):
            expected = sorted(lengths)[int(0.9 * n)]
            assert policy.reserve_tokens(sched, req) == 40 + expected
    assert len(policy.observed) <= 60


def test_bros_batch_size_doubles_when_calm_and_resets_on_danger():
    policy = make_policy("bros")
    sched = Scheduler(BlockPool(2000, 16, False), 4096, 1024, policy,
                      cost_model=preset("llama2-7b-a100"))
    for i in range(4):
        req = Request(f"be{i}", list(range(32)), SamplingParams(max_tokens=64))
        sched.add(req)
    sched.schedule(0.0)  # BE only: nothing to protect, the batch size grows
    assert policy.batch_size == 2 * BASE_BATCH
    late = Request("rt", list(range(3000)), SamplingParams(max_tokens=4), arrival=0.0)
    late.priority, late.slo_ttft_s, late.slo_tbt_s = "RT", 0.05, 0.05
    tight = Request("rt2", list(range(3000)), SamplingParams(max_tokens=4), arrival=0.0)
    tight.priority, tight.slo_ttft_s, tight.slo_tbt_s = "RT", 10.0, 10.0
    sched.add(late)
    sched.add(tight)
    # At t=0.01 `late` can still make it only with a tiny batch: the time test stops the RT
    # loop, and the batch size falls back to the base.
    sched.schedule(0.01)
    assert policy.batch_size == BASE_BATCH


def test_rr_alternates_classes():
    specs = [RequestSpec(0.0, 32, 8, "RT", f"rt{i}") for i in range(4)] + [
        RequestSpec(0.0, 32, 8, "BE", f"be{i}") for i in range(4)]
    classes = []
    result = simulate(specs, "rr", preset("llama2-7b-a100"), SimConfig(num_blocks=200),
                      observe=lambda out: classes.append({r.priority for r, _ in out.scheduled}))
    _check_sim(result, specs)
    assert all(len(c) == 1 for c in classes)
    assert classes[0] != classes[1]


def test_apt_never_switches_a_request_larger_than_the_pool_to_kv():
    """A pool of 42 blocks of 2 tokens; a prompt of 85 tokens (43 blocks as K/V: only hidden
    states fit) shares 52 of them (26 blocks) with a request of 61 running beside it. The
    blocks shared raise apt's budget past the pool, and its KV option was picked: projected
    to K/V on the shared prefix, it filled the pool and both were evicted (6 evictions,
    156 steps). It holds its 43 blocks whoever shares them: it stays hidden states."""
    shared = list(range(1000, 1052))
    specs = [RequestSpec(0.0, 61, 20, "BE", "a", tuple(shared + list(range(9)))),
             RequestSpec(0.0, 85, 4, "BE", "b", tuple(shared + list(range(100, 133))))]
    cfg = SimConfig(num_blocks=42, block_size=2, max_num_batched_tokens=2,
                    max_prefill_tokens=None, hidden_ratio=0.5, prefix_caching=True)
    res = simulate(specs, "apt", preset("opt13b-a100"), cfg)
    assert all(r.finished for r in res.requests)
    assert res.evictions == 0
