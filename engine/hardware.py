"""What this CPU can do fast."""

from __future__ import annotations

import functools

import torch


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def default_dtype() -> torch.dtype:
    """bf16 where the CPU multiplies it natively (AMX or AVX512-BF16), fp32 elsewhere."""
    flags = cpu_flags()
    return torch.bfloat16 if {"amx_bf16", "avx512_bf16"} & flags else torch.float32
