"""Apt-Serve's traces (engine/research/workloads.py) and its FCFS-on-hybrid-cache ablation
policy."""

from __future__ import annotations

import random

import numpy as np
import pytest

from llmdb.engine.cache.block_pool import BlockPool
from llmdb.engine.costmodel import preset
from llmdb.engine.params import SamplingParams
from llmdb.engine.research.sim import SimConfig, simulate
from llmdb.engine.research.workloads import (
    LONGBENCH_DOC_WORDS,
    TOKENS_PER_WORD,
    EarlyEos,
    RequestSpec,
    arrivals,
    dataset,
    early_eos,
    humaneval_lengths,
)
from llmdb.engine.sched.policies import make_policy
from llmdb.engine.sched.request import Request, Status
from llmdb.engine.sched.scheduler import Scheduler


def test_humaneval_pairs_are_the_real_prompts_and_canonical_solutions():
    pairs = humaneval_lengths()
    assert len(pairs) == 164
    prompts = np.array([p for p, _ in pairs])
    outputs = np.array([o for _, o in pairs])
    # Canonical solutions are short function bodies: tens of tokens, far below the prompts.
    assert 40 < outputs.mean() < 80 and outputs.max() < 400
    assert 100 < prompts.mean() < 200
    specs = dataset("humaneval", 300, rate=5.0, seed=1)
    assert {(s.prompt_len, s.output_len) for s in specs} <= set(pairs)


def test_longbench_keeps_only_pairs_within_the_context_as_apt_serve_filters_them():
    specs = dataset("longbench", 2000, rate=1.0, seed=2)
    p = np.array([s.prompt_len for s in specs])
    o = np.array([s.output_len for s in specs])
    assert (p + o <= 2048).all() and (p >= 4).all() and (o >= 4).all()
    # Rejection, not truncation: the survivors are the shorter documents, so their mean is
    # well below Multi-News' published ~2,700 tokens, and no prompt was cut to the limit.
    assert p.mean() < LONGBENCH_DOC_WORDS * TOKENS_PER_WORD / 2
    assert 700 < p.mean() < 1400 and 200 < o.mean() < 400
    assert (p + o == 2048).sum() < 10


@pytest.mark.parametrize("cv", [1.0, 5.0])
def test_gamma_arrivals_have_the_requested_rate_and_burstiness(cv):
    t = arrivals(np.random.default_rng(0), rate=2.0, n=200_000, cv=cv)
    gaps = np.diff(t)
    assert gaps.mean() == pytest.approx(0.5, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.1)


def test_early_eos_keeps_prompts_and_arrivals_and_caps_outputs_at_the_reference():
    ref = dataset("sharegpt", 500, rate=2.0, seed=3)
    for eos in (EarlyEos(scale=0.25), EarlyEos(eos_mean=64), EarlyEos(0.5, 128)):
        short = early_eos(ref, eos, seed=3)
        assert [(s.arrival, s.prompt_len, s.request_id) for s in short] == \
            [(s.arrival, s.prompt_len, s.request_id) for s in ref]
        assert all(1 <= s.output_len <= r.output_len for s, r in zip(short, ref, strict=True))
        assert sum(s.output_len for s in short) < 0.6 * sum(r.output_len for r in ref)
    scaled = early_eos(ref, EarlyEos(scale=0.5))
    assert [s.output_len for s in scaled] == [max(1, round(r.output_len * 0.5)) for r in ref]
    assert early_eos(ref, EarlyEos()) == ref  # the default is the reference trace


def test_early_eos_is_the_same_trace_for_every_rate_and_run():
    """apt_repro builds each variant's trace afresh at each rate it tries: the shortened
    lengths must not depend on the rate, the call or the other requests."""
    eos = EarlyEos(eos_mean=64)
    ref = dataset("longbench", 300, rate=0.5, seed=0)
    a = early_eos(ref, eos)
    b = early_eos(dataset("longbench", 300, rate=3.0, seed=0), eos)
    assert [s.output_len for s in a] == [s.output_len for s in b]
    assert early_eos(ref[:100], eos) == a[:100]
    assert [s.output_len for s in a] != [s.output_len for s in early_eos(a, eos, seed=1)]
    longer = early_eos(dataset("longbench", 300, rate=0.5, seed=0), EarlyEos(eos_mean=128))
    assert all(s.output_len <= t.output_len for s, t in zip(a, longer, strict=True))


@pytest.mark.parametrize("mean", [8.0, 64.0])
def test_early_eos_lengths_are_geometric_with_the_given_mean(mean):
    """Uncapped (references far longer than any draw): each token is EOS with probability
    q = 1 / mean, so lengths have mean 1/q, variance (1 - q) / q^2 and P(1) = q."""
    n, q = 40_000, 1 / mean
    ref = [RequestSpec(0.0, 8, 10**9, request_id=f"r{i}") for i in range(n)]
    lens = np.array([s.output_len for s in early_eos(ref, EarlyEos(eos_mean=mean))])
    assert lens.min() == 1
    assert lens.mean() == pytest.approx(mean, rel=0.03)
    assert lens.var() == pytest.approx((1 - q) / q**2, rel=0.06)
    assert (lens == 1).mean() == pytest.approx(q, rel=0.1)


