"""What this CPU can do fast."""

from __future__ import annotations

import os

import torch

from llmdb.kernels.host import cpu_info

# Instruction sets that multiply bf16 natively.
BF16_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})


def default_dtype() -> torch.dtype:
    """bf16 where the CPU multiplies it natively (AMX or AVX512-BF16), fp32 elsewhere."""
    return torch.bfloat16 if BF16_FLAGS & cpu_info().flags else torch.float32


def default_threads() -> int:
    """The compute threads an engine takes unless told: OMP_NUM_THREADS where it is set
    (Ray sets it to an actor's CPUs: two engine workers on two cores then take one thread
    each, where taking every core each made a job 1.4x slower), else the CPUs this process
    may run on (a taskset or a container's cpuset, where os.cpu_count() counts the machine)."""
    # OpenMP reads "4,2" (nested levels) as 4 threads at the outer level, as here.
    try:
        omp = int(os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip())
    except ValueError:
        omp = 0
    if omp > 0:
        return omp
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
