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

from ..cache.block_pool import BlockPool, block_hash
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

    def _block_tokens(self, req: Request, i: int) -> tuple[int, ...]:
        bs = self.pool.block_size
        return tuple(req.token_ids[i * bs : (i + 1) * bs])

    def _hashes(self, req: Request, num_blocks: int) -> list[int]:
        """Chained hashes of the request's first num_blocks full blocks."""
        while len(req.block_hashes) < num_blocks:
            i = len(req.block_hashes)
            parent = req.block_hashes[-1] if i else None
            req.block_hashes.append(block_hash(parent, self._block_tokens(req, i)))
        return req.block_hashes

    def _prefix_hit(self, req: Request) -> list[int]:
        """Cached blocks holding a prefix of a request that has computed nothing yet.

        At least one token is left to compute (its logits are needed), and a scoring request
        computes every position whose logits it asked for."""
        if not self.pool.enable_prefix_caching or req.num_computed:
            return []
        limit = req.num_tokens - 1
        if req.logits_from is not None:
            limit = min(limit, req.logits_from)
        num_blocks = limit // self.pool.block_size
        hits: list[int] = []
        for i, h in enumerate(self._hashes(req, num_blocks)[:num_blocks]):
            b = self.pool.lookup(h, self._block_tokens(req, i))
            if b is None:
                break
            hits.append(b)
        return hits

    def register_computed(self, req: Request) -> None:
        """Publish the request's newly completed full blocks for reuse by others."""
        full = req.num_computed // self.pool.block_size
        if full <= req.num_registered:
            return
        hashes = self._hashes(req, full)
        for i in range(req.num_registered, full):
            self.pool.register(req.block_ids[i], hashes[i], self._block_tokens(req, i))
        req.num_registered = full

    def _preempt(self, req: Request) -> None:
        """Recompute later: free its blocks; its prompt and outputs so far are kept."""
        self.pool.free(req.block_ids)
        req.block_ids = []
        req.num_computed = 0
        req.num_registered = 0
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
            req = self.waiting[0]  # waiting requests hold no blocks and have computed nothing
            hits = self._prefix_hit(req)
            cached = len(hits) * self.pool.block_size
            n = min(req.num_tokens - cached, budget)
            # Reviving an unreferenced cached block takes it off the free list too.
            revived = sum(1 for b in hits if self.pool.ref_count[b] == 0)
            new_blocks = self.pool.blocks_for(cached + n) - len(hits)
            if new_blocks + revived > self.pool.num_free:
                break
            self.waiting.popleft()
            if hits:
                for b in hits:
                    self.pool.touch(b)
                req.block_ids, req.num_computed, req.num_registered = hits, cached, len(hits)
            if req.num_cached_tokens is None:
                req.num_cached_tokens = cached
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
