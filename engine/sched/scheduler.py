"""The default iteration-level scheduler (Sarathi-style, vLLM v1 shape).

There are no prefill or decode phases: each request's computed tokens catch up with its
tokens within a per-step token budget. Running requests go first (oldest first), so decodes
and the rest of started prefills are never starved; waiting requests fill what is left,
chunked. Memory is a budget: a request is only scheduled when its blocks can be allocated;
when they cannot, the newest running request is preempted and later recomputed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..cache.block_pool import BlockPool
from .request import Request, Status


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, tokens)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_batched_tokens: int, max_num_seqs: int):
        self.pool = pool
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _blocks_needed(self, req: Request, n: int) -> int:
        return max(0, self.pool.blocks_for(req.num_computed + n) - len(req.block_ids))

    def _allocate(self, req: Request, n: int) -> None:
        req.block_ids.extend(self.pool.allocate(self._blocks_needed(req, n)))

    def _preempt(self, req: Request) -> None:
        """Recompute later: free its blocks; its prompt and outputs so far are kept."""
        self.pool.free(req.block_ids)
        req.block_ids = []
        req.num_computed = 0
        req.num_preemptions += 1
        req.target_logprobs.clear()
        req.logit_rows.clear()
        req.status = Status.WAITING
        self.waiting.appendleft(req)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed, budget)
            while self._blocks_needed(req, n) > self.pool.num_free:
                victim = self.running.pop()  # the newest running request
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                self._allocate(req, n)
                out.scheduled.append((req, n))
                budget -= n
                i += 1
        if out.preempted:
            return out  # memory is short: admit nobody new this step
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            n = min(req.num_tokens - req.num_computed, budget)
            if self._blocks_needed(req, n) > self.pool.num_free:
                break
            self.waiting.popleft()
            self._allocate(req, n)
            req.status = Status.RUNNING
            self.running.append(req)
            out.scheduled.append((req, n))
            budget -= n
        return out

    def finish(self, req: Request) -> None:
        """Remove a request wherever it is and free its blocks."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING and req in self.waiting:
            self.waiting.remove(req)
        self.pool.free(req.block_ids)
        req.block_ids = []
        req.status = Status.FINISHED
