"""Apt-Serve's scheduler (its Sec. 4.2 and 5, appendix Algorithm 1).

Each iteration serves one queue: waiting W (a prefill iteration) or running R (a decode
iteration), whichever has the larger total pending time p (since arrival before the first
token, since the last token after). Its requests are candidates for a knapsack over memory:
a request is worth p in KV form (memory m) or p - N rho m in hidden form (memory h), with
N = |W| + |R| and rho the cost model's re-projection time per unit of memory (here: seconds
per KV block's worth of tokens); a request whose K/V exceed the whole pool has no KV form and
is worth p in hidden form. The repaired greedy of apt_knapsack picks. In a decode
iteration the budget is the whole pool; in a prefill iteration it is what the running
requests leave, a started prefill counted whole. A request whose cache type changes is
recomputed in the new type, except hidden -> KV, which projects the cached hidden states to
K/V once (Scheduler.convert_to_kv) where the KV blocks fit.

A running request the knapsack does not pick is not run, and keeps its cache until a request
that runs needs the memory (the paper is silent here; evicting it at once threw away, at a
small C where few of the picked fit the step, work nobody needed the memory for, and made
apt thrash). Likewise a KV cache is discarded for the hidden one only when memory is short,
and a conversion to KV, which the request does not need to run, evicts others only where C
lets the knapsack's whole plan run.

SLO-aware fallback: a waiting request past its TTFT SLO or a running one past its TBT SLO
has p set near zero (fallback="zero"), or multiplied by 0.4 (fallback="decay", the paper's
decaying factor) while it stays in violation. The knapsack has no token budget; on this CPU
the picked requests then fill C (and P) in order of value, a documented filter.

The engine has a hidden cache for MHA models (OPT, Llama-2); for the others the scheduler's
hidden_ratio is None, every option is KV, and apt degrades to pending-time-weighted selection
with preemption.
"""

from __future__ import annotations

from ..request import Request, Status
from ..scheduler import Scheduler, SchedulerOutput
from .apt_knapsack import select_columns
from .base import Policy
from .fcfs import FCFSPolicy

NEAR_ZERO = 1e-6
DECAY = 0.4


def _total_pending(reqs, now: float) -> float:
    """The sum of Request.pending_time over reqs, in one pass."""
    return len(reqs) * now - sum(
        r.arrival if r.last_token_time is None else r.last_token_time for r in reqs)


