"""A request's sampling parameters, with no dependency on torch: the SQL layer, the
scheduler's request state, the simulator and EXPLAIN all import this without loading torch."""

from __future__ import annotations

import math
import numbers
import struct
from dataclasses import dataclass, field


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
        """Refuse a bad value, naming its field, and normalize the rest (a stop string
        alone becomes a list, None no stop, numpy integers ints). Checked here, not left to
        the sampler: it runs a batch of requests at once, where one request's float seed or
        logprobs beyond the vocabulary failed all of them, and a stop "string" that was
        not one failed every later step of the engine."""
        self.max_tokens = _integer("max_tokens", self.max_tokens)
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}")
        # (NaN passes `< 0`: sampling then divided the logits by NaN, an answer of arbitrary
        # tokens with no error; infinity divided them all to 0)
        if not 0 <= _real("temperature", self.temperature) < math.inf:
            raise ValueError(f"temperature must be >= 0 and finite, got {self.temperature}")
        if _fp32(self.temperature) == 0.0:  # (the sampler scales in fp32: 0/0 was NaN)
            self.temperature = 0.0
        if not 0.0 < _real("top_p", self.top_p) <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.top_k = _integer("top_k", self.top_k)
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.seed is not None:
            self.seed = _integer("seed", self.seed)
        if self.logprobs is not None:
            self.logprobs = _integer("logprobs", self.logprobs)
            if self.logprobs < 0:
                raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        self.stop = _listed("stop", self.stop)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")
        self.stop_token_ids = [_integer("stop_token_ids", t)
                               for t in _listed("stop_token_ids", self.stop_token_ids)]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _fp32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def _integer(name: str, value: object) -> int:
    # (bool is an int to Python, but True tokens or a seed of False is a mistake)
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    return int(value)


def _real(name: str, value: object) -> float:
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got {value!r}")
    return value


def _listed(name: str, value: object) -> list:
    """A list: a lone string or number stands for a list of one, None for none."""
    if value is None:
        return []
    if isinstance(value, str | numbers.Integral):
        return [value]
    if not isinstance(value, list | tuple):
        raise TypeError(f"{name} must be a list, got {value!r}")
    return list(value)
