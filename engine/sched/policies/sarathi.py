"""Sarathi-Serve: decodes first, then started prefills, then new requests; mixed batches;
chunked prefill under P. The engine's default."""

from __future__ import annotations

from ..request import Request
from ..scheduler import Scheduler
from .base import Group, Policy


class SarathiPolicy(Policy):
    name = "sarathi"
    description = "decodes first, mixed batches, chunked prefill under P; evicts the newest"

    def decode_order(self, s: Scheduler, decodes: list[Request]) -> list[Request]:
        return decodes  # oldest first

    def groups(self, s: Scheduler, now: float) -> list[Group]:
        decodes: list[Request] = []
        prefills: list[Request] = []
        for r in s.running:
            (decodes if r.is_decode else prefills).append(r)
        return [Group(self.decode_order(s, decodes), evict=True),
                Group(prefills, evict=True),
                Group(list(s.waiting), evict=False, stop_on_short=True)]
