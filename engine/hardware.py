"""What this CPU can do fast."""

from __future__ import annotations

import torch

from llmdb.kernels.host import cpu_info

# Instruction sets that multiply bf16 natively.
BF16_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})


def default_dtype() -> torch.dtype:
    """bf16 where the CPU multiplies it natively (AMX or AVX512-BF16), fp32 elsewhere."""
    return torch.bfloat16 if BF16_FLAGS & cpu_info().flags else torch.float32
