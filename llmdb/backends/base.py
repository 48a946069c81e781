"""The llmdb -> backend contract: requests in, results with usage out, abort by handle.

Prompts here are what the backend's render_chat made of a row: chat messages for a model
with a chat template, which the model encodes itself so that row text stays data (a
`<|im_end|>` in a row never ends a turn), or final text for a backend without one. The same
request always means the same model input. Priority is carried for the scheduler
(interactive = RT, bulk = BE).

EXPLAIN LLM asks a backend what its requests would cost without sending them: their tokens,
the prompt tokens its prefix cache holds now, and how it schedules (a configuration for the
engine's simulator)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from llmdb.engine.params import SamplingParams

if TYPE_CHECKING:  # the simulator's types; loading them is the engine's business
    from llmdb.engine.costmodel import CostModel
    from llmdb.engine.research.sim import SimConfig

# Chat messages ({"role": ..., "content": ...}); for a backend without a chat template, final
# text; for a base model's llm_complete, its token ids (the text encoded as data).
Prompt = list[dict[str, str]] | str | list[int]


# An earlier exchange of a conversation, before the row's question: (user text, assistant text).
Exchange = tuple[str, str]


def chat_messages(user: str, system: str | None,
                  before: Sequence[Exchange] = ()) -> list[dict[str, str]]:
    """A row's prompt as chat messages (a system turn first when given, then the earlier
    exchanges): what a backend with a chat template sends, so that the model's side encodes
    row text as text."""
    messages = [] if system is None else [{"role": "system", "content": system}]
    for asked, answered in before:
        messages += [{"role": "user", "content": asked},
                     {"role": "assistant", "content": answered}]
    messages.append({"role": "user", "content": user})
    return messages


@dataclass(frozen=True)
class GenerationRequest:
    prompt: Prompt
    params: SamplingParams
    priority: str = "BE"
    # Tokens an earlier run of this request generated (Backend.output_so_far): it goes on
    # after them. Only for a backend whose output_so_far gave them.
    resume_from: tuple[int, ...] = ()


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
    resumed_tokens: int = 0  # of the answer's tokens, those given by resume_from
    error: str | None = None


@dataclass(frozen=True)
class RequestTokens:
    """What the model computes for a request: its prompt, and a scored continuation with its
    end of turn."""

    ids: tuple[int, ...] | None  # None: the backend tokenizes elsewhere (a count only)
    count: int
    cacheable: int  # leading tokens a prefix hit may cover; the rest is always computed


@dataclass(frozen=True)
class Simulation:
    """How a backend schedules its requests, for the engine's simulator."""

    config: SimConfig  # its limits, block pool and prefix caching
    policy: str
    cost_model: CostModel


class Backend(Protocol):
    name: str

    def identity(self) -> dict[str, Any]:
        """Everything about the model that changes answers (weights hash, dtype, version,
        chat template); part of every result-cache key."""

    def render_chat(self, user: str, system: str | None,
                    before: Sequence[Exchange] = ()) -> Prompt: ...

    def render_completion(self, prompt: str, system: str | None) -> Prompt:
        """llm_complete's prompt: the chat (render_chat), or for a base model the text to
        continue."""

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Each text's tokens, without a chat template. Many at once: a remote backend asks
        for them together, not a round trip per text."""

    def submit(self, request: ModelRequest, on_finish: Callable[[], None]) -> str:
        """Queue a request; raises ValueError when it cannot run (too long, empty)."""

    def collect(self, handle: str) -> BackendResult:
        """The result of a finished request (after on_finish was called)."""

    def generated_so_far(self, handle: str) -> int:
        """Tokens a request in flight has generated (0 where the backend cannot tell): the
        progress bar's measure within one big batch."""

    def output_so_far(self, handle: str) -> list[int] | None:
        """The token ids a generation in flight has produced so far, for a later
        GenerationRequest(resume_from=...) to go on from; None where the backend cannot
        resume a request."""

    def abort(self, *handles: str) -> None:
        """End these requests (all in one call: a local engine ends them in one step)."""

    # ---- for EXPLAIN LLM -----------------------------------------------------------------

    def describe(self) -> str:
        """Where the model runs, in words."""

    def tokenize(self, request: ModelRequest) -> RequestTokens: ...

    def cached_prefix(self, ids: Sequence[int]) -> int:
        """Leading tokens of a new request with these token ids that the prefix cache holds
        now (its last token is always computed); 0 without a prefix cache."""

    def simulation(self) -> Simulation | None:
        """None: the backend cannot say (no model time is estimated)."""
