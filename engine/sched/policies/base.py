"""InferMax's Algorithm 1 (GETNEXTBATCH) as one loop; policies fill in its four steps.

(1) group and order the candidates; (2) skip a candidate whose phase differs from the batch
when hybrid batching is off; (3) can-allocate under the token budget C, the prefill budget P
and the memory budget M; (4) otherwise evict a lower-priority running request, or the
candidate itself when none is left (running candidates only; a waiting one evicts only
where that makes room for it, and is skipped otherwise).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice

from ..request import Request, Status
from ..scheduler import Scheduler, SchedulerOutput


@dataclass
class Group:
    requests: Sequence[Request]
    evict: bool  # on a memory shortage: evict lower-priority running requests
    stop_on_short: bool = False  # a candidate that does not fit ends the group (FCFS order)
    # A waiting candidate may take a running request's seat when every seat is taken, by
    # preempting victim()s (a higher class, by rank(), displacing a lower one).
    displace: bool = False
    # At most this many tokens from this group on (None: the step's budget C alone).
    token_cap: int | None = None


class Policy:
    name = "base"
    description = ""
    hybrid = True  # prefill chunks and decodes in one batch
    chunked_prefill = True  # a prefill may be split across steps under P
    reserves_memory = False  # reserve_tokens() is used by can-allocate
    keeps_hidden_states = False  # gives requests hidden caches (Apt-Serve) where there are any

    def groups(self, s: Scheduler, now: float) -> Iterable[Group]:
        """The candidates in groups, in order; taken one group at a time, so that a
        generator's later groups may depend on what the earlier ones scheduled."""
        raise NotImplementedError

    def victim(self, s: Scheduler, cand: Request, batch: dict[Request, int]) -> Request | None:
        """The lowest-priority running request outside the batch (default: the newest)."""
        for r in reversed(s.running):
            if r is not cand and r not in batch:
                return r
        return None

    def victims(self, s: Scheduler, cand: Request, batch: dict[Request, int]
                ) -> Iterator[Request]:
        """victim() and the ones it would name after it, were each preempted in turn (a
        policy may give these in one pass)."""
        passed = dict(batch)
        while (r := self.victim(s, cand, passed)) is not None:
            passed[r] = 0
            yield r

    def rank(self, req: Request) -> int:
        """A request's class: a lower rank is served first and may displace a higher one
        (one class unless a policy says otherwise)."""
        return 0

    def reserve_tokens(self, s: Scheduler, req: Request) -> int:
        return 0

    def observe_finished(self, req: Request) -> None:
        pass

    def schedule(self, s: Scheduler, now: float) -> SchedulerOutput:
        out = SchedulerOutput()
        batch: dict[Request, int] = {}
        c_left, p_left = s.max_num_batched_tokens, s.max_prefill_tokens
        phase: bool | None = None  # True: the batch holds prefills (hybrid off)
        for group in self.groups(s, now):
            if group.token_cap is not None:
                c_left = min(c_left, group.token_cap)
            cands = list(group.requests)
            i = 0
            while i < len(cands):
                if len(batch) >= s.max_num_seqs or c_left <= 0:
                    return out
                if (self.hybrid or phase is not True) and cands[i].status is Status.RUNNING:
                    # Running decodes that fit, many at once.
                    taken = s.run_decodes(out, batch, cands, i,
                                          min(s.max_num_seqs - len(batch), c_left))
                    if taken:
                        i += taken
                        c_left -= taken
                        phase = False if phase is None else phase
                        continue
                cand = cands[i]
                i += 1
                if cand in batch or cand.status is Status.FINISHED or cand in out.preempted:
                    continue
                waiting = cand.status is Status.WAITING
                if waiting and (any(self.rank(r) <= self.rank(cand) for r in out.preempted)
                                or s.waits_for_prefix(cand)):
                    continue  # memory is short this step, or its prefix is being computed
                # Seats a waiting candidate must take from running requests (displace).
                seats = len(s.running) + 1 - s.max_num_seqs if waiting else 0
                if seats > 0 and not group.displace:
                    continue  # full: admit nobody new
                prefill = s.is_prefill(cand)
                if not self.hybrid and phase is not None and prefill != phase:
                    continue  # (2)
                n = s.tokens_left(cand)
                if prefill:  # (3): C and P
                    cap = min(c_left, p_left)
                    if n > cap and self.chunked_prefill:
                        n = cap
                    elif n > cap and batch:
                        continue  # whole prompts only; one longer than C runs alone
                elif n > c_left:
                    continue
                if n <= 0:
                    continue
                fits = s.fits(cand, n)  # (3): M
                if waiting and (seats > 0 or not fits):
                    room = self._room(s, cand, n, batch, seats, fits, group.evict)
                    if room is None:
                        if group.stop_on_short:
                            break
                        continue
                    for k, victim in enumerate(room):  # seats first, then (4) as needed
                        if k >= seats and s.fits(cand, n):
                            break
                        s.preempt(out, victim)
                    fits = s.fits(cand, n)
                while not fits and group.evict:  # (4)
                    victim = self.victim(s, cand, batch)
                    if victim is None:
                        break
                    s.preempt(out, victim)
                    fits = s.fits(cand, n)
                if not fits:
                    if not waiting and group.evict:
                        s.preempt(out, cand)  # self-eviction
                    if group.stop_on_short:
                        break
                    continue
                n = s.run(out, cand, n)
                batch[cand] = n
                c_left -= n
                if prefill:
                    p_left -= n
                phase = prefill if phase is None else phase
        return out

    def _room(self, s: Scheduler, cand: Request, n: int, batch: dict[Request, int],
              seats: int, fits: bool, evict: bool) -> list[Request] | None:
        """The victims() a waiting candidate may preempt for its seats and, where its group
        evicts, for its blocks, in order; None when even all of them would not make room:
        then none is preempted, where evicting them for nothing cost their work and, each
        time they were admitted again, again (two requests in turn, for ever)."""
        victims = self.victims(s, cand, batch)
        room = list(islice(victims, max(seats, 0)))
        if len(room) < seats:
            return None
        if fits or (room and s.fits(cand, n, room)):
            return room
        if evict:
            room += victims
            if s.fits(cand, n, room):
                return room
        return None
