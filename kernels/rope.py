"""RoPE on the CPU path, and the K/V cache write that follows it in every attention layer.

`rotate` is the torch reference (Hugging Face's rotate-half layout, fp32 math). The C++ pass
of csrc/cache_write.cpp rotates Q and K and writes K/V into their slots with the same
rounding, in one pass where torch takes about ten ops (the GPU's is kernels/gpu/cache_write.py).
"""

from __future__ import annotations

import torch

from .attention import write_kv
from .cpu_ext import load_library, rope_write_kv


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (Hugging Face layout) in fp32, written into one output buffer, over
    the first 2 x cos.shape[-1] dimensions of each head; the rest pass (partial rotary)."""
    xf = x.float()
    half = cos.shape[-1]
    x1, x2 = xf[..., :half], xf[..., half:2 * half]
    out = torch.empty_like(xf)
    torch.mul(x1, cos, out=out[..., :half]).addcmul_(x2, sin, value=-1.0)
    torch.mul(x2, cos, out=out[..., half:2 * half]).addcmul_(x1, sin)
    if 2 * half < xf.shape[-1]:
        out[..., 2 * half:] = xf[..., 2 * half:]
    return out.to(x.dtype)


def rotate_and_write_kv(qkv: torch.Tensor, positions: torch.Tensor,
                      table: tuple[torch.Tensor, torch.Tensor] | None, slots: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int, kv_heads: int,
                      written: int) -> torch.Tensor:
    """Q [T, heads, D] of the projection qkv [T, (heads + 2 kv_heads) * D] (Q, K, V heads),
    rotated at `positions` by table = (cos, sin) [positions, R/2] fp32 (None: not rotated);
    rows below `written` write their rotated K and their V to slots[:written] of the caches
    [slots, kv_heads, D] (the rows after them are hidden-cache rows, or none)."""
    dim = k_cache.shape[-1]
    tensors = [qkv, positions, slots, k_cache, v_cache, *(table or ())]
    if (all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)
            and qkv.dtype in (torch.bfloat16, torch.float32) and k_cache.dtype == qkv.dtype
            and (table is None or table[0].dtype == torch.float32)
            and load_library() is not None):
        return rope_write_kv(qkv, positions, *(table or (None, None)), slots, k_cache, v_cache,
                             heads, kv_heads, written)
    rows = qkv.shape[0]
    qk, v = qkv.split([(heads + kv_heads) * dim, kv_heads * dim], dim=-1)
    qk = qk.view(rows, heads + kv_heads, dim)
    if table is not None:  # Q and K heads rotate together: one pass over both
        qk = rotate(qk, table[0][positions][:, None, :], table[1][positions][:, None, :])
    q, k = qk.split([heads, kv_heads], dim=1)
    write_kv(k_cache, v_cache, k[:written], v.reshape(rows, kv_heads, dim)[:written],
             slots[:written])
    return q
