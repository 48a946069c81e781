"""RoPE frequencies, and the context-extension schemes that rescale them.

Every scheme a model file may name that we run comes down to one divisor per rotary
frequency: linear scaling divides them all by its factor, Llama 3's ("llama3": Llama 3.1,
3.2 and 3.3) divides the low frequencies by its factor, leaves the high ones alone and
blends in between. llama.cpp stores the same divisors as a GGUF tensor (`rope_freqs`). So a
ModelConfig carries the divisors, whatever the file called the scheme, and one function
turns them into frequencies.

LongRoPE (Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini; "su" in Phi-3's first configs) has two
sets of divisors, "short" for sequences within the pretrained context and "long" past it,
and a factor that scales cos and sin with either set. transformers picks the set per
forward pass from the sequence's length, and re-computes a sequence's whole cache with the
long set when it grows past the pretrained context. An engine over table rows cannot do
that: K/V blocks are shared between rows (prefix cache) and kept as hidden states, so a K
must not depend on how long its row will grow. We pick one set for the engine's life from
the context it serves, as llama.cpp (its n_ctx) and vLLM (max_model_len) do: short while it
serves at most the pretrained context, long beyond. By default an engine serves a LongRoPE
model's pretrained context (ModelConfig.serving): every row then runs exactly as in
transformers, and rows are short; LLMEngine(max_context=...) serves more, with the long
set for every row, short ones included (as llama.cpp and vLLM then do).

Schemes that depend on the sequence's length otherwise (YaRN, dynamic NTK) are refused by
name.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import ModelLoadError

LONGROPE_KINDS = ("longrope", "su")


def base_frequencies(head_dim: int, theta: float) -> list[float]:
    """The unscaled rotary frequencies theta^(-2i/d), one per pair of dimensions."""
    return [theta ** (-i / head_dim) for i in range(0, head_dim, 2)]


def frequencies(head_dim: int, theta: float, divisors: Sequence[float] = ()) -> list[float]:
    """The model's rotary frequencies: the base ones divided by the scheme's divisors."""
    base = base_frequencies(head_dim, theta)
    # (The loaders give one divisor per frequency; GGUF's rope_freqs is checked there.)
    return [f / d for f, d in zip(base, divisors, strict=True)] if divisors else base


def llama3_divisors(head_dim: int, theta: float, factor: float, low_freq_factor: float,
                    high_freq_factor: float, original_context: int) -> tuple[float, ...]:
    """Llama 3.1's scheme (Meta's reference code; transformers' "llama3" rope type):
    wavelengths longer than original_context / low_freq_factor are stretched by `factor`,
    those shorter than original_context / high_freq_factor kept, and those between
    interpolated smoothly."""
    low_wavelen = original_context / low_freq_factor
    high_wavelen = original_context / high_freq_factor
    out = []
    for f in base_frequencies(head_dim, theta):
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(float(factor))
        else:
            smooth = ((original_context / wavelen - low_freq_factor)
                      / (high_freq_factor - low_freq_factor))
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return tuple(out)


@dataclass(frozen=True)
class LongRope:
    """LongRoPE's parameters: one divisor per rotary frequency for each set, the pretrained
    context (the longest the short set serves), and the factor on cos and sin."""

    short: tuple[float, ...]
    long: tuple[float, ...]
    original_context: int
    attention_factor: float

    def config_fields(self) -> dict[str, Any]:
        """ModelConfig's fields for it."""
        return {"rope_divisors": self.short, "rope_long_divisors": self.long,
                "rope_original_context": self.original_context,
                "rope_attention_factor": self.attention_factor}


def longrope_attention_factor(stretch: float, original_context: int) -> float:
    """The LongRoPE paper's factor for a context stretched `stretch` times past
    original_context (transformers and llama.cpp's converter use it where the file gives
    none)."""
    if stretch <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(stretch) / math.log(original_context))


def hf_longrope(scaling: Mapping[str, Any], rotary_dim: int, max_context: int,
                original_context: int, where: str) -> LongRope:
    """A Hugging Face config's LongRoPE entry (rope_scaling or rope_parameters). The
    stretch is `factor` where given, else the context over the pretrained one."""
    try:
        short, long = scaling["short_factor"], scaling["long_factor"]
    except KeyError as e:
        raise ModelLoadError(f"{where}: rope_scaling 'longrope' lacks {e.args[0]!r}") from e
    for name, factors in (("short_factor", short), ("long_factor", long)):
        if len(factors) != rotary_dim // 2:
            raise ModelLoadError(f"{where}: rope_scaling {name} has {len(factors)} values for "
                                 f"{rotary_dim // 2} rotary frequencies")
    factor = scaling.get("attention_factor")
    if factor is None:
        stretch = scaling.get("factor") or max_context / original_context
        factor = longrope_attention_factor(stretch, original_context)
    return LongRope(tuple(float(f) for f in short), tuple(float(f) for f in long),
                    original_context, float(factor))


def hf_divisors(scaling: Mapping[str, Any] | None, head_dim: int, theta: float, where: str
                ) -> tuple[float, ...]:
    """The divisors of a Hugging Face config's rope_scaling / rope_parameters entry (empty:
    none). Raises ModelLoadError naming a scheme we do not run."""
    if not scaling:
        return ()
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return ()
    try:
        if kind == "linear":
            return (float(scaling["factor"]),) * (head_dim // 2)
        if kind == "llama3":
            return llama3_divisors(
                head_dim, theta, float(scaling["factor"]), float(scaling["low_freq_factor"]),
                float(scaling["high_freq_factor"]),
                int(scaling["original_max_position_embeddings"]))
    except KeyError as e:
        raise ModelLoadError(f"{where}: rope_scaling {kind!r} lacks {e.args[0]!r}") from e
    raise ModelLoadError(f"{where}: rope_scaling {kind!r} is not supported "
                         f"(supported: default, linear, llama3)")
