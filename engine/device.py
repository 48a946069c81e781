"""Which device the engine runs on, and the dtype and limits that suit it."""

from __future__ import annotations

import os

import torch

from .hardware import default_dtype as cpu_default_dtype


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """"auto" (or None) takes the LLMDB_DEVICE environment variable when set, else the first
    CUDA GPU when torch sees one, else the CPU; "cpu", "cuda" and "cuda:N" are taken as
    given, and fail clearly when absent."""
    if (device is None or device == "auto") and os.environ.get("LLMDB_DEVICE"):
        device = os.environ["LLMDB_DEVICE"]
    if device is None or device == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"unknown device {device!r} (use 'auto', 'cpu', 'cuda' or "
                         "'cuda:N')") from e
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ValueError(f"device {device!r}: the engine runs on 'cpu' or 'cuda' devices")
    if not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for, but torch sees no CUDA GPU "
                         f"(torch {torch.__version__}; a CPU-only build?)")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} CUDA "
                         "device(s) are visible")
    return torch.device("cuda", index)


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on GPUs that have it (fp16 on older ones); on the CPU, bf16 where it multiplies
    it natively and fp32 elsewhere."""
    if device.type == "cuda":
        # Native bf16 from Ampere (sm_80) on. torch.cuda.is_bf16_supported() says yes on a
        # V100 or T4 too (it counts emulation) and asks the current device, not this one.
        native = torch.cuda.get_device_capability(device)[0] >= 8
        return torch.bfloat16 if native else torch.float16
    return cpu_default_dtype()


def device_name(device: torch.device) -> str:
    """What describe() and EXPLAIN print: "cpu" or "cuda:0 (NVIDIA H100 80GB HBM3)"."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return "cpu"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
