"""Gemma 2 and Gemma 3 (text) decoders over a paged KV cache.

What differs from Llama (llama.py, whose pieces this reuses): the embeddings are scaled by
sqrt(hidden_size); every RMSNorm scales by 1 + its weight, in fp32, rounding once
(elementwise.rms_norm_fp32); each layer normalizes its attention and MLP outputs again before
adding them to the residual stream (four norms a layer); the MLP is GeGLU (gelu, tanh
approximation); the attention scale is query_pre_attn_scalar ** -0.5 (ModelConfig.attn_scale).
Gemma 2 caps the final logits with tanh (ModelConfig.logit_softcap). Gemma 3 normalizes each
Q and K head before RoPE, as Qwen3 does, and its sliding-window layers rotate with a RoPE of
their own (base 10,000, unscaled; ModelConfig.rope_local_layers) while the global layers
take rope_theta (1e6) and, from 4B on, linear scaling. Sliding windows (Gemma 2: every other
layer, 4,096 tokens; Gemma 3: five layers in six, 512 or 1,024) and Gemma 2's attention
softcap go to the attention kernels (ModelConfig.layer_windows, attn_softcap).

Kernel sets as in llama.py. On the Triton path each sublayer's output norm is fused with
the residual add and the next norm (norm.add_rms_norm's x_weight), Gemma 3's Q/K norms with
RoPE and the K/V write. No hidden cache: every published Gemma's hidden states are larger
than its K and V (ModelConfig.hidden_cache_support).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from llmdb.kernels.attention import AttentionBatch
from llmdb.kernels.elementwise import gelu_tanh_mul_reference, rms_norm_fp32
from llmdb.kernels.hidden_cache import HiddenBatch
from llmdb.kernels.linear import Linear, linear
from llmdb.kernels.rope import rotate_and_write_kv

from .checkpoint import Checkpoint
from .config import ModelConfig
from .llama import RopeTable, cpu_attention, norm_heads, vocab_projection


@dataclass(frozen=True)
class GemmaLayer:
    """One decoder layer. Norms are fp32 scales: 1 + the checkpoint's weight."""

    input_norm: torch.Tensor
    qkv: Linear  # Q, K and V in one GEMM
    qk_norm: tuple[torch.Tensor, torch.Tensor] | None  # Gemma 3: per-head Q and K scales
    o: Linear
    post_attention_norm: torch.Tensor
    pre_feedforward_norm: torch.Tensor
    gate_up: Linear  # gate and up in one GEMM
    down: Linear
    post_feedforward_norm: torch.Tensor
    rope: int  # index into GemmaModel.ropes
    window: int  # 0: the whole context


