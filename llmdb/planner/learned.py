"""What the planner learns from the queries it runs, for ordering predicates and estimating.

Per predicate (an LLM operand of AND/OR, by its SQL text): how many rows it saw and passed.
Per call site (by its SQL text): a sample of the values it returned, and of the number of
tokens it generated per call (the output-length histogram). Keys carry the model's name,
since another model answers differently.
Per model: how the model time of finished batches compares with the cost model's simulation
of the same batches (the machine's load, or a stale calibration, scales every step alike).
One store per process, shared by its connections. Each table keeps the KEPT_KEYS keys used
last: a query text holds literals (a notebook's f-strings, a service's prompts written into
the SQL), so a long-running process meets new keys without end (300 such queries left 301
value samples and 301 output-length samples, one more of each per query).
"""

from __future__ import annotations

import hashlib
import random
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, TypeVar

SAMPLE_SIZE = 256
DEFAULT_PASS_RATE = 0.5
PRIOR_WEIGHT = 10  # a sample of n values speaks for n / (n + PRIOR_WEIGHT) of the answers
TIME_WINDOW = 20  # batches whose model time the time scale averages over
KEPT_KEYS = 1024  # predicates, call sites or models per table (the least recently used go)

V = TypeVar("V")


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
        self._passes: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self._values: OrderedDict[str, _Values] = OrderedDict()
        self._lengths: OrderedDict[str, _Values] = OrderedDict()
        self._times: OrderedDict[str, deque[tuple[float, float]]] = OrderedDict()
        self._rng = random.Random(0)

    @staticmethod
    def _get(table: OrderedDict[str, V], key: str) -> V | None:
        """The key's entry, now the most recently used. The lock is held."""
        entry = table.get(key)
        if entry is not None:
            table.move_to_end(key)
        return entry

    @staticmethod
    def _put(table: OrderedDict[str, V], key: str, entry: V) -> V:
        """Store the key's entry as the most recently used, within KEPT_KEYS. The lock is
        held."""
        table[key] = entry
        table.move_to_end(key)
        while len(table) > KEPT_KEYS:
            table.popitem(last=False)
        return entry

    def pass_rate(self, key: str) -> float | None:
        with self._lock:
            passed, seen = self._get(self._passes, key) or (0, 0)
        return passed / seen if seen else None

    def observe_passes(self, key: str, passed: int, seen: int) -> None:
        if seen <= 0:
            return
        with self._lock:
            p, s = self._get(self._passes, key) or (0, 0)
            self._put(self._passes, key, (p + passed, s + seen))

    def observe_values(self, key: str, values: list[Any]) -> None:
        """Reservoir sampling: every value returned so far is equally likely to be kept."""
        with self._lock:
            v = self._get(self._values, key) or self._put(self._values, key, _Values())
            self._reservoir(v, values)

    def _reservoir(self, v: _Values, values: list[Any]) -> None:
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
            v = self._get(self._values, key)
            return list(v.sample) if v else []

    def observe_output_lengths(self, key: str, lengths: list[int]) -> None:
        with self._lock:
            v = self._get(self._lengths, key) or self._put(self._lengths, key, _Values())
            self._reservoir(v, lengths)

    def output_lengths(self, key: str) -> list[int]:
        with self._lock:
            v = self._get(self._lengths, key)
            return list(v.sample) if v else []

    def observe_time(self, model: str, simulated_s: float, actual_s: float) -> None:
        """A batch's model time, next to the cost model's. The first batch of a model in the
        process is left out: it pays the engine's warm-up (kernels loaded, first steps),
        several times a batch's work for a small query."""
        if simulated_s <= 0 or actual_s <= 0:
            return
        with self._lock:
            times = self._get(self._times, model)
            if times is None:
                self._put(self._times, model, deque(maxlen=TIME_WINDOW))
                return
            times.append((simulated_s, actual_s))

    def time_scale(self, model: str) -> tuple[float, int]:
        """Actual over simulated model time of recent batches, and how many there were."""
        with self._lock:
            pairs = list(self._get(self._times, model) or ())
        if not pairs:
            return 1.0, 0
        return sum(a for _, a in pairs) / sum(s for s, _ in pairs), len(pairs)

    def clear(self) -> None:
        with self._lock:
            self._passes.clear()
            self._values.clear()
            self._lengths.clear()
            self._times.clear()


LEARNED = Learned()