def test_simulator_generates_the_shortened_outputs():
    ref = dataset("humaneval", 40, rate=5.0, seed=4)
    short = early_eos(ref, EarlyEos(eos_mean=16))
    cfg = SimConfig(num_blocks=915, max_num_batched_tokens=2048, max_prefill_tokens=2048)
    res = simulate(short, "fcfs", preset("opt13b-a100"), cfg)
    by_id = {m.request_id: len(m.token_times) for m in res.requests}
    assert [by_id[s.request_id] for s in short] == [s.output_len for s in short]


def _waiting(sched: Scheduler, lengths: list[int]) -> list[Request]:
    reqs = []
    for i, n in enumerate(lengths):
        r = Request(f"r{i}", list(range(n)), SamplingParams(max_tokens=4), arrival=0.0)
        sched.add(r)
        reqs.append(r)
    return reqs


def test_fcfs_hybrid_admits_in_order_taking_hidden_cache_when_kv_does_not_fit():
    pool = BlockPool(10, 16, enable_prefix_caching=False)
    sched = Scheduler(pool, 4096, 64, make_policy("fcfs-hybrid"), hidden_ratio=0.5)
    # 96 tokens: 6 KV blocks or 3 hidden ones. 6 KV fit; then 3 hidden fit (1 block left);
    # the third fits in neither form, and FCFS stops there: the fourth (tiny) waits.
    reqs = _waiting(sched, [96, 96, 96, 8])
    out = sched.schedule(0.0)
    assert [r.request_id for r, _ in out.scheduled] == ["r0", "r1"]
    assert [r.cache_type for r in reqs[:2]] == ["kv", "hidden"]
    assert pool.num_free == 1


def test_fcfs_hybrid_is_plain_fcfs_without_a_hidden_cache():
    specs = dataset("sharegpt", 60, rate=4.0, seed=1)
    cfg = SimConfig(num_blocks=200, max_num_batched_tokens=2048, max_prefill_tokens=2048,
                    slo_ttft_s=1.0, slo_tbt_s=1.0)
    a = simulate(specs, "fcfs", preset("opt13b-a100"), cfg)
    b = simulate(specs, "fcfs-hybrid", preset("opt13b-a100"), cfg)
    assert [m.token_times for m in a.requests] == [m.token_times for m in b.requests]


@pytest.mark.parametrize("priority", ["RT", "BE"])  # with SLOs (the fallback on) and without
@pytest.mark.parametrize("budget", [1, 2, 7])
def test_apt_at_tiny_step_budgets_does_not_thrash(priority, budget):
    """30 requests at once on 40 blocks of 4 tokens with C = P of a few tokens, hidden cache
    on: apt finishes within a small factor of sarathi's steps (which evicts nothing here)
    and evicts each request at most a few times (it has no growth headroom: it admits up
    to the pool, so decodes evict when they grow). It once evicted every running request its
    knapsack left out of a decode iteration, and admitted against blocks its started
    prefills still needed: 2.5-10.5 times sarathi's steps, 7-66 evictions a request."""
    rng = random.Random(0)
    specs = [RequestSpec(0.0, rng.randrange(2, 40), rng.randrange(4, 20), priority,
                         f"r{i}") for i in range(30)]
    cfg = SimConfig(num_blocks=40, block_size=4, max_num_batched_tokens=budget,
                    max_prefill_tokens=budget, hidden_ratio=0.5, max_time_s=1e4)
    apt = simulate(specs, "apt", preset("opt13b-a100"), cfg)
    sarathi = simulate(specs, "sarathi", preset("opt13b-a100"), cfg)
    assert all(m.finished for m in apt.requests)
    assert apt.steps <= 4 * sarathi.steps  # now 1.0-1.7 times with SLOs, 1.7-3 without
    assert apt.evictions <= 3 * len(specs)


def _running(sched: Scheduler, rid: str, prompt_len: int, last_token_time: float) -> Request:
    """A KV-cache decode with one token pending, its prompt's blocks held."""
    r = Request(rid, list(range(prompt_len)), SamplingParams(max_tokens=4), arrival=0.0)
    r.output_ids, r.num_computed, r.last_token_time = [7], prompt_len, last_token_time
    r.block_ids = sched.pool.allocate(sched.pool.blocks_for(prompt_len))
    r.status = Status.RUNNING
    sched.running.append(r)
    return r


@pytest.mark.parametrize("a_waited_longer", [False, True])
def test_apt_discards_a_kv_cache_for_a_hidden_one_only_when_memory_is_short(a_waited_longer):
    """A full pool (16 blocks of 4): a needs a 9th block for its next token, c (30 tokens)
    fits its next one in the 8 it holds. Their KV caches (9 + 8 blocks) exceed the pool,
    so the knapsack keeps a in KV and picks the hidden cache for c, which means discarding
    c's KV cache to recompute it. With one token a step, the one that waited longer runs:
    c is discarded only when that is a, which needs its blocks; when it is c itself, no
    one needs them and c runs on its KV cache."""
    sched = Scheduler(BlockPool(16, 4, enable_prefix_caching=False), 1, 8, make_policy("apt"),
                      hidden_ratio=0.5)
    a = _running(sched, "a", 32, last_token_time=5.0 if a_waited_longer else 9.0)
    c = _running(sched, "c", 30, last_token_time=9.0 if a_waited_longer else 5.0)
    out = sched.schedule(10.0)
    if a_waited_longer:
        assert [r for r, _ in out.scheduled] == [a] and out.preempted == [c]
    else:
        assert [r for r, _ in out.scheduled] == [c] and not out.preempted
        assert c.cache_type == "kv"
