"""Llama-family decoder (GQA, RoPE, RMSNorm, SwiGLU) over a paged KV cache; SmolLM3's NoPE
layers (ModelConfig.nope_layers) skip the rotation, on every path.

Two kernel sets behind one forward: "cpu" (the C++ attention, rmsnorm and SwiGLU kernels and
oneDNN-packed linears; "reference" swaps in the torch reference attention) and "triton" (the
GPU kernels of kernels/gpu: RoPE fused with the K/V write, residual add fused with RMSNorm;
also runnable on CPU tensors under TRITON_INTERPRET=1, which is how CI tests this path).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from llmdb.kernels.attention import (
    AttentionBatch,
    paged_attention,
    paged_attention_reference,
)
from llmdb.kernels.elementwise import rms_norm, silu_mul
from llmdb.kernels.hidden_cache import HiddenBatch
from llmdb.kernels.linear import Linear, linear
from llmdb.kernels.rope import rotate, rotate_and_write_kv

from .checkpoint import Checkpoint, kv_projection
from .config import ModelConfig
from .hidden_attention import mixed_attention
from .rope import frequencies

# Measured here: the [rows, vocab] GEMM runs ~15% slower per row above 256 rows (its output
# no longer fits the caches), so larger batches are projected in slices.
_VOCAB_SLICE_ROWS = 256


KERNEL_SETS = ("cpu", "reference", "triton")


def cpu_attention(kernels: str):
    return paged_attention_reference if kernels == "reference" else paged_attention


@dataclass(frozen=True)
class RopeTable:
    """cos and sin of one RoPE's angles at every position, on the model's device: [P, R/2]
    each for the torch path ("cpu" and "reference" kernels, the latter on GPUs too), or for
    the Triton kernel one [P, R] table, cos half then sin half (cos_sin); R is the rotated
    width of a head (config.rotary_dim, else all of it)."""

    cos: torch.Tensor | None
    sin: torch.Tensor | None
    cos_sin: torch.Tensor | None

    @classmethod
    def build(cls, config: ModelConfig, theta: float, divisors: tuple[float, ...],
              triton: bool, device: torch.device, scale: float = 1.0) -> RopeTable:
        """scale: a factor on cos and sin, and so on the rotated Q and K (LongRoPE's)."""
        inv_freq = torch.tensor(frequencies(config.rotary_dim or config.head_dim, theta,
                                            divisors), dtype=torch.float64)
        angles = torch.arange(config.max_context).double()[:, None] * inv_freq[None, :]
        cos, sin = angles.cos() * scale, angles.sin() * scale
        if triton:
            return cls(None, None, torch.cat([cos, sin], -1).float().to(device))
        return cls(cos.float().to(device), sin.float().to(device), None)

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [T, 1, R/2] of the CPU path at `positions`, to rotate [T, heads, D]."""
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]


def norm_heads(x: torch.Tensor, first: int, heads: int, head_dim: int, weight: torch.Tensor,
               eps: float, norm: Callable = rms_norm) -> None:
    """`norm` (an RMSNorm), in place, over each of `heads` heads of x [T, ...] from head
    `first` on: per-head Q/K norms (Qwen3, Gemma 3) on the packed QKV projection."""
    part = x[:, first * head_dim:(first + heads) * head_dim]
    part.copy_(norm(part.reshape(-1, head_dim), weight, eps).view(part.shape))


def vocab_projection(hidden: torch.Tensor, lm_head: Linear,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    if hidden.shape[0] <= _VOCAB_SLICE_ROWS or hidden.device.type != "cpu":
        return lm_head(hidden, out=out)
    if out is None:
        out = torch.empty(hidden.shape[0], lm_head.out_features, dtype=hidden.dtype,
                          device=hidden.device)
    for i in range(0, hidden.shape[0], _VOCAB_SLICE_ROWS):
        out[i : i + _VOCAB_SLICE_ROWS] = lm_head(hidden[i : i + _VOCAB_SLICE_ROWS])
    return out


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device | str = "cpu", kernels: str = "cpu"):
        self.config, self.dtype, self.kernels = config, dtype, kernels
        self.device = torch.device(device)
        c, w = config, Checkpoint(weights, dtype, self.device)
        # Qwen3: an RMSNorm over each Q and each K head (one weight per projection), before
        # RoPE. None where the checkpoint has none.
        self.qk_norms: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        if "model.layers.0.self_attn.q_norm.weight" in w:
            self.qk_norms = [(w(f"model.layers.{i}.self_attn.q_norm.weight"),
                              w(f"model.layers.{i}.self_attn.k_norm.weight"))
                             for i in range(c.num_layers)]
        lin = partial(linear, batch_invariant=c.batch_invariant)
        self.embed = w("model.embed_tokens.weight")
        self.lm_head = lin(self.embed if c.tie_embeddings else w("lm_head.weight"))
        self.norm = w("model.norm.weight")
        self.layers = []
        self.kv_projs: list[Linear] = []  # K and V alone: hidden-cache re-projection
        hidden_cache = c.hidden_cache_support()[0]
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            # One matmul for Q, K and V and one for gate and up: fewer, larger GEMMs.
            qkv, qkv_bias = w.fused([p + f"self_attn.{n}_proj" for n in "qkv"],
                                    p + "self_attn.qkv_proj")
            if hidden_cache:
                self.kv_projs.append(kv_projection(qkv, qkv_bias, c.num_heads * c.head_dim,
                                                   c.batch_invariant))
            self.layers.append((
                w(p + "input_layernorm.weight"),
                lin(qkv, qkv_bias),
                lin(*w.fused([p + "self_attn.o_proj"])),
                w(p + "post_attention_layernorm.weight"),
                lin(*w.fused([p + "mlp.gate_proj", p + "mlp.up_proj"], p + "mlp.gate_up_proj")),
                lin(*w.fused([p + "mlp.down_proj"])),
            ))
        divisors, scale = c.served_rope()  # (LongRoPE's set for the context served)
        self.rope = RopeTable.build(c, c.rope_theta, divisors, kernels == "triton", device,
                                    scale)
        # Per layer: does it rotate Q and K (all but SmolLM3's NoPE layers)?
        self.rotates = [i not in c.nope_layers for i in range(c.num_layers)]

    def _norm_qk(self, qkv: torch.Tensor, layer: int) -> None:
        """Qwen3's per-head norms of Q and K, in place on the [T, (Hq + 2 Hk) * D] projection
        (the Triton path does it inside rope_and_write_kv)."""
        if self.qk_norms is not None:
            c = self.config
            q_norm, k_norm = self.qk_norms[layer]
            norm_heads(qkv, 0, c.num_heads, c.head_dim, q_norm, c.norm_eps)
            norm_heads(qkv, c.num_heads, c.num_kv_heads, c.head_dim, k_norm, c.norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        hidden: HiddenBatch | None = None,
        stores: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Final-norm hidden states [T, hidden] of the packed tokens. With `hidden`, the rows
        from hidden.first_row on belong to hidden-cache sequences, whose per-layer states go
        to `stores` (KVCache.hidden) and whose K/V are re-projected from them."""
        if self.kernels == "triton":
            return self._forward_triton(input_ids, positions, batch, kv_caches, hidden, stores)
        attention = cpu_attention(self.kernels)
        c = self.config
        t = input_ids.shape[0]
        hq, hk, d = c.num_heads, c.num_kv_heads, c.head_dim
        table = (self.rope.cos, self.rope.sin)
        scale = d**-0.5
        nk = t if hidden is None else hidden.first_row
        x = self.embed[input_ids]
        for i, ((ln1, qkv_proj, o_proj, ln2, gate_up_proj, down_proj), (k_cache, v_cache)) in (
            enumerate(zip(self.layers, kv_caches, strict=True))
        ):
            h = rms_norm(x, ln1, c.norm_eps)
            qkv = qkv_proj(h)
            self._norm_qk(qkv, i)
            q = rotate_and_write_kv(qkv, positions, table if self.rotates[i] else None,
                                    batch.slot_mapping, k_cache, v_cache, hq, hk, nk)
            attn_args = {"window": c.layer_window(i), "softcap": c.attn_softcap}
            if hidden is None:
                o = attention(q, k_cache, v_cache, batch, scale, **attn_args)
            else:
                o = mixed_attention(q, h, (k_cache, v_cache), batch, scale, attention, hidden,
                                    stores[i], partial(self.reproject_kv, i), **attn_args)
            x = x + o_proj(o.reshape(t, hq * d))
            h = rms_norm(x, ln2, c.norm_eps)
            x = x + down_proj(silu_mul(gate_up_proj(h)))
        return rms_norm(x, self.norm, c.norm_eps)

    def _forward_triton(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        hidden: HiddenBatch | None,
        stores: list[torch.Tensor] | None,
    ) -> torch.Tensor:
        from llmdb.kernels.gpu.attention import paged_attention
        from llmdb.kernels.gpu.cache_write import rope_and_write_kv
        from llmdb.kernels.gpu.norm import add_rms_norm
        from llmdb.kernels.gpu.norm import rms_norm as rms_norm_gpu
        from llmdb.kernels.gpu.norm import silu_mul as silu_mul_gpu

        c = self.config
        attention = partial(paged_attention, invariant=c.batch_invariant)
        t = input_ids.shape[0]
        hq, hk, d = c.num_heads, c.num_kv_heads, c.head_dim
        scale = d**-0.5
        residual = self.embed[input_ids]
        x = None
        for i, ((ln1, qkv_proj, o_proj, ln2, gate_up_proj, down_proj), (k_cache, v_cache)) in (
            enumerate(zip(self.layers, kv_caches, strict=True))
        ):
            # The residual stream is added to in place, fused with the next norm.
            if x is None:
                h = rms_norm_gpu(residual, ln1, c.norm_eps)
            else:
                h, residual = add_rms_norm(x, residual, ln1, c.norm_eps)
            # Hidden-cache rows have slot -1: their K/V are not written. (Qwen3's Q/K norms
            # run inside the same kernel; a NoPE layer's table is None: no rotation.)
            q = rope_and_write_kv(qkv_proj(h), positions, self._cos_sin(i), batch.slot_mapping,
                                  k_cache, v_cache, hq, hk, d,
                                  self.qk_norms[i] if self.qk_norms else None, c.norm_eps)
            # Host values per layer: a CUDA graph bakes them into this layer's launch.
            attn_args = {"window": c.layer_window(i), "softcap": c.attn_softcap}
            if hidden is None:
                o = attention(q, k_cache, v_cache, batch, scale, num_splits=batch.num_splits,
                              **attn_args)
            else:
                o = mixed_attention(q, h, (k_cache, v_cache), batch, scale, attention, hidden,
                                    stores[i], partial(self.reproject_kv, i), triton=True,
                                    **attn_args)
            h, residual = add_rms_norm(o_proj(o.view(t, hq * d)), residual, ln2, c.norm_eps)
            x = down_proj(silu_mul_gpu(gate_up_proj(h)))
        return add_rms_norm(x, residual, self.norm, c.norm_eps)[0]

    def reproject_kv(self, layer: int, states: torch.Tensor, positions: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """K (rotated at `positions`) and V [R, KVH, D] of hidden-cache states [R, hidden]."""
        c = self.config
        r, hk, d = states.shape[0], c.num_kv_heads, c.head_dim
        kv = self.kv_projs[layer](states)
        if self.kernels == "triton":
            from llmdb.kernels.gpu.cache_write import rope_and_write_kv

            k, v = (torch.empty(r, hk, d, dtype=kv.dtype, device=kv.device) for _ in "kv")
            slots = torch.arange(r, device=kv.device)
            norm = (None, self.qk_norms[layer][1]) if self.qk_norms else None
            rope_and_write_kv(kv, positions, self._cos_sin(layer), slots, k, v, 0, hk, d, norm,
                              c.norm_eps)
            return k, v
        if self.qk_norms is not None:
            norm_heads(kv, 0, hk, d, self.qk_norms[layer][1], c.norm_eps)
        kv = kv.view(r, 2 * hk, d)
        k = kv[:, :hk]
        k = rotate(k, *self.rope.at(positions)) if self.rotates[layer] else k.contiguous()
        return k, kv[:, hk:].contiguous()

    def _cos_sin(self, layer: int) -> torch.Tensor | None:
        """The Triton kernels' RoPE table for a layer: None where it does not rotate."""
        return self.rope.cos_sin if self.rotates[layer] else None

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """In the model dtype: greedy argmax needs no fp32 copy of [rows, vocab]. out: the
        tensor to write into."""
        return vocab_projection(hidden, self.lm_head, out)
