"""Apt-Serve's scheduler (its Sec. 4.2 and 5, appendix Algorithm 1).

Each iteration serves one queue: waiting W (a prefill iteration) or running R (a decode
iteration), whichever has the larger total pending time p (since arrival before the first
token, since the last token after). Its requests are candidates for a knapsack over memory:
a request is worth p in KV form (memory m) or p - N rho m in hidden form (memory h), with
N = |W| + |R| and rho the cost model's re-projection time per unit of memory (here: seconds
per KV block's worth of tokens). The repaired greedy of apt_knapsack picks. In a decode
iteration the budget is the whole pool and running requests not picked are preempted; in a
prefill iteration it is what the running requests leave. A request whose cache type changes
is recomputed in the new type.

SLO-aware fallback: a waiting request past its TTFT SLO or a running one past its TBT SLO
has p set near zero (fallback="zero"), or multiplied by 0.4 (fallback="decay", the paper's
decaying factor) while it stays in violation. The knapsack has no token budget; on this CPU
the picked requests then fill C (and P) in order of value, a documented filter.

On the engine there is no hidden cache (the scheduler's hidden_ratio is None): every option
is KV, and apt degrades to pending-time-weighted selection with preemption.
"""

from __future__ import annotations

from ..apt_knapsack import Candidate, select
from ..request import Request, Status
from ..scheduler import Scheduler, SchedulerOutput
from .base import Policy

NEAR_ZERO = 1e-6
DECAY = 0.4


class AptPolicy(Policy):
    name = "apt"
    description = ("Apt-Serve: knapsack over pending time and memory (hybrid KV/hidden cache "
                   "in the simulator; KV only on the engine), SLO-aware fallback, C as a filter")

    def __init__(self, fallback: str = "zero") -> None:
        if fallback not in ("zero", "decay"):
            raise ValueError(f"fallback must be 'zero' or 'decay', got {fallback!r}")
        self.fallback = fallback

    def value_time(self, req: Request, now: float) -> float:
        p = req.pending_time(now)
        if req.last_token_time is None:
            late = req.slo_ttft_s is not None and now - req.arrival > req.slo_ttft_s
        else:
            late = req.slo_tbt_s is not None and p > req.slo_tbt_s
        if not late:
            return max(p, 0.0)
        return NEAR_ZERO if self.fallback == "zero" else p * DECAY

    def schedule(self, s: Scheduler, now: float) -> SchedulerOutput:
        waiting, running = list(s.waiting), list(s.running)
        if not waiting and not running:
            return SchedulerOutput()
        prefill_iter = (sum(r.pending_time(now) for r in waiting)
                        > sum(r.pending_time(now) for r in running)) or not running
        out = self.iteration(s, now, prefill_iter)
        if prefill_iter and not out.scheduled and running:
            # Nothing waiting fits next to the running requests: serve them instead, or the
            # engine would stall on empty prefill iterations.
            out = self.iteration(s, now, False)
        return out

    def decide(self, s: Scheduler, now: float, prefill_iter: bool
               ) -> tuple[list[Request], list[float], dict[int, str]]:
        """The candidates of this iteration, their values and the knapsack's picks."""
        waiting, running = list(s.waiting), list(s.running)
        pool = s.pool
        if prefill_iter:
            queue = waiting[: s.max_num_seqs - len(running)]
            budget = pool.num_blocks - sum(len(r.block_ids) for r in running)
        else:
            queue, budget = running, pool.num_blocks
        bs = pool.block_size
        hidden_per_block = max(1, int(bs / s.hidden_ratio)) if s.hidden_ratio else 0
        values = [self.value_time(r, now) for r in queue]
        cands = []
        for k, r in enumerate(queue):
            tokens = len(r.prompt_ids) + len(r.output_ids)
            m = -(-tokens // bs)
            h = -(-tokens // hidden_per_block) if hidden_per_block else m + 1
            cands.append(Candidate(k, values[k], m, h))
        rho = (s.cost_model.rho if s.cost_model is not None else 0.0) * bs
        return queue, values, select(cands, budget, len(waiting) + len(running), rho).choice

    def iteration(self, s: Scheduler, now: float, prefill_iter: bool) -> SchedulerOutput:
        out = SchedulerOutput()
        queue, values, picked = self.decide(s, now, prefill_iter)
        if not prefill_iter:
            for k, r in enumerate(queue):
                if k not in picked:
                    s.preempt(out, r)
                elif picked[k] != r.cache_type:  # recompute in the new type
                    s.preempt(out, r)
                    r.cache_type = picked[k]
        else:
            for k, choice in picked.items():
                queue[k].cache_type = choice
        c_left, p_left = s.max_num_batched_tokens, s.max_prefill_tokens
        for k in sorted(picked, key=lambda k: (-values[k], k)):
            if c_left <= 0:
                break
            r = queue[k]
            if r.status is Status.WAITING and (not prefill_iter or s.waits_for_prefix(r)):
                continue  # recomputed later (a new cache type, or its prefix is in flight)
            n = s.tokens_left(r)
            decode = n == 1 and bool(r.output_ids)
            if not decode:
                n = min(n, c_left, p_left)
            if n <= 0 or not s.fits(r, n):
                continue
            n = s.run(out, r, n)
            c_left -= n
            if not decode:
                p_left -= n
        return out
