"""RMSNorm and gated MLP activations (SwiGLU's silu(gate) * up, GeGLU's gelu(gate) * up):
torch references and fused bf16 fast paths."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .cpu_ext import load_library, rms_norm_bf16, silu_mul_bf16


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
    return (all(t.device.type == "cpu" and t.dtype == torch.bfloat16 and t.is_contiguous()
                for t in tensors)
            and tensors[0].dim() == 2 and load_library() is not None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm_bf16(x, weight, eps) if _fast(x, weight) else rms_norm_reference(x, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return silu_mul_bf16(gate_up) if _fast(gate_up) else silu_mul_reference(gate_up)
