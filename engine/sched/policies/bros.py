"""BROS's priority packing of real-time (RT) and best-effort (BE) requests (its Alg. 1 and
Sec. 4.2), with adaptive batch sizing.

RT requests (running and waiting) are ordered by the residual time of their next token,
T_SLO - t_i - (k_i - 1) T_avg: T_SLO is the TTFT target before the first token and the TBT
target after; t_i the time since arrival or since the last token; k_i the iterations the
next token still needs (prefill chunks under P; 1 for a decode); T_avg the average iteration
time seen so far. The smallest residual is the time budget of this iteration: RT requests join
while the cost model's step time stays within it; then BE requests (running first, then
waiting, oldest first: no host tier yet, so every swap-in cost is zero and BROS's order is
FIFO) fill the batch, or replace the least urgent RT request when the batch is full or over
time; an RT request that finds every seat taken takes a running BE request's. Batch size:
starts at 128, doubles after an iteration whose RT loop did not stop on the
time test (up to max_num_seqs), and resets to 128 when it did. RT requests may evict running
BE requests for memory (BROS's preemptible blocks); BE requests only take free blocks.
Repairs where the published loop stalls or collapses under overload: the time budget is the
smallest residual among RT requests that can still meet their deadline (late ones are served
in urgency order but do not constrain the batch); the most urgent RT request always runs,
even when it alone exceeds the budget; an RT request that finds no memory (after evicting
BE requests, and for a running one less urgent running RT ones) is skipped rather than
ending the RT loop; a running BE request that needs a block evicts the newest other BE one.
Without shared bidirectional RT/BE blocks (not built yet) eviction is by recompute.
"""

from __future__ import annotations

import math

from ...costmodel import CostModel, load_cost_model
from ..request import Request, Status
from ..scheduler import Scheduler, SchedulerOutput
from .base import Policy

BASE_BATCH = 128
T_AVG_WEIGHT = 0.2  # exponential average of iteration times


def largest_chunk(fits, n: int) -> int:
    """The largest m < n with fits(m), by bisection (step time grows with m); 0 if none."""
    lo, hi = 0, n - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo if lo and fits(lo) else 0


