"""RoPE on Q and K and the KV-cache write, fused into one Triton kernel.

Why: between the QKV projection and attention the CPU path does a rotate (a read and write of
Q and K), a split, and two index copies into the cache; on a GPU each is a launch and a trip
through memory. Here one program per token reads its row of the fused projection once,
rotates Q and K in fp32 and rounds them to the model dtype (as the CPU path does), writes K and
V into their cache slot and Q into a contiguous [T, H, D] output for attention.

RoPE is rotate-half in Hugging Face's layout: with x = (x1, x2) halves and per-position
angles a, out = (x1 cos a - x2 sin a, x2 cos a + x1 sin a). The table cos_sin [positions, R]
holds cos a in its first R/2 columns and sin a in its last R/2; R is the head's rotated width:
D, or less where only the first R dimensions rotate and the rest pass as they are (partial
rotary: Phi-4-mini's 96 of 128). A slot < 0 marks a padding row: its Q is still written, its
K/V are not.

With q_norm/k_norm (Qwen3, Gemma 3), each Q and K head is RMS-normalized before it is
rotated, in the same pass, rounded as the unfused path rounds: Llama's norm (Qwen3)
normalizes in fp32, rounds to the dtype, multiplies by the weight and rounds again; Gemma's
(fp32_scale) multiplies by an fp32 scale and rounds once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmdb.kernels.elementwise import rms_norm_fp32, rms_norm_reference


@triton.jit
def _norm_part(x, rms, norm_ptr, cols, col_ok, dt, FP32_SCALE: tl.constexpr):
    """One part of normalized heads, rounded as the unfused path rounds."""
    w = tl.load(norm_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    x = x / rms[:, None]
    if not FP32_SCALE:
        x = x.to(dt).to(tl.float32)
    return (x * w[None, :]).to(dt).to(tl.float32)


@triton.jit
def _rotate_heads(x_ptr, head_idx, head_ok, cos, sin, rots, rot_ok, rest, rest_ok, norm_ptr,
                  eps, D: tl.constexpr, ROT_HALF: tl.constexpr, HAS_ROPE: tl.constexpr,
                  HAS_NORM: tl.constexpr, FP32_SCALE: tl.constexpr):
    """Load heads [NH_PAD, D] of one token as the two rotated halves and the rest (columns
    2 ROT_HALF on; none without partial rotary: rest_ok all false) and return them
    (normalized, with HAS_NORM, then rotated) in fp32."""
    base = x_ptr + head_idx[:, None] * D
    mask = head_ok[:, None] & rot_ok[None, :]
    x1 = tl.load(base + rots[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + ROT_HALF + rots[None, :], mask=mask, other=0.0).to(tl.float32)
    x3 = tl.load(base + 2 * ROT_HALF + rest[None, :], mask=head_ok[:, None] & rest_ok[None, :],
                 other=0.0).to(tl.float32)
    if HAS_NORM:
        dt = x_ptr.dtype.element_ty
        rms = tl.sqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1) + tl.sum(x3 * x3, 1)) / D + eps)
        x1 = _norm_part(x1, rms, norm_ptr, rots, rot_ok, dt, FP32_SCALE)
        x2 = _norm_part(x2, rms, norm_ptr + ROT_HALF, rots, rot_ok, dt, FP32_SCALE)
        x3 = _norm_part(x3, rms, norm_ptr + 2 * ROT_HALF, rest, rest_ok, dt, FP32_SCALE)
    if HAS_ROPE:
        y1 = x1 * cos[None, :] - x2 * sin[None, :]
        x2 = x2 * cos[None, :] + x1 * sin[None, :]
        x1 = y1
    return x1, x2, x3


@triton.jit
def _store_heads(dst, heads_ok, x1, x2, x3, rots, rot_ok, rest, rest_ok,
                 ROT_HALF: tl.constexpr):
    """Store what _rotate_heads returned at dst [NH_PAD, 1] (each head's first column)."""
    dt = dst.dtype.element_ty
    mask = heads_ok[:, None] & rot_ok[None, :]
    tl.store(dst + rots[None, :], x1.to(dt), mask=mask)
    tl.store(dst + ROT_HALF + rots[None, :], x2.to(dt), mask=mask)
    tl.store(dst + 2 * ROT_HALF + rest[None, :], x3.to(dt),
             mask=heads_ok[:, None] & rest_ok[None, :])


@triton.jit
def _rope_write_kernel(
    qkv_ptr, positions_ptr, cos_sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, q_out_ptr,
    q_norm_ptr, k_norm_ptr, eps,
    stride_qkv, stride_cs, stride_ks, stride_kh, stride_vs, stride_vh,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
    HALF_PAD: tl.constexpr, ROT_HALF: tl.constexpr, ROT_PAD: tl.constexpr,
    REST_PAD: tl.constexpr, H_PAD: tl.constexpr, KVH_PAD: tl.constexpr,
    HAS_ROPE: tl.constexpr, HAS_NORM: tl.constexpr, FP32_SCALE: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    rots = tl.arange(0, ROT_PAD)
    rot_ok = rots < ROT_HALF
    rest = tl.arange(0, REST_PAD)
    rest_ok = rest < D - 2 * ROT_HALF
    if HAS_ROPE:
        pos = tl.load(positions_ptr + tok)
        cos = tl.load(cos_sin_ptr + pos * stride_cs + rots, mask=rot_ok, other=0.0)
        sin = tl.load(cos_sin_ptr + pos * stride_cs + ROT_HALF + rots, mask=rot_ok, other=0.0)
    else:
        cos = tl.zeros([ROT_PAD], tl.float32)
        sin = tl.zeros([ROT_PAD], tl.float32)
    row = qkv_ptr + tok * stride_qkv

    q_heads = tl.arange(0, H_PAD)
    q_ok = q_heads < NUM_HEADS
    q1, q2, q3 = _rotate_heads(row, q_heads, q_ok, cos, sin, rots, rot_ok, rest, rest_ok,
                               q_norm_ptr, eps, D, ROT_HALF, HAS_ROPE, HAS_NORM, FP32_SCALE)
    q_out = q_out_ptr + tok * (NUM_HEADS * D) + q_heads[:, None] * D
    _store_heads(q_out, q_ok, q1, q2, q3, rots, rot_ok, rest, rest_ok, ROT_HALF)

    slot = tl.load(slot_ptr + tok)
    if slot >= 0:
        kv_heads = tl.arange(0, KVH_PAD)
        kv_ok = kv_heads < NUM_KV_HEADS
        k1, k2, k3 = _rotate_heads(row + NUM_HEADS * D, kv_heads, kv_ok, cos, sin, rots,
                                   rot_ok, rest, rest_ok, k_norm_ptr, eps, D, ROT_HALF,
                                   HAS_ROPE, HAS_NORM, FP32_SCALE)
        k_dst = k_cache_ptr + slot * stride_ks + kv_heads[:, None] * stride_kh
        _store_heads(k_dst, kv_ok, k1, k2, k3, rots, rot_ok, rest, rest_ok, ROT_HALF)
        # V is copied as is, in two halves so that one HALF_PAD serves any D.
        halves = tl.arange(0, HALF_PAD)
        kv_mask = kv_ok[:, None] & (halves < HALF)[None, :]
        v_src = row + (NUM_HEADS + NUM_KV_HEADS) * D + kv_heads[:, None] * D
        v_src += halves[None, :]
        v_dst = v_cache_ptr + slot * stride_vs + kv_heads[:, None] * stride_vh + halves[None, :]
        v1 = tl.load(v_src, mask=kv_mask, other=0.0)
        v2 = tl.load(v_src + HALF, mask=kv_mask, other=0.0)
        tl.store(v_dst, v1.to(v_cache_ptr.dtype.element_ty), mask=kv_mask)
        tl.store(v_dst + HALF, v2.to(v_cache_ptr.dtype.element_ty), mask=kv_mask)


def rope_and_write_kv(
    qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor | None,
    slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    num_heads: int, num_kv_heads: int, head_dim: int,
    qk_norm: tuple[torch.Tensor | None, torch.Tensor] | None = None, eps: float = 0.0,
    fp32_scale: bool = False,
) -> torch.Tensor:
    """qkv [T, (H + 2 KVH) D] (unit stride in the last dim) -> rotated q [T, H, D], contiguous,
    in qkv's dtype; K (rotated) and V land in k_cache/v_cache [slots, KVH, D] at slot_mapping.

    positions [T] int64, slot_mapping [T] int64 (-1: do not write), cos_sin fp32 [P, R] with
    unit stride in its last dim (R <= D: the first R dimensions of each head rotate), or None
    for a model without RoPE. Caches need a unit stride in their last dim. num_heads may be
    0: K/V alone (hidden-cache re-projection).
    qk_norm: (q_norm [D], k_norm [D]) RMSNorm weights applied to each head before RoPE, with
    eps (q_norm None when num_heads is 0); fp32_scale: Gemma's norm, the weights fp32
    scales."""
    num_tokens = qkv.shape[0]
    assert head_dim % 2 == 0 and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim
    assert qkv.stride(1) == 1 and k_cache.stride(2) == 1 and v_cache.stride(2) == 1
    q = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q
    has_rope = cos_sin is not None
    rotary = head_dim
    if has_rope:
        rotary = cos_sin.shape[1]
        assert rotary % 2 == 0 and rotary <= head_dim and cos_sin.stride(1) == 1
    half = head_dim // 2
    q_norm, k_norm = qk_norm if qk_norm is not None else (None, None)
    _rope_write_kernel[(num_tokens,)](
        qkv, positions, cos_sin if has_rope else qkv, slot_mapping, k_cache, v_cache, q,
        q_norm if q_norm is not None else qkv, k_norm if k_norm is not None else qkv, eps,
        qkv.stride(0), cos_sin.stride(0) if has_rope else 0,
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, D=head_dim, HALF=half,
        HALF_PAD=triton.next_power_of_2(half), ROT_HALF=rotary // 2,
        ROT_PAD=triton.next_power_of_2(rotary // 2),
        REST_PAD=triton.next_power_of_2(max(head_dim - rotary, 1)),
        H_PAD=triton.next_power_of_2(max(num_heads, 1)),
        KVH_PAD=triton.next_power_of_2(num_kv_heads), HAS_ROPE=has_rope,
        HAS_NORM=qk_norm is not None, FP32_SCALE=fp32_scale,
        num_warps=4 if num_heads * head_dim >= 2048 else 2,
    )
    return q


def rope_and_write_kv_reference(
    qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor | None,
    slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    num_heads: int, num_kv_heads: int, head_dim: int,
    qk_norm: tuple[torch.Tensor | None, torch.Tensor] | None = None, eps: float = 0.0,
    fp32_scale: bool = False,
) -> torch.Tensor:
    """The torch definition `rope_and_write_kv` is tested against (same contract)."""
    t = qkv.shape[0]
    q, k, v = qkv.view(t, -1, head_dim).split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    if qk_norm is not None:
        norm = rms_norm_fp32 if fp32_scale else rms_norm_reference
        if num_heads:
            q = norm(q, qk_norm[0], eps)
        k = norm(k, qk_norm[1], eps)
    if cos_sin is not None:
        half = cos_sin.shape[1] // 2
        cs = cos_sin[positions].float()
        cos, sin = cs[:, None, :half], cs[:, None, half:]

        def rotate(x: torch.Tensor) -> torch.Tensor:
            xf = x.float()
            x1, x2, rest = xf[..., :half], xf[..., half:2 * half], xf[..., 2 * half:]
            return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest],
                             dim=-1).to(x.dtype)

        q, k = rotate(q), rotate(k)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache[slots] = k[keep].to(k_cache.dtype)
    v_cache[slots] = v[keep].to(v_cache.dtype)
    return q.contiguous()
