"""The default policy: interactive (RT) requests before bulk (BE) ones, on the real engine and
in the scheduler alone."""

from __future__ import annotations

from dataclasses import replace

import pytest

from llmdb.engine.cache.block_pool import BlockPool
from llmdb.engine.costmodel import CostModel, preset
from llmdb.engine.engine import LLMEngine
from llmdb.engine.params import SamplingParams
from llmdb.engine.research.sim import SimConfig, simulate
from llmdb.engine.research.workloads import dataset
from llmdb.engine.sched.policies import make_policy
from llmdb.engine.sched.request import Request
from llmdb.engine.sched.scheduler import Scheduler, SchedulerOutput

from .model_builders import save_tiny_llama

PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")


def _prompts(n: int, first: int = 0) -> list[list[int]]:
    return [[1] + [(first + 7 * i + j) % 40 + 5 for j in range(5 + i % 9)] for i in range(n)]


def test_the_engine_runs_priority_by_default(model_dir):
    eng = LLMEngine(str(model_dir), dtype="fp32", threads=1)
    assert eng.describe()["policy"] == "priority"


@pytest.mark.parametrize("policy,full", [("priority", "seats"), ("priority", "memory"),
                                         ("bros", "seats"), ("bros", "memory")])
def test_an_rt_request_runs_at_once_behind_a_bulk_job(model_dir, policy, full):
    """40 BE requests fill the engine's seats (or its memory); an RT request added later
    gets its first token on the next step, one BE request giving up its place, and every
    request still gets the tokens it gets alone. (bros: an RT request waited 14 steps for a
    seat.)"""
    limits = ({"max_num_seqs": 4, "kv_cache_bytes": 1 << 20} if full == "seats"
              else {"max_num_seqs": 64, "kv_cache_bytes": 9 * 16 * 1024})  # 9 blocks
    eng = LLMEngine(str(model_dir), dtype="fp32", threads=1, block_size=16, policy=policy,
                    **limits)
    bulk, interactive = _prompts(40), _prompts(1, first=3)[0]
    alone = [r.token_ids for r in eng.generate(bulk + [interactive], PARAMS)]
    preempted = []
    eng.scheduler.observers.append(lambda out: preempted.extend(out.preempted))
    ids = [eng.add_request(p, PARAMS, priority="BE") for p in bulk]
    for _ in range(3):
        eng.step()
    rt = eng.add_request(interactive, PARAMS, priority="RT")
    before = len(preempted)
    eng.step()
    assert len(eng._requests[rt].output_ids) == 1
    assert len(preempted) > before and all(r.priority == "BE" for r in preempted)
    steps = 1
    while rt in eng._requests:
        eng.step()
        steps += 1
    assert steps == PARAMS.max_tokens  # one token a step, never set aside
    while eng.has_unfinished:
        eng.step()
    got = [eng.wait(i).token_ids for i in ids + [rt]]
    assert got == alone
    assert eng.pool.num_free == eng.pool.num_blocks, "blocks leaked"
    assert eng.scheduler.num_rt == 0


@pytest.mark.parametrize("policy", ["priority", "bros"])
def test_an_rt_request_that_cannot_fit_yet_evicts_nobody(model_dir, policy):
    """An RT request holds most of a 10-block pool; a second one's prompt (5 blocks) does not
    fit even with every BE request's block freed. Evicting them anyway threw their work away
    each step the second one waited, and again each time they came back; now none is evicted
    until it can start (when the first ends), and every request gets the tokens it gets alone."""
    eng = LLMEngine(str(model_dir), dtype="fp32", threads=1, block_size=16, max_num_seqs=4,
                    kv_cache_bytes=10 * 16 * 512, enable_prefix_caching=False, policy=policy)
    assert eng.pool.num_blocks == 10
    long_prompts = [[1] + [(3 * j + k) % 40 + 5 for j in range(79)] for k in range(2)]
    bulk = [[1, 5 + i % 40, 6, 7] for i in range(12)]
    rt_params, be_params = SamplingParams(max_tokens=20, ignore_eos=True), PARAMS
    alone = [r.token_ids for r in eng.generate(long_prompts, rt_params)]
    alone += [r.token_ids for r in eng.generate(bulk, be_params)]
    preempted = []
    eng.scheduler.observers.append(lambda out: preempted.extend(out.preempted))
    first = eng.add_request(long_prompts[0], rt_params, priority="RT")
    eng.step()
    ids = [eng.add_request(p, be_params, priority="BE") for p in bulk]
    eng.step()
    second = eng.add_request(long_prompts[1], rt_params, priority="RT")
    while first in eng._requests:
        eng.step()
    assert second in eng._requests and not eng._requests[second].output_ids
    assert preempted == []
    while eng.has_unfinished:
        eng.step()
    assert [eng.wait(i).token_ids for i in [first, second] + ids] == alone
    assert eng.pool.num_free == eng.pool.num_blocks, "blocks leaked"
    assert eng.scheduler.num_rt == 0


