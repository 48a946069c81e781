"""Llama-family decoder (GQA, RoPE, RMSNorm, SwiGLU) over a paged KV cache."""

from __future__ import annotations

import torch

from llmdb.kernels.attention import AttentionBatch, write_kv
from llmdb.kernels.elementwise import rms_norm, silu_mul
from llmdb.kernels.linear import Linear, linear

from .config import ModelConfig

# Measured here: the [rows, vocab] GEMM runs ~15% slower per row above 256 rows (its output
# no longer fits the caches), so larger batches are projected in slices.
_VOCAB_SLICE_ROWS = 256


def vocab_projection(hidden: torch.Tensor, lm_head: Linear) -> torch.Tensor:
    if hidden.shape[0] <= _VOCAB_SLICE_ROWS:
        return lm_head(hidden)
    out = torch.empty(hidden.shape[0], lm_head.out_features, dtype=hidden.dtype)
    for i in range(0, hidden.shape[0], _VOCAB_SLICE_ROWS):
        out[i : i + _VOCAB_SLICE_ROWS] = lm_head(hidden[i : i + _VOCAB_SLICE_ROWS])
    return out


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype):
        self.config = config
        self.dtype = dtype
        c = config

        def w(name: str) -> torch.Tensor:
            return weights[name].to(dtype).contiguous()

        self.embed = w("model.embed_tokens.weight")
        self.lm_head = linear(self.embed if c.tie_embeddings else w("lm_head.weight"))
        self.norm = w("model.norm.weight")
        self.layers = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            # One matmul for Q, K and V and one for gate and up: fewer, larger GEMMs.
            qkv = torch.cat([weights[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
            gate_up = torch.cat([weights[p + "mlp.gate_proj.weight"],
                                 weights[p + "mlp.up_proj.weight"]])
            self.layers.append((
                w(p + "input_layernorm.weight"),
                linear(qkv.to(dtype)),
                linear(w(p + "self_attn.o_proj.weight")),
                w(p + "post_attention_layernorm.weight"),
                linear(gate_up.to(dtype)),
                linear(w(p + "mlp.down_proj.weight")),
            ))
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2).double() / c.head_dim))
        angles = torch.arange(c.max_context).double()[:, None] * inv_freq[None, :]
        self.cos, self.sin = angles.cos().float(), angles.sin().float()

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate-half RoPE (Hugging Face layout) in fp32, written into one output buffer."""
        xf = x.float()
        half = xf.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
        out = torch.empty_like(xf)
        torch.mul(x1, cos, out=out[..., :half]).addcmul_(x2, sin, value=-1.0)
        torch.mul(x2, cos, out=out[..., half:]).addcmul_(x1, sin)
        return out.to(x.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attention,
    ) -> torch.Tensor:
        """Final-norm hidden states [T, hidden] of the packed tokens."""
        c = self.config
        t = input_ids.shape[0]
        hq, hk, d = c.num_heads, c.num_kv_heads, c.head_dim
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        scale = d**-0.5
        x = self.embed[input_ids]
        for (ln1, qkv_proj, o_proj, ln2, gate_up_proj, down_proj), (k_cache, v_cache) in zip(
            self.layers, kv_caches, strict=True
        ):
            h = rms_norm(x, ln1, c.norm_eps)
            qk, v = qkv_proj(h).split([(hq + hk) * d, hk * d], dim=-1)
            # Q and K heads rotate together: one pass over both.
            q, k = self._rope(qk.view(t, hq + hk, d), cos, sin).split([hq, hk], dim=1)
            write_kv(k_cache, v_cache, k, v.reshape(t, hk, d), batch.slot_mapping)
            o = attention(q, k_cache, v_cache, batch, scale)
            x = x + o_proj(o.reshape(t, hq * d))
            h = rms_norm(x, ln2, c.norm_eps)
            x = x + down_proj(silu_mul(gate_up_proj(h)))
        return rms_norm(x, self.norm, c.norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """In the model dtype: greedy argmax needs no fp32 copy of [rows, vocab]."""
        return vocab_projection(hidden, self.lm_head)
