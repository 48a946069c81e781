"""RMSNorm and gated MLP activations (SwiGLU's silu(gate) * up, GeGLU's gelu(gate) * up):
torch references and fused C++ fast paths for bf16 and fp32 on the CPU."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import cpu_ext


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm: normalize in fp32, round to x's dtype, then scale."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rms_norm_fp32(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: x / rms(x) times an fp32 scale (1 + the checkpoint's weight), rounded
    once to x's dtype; rms_norm_reference rounds the normalized x before it scales."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * scale).to(x.dtype)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU (Gemma): gelu(gate), tanh approximation, times up; gelu rounded to the dtype
    before the product, as transformers computes it."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def _fast(*tensors: torch.Tensor) -> bool:
    # A CUDA tensor must never reach the C++ kernels, which read raw host pointers.
    dtype = tensors[0].dtype
    return (dtype in (torch.bfloat16, torch.float32)
            and all(t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous()
                    for t in tensors)
            and tensors[0].dim() == 2 and cpu_ext.load_library() is not None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return cpu_ext.rms_norm(x, weight, eps) if _fast(x, weight) else rms_norm_reference(
        x, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return cpu_ext.silu_mul(gate_up) if _fast(gate_up) else silu_mul_reference(gate_up)
