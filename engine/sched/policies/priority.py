"""Sarathi-Serve's loop with two classes: real-time (RT) requests before best-effort (BE)
ones at every stage. The engine's default.

Why: interactive queries and bulk jobs share one engine (llmdb serve, a notebook beside an
ETL job). Under plain sarathi a waiting RT request queued behind every BE request submitted
before it: an interactive query behind a 200-row job got its first token 95 steps later,
3 steps before the job ended. Here the RT requests run first (decodes, started prefills, then
waiting ones within the token budget), and an RT request that finds the running set or
memory full takes the place of the newest BE request, which is preempted (recomputed later;
its prompt's blocks usually stay in the prefix cache). A BE request never displaces an RT
one. With one class only, the schedule is sarathi's.

BROS (bros.py) does the same job by the requests' deadlines under the cost model; this
policy needs no cost model and no SLOs, only the class.
"""

from __future__ import annotations

from ..request import Request, Status
from ..scheduler import Scheduler
from .base import Group
from .sarathi import SarathiPolicy


class PriorityPolicy(SarathiPolicy):
    name = "priority"
    description = ("sarathi with RT before BE: RT decodes, prefills and admissions first; an "
                   "RT request takes the newest BE one's place when seats or memory run out")

    def rank(self, req: Request) -> int:
        return 0 if req.priority == "RT" else 1

    def groups(self, s: Scheduler, now: float) -> list[Group]:
        if not s.num_rt:
            return super().groups(s, now)
        decodes: tuple[list[Request], list[Request]] = ([], [])
        prefills: tuple[list[Request], list[Request]] = ([], [])
        waiting: tuple[list[Request], list[Request]] = ([], [])
        for r in s.running:
            (decodes if r.is_decode else prefills)[self.rank(r)].append(r)
        for r in s.waiting:
            waiting[self.rank(r)].append(r)
        return [Group(decodes[0], evict=True), Group(prefills[0], evict=True),
                Group(waiting[0], evict=True, stop_on_short=True, displace=True),
                Group(decodes[1], evict=True), Group(prefills[1], evict=True),
                Group(waiting[1], evict=False, stop_on_short=True)]

    def victim(self, s: Scheduler, cand: Request, batch: dict[Request, int]) -> Request | None:
        """The newest running request of a lower class outside the batch; for a running
        request short of memory, else the newest of its own class (sarathi's rule)."""
        same = None
        for r in reversed(s.running):
            if r is cand or r in batch:
                continue
            if self.rank(r) > self.rank(cand):
                return r
            if same is None and self.rank(r) == self.rank(cand):
                same = r
        return same if cand.status is Status.RUNNING else None
