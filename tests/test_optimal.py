"""The optimal-schedule bound (engine/research/optimal.py): valid schedules, no slower than any
policy, equal to an exhaustive search on tiny instances, and evictions help where InferMax says."""

from __future__ import annotations

import heapq
import itertools
import math

import pytest

pytest.importorskip("ortools", reason="the bound needs OR-Tools: pip install 'llmdb[bound]'")

from llmdb.engine.costmodel import Chunk, CostModel, preset  # noqa: E402
from llmdb.engine.research.optimal import OptimalResult, solve  # noqa: E402
from llmdb.engine.research.schedules import policy_steps, replay, sim_config  # noqa: E402
from llmdb.engine.research.sim import simulate  # noqa: E402
from llmdb.engine.research.workloads import RequestSpec  # noqa: E402
from llmdb.engine.sched.policies import POLICIES  # noqa: E402

CM = preset("llama2-7b-a100")
C, P = 4096, 512
# Two requests of I = 2, O = 3 with M = max(2I, I+O-1) = 4: InferMax's eviction instance in
# miniature; evicting one of the two prompts is optimal here.
EVICTS = [(2, 3), (2, 3)]


def exhaustive(requests: list[tuple[int, int]], cm: CostModel, C: int, P: int, M: int,
               forbid_evictions: bool = False) -> float:
    """Dijkstra over (generated, cached) per request, every batch the engine could run."""
    start = tuple((0, 0) for _ in requests)
    goal = tuple((out, 0) for _, out in requests)
    best, heap = {start: 0.0}, [(0.0, start)]
    while heap:
        d, state = heapq.heappop(heap)
        if state == goal:
            return d
        if d > best[state]:
            continue
        options = []
        for (inp, out), (gen, m) in zip(requests, state, strict=True):
            if gen == out:
                options.append([(0, 0)])
                continue
            keep = [(m, c) for c in range(inp + gen - m + 1)]  # (kept cache, tokens)
            options.append(keep + ([(0, 0)] if m and not forbid_evictions else []))
        for combo in itertools.product(*options):
            if not any(c for _, c in combo) or sum(k + c for k, c in combo) > M:
                continue
            chunks, new = [], []
            for (inp, out), (gen, _), (kept, c) in zip(requests, state, combo, strict=True):
                left = inp + gen - kept
                if c:
                    chunks.append(Chunk(kept, c, left == 1 and gen >= 1))
                if c and c == left:
                    new.append((gen + 1, 0 if gen + 1 == out else kept + c))
                else:
                    new.append((gen, kept + c if gen < out else 0))
            if (sum(ch.tokens for ch in chunks) > C
                    or sum(ch.tokens for ch in chunks if not ch.decode) > P):
                continue
            nd, ns = d + cm.step_time(chunks), tuple(new)
            if nd < best.get(ns, math.inf):
                best[ns] = nd
                heapq.heappush(heap, (nd, ns))
    return math.inf


def check_schedule(requests: list[tuple[int, int]], res: OptimalResult, C: int, P: int,
                   M: int) -> None:
    """The schedule's batches obey C, P and M, evict only held cache, and finish everyone;
    its latency is the cost model's sum over them."""
    seq = [inp for inp, _ in requests]
    cached = [0] * len(requests)
    tokens = [0] * len(requests)
    total = 0.0
    for batch in res.schedule:
        for i in batch.evicted:
            assert cached[i] > 0 and tokens[i] < requests[i][1]
            cached[i] = 0
        for w in batch.work:
            assert w.computed == cached[w.request] and 1 <= w.tokens <= seq[w.request] - w.computed
            assert w.decode == (w.tokens == 1 and seq[w.request] - w.computed == 1
                                and tokens[w.request] > 0)
        assert sum(w.tokens for w in batch.work) <= C
        assert sum(w.tokens for w in batch.work if not w.decode) <= P
        assert sum(cached) + sum(w.tokens for w in batch.work) <= M
        total += CM.step_time([Chunk(w.computed, w.tokens, w.decode) for w in batch.work])
        for w in batch.work:
            cached[w.request] += w.tokens
            if cached[w.request] == seq[w.request]:
                seq[w.request] += 1
                tokens[w.request] += 1
                if tokens[w.request] == requests[w.request][1]:
                    cached[w.request] = 0
    assert tokens == [out for _, out in requests]
    assert total == pytest.approx(res.latency, rel=1e-12)
    assert res.evictions == sum(len(b.evicted) for b in res.schedule)


