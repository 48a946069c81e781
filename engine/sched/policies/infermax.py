"""InferMax's eviction-aware policy (its Sec. 6): Sarathi's grouping with running decodes
ordered longest first and the shortest evicted first (a long request is expensive to
refill), and memory reserved for each request's estimated output length.

The estimate is the 90th percentile of the output lengths observed so far (capped by the
request's max_tokens); until 16 requests have finished there are no observations worth a
quantile, and only the prompt is reserved, as Sarathi does. The lengths are kept as an
online histogram (a count per length): its size is bounded by the context, where a sorted
list of every length grew by one entry, and one O(n) insertion, per finished request for
the life of a server.
"""

from __future__ import annotations

from collections import Counter

from ..request import Request
from ..scheduler import Scheduler
from .sarathi import SarathiPolicy

QUANTILE = 0.9
MIN_OBSERVATIONS = 16


class InferMaxPolicy(SarathiPolicy):
    name = "infermax"
    description = ("Sarathi grouping; longest decodes first, shortest evicted first; reserves "
                   f"prompt + p{int(QUANTILE * 100)} of observed output lengths")
    reserves_memory = True

    def __init__(self) -> None:
        self.observed: Counter[int] = Counter()  # output length -> finished requests
        self._count = 0
        self._quantile: int | None = None  # of `observed`, until the next observation

    def decode_order(self, s: Scheduler, decodes: list[Request]) -> list[Request]:
        return sorted(decodes, key=lambda r: -r.num_tokens)

    def victim(self, s: Scheduler, cand: Request, batch: dict[Request, int]) -> Request | None:
        others = [r for r in s.running if r is not cand and r not in batch]
        return min(others, key=lambda r: r.num_tokens, default=None)

    def estimated_output(self, req: Request) -> int:
        if self._count < MIN_OBSERVATIONS:
            return 0
        if self._quantile is None:
            self._quantile = self._length_at(int(QUANTILE * self._count))
        return min(self._quantile, req.params.max_tokens)

    def _length_at(self, rank: int) -> int:
        """The rank-th smallest length observed (from 0)."""
        seen = 0
        for length, count in sorted(self.observed.items()):
            seen += count
            if seen > rank:
                return length
        raise ValueError(f"rank {rank} of {seen} observations")

    def reserve_tokens(self, s: Scheduler, req: Request) -> int:
        return len(req.prompt_ids) + max(self.estimated_output(req), len(req.output_ids))

    def observe_finished(self, req: Request) -> None:
        if req.finish_reason in ("stop", "length") and req.generate:
            self.observed[len(req.output_ids)] += 1
            self._count += 1
            self._quantile = None
