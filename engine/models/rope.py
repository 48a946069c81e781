"""RoPE frequencies, and the context-extension schemes that rescale them.

Every scheme a model file may name that we run comes down to one divisor per rotary
frequency: linear scaling divides them all by its factor, Llama 3's ("llama3": Llama 3.1,
3.2 and 3.3) divides the low frequencies by its factor, leaves the high ones alone and
blends in between. llama.cpp stores the same divisors as a GGUF tensor (`rope_freqs`). So a
ModelConfig carries the divisors, whatever the file called the scheme, and one function
turns them into frequencies. Schemes that also rescale attention or depend on the sequence's
length (YaRN, dynamic NTK, LongRoPE) are refused by name.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from .errors import ModelLoadError


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
