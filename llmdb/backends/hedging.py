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
- A request asking for more tokens (max_tokens) than the slowest answer generated has that
  answer's time scaled up by the ratio: after a run of one-token classifications, a row
  asking 2,000 tokens of a replica busy generating them is not copied for taking longer than
  they did. The scale counts an answer's whole time as per-token time, so a request much
  longer than the recent answers is copied late or not at all (timeout_s still bounds it):
  the rule errs towards paying once.
- Another replica can take the copy at no row's expense: it is in rotation, has not stalled
  itself, has a free slot, and no request is waiting for a slot (the copy takes capacity
  nobody else wants, so it delays no row).
Then one copy is sent (never more per attempt): the first answer wins and the other copy is
cancelled, its connection closed (which aborts it on vLLM and llmdb serve), so a row is
answered once and paid at most twice. The stalled replica's cancelled copy counts as a failed
request, as a timeout does: after FAILURES_OUT of them the replica leaves the rotation rather
than taking new rows to hold.
Hedging stays on for hosted (https) APIs, which may bill a cancelled copy too: a copy needs a
second endpoint the user listed and a replica that answered nothing for the stall time, and
the alternative, a timeout and a retry, leaves the stalled request billed as well, only later.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

LATENCIES_KEPT = 64  # answers per route whose latencies set the stall time


@dataclass
class StallRule:
    floor_s: float  # ReplicaLimits.stall_s
    factor: float  # ReplicaLimits.stall_factor
    # route -> the recent answers' (seconds, tokens generated)
    _answers: dict[str, deque[tuple[float, int]]] = field(default_factory=dict)

    def observe(self, route: str, seconds: float, tokens: int = 0) -> None:
        """An answer to `route` that took `seconds` from sending to its last byte and
        generated `tokens` (0: unknown, or a route that generates none)."""
        kept = self._answers.setdefault(route, deque(maxlen=LATENCIES_KEPT))
        kept.append((seconds, tokens))

    def stall_s(self, route: str, tokens: int = 0) -> float:
        """How long a replica answering nothing holds a request to `route` that asks for up
        to `tokens` generated tokens (its max_tokens) before it is sent again elsewhere."""
        slowest, generated = max(self._answers.get(route) or [(self.floor_s, 0)])
        scale = tokens / generated if 0 < generated < tokens else 1.0
        return max(self.floor_s, self.factor * slowest * scale)