def simulated(requests: list[tuple[int, int]], policy: str, M: int) -> float:
    specs = [RequestSpec(0.0, inp, out, "RT", f"r{i}") for i, (inp, out) in enumerate(requests)]
    return simulate(specs, policy, CM, sim_config(C, P, M)).end_time


@pytest.mark.parametrize("requests,C,P,M", [
    (EVICTS, C, P, 4),
    ([(3, 2)] * 3, C, P, 6),
    ([(2, 3), (4, 2), (1, 3)], C, P, 5),
    ([(5, 3), (5, 2)], C, 2, 10),  # P binds: prompts in chunks of two
    ([(3, 1), (1, 3)], 3, 3, 5),  # C binds
])
def test_matches_exhaustive_search(requests, C, P, M):
    for forbid in (False, True):
        res = solve(requests, CM, C=C, P=P, M=M, time_limit_s=20, forbid_evictions=forbid)
        want = exhaustive(requests, CM, C, P, M, forbid)
        assert res.status == "OPTIMAL"
        assert res.latency == pytest.approx(want, rel=1e-4)
        assert res.bound <= want * (1 + 1e-9)
        check_schedule(requests, res, C, P, M)
        if forbid:
            assert res.evictions == 0


def test_evictions_can_be_optimal():
    free = solve(EVICTS, CM, C=C, P=P, M=4)
    ef = solve(EVICTS, CM, C=C, P=P, M=4, forbid_evictions=True)
    assert free.evictions >= 1 and ef.evictions == 0
    assert free.latency < ef.latency
    assert "rejected" not in free.hint  # the simulator's evicting schedule is a valid start


@pytest.mark.parametrize("requests,M", [(EVICTS, 4), ([(6, 3)] * 3, 12), ([(4, 2), (2, 3)], 5)])
def test_no_slower_than_any_policy(requests, M):
    res = solve(requests, CM, C=C, P=P, M=M, time_limit_s=20)
    check_schedule(requests, res, C, P, M)
    assert res.status in ("OPTIMAL", "FEASIBLE")
    for policy in POLICIES:
        latency = simulated(requests, policy, M)
        assert res.bound <= latency * (1 + 1e-9), policy
        assert res.latency <= latency * (1 + 1e-9), policy
    ef = solve(requests, CM, C=C, P=P, M=M, time_limit_s=20, forbid_evictions=True)
    assert ef.latency >= res.latency * (1 - 1e-4)


def test_recorded_policy_schedule_replays_to_the_simulated_latency():
    requests, M = [(6, 3)] * 3, 12
    for policy in POLICIES:
        steps = policy_steps(requests, policy, CM, C, P, M)
        assert replay(requests, steps, CM, C, P, M).latency == pytest.approx(
            simulated(requests, policy, M), rel=1e-12)


@pytest.mark.parametrize("limit,statuses", [(2.0, ("FEASIBLE",)), (0.01, ("UNKNOWN", "FEASIBLE"))])
def test_time_limit_reports_status_and_bound(limit, statuses):
    # InferMax's instance at I = 8 takes the solver ~30 s to prove: two seconds leave it with
    # a schedule and a weaker bound; stopped before it starts, it returns the hint.
    requests, M = [(8, 4)] * 4, 16
    res = solve(requests, CM, C=C, P=P, M=M, time_limit_s=limit)
    assert res.status in statuses
    assert 0 <= res.bound <= res.latency
    assert res.latency <= res.hint_latency * (1 + 1e-12)
    assert res.hint == "sarathi"
    check_schedule(requests, res, C, P, M)
