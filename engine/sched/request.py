"""A request's state as the engine and the scheduler see it."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..params import SamplingParams

if TYPE_CHECKING:  # only the engine puts tensors here; the simulator never loads torch
    import torch


# A generated token whose value is still on the device: the engine schedules the next step
# before it reads the last one's samples (Scheduler.advance, then take_token).
PENDING_TOKEN = -1


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.perf_counter)
    # The fields every scheduling decision reads come first: with slots they share cache
    # lines, which matters when a policy sweeps ~1,600 requests per iteration.
    output_ids: list[int] = field(default_factory=list)
    last_token_time: float | None = None
    # Scheduling class and targets: RT (interactive) or BE (bulk); SLOs in seconds or None.
    priority: str = "BE"
    slo_ttft_s: float | None = None
    slo_tbt_s: float | None = None
    status: Status = Status.WAITING
    num_computed: int = 0
    # Replaced or extended, never changed in place: the runner mirrors it (BlockTableRows).
    block_ids: list[int] = field(default_factory=list)
    # Generation stops after max_tokens; scoring requests generate nothing (generate=False).
    generate: bool = True
    # Positions p >= logits_from have the logits predicting token p + 1 returned (scoring).
    logits_from: int | None = None
    # Prefix caching: chained hashes of the full blocks of token_ids (grown as needed), how
    # many of this request's blocks are published, and the prompt tokens served from cache.
    block_hashes: list[int] = field(default_factory=list)
    num_registered: int = 0
    num_cached_tokens: int | None = None
    cache_type: str = "kv"  # "kv" or "hidden" (Apt-Serve's hidden cache)
    # A hidden-cache request's first block_ids that are KV blocks of the prefix cache: a
    # cached prompt prefix whose K/V it reads where they are (shared, never re-projected);
    # its other block_ids are half blocks of hidden states. 0 for a KV-cache request.
    num_kv_prefix: int = 0
    finish_reason: str | None = None
    error: str | None = None
    # Sampling noise seed (params.seed, or one the engine drew): see sampling.py.
    seed: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    num_resumed: int = 0  # leading output_ids an earlier run generated (resume_from)
    logprobs: list[tuple[float, dict[int, float]]] = field(default_factory=list)
    # Scoring: log-probability of each token after logits_from; or the raw rows (keep_logits).
    keep_logits: bool = False
    target_logprobs: list[float] = field(default_factory=list)
    logit_rows: list[torch.Tensor] = field(default_factory=list)
    callbacks: list = field(default_factory=list)  # called with each new token id
    # Called with each new token's (logprob, top logprobs) before its token, when asked for.
    on_logprobs: Callable[[tuple[float, dict[int, float]]], None] | None = None
    # Called with the request id once the result is ready (any finish reason).
    on_finish: Callable[[str], None] | None = None
    # Choice requests: next-token log-probabilities of these ids after the prompt.
    candidate_ids: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def token_ids(self) -> list[int]:
        """Prompt and output, as a new list: hot paths take a token_slice instead."""
        return self.prompt_ids + self.output_ids

    def token_slice(self, start: int, n: int) -> list[int]:
        """token_ids[start : start + n] without building token_ids (a decode's one token, a
        block's worth)."""
        p = len(self.prompt_ids)
        if start >= p:
            return self.output_ids[start - p : start - p + n]
        if start + n <= p:
            return self.prompt_ids[start : start + n]
        return self.prompt_ids[start:] + self.output_ids[: start + n - p]

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def is_decode(self) -> bool:
        """Its only token left to compute is the last one it generated."""
        out = self.output_ids
        return bool(out) and len(self.prompt_ids) + len(out) - self.num_computed == 1

    def pending_time(self, now: float) -> float:
        """Apt-Serve's p: since arrival before the first token, since the last one after."""
        return now - (self.last_token_time if self.last_token_time is not None else self.arrival)
