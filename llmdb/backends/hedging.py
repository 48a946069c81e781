"""When a request held by a stalled replica is sent again to another (a hedged request).

A hung server holds the rows it took until timeout_s (300 s by default: a long generation on
a busy server is slow), while the other replicas sit idle at the end of a job. ReplicaPool
sends such a row again once all of these hold:
- The replica has stalled: it has answered nothing (no request of any kind) for the stall
  time, and the row has waited on it as long. A hung server answers nothing; a busy one keeps
  answering its other rows, and is left to finish.
- The stall time is stall_factor times the slowest of the last LATENCIES_KEPT answers to the
  same route (from any replica), and at least stall_s: a stall is measured against what this
  workload takes here (a 2-minute generation is not hedged for being slower than a 1-second
  classification), and the floor keeps a hiccup on a fast route from being paid twice.
  Before any answer, the slowest is taken as stall_s.
- Another replica can take the copy at no row's expense: it is in rotation, has not stalled
  itself, has a free slot, and no request is waiting for a slot (the copy takes capacity
  nobody else wants, so it delays no row).
Then one copy is sent (never more per attempt): the first answer wins and the other copy is
cancelled, its connection closed (which aborts it on vLLM and llmdb serve), so a row is
answered once and paid at most twice. The stalled replica's cancelled copy counts as a failed
request, as a timeout does: after FAILURES_OUT of them the replica leaves the rotation rather
than taking new rows to hold.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

LATENCIES_KEPT = 64  # answers per route whose latencies set the stall time


@dataclass
class StallRule:
    floor_s: float  # ReplicaLimits.stall_s
    factor: float  # ReplicaLimits.stall_factor
    _latencies: dict[str, deque[float]] = field(default_factory=dict)

    def observe(self, route: str, seconds: float) -> None:
        """An answer to `route` that took `seconds` from sending to its last byte."""
        kept = self._latencies.setdefault(route, deque(maxlen=LATENCIES_KEPT))
        kept.append(seconds)

    def stall_s(self, route: str) -> float:
        """How long a replica answering nothing holds a request to `route` before it is
        sent again elsewhere."""
        slowest = max(self._latencies.get(route) or [self.floor_s])
        return max(self.floor_s, self.factor * slowest)