class GemmaModel:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device | str = "cpu", kernels: str = "cpu"):
        self.config, self.dtype, self.kernels = config, dtype, kernels
        self.device = device = torch.device(device)
        c, w = config, Checkpoint(weights, dtype, device)

        def scale(name: str) -> torch.Tensor:
            # 1 + weight in fp32 whatever the model's dtype, as transformers computes it:
            # folded into a bf16 weight, 1 + w would lose most of w's bits.
            return (1.0 + weights[name].float()).to(device)

        self.embed = w("model.embed_tokens.weight")
        # sqrt(hidden_size) rounded to the model's dtype first (transformers, and Google's
        # reference code): in bf16 sqrt(1152) = 33.94 multiplies as 34.
        self.embed_scale = torch.tensor(c.hidden_size**0.5, dtype=dtype, device=device)
        lin = partial(linear, batch_invariant=c.batch_invariant)
        self.lm_head = lin(self.embed if c.tie_embeddings else w("lm_head.weight"))
        self.norm = scale("model.norm.weight")
        triton = kernels == "triton"
        # Global layers' RoPE first; Gemma 3's sliding-window layers have their own.
        self.ropes = [RopeTable.build(c, c.rope_theta, c.rope_divisors, triton, device)]
        if c.rope_local_theta:
            self.ropes.append(RopeTable.build(c, c.rope_local_theta, (), triton, device))
        local = set(c.rope_local_layers) if c.rope_local_theta else set()
        self.layers = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            qk_norm = None
            if p + "self_attn.q_norm.weight" in w:
                qk_norm = (scale(p + "self_attn.q_norm.weight"),
                           scale(p + "self_attn.k_norm.weight"))
            self.layers.append(GemmaLayer(
                input_norm=scale(p + "input_layernorm.weight"),
                qkv=lin(*w.fused([p + f"self_attn.{n}_proj" for n in "qkv"])),
                qk_norm=qk_norm,
                o=lin(*w.fused([p + "self_attn.o_proj"])),
                post_attention_norm=scale(p + "post_attention_layernorm.weight"),
                pre_feedforward_norm=scale(p + "pre_feedforward_layernorm.weight"),
                gate_up=lin(*w.fused([p + "mlp.gate_proj", p + "mlp.up_proj"])),
                down=lin(*w.fused([p + "mlp.down_proj"])),
                post_feedforward_norm=scale(p + "post_feedforward_layernorm.weight"),
                rope=1 if i in local else 0,
                window=c.layer_window(i),
            ))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        hidden: HiddenBatch | None = None,
        stores: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Final-norm hidden states [T, hidden] of the packed tokens (no hidden-cache rows:
        the engine never turns the hidden cache on for Gemma)."""
        assert hidden is None, "Gemma has no hidden cache"
        if self.kernels == "triton":
            return self._forward_triton(input_ids, positions, batch, kv_caches)
        attention = cpu_attention(self.kernels)
        c = self.config
        t, eps = input_ids.shape[0], c.norm_eps
        hq, hk, d = c.num_heads, c.num_kv_heads, c.head_dim
        tables = [(rope.cos, rope.sin) for rope in self.ropes]
        x = self.embed[input_ids] * self.embed_scale
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            h = rms_norm_fp32(x, layer.input_norm, eps)
            qkv = layer.qkv(h)
            if layer.qk_norm is not None:
                norm_heads(qkv, 0, hq, d, layer.qk_norm[0], eps, rms_norm_fp32)
                norm_heads(qkv, hq, hk, d, layer.qk_norm[1], eps, rms_norm_fp32)
            q = rotate_and_write_kv(qkv, positions, tables[layer.rope], batch.slot_mapping,
                                    k_cache, v_cache, hq, hk, t)
            o = attention(q, k_cache, v_cache, batch, c.attention_scale, window=layer.window,
                          softcap=c.attn_softcap)
            x = x + rms_norm_fp32(layer.o(o.reshape(t, hq * d)), layer.post_attention_norm, eps)
            h = rms_norm_fp32(x, layer.pre_feedforward_norm, eps)
            mlp = layer.down(gelu_tanh_mul_reference(layer.gate_up(h)))
            x = x + rms_norm_fp32(mlp, layer.post_feedforward_norm, eps)
        return rms_norm_fp32(x, self.norm, eps)

    def _forward_triton(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        from llmdb.kernels.gpu.attention import paged_attention
        from llmdb.kernels.gpu.cache_write import rope_and_write_kv
        from llmdb.kernels.gpu.norm import add_rms_norm, gelu_tanh_mul, rms_norm

        c = self.config
        attention = partial(paged_attention, invariant=c.batch_invariant)
        t, eps = input_ids.shape[0], c.norm_eps
        hq, hk, d = c.num_heads, c.num_kv_heads, c.head_dim
        residual = self.embed[input_ids] * self.embed_scale
        # The MLP output not yet added, and the norm it takes before it is.
        x: torch.Tensor | None = None
        x_norm: torch.Tensor | None = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            if x is None:
                h = rms_norm(residual, layer.input_norm, eps, fp32_scale=True)
            else:
                h, residual = add_rms_norm(x, residual, layer.input_norm, eps, True, x_norm)
            # Padding rows have slot -1: their K/V are not written.
            q = rope_and_write_kv(layer.qkv(h), positions, self.ropes[layer.rope].cos_sin,
                                  batch.slot_mapping, k_cache, v_cache, hq, hk, d,
                                  layer.qk_norm, eps, fp32_scale=True)
            # (Host values per layer: a CUDA graph bakes them into this layer's launch.)
            o = attention(q, k_cache, v_cache, batch, c.attention_scale,
                          num_splits=batch.num_splits, window=layer.window,
                          softcap=c.attn_softcap)
            h, residual = add_rms_norm(layer.o(o.view(t, hq * d)), residual,
                                       layer.pre_feedforward_norm, eps, True,
                                       layer.post_attention_norm)
            x, x_norm = layer.down(gelu_tanh_mul(layer.gate_up(h))), layer.post_feedforward_norm
        return add_rms_norm(x, residual, self.norm, eps, True, x_norm)[0]

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """In the model dtype; out: the tensor to write into. Gemma 2's cap applies in place,
        in the model dtype as transformers applies it: the capped logits are what sampling,
        logprobs and label scores read."""
        logits = vocab_projection(hidden, self.lm_head, out)
        cap = self.config.logit_softcap
        if cap:  # (elementwise: a logit's cap reads that logit alone, in any batch)
            logits.div_(cap).tanh_().mul_(cap)
        return logits
