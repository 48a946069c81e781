"""Sampling parameters and the sampler: greedy rows batched, sampled rows per request."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no limit
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k log-probabilities of each generated token

    def validate(self) -> None:
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sample_row(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> int:
    """One token from fp32 logits [vocab] with temperature, top-k and top-p."""
    if params.greedy:
        return int(logits.argmax())
    scaled = logits / params.temperature
    if params.top_k and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = scaled.softmax(-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int]:
    """Tokens for rows of logits [N, vocab]; greedy rows in one argmax (exact in any dtype:
    widening to fp32 changes no value), sampled rows in fp32."""
    tokens = logits.max(-1).indices.tolist()  # max is 3x faster than argmax on bf16 here
    for i, (p, g) in enumerate(zip(params, generators, strict=True)):
        if not p.greedy:
            tokens[i] = sample_row(logits[i].float(), p, g)
    return tokens


def top_logprobs(logits: torch.Tensor, token: int, k: int) -> tuple[float, dict[int, float]]:
    """The chosen token's log-probability and the k most likely tokens' (raw model logits)."""
    lp = logits.float().log_softmax(-1)
    top = torch.topk(lp, k) if k else None
    return float(lp[token]), (
        {int(i): float(v) for v, i in zip(top.values, top.indices, strict=True)} if top else {}
    )