def _request(rid: str, n: int, priority: str) -> Request:
    req = Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=64))
    req.priority = priority
    return req


def test_victims_come_from_a_lower_class():
    """Who gives up its place: the newest request of a lower class outside the batch; for a
    running request short of memory, else the newest other one of its own class (sarathi's
    rule); never an RT request for a BE one, nor a running one for a waiting one of its class."""
    policy = make_policy("priority")
    sched = Scheduler(BlockPool(64, 4, False), 64, 8, policy)
    rt_old, be1, rt_new, be2 = (_request("rt_old", 4, "RT"), _request("be1", 4, "BE"),
                                _request("rt_new", 4, "RT"), _request("be2", 4, "BE"))
    for r in (rt_old, be1, be2):
        sched.add(r)
    sched.schedule(0.0)
    sched.add(rt_new)
    sched.schedule(0.0)
    assert sched.running == [rt_old, be1, be2, rt_new]
    rt_waiting, be_waiting = _request("rt_w", 4, "RT"), _request("be_w", 4, "BE")
    sched.add(rt_waiting)
    sched.add(be_waiting)

    def victim(cand, *batch):
        return policy.victim(sched, cand, dict.fromkeys(batch, 1))

    assert victim(rt_old) is be2 and victim(rt_old, be2) is be1
    assert victim(rt_old, be1, be2) is rt_new  # no BE left: the newest RT
    assert victim(be2) is be1 and victim(be1) is be2  # never rt_new, the newest
    assert victim(be1, be2) is None
    assert victim(rt_waiting) is be2 and victim(rt_waiting, be1, be2) is None
    assert victim(be_waiting) is None


def _advance(out) -> None:
    """What the engine does after a step: the tokens are computed, prompts done sample one."""
    for r, n in out.scheduled:
        r.num_computed += n
        if r.num_computed == len(r.token_ids):
            r.output_ids.append(0)
            Scheduler.take_token(r, 0, 0.0)


def test_an_rt_request_that_cannot_run_this_step_displaces_nobody():
    """Every seat taken, and an older RT prompt takes the whole prefill budget: the waiting
    RT request would get no token this step, so no BE request gives up its place for it
    (one did, each step, and came back to be evicted again)."""
    sched = Scheduler(BlockPool(64, 4, False), 64, 3, make_policy("priority"),
                      max_prefill_tokens=4)
    be = [_request("be0", 4, "BE"), _request("be1", 4, "BE")]
    for r in be:
        sched.add(r)
    for _ in range(2):
        _advance(sched.schedule(0.0))
    sched.add(long_rt := _request("long", 40, "RT"))
    _advance(sched.schedule(0.0))
    assert sched.running == [*be, long_rt]
    sched.add(_request("rt", 8, "RT"))
    out = sched.schedule(0.0)
    assert ("long", 4) in [(r.request_id, n) for r, n in out.scheduled]
    assert out.preempted == []


@pytest.mark.parametrize("tbt", [None, 0.05, 0.105, 1.0])
def test_be_work_beside_rt_requests_keeps_within_their_slo(tbt):
    """A step's cost: 10 ms, 5 ms a token. An RT request decodes with a TBT target beside 12
    BE decodes and a waiting BE prompt: the oldest BE decodes that keep the step within the
    target run; BE prompt tokens only when every BE decode fits, in the time left."""
    cost = CostModel("t", {"const": 0.01, "tokens": 0.005}, "test")
    sched = Scheduler(BlockPool(256, 4, False), 64, 32, make_policy("priority"), cost_model=cost)
    rt, be = _request("rt", 4, "RT"), [_request(f"be{i}", 4, "BE") for i in range(12)]
    rt.slo_ttft_s, rt.slo_tbt_s = 1.0, tbt
    for r in (rt, *be):
        sched.add(r)
    _advance(sched.schedule(0.0))  # every prompt: all decode next
    sched.add(_request("late", 40, "BE"))
    out = sched.schedule(0.0)
    took = [r.request_id for r, _ in out.scheduled]
    assert took[0] == "rt"
    if tbt is None:  # no target: sarathi's step
        assert took[1:] == [r.request_id for r in be] + ["late"]
        return
    assert cost.step_time(sched.costs(out.scheduled)) <= tbt
    fit = min(12, round((tbt - 0.01) / 0.005) - 1)  # BE decodes beside the RT one
    assert took[1:fit + 1] == [r.request_id for r in be[:fit]]
    prompt = dict((r.request_id, n) for r, n in out.scheduled).get("late", 0)
    assert prompt == (0 if fit < 12 else min(40, round((tbt - 0.075) / 0.005)))


