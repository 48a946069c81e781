"""vLLM's original scheduler: prefill first, prefill-only or decode-only batches, whole
prompts (no chunking), evict the newest running request when memory is short."""

from __future__ import annotations

from ..scheduler import Scheduler
from .base import Group, Policy


class FCFSPolicy(Policy):
    name = "fcfs"
    description = ("vLLM: waiting prefills first, no mixed batches, no chunking "
                   "(a prompt longer than C runs alone); evicts the newest")
    hybrid = False
    chunked_prefill = False

    def groups(self, s: Scheduler, now: float) -> list[Group]:
        return [Group(list(s.waiting), evict=False, stop_on_short=True),
                Group(list(s.running), evict=True)]