class AptPolicy(Policy):
    name = "apt"
    description = ("Apt-Serve: knapsack over pending time and memory (hybrid KV/hidden cache "
                   "where the model has one), SLO-aware fallback, C as a filter")
    keeps_hidden_states = True

    def __init__(self, fallback: str = "zero") -> None:
        if fallback not in ("zero", "decay"):
            raise ValueError(f"fallback must be 'zero' or 'decay', got {fallback!r}")
        self.fallback = fallback

    def values(self, since: list[float], slo: list[float | None], now: float) -> list[float]:
        """Each request's p = now - since after the SLO-aware fallback. Before its first token
        a request is late when now - arrival > its TTFT SLO, after it when now - last token >
        its TBT SLO: either way, when p exceeds the SLO of the token it waits for."""
        late = NEAR_ZERO if self.fallback == "zero" else None
        return [(p if p > 0.0 else 0.0) if lim is None or p <= lim
                else late if late is not None else p * DECAY
                for p, lim in zip([now - t for t in since], slo, strict=True)]

    def schedule(self, s: Scheduler, now: float) -> SchedulerOutput:
        if not s.waiting and not s.running:
            return SchedulerOutput()
        # Pending times without the fallback: the iteration type compares raw waiting time.
        prefill_iter = not s.running or (
            _total_pending(s.waiting, now) > _total_pending(s.running, now))
        out = self.iteration(s, now, prefill_iter)
        if prefill_iter and not out.scheduled and s.running:
            # Nothing waiting fits next to the running requests: serve them instead, or the
            # engine would stall on empty prefill iterations.
            out = self.iteration(s, now, False)
        return out

    def decide(self, s: Scheduler, now: float, prefill_iter: bool
               ) -> tuple[list[Request], list[float], dict[int, str]]:
        """The candidates of this iteration, their values and the knapsack's picks."""
        pool = s.pool
        # Held requests (finishing, their last step not read yet) free their blocks soon.
        # Every holder counts its blocks whole, so a block shared through the prefix cache
        # counts once per holder: the pool holds that many more (shared_refs).
        budget = pool.num_blocks + pool.shared_refs - sum(map(s.memory_held, s.held.values()))
        if prefill_iter:
            queue = list(s.waiting)[: s.max_num_seqs - len(s.running)]
            budget -= sum(_memory_claimed(s, r) for r in s.running)
            for r in queue:  # (its type is chosen again below)
                s.set_cache_type(r, "kv")
        else:
            queue = list(s.running)
        bs = pool.block_size
        # Column by column (this runs every iteration over up to ~1,600 requests): measured
        # faster here than one sweep building a tuple per request.
        since = [r.arrival if r.last_token_time is None else r.last_token_time for r in queue]
        slo = [r.slo_ttft_s if r.last_token_time is None else r.slo_tbt_s for r in queue]
        values = self.values(since, slo, now)
        tokens = [len(r.prompt_ids) + len(r.output_ids) for r in queue]
        full = [(t + bs - 1) // bs for t in tokens]  # KV blocks, rounded up
        m = full
        # Blocks of its prefix hit in use: shared whatever the request's form.
        in_use = [0] * len(queue)
        if prefill_iter and pool.enable_prefix_caching:
            # A shared prompt prefix takes the pool's memory once (a hit on blocks in use
            # adds to shared_refs), in either form: a hidden-cache request reads the prefix
            # cache's K/V where they are. Counted whole, shared prompts looked too large for
            # their K/V: apt kept them as hidden states and recomputed every prompt.
            # Blocks shared with an earlier waiting request are shared only if that one
            # takes the KV cache too, and the two then hold at least this one's blocks less
            # those in use: more than the budget, and no plan has it in KV form. (Counted as
            # shared, it was picked for a KV cache it could never have, ahead of the other:
            # two prompts on a prefix that fit only as hidden states waited for ever.)
            sharing = list(s.prefix_sharing(queue))
            in_use = [u for _, u in sharing]
            m = [b - n if b - u <= budget else b - u
                 for b, (n, u) in zip(full, sharing, strict=True)]
        if s.hidden_ratio:
            ratio = s.hidden_ratio
            if prefill_iter:
                # The same count of half blocks, less the prefix it would read from blocks in
                # use (a hidden request publishes nothing, so blocks shared with another
                # waiting request are shared only if that one takes the KV cache).
                h = [(b - u) * ratio for b, u in zip(full, in_use, strict=True)]
            else:
                # A hidden request's KV prefix counts whole, as memory_held counts it. Where
                # that exceeds the budget (the requests it shared the prefix with are gone),
                # its hidden option is to be recomputed as hidden states alone (_fits).
                h = [kept if (kept := r.num_kv_prefix + (b - r.num_kv_prefix) * ratio)
                     <= budget else b * ratio for r, b in zip(queue, full, strict=True)]
        else:
            h = [b + 1 for b in m]  # h > m: no hidden option
        rho = (s.cost_model.rho if s.cost_model is not None else 0.0) * bs
        n_queue = len(s.waiting) + len(s.running)
        worth = values
        if s.hidden_ratio:
            # K/V larger than the whole pool: hidden states are the request's only form, worth
            # its pending time. Valued p - N rho m, it was picked only once it had waited
            # N rho m, and never once the SLO fallback had set p near zero. Its KV option is
            # put past the budget, which blocks shared with others raise past the pool: it
            # holds its blocks whoever shares them, and, offered, it was switched to K/V
            # beside a request sharing its prefix, filled the pool and was evicted, over
            # and over.
            nr = n_queue * rho
            m = [max(k, budget + 1) if b > pool.num_blocks else k
                 for k, b in zip(m, full, strict=True)]
            worth = [v + nr * k if b > pool.num_blocks else v
                     for v, k, b in zip(values, m, full, strict=True)]
        picked = select_columns(range(len(queue)), worth, m, h, budget, n_queue, rho).choice
        return queue, values, picked

    def iteration(self, s: Scheduler, now: float, prefill_iter: bool) -> SchedulerOutput:
        out = SchedulerOutput()
        queue, values, picked = self.decide(s, now, prefill_iter)
        if prefill_iter:
            for k, choice in picked.items():
                s.set_cache_type(queue[k], choice)
            victims: list[Request] = []  # the budget already leaves the running ones out
        else:
            victims = _victims(queue, values, picked)
        # The knapsack's plan, which the victims make room for, has every picked request
        # run. A conversion only speeds one up (it runs on its hidden cache anyway), so it
        # evicts for the plan only where C gives each picked request a token: at a small C
        # the request left out is the one that just ran (its pending time is near zero),
        # and evicting it for each step's conversion threw away each step's work. (The same
        # list where it may: a request evicted for one is gone for the other.)
        for_conversions = victims if len(picked) <= s.max_num_batched_tokens else []
        c_left, p_left = s.max_num_batched_tokens, s.max_prefill_tokens
        for k in sorted(picked, key=lambda k: (-values[k], k)):
            if c_left <= 0:
                break
            r, choice = queue[k], picked[k]
            if r.status is Status.WAITING and (not prefill_iter or s.waits_for_prefix(r)):
                continue  # evicted for another this step, or its prefix is in flight
            if choice == "kv" and r.cache_type == "hidden":
                _convert_to_kv(s, out, r, for_conversions)
            n = s.tokens_left(r)
            decode = n == 1 and bool(r.output_ids)
            if not decode:
                n = min(n, c_left, p_left)
            if n <= 0 or not _fits(s, out, r, choice, n, victims):
                continue
            n = s.run(out, r, n)
            c_left -= n
            if not decode:
                p_left -= n
        return out


def _memory_claimed(s: Scheduler, r: Request) -> float:
    """A running request's memory as a prefill iteration counts it (halves count half): what
    it holds, and for a started prefill what it holds once the prefill is done. It was
    admitted on that whole size; counting only its chunks so far let each prefill iteration
    of a small C start another request against memory already promised, until the running
    requests no longer fit the pool together and decode iterations evicted them."""
    if r.is_decode:
        return s.memory_held(r)
    return s.memory_of(r, s.pool.blocks_for(r.num_tokens))


def _victims(queue: list[Request], values: list[float], picked: dict[int, str]
             ) -> list[Request]:
    """The running requests that may be evicted for one that runs this step and needs their
    memory, in the order pop() takes them: those the knapsack did not pick, then KV ones it
    picked for the hidden cache (its plan recomputes them as hidden states), each least
    valuable and then least work to redo first."""
    to_hidden = [k for k, c in picked.items() if c == "hidden" and queue[k].cache_type == "kv"]
    # Every request picked is the common case, on a hot path: no sweep for the others.
    left = [k for k in range(len(queue)) if k not in picked] if len(picked) < len(queue) else []
    return [queue[k] for k in _last_least(to_hidden, queue, values)
            + _last_least(left, queue, values)]


def _last_least(ks: list[int], queue: list[Request], values: list[float]) -> list[int]:
    """ks by value, then work done, the least last (where pop() takes it)."""
    return sorted(ks, key=lambda k: (values[k], queue[k].num_computed), reverse=True)


def _convert_to_kv(s: Scheduler, out: SchedulerOutput, r: Request,
                   victims: list[Request]) -> None:
    """Hidden -> KV by projecting its hidden states once (beyond the paper, which recomputes),
    making room from `victims` (none at a small C); where it cannot fit, it stays hidden
    this step."""
    while not s.convert_to_kv(out, r) and victims:
        s.preempt(out, victims.pop())


def _fits(s: Scheduler, out: SchedulerOutput, r: Request, choice: str, n: int,
          victims: list[Request]) -> bool:
    """Can `r` compute n more tokens this step, on the cache type picked for it where it
    can have it? A running KV request picked for the hidden cache is discarded to be
    recomputed as hidden states (Apt-Serve's switch; the prefill iteration that readmits it
    gives it the type) only when memory is short: evicted for another that needs its
    blocks, or when its own next tokens do not fit. Otherwise it runs on its KV cache.
    A hidden request whose KV prefix leaves its next tokens no room even were every other
    request gone is discarded too, to be recomputed as hidden states alone (half the memory
    for the prefix): kept, it waited for memory that would never come."""
    if choice == "hidden" and r.cache_type == "kv":  # (running: a decode iteration)
        victims.remove(r)  # it runs or goes now: no later request may evict it
        if s.fits(r, n):
            return True
        s.preempt(out, r)
        return False
    while not s.fits(r, n):  # evict as few of the left-out requests as it takes
        if not victims:
            if r.num_kv_prefix and not s.fits(r, n, _others(s, r)):
                s.preempt(out, r)
            return False
        s.preempt(out, victims.pop())
    return True


def _others(s: Scheduler, r: Request) -> list[Request]:
    """Every request holding blocks but r (held ones too: they free theirs soon)."""
    return [x for x in s.running if x is not r] + list(s.held.values())


class FCFSHybridPolicy(FCFSPolicy):
    """vLLM's FCFS loop on Apt-Serve's hybrid cache, without its adaptive scheduling: the
    "FCFS" column of Apt-Serve's Table 5 and the "hybrid cache alone" ablation. Waiting
    requests are admitted in arrival order as vLLM does; one whose KV cache does not fit
    the free blocks left is admitted with a hidden cache if that fits, and admission stops
    at the first that fits neither. Running requests keep their cache type (a preempted one
    chooses again when it is readmitted)."""

    name = "fcfs-hybrid"
    description = "vLLM's FCFS, a waiting request takes a hidden cache when its KV does not fit"
    keeps_hidden_states = True

    def schedule(self, s: Scheduler, now: float) -> SchedulerOutput:
        if s.hidden_ratio:
            self.assign_cache_types(s)
        return super().schedule(s, now)

    @staticmethod
    def assign_cache_types(s: Scheduler) -> None:
        """KV for each waiting request, in order, while its KV cache fits what the ones
        before it left free; hidden where only that fits; the rest wait in KV form. A prompt
        prefix shared through the prefix cache takes KV blocks once (counted whole, a shared
        prompt was given a hidden cache where its K/V fitted); a hidden-cache request reads
        the blocks of its prefix in use."""
        free = s.pool.free_space()
        waiting = [r for r in s.waiting if not r.num_computed]  # (none holds blocks)
        for r in waiting:
            s.set_cache_type(r, "kv")
        for r, (shared, in_use) in zip(waiting, s.prefix_sharing(waiting), strict=True):
            units = s.pool.blocks_for(r.num_tokens)  # KV blocks or as many hidden halves
            if free.take_blocks(units - shared):
                continue
            if not free.take_halves(units - in_use):
                break
            s.set_cache_type(r, "hidden")
