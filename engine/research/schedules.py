"""Schedules of a small offline workload, all present at t = 0, as sequences of batches: the
engine's scheduler replays and checks them, the simulator records a policy's, and serving one
request at a time is always one (optimal.py starts its search from the fastest)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..cache.block_pool import BlockPool
from ..costmodel import Chunk, CostModel
from ..params import SamplingParams
from ..sched.policies import make_policy
from ..sched.request import Request
from ..sched.scheduler import Scheduler, SchedulerOutput
from .sim import SimConfig, simulate
from .workloads import RequestSpec


@dataclass(frozen=True)
class Step:
    """One batch as decided: who is evicted before it, and tokens processed per request."""

    evict: tuple[int, ...]
    tokens: dict[int, int]  # request index -> c (>= 1)


@dataclass(frozen=True)
class Work:
    request: int
    computed: int  # cached tokens before the batch (m)
    tokens: int  # c
    decode: bool


@dataclass
class Batch:
    evicted: list[int]
    work: list[Work]
    time_s: float


@dataclass
class Replay:
    batches: list[Batch]
    latency: float  # seconds: the sum of the batch times
    evictions: int
    token_times: list[list[float]]  # per request, the time of each generated token


class InvalidSchedule(ValueError):
    pass


def replay(requests: Sequence[tuple[int, int]], steps: Sequence[Step], cost_model: CostModel,
           C: int, P: int, M: int, hybrid: bool = True) -> Replay:
    """Run a schedule as the engine would, checking every constraint (InvalidSchedule).

    The requests advance through the scheduler's own bookkeeping (run, preempt,
    update_from_output, finish) over a pool of M one-token blocks; only the choice of
    batches comes from the schedule instead of a policy."""
    reqs = [Request(f"r{i}", list(range(i * 100_000, i * 100_000 + inp)),
                    SamplingParams(max_tokens=out, ignore_eos=True))
            for i, (inp, out) in enumerate(requests)]
    index = {r.request_id: i for i, r in enumerate(reqs)}
    sched = Scheduler(BlockPool(max(M, 1), 1, enable_prefix_caching=False), C, len(reqs),
                      make_policy("fcfs"), P)  # never asked: the schedule decides
    for r in reqs:
        sched.add(r)
    times: list[list[float]] = [[] for _ in reqs]
    now, evictions, batches = 0.0, 0, []
    for j, step in enumerate(steps):
        for i in step.evict:
            if reqs[i].is_finished or reqs[i].num_computed == 0:
                raise InvalidSchedule(f"batch {j}: request {i} has no cache to evict")
            sched.preempt(SchedulerOutput(), reqs[i])
            evictions += 1
        work = []
        for i, c in sorted(step.tokens.items()):
            r = reqs[i]
            if r.is_finished or i in step.evict or not 1 <= c <= r.num_tokens - r.num_computed:
                raise InvalidSchedule(f"batch {j}: request {i} cannot process {c} tokens")
            work.append(Work(i, r.num_computed, c, r.is_decode))
        if sum(w.tokens for w in work) > C:
            raise InvalidSchedule(f"batch {j}: more than C = {C} tokens")
        if sum(w.tokens for w in work if not w.decode) > P:
            raise InvalidSchedule(f"batch {j}: more than P = {P} prefill tokens")
        live = sum(r.num_computed for r in reqs if not r.is_finished)
        if live + sum(w.tokens for w in work) > M:
            raise InvalidSchedule(f"batch {j}: more than M = {M} cached tokens")
        if not hybrid and len({w.decode for w in work}) > 1:
            raise InvalidSchedule(f"batch {j}: prefills and decodes mixed")
        out = SchedulerOutput()
        for w in work:
            sched.run(out, reqs[w.request], w.tokens)
        t = cost_model.step_time([Chunk(w.computed, w.tokens, w.decode) for w in work])
        now += t
        for r in sched.update_from_output(out.scheduled, None, now):
            times[index[r.request_id]].append(now)
            if len(r.output_ids) >= r.params.max_tokens:
                sched.finish(r)
        batches.append(Batch(list(step.evict), work, t))
    unfinished = [i for i, r in enumerate(reqs) if not r.is_finished]
    if unfinished:
        raise InvalidSchedule(f"requests {unfinished} do not finish")
    return Replay(batches, now, evictions, times)


def _specs(requests: Sequence[tuple[int, int]]) -> list[RequestSpec]:
    return [RequestSpec(0.0, inp, out, "RT", f"r{i}") for i, (inp, out) in enumerate(requests)]


def sim_config(C: int, P: int, M: int) -> SimConfig:
    """The simulator with M counted in tokens (one-token blocks), as the constraints count it."""
    return SimConfig(num_blocks=M, block_size=1, max_num_batched_tokens=C, max_prefill_tokens=P)


def policy_steps(requests: Sequence[tuple[int, int]], policy: str, cost_model: CostModel,
                 C: int, P: int, M: int) -> list[Step]:
    """The simulator's batches under `policy`, as the scheduler's observer saw them."""
    log: list[SchedulerOutput] = []
    simulate(_specs(requests), policy, cost_model, sim_config(C, P, M), observe=log.append)
    steps, pending = [], []
    for out in log:
        pending += [int(r.request_id[1:]) for r in out.preempted]
        if out.scheduled:  # a call that scheduled nothing is not a batch; its evictions carry on
            steps.append(Step(tuple(pending),
                              {int(r.request_id[1:]): k for r, k in out.scheduled}))
            pending = []
    return steps


def serial_steps(requests: Sequence[tuple[int, int]], C: int, P: int) -> list[Step]:
    """One request at a time: its prompt in chunks of min(C, P), then its decodes. Never
    evicts; feasible whenever every request fits in M alone."""
    steps = []
    for i, (inp, out) in enumerate(requests):
        chunk = min(C, P)
        steps += [Step((), {i: min(chunk, inp - k)}) for k in range(0, inp, chunk)]
        steps += [Step((), {i: 1}) for _ in range(out - 1)]
    return steps
