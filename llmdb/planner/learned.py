"""What the planner learns from the queries it runs, for ordering predicates and estimating.

Per predicate (an LLM operand of AND/OR, by its SQL text): how many rows it saw and passed.
Per call site (by its SQL text): a sample of the values it returned, and the tokens it
generated per call. Keys carry the model's name, since another model answers differently.
One store per process, shared by its connections.
"""

from __future__ import annotations

import hashlib
import random
import threading
from dataclasses import dataclass, field
from typing import Any

SAMPLE_SIZE = 256
DEFAULT_PASS_RATE = 0.5


def stable_hash(value: Any) -> int:
    """A hash that does not change between processes (Python's str hash does)."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "big")


@dataclass
class _Values:
    seen: int = 0
    sample: list[Any] = field(default_factory=list)


class Learned:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._passes: dict[str, tuple[int, int]] = {}
        self._values: dict[str, _Values] = {}
        self._generated: dict[str, tuple[int, int]] = {}
        self._rng = random.Random(0)

    def pass_rate(self, key: str) -> float | None:
        with self._lock:
            passed, seen = self._passes.get(key, (0, 0))
        return passed / seen if seen else None

    def observe_passes(self, key: str, passed: int, seen: int) -> None:
        if seen <= 0:
            return
        with self._lock:
            p, s = self._passes.get(key, (0, 0))
            self._passes[key] = (p + passed, s + seen)

    def observe_values(self, key: str, values: list[Any]) -> None:
        """Reservoir sampling: every value returned so far is equally likely to be kept."""
        with self._lock:
            v = self._values.setdefault(key, _Values())
            for x in values:
                v.seen += 1
                if len(v.sample) < SAMPLE_SIZE:
                    v.sample.append(x)
                else:
                    j = self._rng.randrange(v.seen)
                    if j < SAMPLE_SIZE:
                        v.sample[j] = x

    def value_sample(self, key: str) -> list[Any]:
        with self._lock:
            v = self._values.get(key)
            return list(v.sample) if v else []

    def observe_generated(self, key: str, tokens: int, calls: int) -> None:
        if calls <= 0:
            return
        with self._lock:
            t, n = self._generated.get(key, (0, 0))
            self._generated[key] = (t + tokens, n + calls)

    def generated_per_call(self, key: str) -> float | None:
        with self._lock:
            t, n = self._generated.get(key, (0, 0))
        return t / n if n else None

    def clear(self) -> None:
        with self._lock:
            self._passes.clear()
            self._values.clear()
            self._generated.clear()


LEARNED = Learned()