def test_a_resumed_rt_request_is_held_to_its_first_token_target_until_it_has_one():
    """An RT request resumed from 4 tokens an earlier run generated computes them as prompt,
    in chunks here: until this run's first token, the BE share is sized to its TTFT target
    (1 s: all 12 BE decodes run), not to its TBT target (20 ms: none would)."""
    cost = CostModel("t", {"const": 0.01, "tokens": 0.005}, "test")
    sched = Scheduler(BlockPool(256, 4, False), 64, 32, make_policy("priority"),
                      max_prefill_tokens=4, cost_model=cost)
    be = [_request(f"be{i}", 4, "BE") for i in range(12)]
    for r in be:
        sched.add(r)
    while not all(r.output_ids for r in be):  # 4 prompt tokens a step
        _advance(sched.schedule(0.0))
    rt = Request("rt", [1, 2, 3, 4], SamplingParams(max_tokens=64), output_ids=[5, 6, 7, 8],
                 num_resumed=4)
    rt.priority, rt.slo_ttft_s, rt.slo_tbt_s = "RT", 1.0, 0.02
    sched.add(rt)
    _advance(sched.schedule(0.0))  # its first 4 tokens
    out = sched.schedule(0.0)
    assert [r.request_id for r, _ in out.scheduled] == ["rt"] + [r.request_id for r in be]


@pytest.mark.parametrize("priority", ["RT", "BE"])
def test_with_one_class_the_schedule_is_sarathis(priority):
    specs = [replace(s, priority=priority)
             for s in dataset("sharegpt", 80, rate=6.0, context=2048, seed=4)]
    cfg = SimConfig(num_blocks=250, max_num_batched_tokens=1024, max_prefill_tokens=512)
    seen: dict[str, list] = {}
    for policy in ("sarathi", "priority"):
        log = seen[policy] = []
        result = simulate(specs, policy, preset("llama2-7b-a100"), cfg,
                          observe=lambda out, log=log: log.append(
                              ([(r.request_id, n) for r, n in out.scheduled],
                               [r.request_id for r in out.preempted])))
        assert all(m.finished for m in result.requests)
    assert seen["priority"] == seen["sarathi"]
    assert any(pre for _, pre in seen["sarathi"])  # memory ran short: eviction was compared


@pytest.mark.parametrize("victims", [["be"], ["be", "rt"], ["rt"]])
def test_what_preempting_would_free_is_what_it_frees(victims):
    """fits(req, n, preempting=...) against fits() once they are preempted, for every n: with
    prefix caching, blocks shared with a request that stays are not freed, and blocks of
    the candidate's own prefix hit are taken back by it."""
    sched = Scheduler(BlockPool(16, 4, True), 64, 8, make_policy("priority"))
    shared = list(range(1, 17))  # 4 full blocks
    running = {"rt": _request("rt", 0, "RT"), "be": _request("be", 0, "BE")}
    running["rt"].prompt_ids = shared + [30, 31]
    running["be"].prompt_ids = shared + [40, 41, 42, 43, 44]
    for r in running.values():
        sched.add(r)
        sched.update_from_output(sched.schedule(0.0).scheduled, None, 0.0)
    cand = _request("cand", 0, "RT")
    cand.prompt_ids = shared[:8] + list(range(50, 60))
    sched.add(cand)
    assert len(sched.prefix_hit(cand)) == 2 and sched.pool.ref_count[sched.prefix_hit(cand)[0]] == 2
    gone = [running[v] for v in victims]
    predicted = [sched.fits(cand, n, gone) for n in range(1, 60)]
    for r in gone:
        sched.preempt(SchedulerOutput(), r)
    sched._hits.clear()
    assert predicted == [sched.fits(cand, n) for n in range(1, 60)]
    assert any(predicted) and not all(predicted)


def test_be_work_is_sized_to_the_rt_work_that_runs():
    """A second RT request waits for memory (its prompt does not fit even with the BE
    requests' blocks freed) beside a first one decoding with a 0.1 s TBT target. Its prompt
    is not in this step: the BE decodes are sized beside the first one's decode alone (a
    step of 10 ms, 5 ms a token: all 4 fit), where counting the waiting prompt (0.3 s) left
    them none, step after step, until the first request ended."""
    cost = CostModel("t", {"const": 0.01, "tokens": 0.005}, "test")
    sched = Scheduler(BlockPool(30, 4, False), 64, 8, make_policy("priority"), cost_model=cost)
    first, second = _request("first", 60, "RT"), _request("second", 60, "RT")
    for r in (first, second):
        r.slo_ttft_s, r.slo_tbt_s = 1.0, 0.1
    sched.add(first)
    _advance(sched.schedule(0.0))
    be = [_request(f"be{i}", 4, "BE") for i in range(4)]
    for r in be:
        sched.add(r)
    _advance(sched.schedule(0.0))
    sched.add(second)
    for _ in range(3):
        out = sched.schedule(0.0)
        assert [r.request_id for r, _ in out.scheduled] == ["first"] + [r.request_id for r in be]
        assert not out.preempted and cost.step_time(sched.costs(out.scheduled)) <= 0.1
        _advance(out)