class BROSPolicy(Policy):
    name = "bros"
    description = ("BROS: RT by residual time to their token deadline under the cost model's "
                   "step time, BE fills or replaces; adaptive batch size 128 -> x2 / reset")

    def __init__(self) -> None:
        self.batch_size = BASE_BATCH
        self.t_avg: float | None = None
        self.last_now: float | None = None
        self._cost: CostModel | None = None

    def cost_model(self, s: Scheduler) -> CostModel:
        """The scheduler's: the engine's own (its model, dtype and device) or the
        simulator's. A scheduler made without one times steps as the default engine on
        this CPU would."""
        if s.cost_model is not None:
            return s.cost_model
        if self._cost is None:
            self._cost = load_cost_model()
        return self._cost

    def residual(self, s: Scheduler, r: Request, now: float) -> float:
        first = r.last_token_time is None
        slo = r.slo_ttft_s if first else r.slo_tbt_s
        if slo is None:
            return math.inf
        left = s.tokens_left(r)
        k = 1 if r.is_decode else math.ceil(left / s.max_prefill_tokens)
        return slo - r.pending_time(now) - (k - 1) * (self.t_avg or 0.0)

    def victim_for(self, s: Scheduler, r: Request, chosen: list[tuple[Request, int]],
                   rt_order: list[Request]) -> Request | None:
        """A running BE request (newest first), else a less urgent running RT one that is
        not further along than r. (A prefill's urgency counts its chunks left, so a victim
        comes back more urgent than the request that evicted it: without the second rule
        two prompts that do not fit together evict each other for ever.)"""
        busy = {c.request_id for c, _ in chosen} | {r.request_id}
        for b in reversed(s.running):
            if b.priority != "RT" and b.request_id not in busy:
                return b
        if r.status is Status.WAITING:  # admitting never evicts running RT work
            return None
        for b in reversed(rt_order[rt_order.index(r) + 1:]):
            if b.status is Status.RUNNING and b.request_id not in busy \
                    and b.num_computed <= r.num_computed:
                return b
        return None

    @staticmethod
    def unblock(s: Scheduler, out: SchedulerOutput) -> list[tuple[Request, int]]:
        """The step when nothing was chosen while requests run: each needs memory that only
        an eviction frees, and none may evict the others (more urgent work, or work further
        along), so no later step would differ. The running request furthest along (the
        oldest of those) runs alone, the least advanced others evicted until it fits. No
        rule lets another evict it (none is further along), so each such step brings it
        closer to its end: the engine cannot stall. Evicting only the least advanced was
        not enough: with one token a step the more urgent requests it let in took every
        step, and the one holding the memory never ran."""
        first = max(s.running, key=lambda r: r.num_computed)
        n = s.tokens_left(first)
        if not first.is_decode:
            n = min(n, s.max_num_batched_tokens, s.max_prefill_tokens)
        while s.blocks_to_run(first, n) > s.pool.num_free:
            others = [r for r in s.running if r is not first]
            if not others:  # (cannot happen: the pool holds any request admitted alone)
                return []
            s.preempt(out, min(reversed(others), key=lambda r: r.num_computed))
        return [(first, n)]

    def schedule(self, s: Scheduler, now: float) -> SchedulerOutput:
        if self.last_now is not None and now > self.last_now:
            dt = now - self.last_now
            self.t_avg = dt if self.t_avg is None else (
                (1 - T_AVG_WEIGHT) * self.t_avg + T_AVG_WEIGHT * dt)
        self.last_now = now
        out = SchedulerOutput()
        cm = self.cost_model(s)
        everyone = list(s.running) + list(s.waiting)
        rt = [r for r in everyone if r.priority == "RT"]
        be = sorted((r for r in everyone if r.priority != "RT"),
                    key=lambda r: (r.status is Status.WAITING, r.arrival))
        slack = {r.request_id: self.residual(s, r, now) for r in rt}
        rt.sort(key=lambda r: slack[r.request_id])
        # The time budget protects the most urgent request that can still make its deadline;
        # one already late cannot be saved and must not shrink every batch to nothing.
        budget_s = min((v for v in slack.values() if v > 0), default=math.inf)
        chosen: list[tuple[Request, int]] = []
        state = {"c": s.max_num_batched_tokens, "p": s.max_prefill_tokens, "blocks": 0}

        def tokens(r: Request) -> int:
            n = s.tokens_left(r)
            return min(n, state["c"]) if r.is_decode else min(n, state["c"], state["p"])

        def admissible(r: Request) -> bool:
            """A waiting request can start now: a sequence slot is free and no other request
            is computing its prefix. (Checked while choosing: a request chosen and then left
            out would hold the step's budget, and every step would come out empty.)"""
            if r.status is not Status.WAITING:
                return True
            if r in out.preempted:
                return False  # evicted in this step for another: not readmitted in it
            starting = sum(c.status is Status.WAITING for c, _ in chosen)
            return len(s.running) + starting < s.max_num_seqs and not s.waits_for_prefix(r)

        def in_time(extra: list[tuple[Request, int]]) -> bool:
            return cm.step_time(s.costs(chosen + extra)) <= budget_s

        def take_seat(r: Request, n: int) -> bool:
            """A waiting RT request that finds every seat taken takes the newest running BE
            request's, preempted: BROS builds each batch afresh from all requests, so no BE
            request holds a place an urgent RT one needs (here it waited 14 steps behind a
            bulk job). Only where it can then run: the memory the running BE requests outside
            the batch hold is enough, and a token of it fits the time (evicting for nothing
            cost their work, and again each time they came back)."""
            if (r.status is not Status.WAITING or r in out.preempted
                    or s.waits_for_prefix(r)):
                return False
            chosen_ids = {c.request_id for c, _ in chosen}
            bes = [b for b in reversed(s.running)
                   if b.priority != "RT" and b.request_id not in chosen_ids]
            hits = set(s.prefix_hit(r))
            if not bes or s.blocks_to_run(r, n) > (s.pool.num_free - state["blocks"]
                                                    + s.units_freed_by(bes, r.cache_type, hits)):
                return False
            if chosen and not in_time([(r, 1)]):
                return False
            evict(bes[0])
            return True

        def take(r: Request, n: int, blocks: int) -> None:
            chosen.append((r, n))
            state["c"] -= n
            state["p"] -= 0 if r.is_decode else n
            state["blocks"] += blocks

        def evict(victim: Request) -> None:
            """Preempt, and count again what the chosen take: the victim may have held
            blocks of their prefix hits, which then come off the free list."""
            s.preempt(out, victim)
            state["blocks"] = sum(s.blocks_to_run(c, m) for c, m in chosen)

        def drop_last_rt() -> tuple[Request, int, int] | None:
            for i in range(len(chosen) - 1, -1, -1):
                r, n = chosen[i]
                if r.priority == "RT":
                    del chosen[i]
                    blocks = s.blocks_to_run(r, n)
                    state["c"] += n
                    state["p"] += 0 if r.is_decode else n
                    state["blocks"] -= blocks
                    return r, n, blocks
            return None

        stopped_on_time = False
        for r in rt:
            if len(chosen) >= self.batch_size:
                break
            n = tokens(r)
            if n <= 0 or not (admissible(r) or take_seat(r, n)):
                continue
            blocks = s.blocks_to_run(r, n)
            while blocks > s.pool.num_free - state["blocks"]:  # FindPreemptBlock
                victim = self.victim_for(s, r, chosen, rt)
                if victim is None:
                    break
                evict(victim)
                blocks = s.blocks_to_run(r, n)
            if blocks > s.pool.num_free - state["blocks"]:
                continue
            if not in_time([(r, n)]):
                stopped_on_time = True
                fit = 0 if r.is_decode else largest_chunk(lambda m, r=r: in_time([(r, m)]), n)
                if fit:  # the part of the prompt that fits the time left, as Sarathi chunks
                    take(r, fit, s.blocks_to_run(r, fit))
                    break
                if chosen:
                    break
                # The most urgent request is late whatever runs; serving it keeps the engine
                # moving (the published loop would return an empty batch forever).
            take(r, n, blocks)
        for b in be:
            if b in out.preempted:
                continue
            n = tokens(b)
            if n <= 0 or not admissible(b):
                continue
            blocks = s.blocks_to_run(b, n)
            if blocks > s.pool.num_free - state["blocks"]:  # FindBlock
                if b.status is Status.WAITING:
                    break  # BE admission stays FIFO
                # A running BE request that needs a block takes one from the newest other BE
                # request outside the batch (by recompute), or yields its own.
                while blocks > s.pool.num_free - state["blocks"]:
                    victim = next((v for v in reversed(s.running) if v.priority != "RT"
                                   and v is not b and all(v is not c for c, _ in chosen)),
                                  None)
                    evict(victim or b)
                    if victim is None:
                        break
                    blocks = s.blocks_to_run(b, n)
                if b.status is Status.WAITING:
                    continue
            if len(chosen) + 1 <= self.batch_size and in_time([(b, n)]):
                take(b, n, blocks)
                continue
            dropped = drop_last_rt()  # replace the least urgent RT request
            if dropped is None:
                break
            n = tokens(b)
            if n > 0 and len(chosen) + 1 <= self.batch_size and in_time([(b, n)]):
                take(b, n, blocks)
            else:
                take(*dropped)
                break
        if not chosen and s.running and not s.held:
            # (Held requests free their blocks once their last step is read: wait for that.)
            chosen = self.unblock(s, out)
        self.batch_size = BASE_BATCH if stopped_on_time else min(
            2 * self.batch_size, s.max_num_seqs)
        for r, n in chosen:
            s.run(out, r, n)
        return out
