"""Sarathi-Serve's loop with two classes: real-time (RT) requests before best-effort (BE)
ones at every stage. The engine's default.

Why: interactive queries and bulk jobs share one engine (llmdb serve, a notebook beside an
ETL job). Under plain sarathi a waiting RT request queued behind every BE request submitted
before it: an interactive query behind a 200-row job got its first token 95 steps later,
3 steps before the job ended. Here the RT requests run first (decodes, started prefills, then
waiting ones within the token budget), and an RT request that finds the running set or
memory full takes the place of the newest BE request, which is preempted (recomputed later;
its prompt's blocks usually stay in the prefix cache), and only where that lets it run in
this step. A BE request never displaces an RT one. With one class only, the schedule is
sarathi's.

While RT requests run, the BE work beside them (sized once the RT work is scheduled) is cut
to what keeps the step within their SLOs (the TBT target of those generating, the TTFT
target of those not started) under the engine's cost model: the oldest BE decodes that fit,
and BE prefill tokens only when every BE decode fits. Without it an RT request beside 512 BE
decodes took ~0.5 s a token on this CPU, twice its 0.25 s target. A scheduler without a
cost model, or RT requests without SLOs, leave the BE work whole.

BROS (bros.py) orders every request by its deadline under the cost model; this policy keeps
sarathi's order and uses the class, and the cost model only to size the BE share.
"""

from __future__ import annotations

from collections.abc import Iterator

from ..request import Request, Status
from ..scheduler import Scheduler
from .base import Group
from .sarathi import SarathiPolicy


class PriorityPolicy(SarathiPolicy):
    name = "priority"
    description = ("sarathi with RT before BE: RT decodes, prefills and admissions first; an "
                   "RT request takes the newest BE one's place when seats or memory run out; "
                   "the BE work beside RT requests is sized to their SLOs")

    def rank(self, req: Request) -> int:
        return 0 if req.priority == "RT" else 1

    def groups(self, s: Scheduler, now: float) -> Iterator[Group]:
        if not s.num_rt:
            yield from super().groups(s, now)
            return
        decodes: tuple[list[Request], list[Request]] = ([], [])
        prefills: tuple[list[Request], list[Request]] = ([], [])
        waiting: tuple[list[Request], list[Request]] = ([], [])
        for r in s.running:
            (decodes if r.is_decode else prefills)[self.rank(r)].append(r)
        for r in s.waiting:
            waiting[self.rank(r)].append(r)
        yield Group(decodes[0], evict=True)
        yield Group(prefills[0], evict=True)
        yield Group(waiting[0], evict=True, stop_on_short=True, displace=True)
        # The loop has taken the RT work by now: the BE share is sized beside the RT requests
        # running, not beside those left waiting (a prompt short of memory for many steps
        # left the BE requests nothing in all of them).
        running = Status.RUNNING
        rt = [r for group in (decodes[0], prefills[0], waiting[0]) for r in group
              if r.status is running]
        yield from self._within_rt_slos(s, rt, [
            Group([r for r in decodes[1] if r.status is running], evict=True),
            Group(prefills[1], evict=True), Group(waiting[1], evict=False, stop_on_short=True)])

    @staticmethod
    def _within_rt_slos(s: Scheduler, rt: list[Request], be: list[Group]) -> list[Group]:
        """The BE groups cut to what keeps the step within the SLO of the RT requests running
        (the tightest)."""
        # (TTFT until this run's first token: a resumed request's earlier ones do not count)
        slos = [r.slo_ttft_s if r.last_token_time is None else r.slo_tbt_s for r in rt]
        budget_s = min((x for x in slos if x is not None), default=None)
        cm = s.cost_model
        if budget_s is None or cm is None:
            return be
        p_left = s.max_prefill_tokens  # (the RT work as the loop took it, about)
        work = []
        for r in rt:
            n = 1 if r.is_decode else min(s.tokens_left(r), p_left)
            if n > 0:
                work.append((r, n))
                p_left -= 0 if r.is_decode else n
        base = s.costs(work)
        be_decodes = list(be[0].requests)
        n = cm.most_decodes(base, [r.num_computed for r in be_decodes], budget_s)
        if n < len(be_decodes):
            return [Group(be_decodes[:n], evict=True)]
        # Prefill tokens in the time left, at the model's cost per token (a chunk's
        # attention and fixed terms left out: the cap is a share, not a promise).
        left_s = budget_s - cm.step_time(base + s.costs([(r, 1) for r in be_decodes]))
        per_token = cm.coefficients["tokens"]
        if per_token > 0:
            be[1].token_cap = max(0, int(left_s / per_token))
        return be

    def victim(self, s: Scheduler, cand: Request, batch: dict[Request, int]) -> Request | None:
        return next(self.victims(s, cand, batch), None)

    def victims(self, s: Scheduler, cand: Request, batch: dict[Request, int]
                ) -> Iterator[Request]:
        """The running requests of a lower class outside the batch, newest first; for a
        running request short of memory, then those of its own class (sarathi's rule)."""
        rank = self.rank(cand)
        for r in reversed(s.running):
            if r is not cand and r not in batch and self.rank(r) > rank:
                yield r
        if cand.status is Status.RUNNING:
            for r in reversed(s.running):
                if r is not cand and r not in batch and self.rank(r) == rank:
                    yield r
