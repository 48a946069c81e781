"""BROS's baseline: iteration-level round robin between an RT and a BE queue, each FCFS
(running first, then waiting, chunked prefill); a class with no work yields its turn."""

from __future__ import annotations

from ..request import Request
from ..scheduler import Scheduler, SchedulerOutput
from .base import Group, Policy


class RoundRobinPolicy(Policy):
    name = "rr"
    description = "alternates RT and BE batches each iteration; FCFS within a class"

    def __init__(self) -> None:
        self.turn = "RT"

    def schedule(self, s: Scheduler, now: float) -> SchedulerOutput:
        out = super().schedule(s, now)
        if not out.scheduled:  # the class whose turn it was could not run: the other one
            out = super().schedule(s, now)
        return out

    def victim(self, s: Scheduler, cand: Request, batch: dict[Request, int]) -> Request | None:
        """The newest running request admitted after the candidate, of either class; none
        older (the candidate yields instead). A turn's batch holds one class only, so the
        base rule (the newest other request) let a request evict older work of the other
        class, and two requests that did not fit together evicted each other on alternate
        turns for ever."""
        for r in reversed(s.running):
            if r is cand:
                return None
            if r not in batch:
                return r
        return None

    def groups(self, s: Scheduler, now: float) -> list[Group]:
        classes = {r.priority for r in s.running} | {r.priority for r in s.waiting}
        cls = self.turn if self.turn in classes or not classes else next(iter(classes))
        self.turn = "BE" if cls == "RT" else "RT"
        return [Group([r for r in s.running if r.priority == cls], evict=True),
                Group([r for r in s.waiting if r.priority == cls], evict=False,
                      stop_on_short=True)]
