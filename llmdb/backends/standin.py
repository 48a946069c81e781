"""A deterministic stand-in for a model: answers are hashes of the prompt.

For tests and benchmarks of the SQL plumbing and the planner, where what matters is which
calls are made, not what a model says. It speaks the backend contract like any backend, so
batching, dedup, the cache and call counting are the real ones. Use it with
llmdb.connect(model="hash-standin"); it never loads weights.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
from collections.abc import Callable, Sequence
from typing import Any

from .base import (
    BackendResult,
    ChoiceRequest,
    Exchange,
    GenerationRequest,
    ModelRequest,
    RequestTokens,
    ScoreRequest,
)

STANDIN_MODEL = "hash-standin"


def _unit(text: str) -> float:
    """A number in [0, 1) fixed by the text."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2**64


def words(text: str) -> int:
    """The stand-in's tokens: whitespace-separated words."""
    return len(text.split())


class StandinBackend:
    name = STANDIN_MODEL

    def __init__(self) -> None:
        self._ids = itertools.count()
        self._results: dict[str, BackendResult] = {}
        self._lock = threading.Lock()
        self.requests = 0  # model requests served, for tests

    def identity(self) -> dict[str, Any]:
        return {"model": STANDIN_MODEL, "fingerprint": "sha256-of-prompt", "version": 1}

    def render_chat(self, user: str, system: str | None, before: Sequence[Exchange] = ()) -> str:
        turns = "".join(f"{asked} || {answered} || " for asked, answered in before)
        return turns + user if system is None else f"[{system}] {turns}{user}"

    def render_completion(self, prompt: str, system: str | None) -> str:
        return self.render_chat(prompt, system)

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        return [words(t) for t in texts]

    def submit(self, request: ModelRequest, on_finish: Callable[[], None]) -> str:
        if isinstance(request, GenerationRequest):
            n = request.params.max_tokens
            words = [f"w{int(_unit(f'{request.prompt}#{i}') * 1000)}" for i in range(n)]
            result = BackendResult(text=" ".join(words), finish_reason="length",
                                   generated_tokens=n)
        elif isinstance(request, ScoreRequest):
            result = BackendResult(logprob=-10 * _unit(request.prompt + request.continuation))
        elif isinstance(request, ChoiceRequest):
            p = _unit(request.prompt)
            result = BackendResult(word_probs=(p, 1 - p) if len(request.words) == 2 else tuple(
                _unit(request.prompt + w) for w in request.words))
        else:
            raise TypeError(f"unknown request type {type(request).__name__}")
        result.prompt_tokens = self.tokenize(request).count
        handle = f"standin-{next(self._ids)}"
        with self._lock:
            self._results[handle] = result
            self.requests += 1
        on_finish()
        return handle

    def collect(self, handle: str) -> BackendResult:
        with self._lock:
            return self._results.pop(handle)

    def generated_so_far(self, handle: str) -> int:
        return 0  # answers are made whole at submit

    def output_so_far(self, handle: str) -> list[int] | None:
        return None

    def abort(self, *handles: str) -> None:
        with self._lock:
            for handle in handles:
                self._results.pop(handle, None)

    # ---- for EXPLAIN LLM: a word is a token; no prefix cache, no model time ---------------

    def describe(self) -> str:
        return f"{STANDIN_MODEL} (answers are hashes: no model)"

    def tokenize(self, request: ModelRequest) -> RequestTokens:
        n = words(request.prompt)
        if isinstance(request, ScoreRequest):  # the continuation, then end of turn
            return RequestTokens(None, n + words(request.continuation) + 1, n - 1)
        return RequestTokens(None, n, n - 1)

    def cached_prefix(self, ids: Sequence[int]) -> int:
        return 0

    def simulation(self) -> None:
        return None


_standin = StandinBackend()


def standin_backend() -> StandinBackend:
    return _standin
