"""Discrete-event simulator: the engine's scheduler and block pool, the cost model as the
executor.

Each iteration: admit the requests that have arrived, ask the policy for a batch, advance
the clock by the cost model's time for that batch, then update the requests as the engine
would (computed tokens catch up; a request whose tokens are all computed emits one). Output
lengths are known to the simulator only (a request ends after its output_len tokens); the
policies see what they would see on the engine. Best-effort work can arrive as a new batch
each time the previous one completes (BROS).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..cache.block_pool import BlockPool
from ..costmodel import CostModel
from ..params import SamplingParams
from ..sched.policies import Policy, make_policy
from ..sched.request import Request
from ..sched.scheduler import Scheduler, SchedulerOutput
from .workloads import RequestSpec


@dataclass
class SimConfig:
    num_blocks: int  # the memory budget M, in blocks
    block_size: int = 16
    max_num_batched_tokens: int = 4096  # C
    max_prefill_tokens: int | None = 512  # P
    max_num_seqs: int = 1024
    hidden_ratio: float | None = None  # h/m when the executor has a hidden cache
    slo_ttft_s: float = 1.0
    slo_tbt_s: float = 0.25
    max_time_s: float = 1e9  # stop the clock here (requests left unfinished are reported)
    # Prefix caching as the engine does it (it matters for specs with real prompt_ids), with
    # these token sequences' blocks already cached at the start (earlier queries' blocks).
    prefix_caching: bool = False
    cached_prefixes: Sequence[Sequence[int]] = ()


@dataclass
class RequestMetrics:
    request_id: str
    priority: str
    arrival: float
    prompt_len: int
    output_len: int
    token_times: list[float] = field(default_factory=list)
    evictions: int = 0

    @property
    def finished(self) -> bool:
        return len(self.token_times) >= self.output_len

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival if self.token_times else float("inf")

    @property
    def tbts(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in itertools.pairwise(t)]

    @property
    def p99_tbt(self) -> float:
        gaps = self.tbts
        return float(np.percentile(gaps, 99)) if gaps else 0.0

    @property
    def latency(self) -> float:
        return self.token_times[-1] - self.arrival if self.finished else float("inf")


@dataclass
class SimResult:
    requests: list[RequestMetrics]
    end_time: float
    steps: int
    evictions: int
    memory: list[tuple[float, int]]  # (time, blocks in use) per step
    scheduler_s: float = 0.0  # wall time spent in the policy (not simulated time)

    def of(self, priority: str | None = None) -> list[RequestMetrics]:
        return [r for r in self.requests if priority is None or r.priority == priority]

    def attainment(self, slo_ttft: float, slo_tbt: float, priority: str = "RT") -> float:
        """Share of requests whose TTFT and P99 TBT both meet the SLOs."""
        rs = self.of(priority)
        ok = [r.finished and r.ttft <= slo_ttft and r.p99_tbt <= slo_tbt for r in rs]
        return sum(ok) / len(ok) if ok else 1.0

    def throughput(self, priority: str | None = None) -> float:
        """Generated tokens per second of simulated time."""
        tokens = sum(len(r.token_times) for r in self.of(priority))
        return tokens / self.end_time if self.end_time > 0 else 0.0


def _request(spec: RequestSpec, cfg: SimConfig, ids: Callable[[], int]) -> Request:
    if spec.prompt_ids is not None:
        prompt = list(spec.prompt_ids)
    else:  # distinct token ids per request, so that prefix caching finds nothing by accident
        base = ids() * 100_000
        prompt = list(range(base, base + spec.prompt_len))
    req = Request(spec.request_id, prompt,
                  SamplingParams(max_tokens=spec.output_len, ignore_eos=True),
                  arrival=spec.arrival)
    req.priority = spec.priority
    if spec.priority == "RT":
        req.slo_ttft_s, req.slo_tbt_s = cfg.slo_ttft_s, cfg.slo_tbt_s
    return req


def simulate(specs: Sequence[RequestSpec], policy: str | Policy, cost_model: CostModel,
             cfg: SimConfig, be_stream: Callable[[int, float], list[RequestSpec]] | None = None,
             be_batches: int = 0, observe: Callable[[SchedulerOutput], None] | None = None
             ) -> SimResult:
    """Run `specs` (sorted by arrival) under `policy` (a name, or a fresh Policy object for a
    variant the registry does not name); `be_stream(k, now)` makes the k-th BE batch, started
    at time 0 and again whenever the previous one has completed. `observe` sees every
    schedule() output (Scheduler.observers)."""
    import time

    pool = BlockPool(cfg.num_blocks, cfg.block_size, enable_prefix_caching=cfg.prefix_caching)
    sched = Scheduler(pool, cfg.max_num_batched_tokens, cfg.max_num_seqs,
                      make_policy(policy) if isinstance(policy, str) else policy,
                      cfg.max_prefill_tokens, cost_model=cost_model,
                      hidden_ratio=cfg.hidden_ratio)
    if observe is not None:
        sched.observers.append(observe)
    if cfg.prefix_caching:
        for ids in cfg.cached_prefixes:
            sched.seed_cached(ids)
    counter = itertools.count()
    pending = sorted(specs, key=lambda s: s.arrival)
    metrics: dict[str, RequestMetrics] = {}
    live_be: set[str] = set()
    next_be = 0
    now, steps, evictions, policy_s = 0.0, 0, 0, 0.0
    memory: list[tuple[float, int]] = []
    i = 0

    def admit(spec: RequestSpec) -> None:
        req = _request(spec, cfg, lambda: next(counter))
        metrics[req.request_id] = RequestMetrics(req.request_id, spec.priority, spec.arrival,
                                                 spec.prompt_len, spec.output_len)
        if spec.priority == "BE":
            live_be.add(req.request_id)
        sched.add(req)

    while now < cfg.max_time_s:
        if be_stream is not None and not live_be and next_be < be_batches:
            for spec in be_stream(next_be, now):
                admit(spec)
            next_be += 1
        while i < len(pending) and pending[i].arrival <= now:
            admit(pending[i])
            i += 1
        if not sched.has_work:
            if i == len(pending):
                break
            now = pending[i].arrival
            continue
        t0 = time.perf_counter()
        out = sched.schedule(now)
        policy_s += time.perf_counter() - t0
        evictions += len(out.preempted)
        for r in out.preempted:
            metrics[r.request_id].evictions += 1
        if not out.scheduled:
            if i == len(pending):
                raise RuntimeError(f"{policy}: nothing can be scheduled and nothing will arrive "
                                   f"(a request needs more memory than the pool has?)")
            now = max(now, pending[i].arrival)
            continue
        now += cost_model.step_time(sched.costs(out.scheduled))
        steps += 1
        for req in sched.update_from_output(out.scheduled, None, now):
            metrics[req.request_id].token_times.append(now)
            if len(req.output_ids) >= req.params.max_tokens:
                req.finish_reason = "length"
                sched.finish(req)
                live_be.discard(req.request_id)
        memory.append((now, pool.num_blocks - pool.num_free))
    return SimResult(list(metrics.values()), now, steps, evictions, memory, policy_s)
