"""The host machine as llmdb sees it: where it keeps files between runs, and what the CPU
is. Here, in the bottom layer, because the kernels' build cache needs both; the engine and
the SQL layer ask the same two functions."""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import platformdirs


def cache_dir() -> Path:
    """$LLMDB_CACHE_DIR, else the user's cache directory for llmdb (XDG on Linux)."""
    return Path(os.environ.get("LLMDB_CACHE_DIR") or platformdirs.user_cache_dir("llmdb"))


@dataclass(frozen=True)
class CPUInfo:
    model: str  # the model name, e.g. "AMD EPYC 9R14 96-Core Processor"
    flags: frozenset[str]  # instruction-set features, e.g. "avx512_bf16", "amx_bf16"


@functools.cache
def cpu_info() -> CPUInfo:
    """The first processor's entry in /proc/cpuinfo; off Linux, platform's names and no
    flags."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the end of the first processor's entry
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return CPUInfo(fields.get("model name") or platform.processor() or platform.machine(),
                   frozenset(fields.get("flags", "").split()))
