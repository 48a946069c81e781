"""The scheduler's mechanics: queues, block allocation, prefix hits, preemption.

Which requests run in a step, with how many tokens, and who is evicted is the policy's
decision (policies/): each policy is a small class over InferMax's Algorithm 1 (base.py).
The scheduler sees requests through a few numbers (tokens to compute, cached tokens, pending
time, class, SLOs, cache type) and the pool through block counts, so the same objects run in
the engine and in the simulator (research/sim.py).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ..cache.block_pool import HIDDEN_RATIO, BlockPool, block_hash
from ..costmodel import Chunk, CostModel
from ..params import SamplingParams
from .request import PENDING_TOKEN, Request, Status


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, tokens)
    preempted: list[Request] = field(default_factory=list)
    # Hidden-cache requests switched to the KV cache this step: (request, its old hidden
    # halves, the position of their first token: the tokens before it are a KV prefix it
    # keeps). The executor projects their K/V from those halves before the step runs.
    converted: list[tuple[Request, list[int], int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class SchedulingPolicy(Protocol):
    """What the scheduler asks of its policy (policies/base.py's Policy is one; the
    scheduler never imports them: policies/ builds on this module, not the other way)."""

    name: str
    reserves_memory: bool  # reserve_tokens() counts when checking that a request fits
    keeps_hidden_states: bool  # it gives requests hidden caches where the executor has them

    def schedule(self, s: Scheduler, now: float) -> SchedulerOutput: ...

    def reserve_tokens(self, s: Scheduler, req: Request) -> int: ...

    def observe_finished(self, req: Request) -> None: ...


class Scheduler:
    """C = max_num_batched_tokens (tokens per step), P = max_prefill_tokens (prefill tokens
    per step, <= C), M = the block pool; max_num_seqs caps the running requests. The policy
    is an object (policies.make_policy builds one from a name)."""

    def __init__(self, pool: BlockPool, max_num_batched_tokens: int, max_num_seqs: int,
                 policy: SchedulingPolicy, max_prefill_tokens: int | None = None,
                 cost_model: CostModel | None = None, hidden_ratio: float | None = None):
        self.pool = pool
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_tokens = min(max_prefill_tokens or max_num_batched_tokens,
                                      max_num_batched_tokens)
        self.max_num_seqs = max_num_seqs
        self.cost_model = cost_model
        # Hidden-cache bytes per token over KV bytes per token (Apt-Serve's h/m); None: the
        # executor has no hidden cache. The pool stores hidden states by half blocks, so the
        # ratio is HIDDEN_RATIO: a hidden request's block_ids are halves of block_size tokens.
        if hidden_ratio not in (None, HIDDEN_RATIO):
            raise ValueError(f"hidden_ratio must be None or {HIDDEN_RATIO} (hidden states take "
                             f"half blocks), got {hidden_ratio}")
        self.hidden_ratio = hidden_ratio
        self.policy = policy
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Running requests with nothing left to compute whose last step's results are not
        # read yet (hold()): they keep their blocks but no policy sees them.
        self.held: dict[str, Request] = {}
        self._hits: dict[str, list[int]] = {}  # this step's prefix hits of waiting requests
        # Full prompt blocks being computed right now: block hash -> the request computing
        # it. A waiting request whose next block is one of them waits for it to be
        # published instead of computing the same prefix in parallel.
        self._computing: dict[int, str] = {}
        # Requests switched hidden -> KV by projection in the last schedule(), and the tokens
        # each projects once in its step (costs()).
        self._converted: dict[str, int] = {}
        # Called with each schedule()'s output, before anything runs it: how tests and the
        # bound's recording of a policy (research/schedules.py) watch the decisions.
        self.observers: list[Callable[[SchedulerOutput], None]] = []
        # RT requests added and not finished: class-aware policies skip their per-class
        # sorting (a pass over every request, each step) while there are none.
        self.num_rt = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)
        self.num_rt += req.priority == "RT"

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.held)

    def schedule(self, now: float | None = None) -> SchedulerOutput:
        self._hits.clear()
        self._converted.clear()
        out = self.policy.schedule(self, time.perf_counter() if now is None else now)
        for observe in self.observers:
            observe(out)
        return out

    # ---- what a request needs --------------------------------------------------------------

    def tokens_left(self, req: Request) -> int:
        """Tokens to compute before its next token can be sampled (after prefix hits)."""
        if req.status is Status.WAITING:
            return req.num_tokens - len(self.prefix_hit(req)) * self.pool.block_size
        return req.num_tokens - req.num_computed

    def is_prefill(self, req: Request) -> bool:
        return not req.is_decode

    def memory_held(self, req: Request) -> float:
        """The request's memory in blocks (a hidden request's halves count half)."""
        return self.memory_of(req, len(req.block_ids))

    def memory_of(self, req: Request, units: int) -> float:
        """`units` of the request's blocks in blocks: its KV prefix whole, halves by half."""
        if req.cache_type != "hidden":
            return units
        return req.num_kv_prefix + (units - req.num_kv_prefix) * self.hidden_ratio

    def max_request_tokens(self) -> int:
        """The most tokens one request can ever hold in the pool: as hidden states where the
        policy keeps them, else as K/V."""
        tokens = self.pool.num_blocks * self.pool.block_size
        if self.hidden_ratio and self.policy.keeps_hidden_states:
            return int(tokens / self.hidden_ratio)
        return tokens

    def _num_free(self, req: Request) -> int:
        """Free units of the request's cache type: KV blocks, or halves for a hidden request.
        Either holds block_size tokens, so pool.blocks_for counts what a request needs."""
        return self.pool.num_free_halves if req.cache_type == "hidden" else self.pool.num_free

    def _allocate(self, req: Request, n: int) -> None:
        hidden = req.cache_type == "hidden"
        req.block_ids.extend(self.pool.allocate_halves(n) if hidden else self.pool.allocate(n))

    def _release(self, req: Request) -> None:
        if req.cache_type == "hidden":
            self.pool.free(req.block_ids[: req.num_kv_prefix])
            self.pool.free_halves(req.block_ids[req.num_kv_prefix :])
        else:
            self.pool.free(req.block_ids)
        req.block_ids = []
        req.num_kv_prefix = 0

    def _blocks_needed(self, req: Request, n: int) -> int:
        return max(0, self.pool.blocks_for(req.num_computed + n) - len(req.block_ids))

    def costs(self, scheduled: list[tuple[Request, int]]) -> list[Chunk]:
        """The cost model's view of a batch (before its tokens are computed)."""
        return [Chunk(r.num_computed, n, r.is_decode, self._reprojected(r)) for r, n in scheduled]

    def _reprojected(self, req: Request) -> int:
        """Context tokens whose K/V the request's step re-projects from hidden states."""
        if req.cache_type == "hidden":
            return req.num_computed - req.num_kv_prefix * self.pool.block_size
        return self._converted.get(req.request_id, 0)

    def reserved_blocks(self, req: Request) -> int:
        """Blocks set aside for a running request beyond those it holds (policy estimate)."""
        want = self.policy.reserve_tokens(self, req)
        return max(0, self.pool.blocks_for(want) - len(req.block_ids)) if want else 0

    def blocks_to_run(self, req: Request, n: int) -> int:
        """Free blocks that computing n more tokens of `req` takes (and its reservation)."""
        if req.status is not Status.WAITING:
            return self._blocks_needed(req, n)
        hits = self.prefix_hit(req)
        cached = len(hits) * self.pool.block_size
        # Reviving an unreferenced cached block takes it off the free list too (a hidden
        # request revives none: _cached_blocks).
        revived = sum(1 for b in hits if self.pool.ref_count[b] == 0)
        need = self.pool.blocks_for(cached + n) - len(hits)
        if self.policy.reserves_memory:
            need = max(need, self.pool.blocks_for(self.policy.reserve_tokens(self, req))
                       - len(hits))
        return need + revived

    def fits(self, req: Request, n: int, preempting: Sequence[Request] = ()) -> bool:
        """Can `req` compute n more tokens now without touching others' blocks/reservations
        (those of `preempting`, running requests, counted as freed)?"""
        free = self._num_free(req)
        if preempting:
            # (a block of its prefix hit that they free it takes back: counted by
            # blocks_to_run as revived once they are gone, here as never freed)
            hits = set(self.prefix_hit(req)) if req.status is Status.WAITING else set()
            free += self.units_freed_by(preempting, req.cache_type, hits)
        if self.policy.reserves_memory:
            gone = set(preempting)
            reserved = sum(self.reserved_blocks(r) for r in self.running
                           if r is not req and r not in gone)
            free -= reserved * (2 if req.cache_type == "hidden" else 1)  # (in halves)
        return self.blocks_to_run(req, n) <= free

    def units_freed_by(self, reqs: Sequence[Request], cache_type: str, kept: set[int]) -> int:
        """Free units of `cache_type` that preempting these running requests would add: a
        block is freed when every reference to it is theirs (prefix hits share blocks), and
        not one of `kept`."""
        refs: Counter[int] = Counter()
        halves: list[int] = []
        for r in reqs:
            if r.cache_type == "hidden":
                refs.update(r.block_ids[: r.num_kv_prefix])
                halves.extend(r.block_ids[r.num_kv_prefix :])
            else:
                refs.update(r.block_ids)
        blocks = sum(1 for b, k in refs.items() if k == self.pool.ref_count[b] and b not in kept)
        if cache_type == "hidden":
            return 2 * blocks + len(halves)
        return blocks + self.pool.blocks_freed_by(halves)

    # ---- prefix caching --------------------------------------------------------------------

    def _block_tokens(self, req: Request, i: int) -> tuple[int, ...]:
        bs = self.pool.block_size
        return tuple(req.token_slice(i * bs, bs))

    def _hashes(self, req: Request, num_blocks: int) -> list[int]:
        """Chained hashes of the request's first num_blocks full blocks."""
        while len(req.block_hashes) < num_blocks:
            i = len(req.block_hashes)
            parent = req.block_hashes[-1] if i else None
            req.block_hashes.append(block_hash(parent, self._block_tokens(req, i)))
        return req.block_hashes

    def _prompt_blocks(self, req: Request) -> int:
        """Full blocks a prefix hit may cover (at least one token is left to compute)."""
        limit = req.num_tokens - 1
        if req.logits_from is not None:
            limit = min(limit, req.logits_from)
        return limit // self.pool.block_size

    def waits_for_prefix(self, req: Request) -> bool:
        """Is the next block of this waiting request's prompt being computed by another?"""
        if not self._computing:
            return False
        i = len(self.prefix_hit(req))
        if i >= self._prompt_blocks(req):
            return False
        owner = self._computing.get(self._hashes(req, i + 1)[i])
        return owner is not None and owner != req.request_id

    def _forget_computing(self, req: Request) -> None:
        for h in req.block_hashes:
            if self._computing.get(h) == req.request_id:
                del self._computing[h]

    def prefix_hit(self, req: Request) -> list[int]:
        """Cached blocks holding a prefix of a request that has computed nothing yet.

        At least one token is left to compute (its logits are needed), and a scoring request
        computes every position whose logits it asked for."""
        if req.request_id not in self._hits:
            self._hits[req.request_id] = self._cached_blocks(req)
        return self._hits[req.request_id]

    def prefix_sharing(self, reqs: Iterable[Request]) -> Iterator[tuple[int, int]]:
        """For each of these waiting requests in turn: how many of its full prompt blocks it
        would not add to the pool as K/V (prefix hits on blocks requests hold, and blocks an
        earlier one of `reqs` has too: the earlier one counts those), and how many it would
        read as a hidden-cache request (the leading hits on blocks in use: _cached_blocks).
        (0, 0) where prefix caching is off."""
        ref, seen = self.pool.ref_count, set()
        for r in reqs:
            if not self.pool.enable_prefix_caching:
                yield 0, 0
                continue
            hits = self.prefix_hit(r)
            in_use = 0
            while in_use < len(hits) and ref[hits[in_use]]:
                in_use += 1
            n = self._prompt_blocks(r)
            shared = 0
            for i, h in enumerate(self._hashes(r, n)[:n]):
                if h in seen or (i < len(hits) and ref[hits[i]]):
                    shared += 1
                seen.add(h)
            yield shared, in_use

    def set_cache_type(self, req: Request, kind: str) -> None:
        """The cache type a waiting request is to be admitted with (its prefix hit is looked up
        again: the prefix cache's blocks are K/V whatever the type, and a hidden-cache request
        reads them where they are)."""
        req.cache_type = kind
        self._hits.pop(req.request_id, None)

    def _cached_blocks(self, req: Request) -> list[int]:
        """The prefix hit. A hidden-cache request takes only blocks in use: they cost it
        nothing, where reviving an unused cached block as K/V would cost it twice the memory
        of its own hidden states (a request that fits the pool only as hidden states would
        then never fit)."""
        hits: list[int] = []
        if self.pool.enable_prefix_caching and not req.num_computed:
            num_blocks = self._prompt_blocks(req)
            in_use_only = req.cache_type == "hidden"
            for i, h in enumerate(self._hashes(req, num_blocks)[:num_blocks]):
                b = self.pool.lookup(h, self._block_tokens(req, i))
                if b is None or (in_use_only and not self.pool.ref_count[b]):
                    break
                hits.append(b)
        return hits

    def cached_prefix_tokens(self, token_ids: Sequence[int]) -> int:
        """Tokens a new request for token_ids would find in the prefix cache now (EXPLAIN)."""
        probe = Request("probe", list(token_ids), SamplingParams(max_tokens=1))
        return len(self._cached_blocks(probe)) * self.pool.block_size

    def register_computed(self, req: Request) -> None:
        """Publish the request's newly completed full blocks for reuse by others."""
        full = req.num_computed // self.pool.block_size
        if (full <= req.num_registered or req.cache_type != "kv"
                or not self.pool.enable_prefix_caching):
            return
        hashes = self._hashes(req, full)
        for i in range(req.num_registered, full):
            self.pool.register(req.block_ids[i], hashes[i], self._block_tokens(req, i))
            if self._computing.get(hashes[i]) == req.request_id:
                del self._computing[hashes[i]]
        req.num_registered = full

    def seed_cached(self, token_ids: Sequence[int]) -> None:
        """Leave the full blocks of token_ids cached and unreferenced in the pool, as the
        requests of an earlier query leave them (the simulator's start state)."""
        bs = self.pool.block_size
        req = Request("seed", list(token_ids), SamplingParams(max_tokens=1))
        blocks = []
        for i, h in enumerate(self._hashes(req, len(token_ids) // bs)):
            tokens = self._block_tokens(req, i)
            b = self.pool.lookup(h, tokens)
            if b is None:
                b = self.pool.allocate(1)[0]
                self.pool.register(b, h, tokens)
            else:
                self.pool.touch(b)
            blocks.append(b)
        self.pool.free(blocks)

    # ---- acting on the policy's decisions --------------------------------------------------

    def run(self, out: SchedulerOutput, req: Request, n: int) -> int:
        """Put `req` in this step with up to n tokens (returned); admits a waiting one."""
        if req.status is Status.WAITING:
            hits = self.prefix_hit(req)
            self.waiting.remove(req)
            if hits:
                for b in hits:
                    self.pool.touch(b)
                req.block_ids, req.num_registered = list(hits), len(hits)
                req.num_computed = len(hits) * self.pool.block_size
                if req.cache_type == "hidden":
                    req.num_kv_prefix = len(hits)
            if req.num_cached_tokens is None:
                req.num_cached_tokens = req.num_computed
            req.status = Status.RUNNING
            self.running.append(req)
            if self.pool.enable_prefix_caching and req.cache_type == "kv":
                full = self._prompt_blocks(req)
                for h in self._hashes(req, full)[len(hits):full]:
                    self._computing.setdefault(h, req.request_id)
        n = min(n, req.num_tokens - req.num_computed)
        new_blocks = self._blocks_needed(req, n)
        if new_blocks:
            self._allocate(req, new_blocks)
            # Allocation may recycle cached blocks that other waiting requests would hit.
            self._hits.clear()
        out.scheduled.append((req, n))
        return n

    def update_from_output(self, scheduled: list[tuple[Request, int]],
                           sampled: Mapping[str, int] | None, now: float) -> list[Request]:
        """After a step: advance(), then each generating request that caught up takes its
        sampled token (token 0 when `sampled` is None: the simulator, whose outputs have no
        values). Returns the requests that caught up, scoring ones included, in batch order.
        The simulator, the bound's replay and the tests advance requests through here; the
        engine calls the two halves itself, with a step in between when it runs ahead."""
        caught_up = self.advance(scheduled)
        for req in caught_up:
            if req.generate:
                self.take_token(req, 0 if sampled is None else sampled[req.request_id], now)
        return caught_up

    def advance(self, scheduled: list[tuple[Request, int]]) -> list[Request]:
        """Computed tokens catch up with a step that has run (or been launched), full blocks
        are published, and each generating request whose tokens are now all computed gets a
        PENDING_TOKEN: its next token, to be given a value by take_token() once the step's
        results are read. Requests finished meanwhile are skipped. Returns the requests whose
        tokens are all computed, in batch order."""
        caught_up = []
        bs, finished = self.pool.block_size, Status.FINISHED
        for req, n in scheduled:
            if req.status is finished:  # aborted while the model ran
                continue
            req.num_computed = done = req.num_computed + n
            if done // bs > req.num_registered:  # a block was completed
                self.register_computed(req)
            out = req.output_ids
            if done < len(req.prompt_ids) + len(out):
                continue
            if req.generate:
                out.append(PENDING_TOKEN)
            caught_up.append(req)
        return caught_up

    @staticmethod
    def take_token(req: Request, token: int, now: float) -> None:
        """The value of the request's pending token (its last), sampled by the step."""
        req.output_ids[-1] = token
        req.first_token_time = req.first_token_time or now
        req.last_token_time = now

    def hold(self, req: Request) -> None:
        """Take a running request that will compute nothing more (its pending token is its
        last) out of the policies' sight until it is finished; it keeps its blocks."""
        self.running.remove(req)
        self.held[req.request_id] = req

    def run_decodes(self, out: SchedulerOutput, batch: dict[Request, int],
                    cands: Sequence[Request], first: int, limit: int) -> int:
        """`run(out, req, 1)` for cands[first:], at most `limit` of them, while each is a
        running KV-cache decode outside `batch` whose block fits the free pool outright (no
        reservations to honour); each taken goes into `batch`. Returns how many were taken:
        the candidate after them (if any) is the policy's to judge. Every step's common
        case, taken in one loop without the general path's calls."""
        if self.policy.reserves_memory:
            return 0
        pool, scheduled, running = self.pool, out.scheduled, Status.RUNNING
        bs = pool.block_size
        taken = 0
        for i in range(first, min(first + limit, len(cands))):
            req = cands[i]
            out_ids, done = req.output_ids, req.num_computed
            if (req.status is not running or req.cache_type != "kv" or req in batch
                    or not out_ids or len(req.prompt_ids) + len(out_ids) - done != 1):
                break
            need = (done + bs) // bs - len(req.block_ids)  # blocks for one more token
            if need > 0:
                if need > pool.num_free:
                    break
                req.block_ids.extend(pool.allocate(need))
                self._hits.clear()
            scheduled.append((req, 1))
            batch[req] = 1
            taken += 1
        return taken

    def convert_to_kv(self, out: SchedulerOutput, req: Request) -> bool:
        """Switch a running hidden-cache request to the KV cache by projecting its cached
        hidden states to K/V once, instead of Apt-Serve's discard and recompute (which redoes
        the whole model over its tokens, where this redoes the K/V projections only). False,
        changing nothing, when its KV blocks do not fit the free pool with its hidden blocks
        back.

        The hidden blocks are freed now and may go to other requests in this same step: the
        executor reads them (each layer's gather is a copy made before that layer's K/V
        write) before the step writes anything."""
        if req.status is not Status.RUNNING or req.cache_type != "hidden":
            raise ValueError(f"{req.request_id} is not a running hidden-cache request")
        prefix = req.block_ids[: req.num_kv_prefix]  # (K/V already: kept as they are)
        old = req.block_ids[req.num_kv_prefix :]
        need = self.pool.blocks_for(req.num_computed) - len(prefix)
        if need > self.pool.num_free + self.pool.blocks_freed_by(old):
            return False
        self.pool.free_halves(old)
        req.block_ids = prefix + self.pool.allocate(need)
        req.num_kv_prefix = 0
        self._hits.clear()
        req.cache_type = "kv"
        # Projected K/V are not published as prefix blocks: published blocks hold exactly
        # what a prefill computes.
        req.num_registered = req.num_computed // self.pool.block_size
        first = len(prefix) * self.pool.block_size
        out.converted.append((req, old, first))
        self._converted[req.request_id] = req.num_computed - first
        return True

    def preempt(self, out: SchedulerOutput, req: Request) -> None:
        """Recompute later: free its blocks; its prompt and outputs so far are kept."""
        self.running.remove(req)
        self._forget_computing(req)
        self._release(req)
        req.num_computed = 0
        req.num_registered = 0
        req.num_preemptions += 1
        req.target_logprobs.clear()
        req.logit_rows.clear()
        req.status = Status.WAITING
        self.waiting.appendleft(req)
        out.preempted.append(req)

    def finish(self, req: Request) -> None:
        """Remove a request wherever it is and free its blocks."""
        if req.status is not Status.FINISHED:
            self.num_rt -= req.priority == "RT"
        if req.status is Status.RUNNING:
            if self.held.pop(req.request_id, None) is None:
                self.running.remove(req)
        elif req.status is Status.WAITING and req in self.waiting:
            self.waiting.remove(req)
        self._forget_computing(req)
        self._release(req)
        req.status = Status.FINISHED
        self.policy.observe_finished(req)
