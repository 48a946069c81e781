"""The llmdb -> backend contract: requests in, results with usage out, abort by handle.

Prompts here are what the backend's render_chat made of a row: chat messages for a model
with a chat template, which the model encodes itself so that row text stays data (a
`<|im_end|>` in a row never ends a turn), or final text for a backend without one. The same
request always means the same model input. Priority is carried for the scheduler
(interactive = RT, bulk = BE)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from llmdb.engine.params import SamplingParams

# Chat messages ({"role": ..., "content": ...}) or, for a backend without a chat template,
# final text.
Prompt = list[dict[str, str]] | str


@dataclass(frozen=True)
class GenerationRequest:
    prompt: Prompt
    params: SamplingParams
    priority: str = "BE"


@dataclass(frozen=True)
class ScoreRequest:
    """Log-likelihood of `continuation` as the whole answer: its tokens, then end of turn."""

    prompt: Prompt
    continuation: str
    priority: str = "BE"


@dataclass(frozen=True)
class ChoiceRequest:
    """Probability that the answer's first token is one of each word's one-token spellings."""

    prompt: Prompt
    words: tuple[str, ...]
    priority: str = "BE"


ModelRequest = GenerationRequest | ScoreRequest | ChoiceRequest


@dataclass
class BackendResult:
    text: str = ""
    finish_reason: str = "stop"  # stop, length, abort or error
    logprob: float = 0.0  # ScoreRequest: total log-likelihood of the continuation
    word_probs: tuple[float, ...] = ()  # ChoiceRequest: summed probability per word
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


class Backend(Protocol):
    name: str

    def identity(self) -> dict[str, Any]:
        """Everything about the model that changes answers (weights hash, dtype, version,
        chat template); part of every result-cache key."""

    def render_chat(self, user: str, system: str | None) -> Prompt: ...

    def count_tokens(self, text: str) -> int: ...

    def submit(self, request: ModelRequest, on_finish: Callable[[], None]) -> str:
        """Queue a request; raises ValueError when it cannot run (too long, empty)."""

    def collect(self, handle: str) -> BackendResult:
        """The result of a finished request (after on_finish was called)."""

    def generated_so_far(self, handle: str) -> int:
        """Tokens a request in flight has generated (0 where the backend cannot tell): the
        progress bar's measure within one big batch."""

    def abort(self, handle: str) -> None: ...
