"""What the engine hands back: final results with usage, and streamed tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class RequestAborted(RuntimeError):
    """engine.abort(request_id) ended the request before its result was ready: the call
    waiting for a result that cannot come (collect_logits, say) raises this, naming it."""

    def __init__(self, request_id: str, what: str = "request"):
        super().__init__(f"{what} {request_id!r} was aborted before it finished")
        self.request_id = request_id


@dataclass
class Usage:
    prompt_tokens: int
    generated_tokens: int
    cached_tokens: int = 0
    resumed_tokens: int = 0  # output given by add_request's resume_from, not generated here
    ttft_s: float | None = None  # submit -> first generated token
    total_s: float | None = None  # submit -> finish


@dataclass
class RequestResult:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop", "length", "abort" or "error"
    usage: Usage
    # Per generated token: (its log-probability, {token id: log-probability} of the top k).
    logprobs: list[tuple[float, dict[int, float]]] | None = None
    # Scoring requests: log-probability of each continuation token after the prompt.
    continuation_logprobs: list[float] = field(default_factory=list)
    # Choice requests: log-probability of each candidate as the next token after the prompt.
    candidate_logprobs: list[float] = field(default_factory=list)
    # Logits requests: the fp32 next-token logits of every position, a chunk per step.
    logit_rows: list[torch.Tensor] = field(default_factory=list)
    error: str | None = None

    @property
    def score(self) -> float:
        """Total log-likelihood of the continuation (scoring requests)."""
        return float(sum(self.continuation_logprobs))
