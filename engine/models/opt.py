"""OPT decoder (MHA, learned positions, LayerNorm, ReLU MLP) over a paged KV cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmdb.kernels.attention import AttentionBatch, write_kv
from llmdb.kernels.linear import linear

from .config import ModelConfig
from .llama import cpu_attention, vocab_projection


class OPTModel:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device | str = "cpu", kernels: str = "cpu"):
        self.config = config
        self.dtype = dtype
        self.device = device = torch.device(device)
        self.kernels = kernels
        p = "model.decoder."

        def w(name: str) -> torch.Tensor | None:
            t = weights.get(p + name)
            return None if t is None else t.to(device, dtype).contiguous()

        self.embed = w("embed_tokens.weight")
        self.positions = w("embed_positions.weight")
        # OPT-350m projects between a narrower embedding and the hidden size.
        project_in, project_out = w("project_in.weight"), w("project_out.weight")
        self.project_in = None if project_in is None else linear(project_in)
        self.project_out = None if project_out is None else linear(project_out)
        self.final_norm = (w("final_layer_norm.weight"), w("final_layer_norm.bias"))
        lm = weights.get("lm_head.weight")
        self.lm_head = linear(self.embed if config.tie_embeddings or lm is None
                              else lm.to(device, dtype))
        self.layers = []
        for i in range(config.num_layers):
            q = f"layers.{i}."
            qkv_w = torch.cat([weights[p + q + f"self_attn.{n}_proj.weight"] for n in "qkv"])
            qkv_b = torch.cat([weights[p + q + f"self_attn.{n}_proj.bias"] for n in "qkv"])
            ln1_w, ln1_b, qkv_w, qkv_b, o_w, o_b, ln2_w, ln2_b, fc1_w, fc1_b, fc2_w, fc2_b = (
                t.to(device, dtype).contiguous() for t in (
                    weights[p + q + "self_attn_layer_norm.weight"],
                    weights[p + q + "self_attn_layer_norm.bias"],
                    qkv_w, qkv_b,
                    weights[p + q + "self_attn.out_proj.weight"],
                    weights[p + q + "self_attn.out_proj.bias"],
                    weights[p + q + "final_layer_norm.weight"],
                    weights[p + q + "final_layer_norm.bias"],
                    weights[p + q + "fc1.weight"], weights[p + q + "fc1.bias"],
                    weights[p + q + "fc2.weight"], weights[p + q + "fc2.bias"],
                ))
            self.layers.append((ln1_w, ln1_b, linear(qkv_w, qkv_b), linear(o_w, o_b), ln2_w,
                                ln2_b, linear(fc1_w, fc1_b), linear(fc2_w, fc2_b)))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        triton = self.kernels == "triton"
        if triton:
            from llmdb.kernels.gpu.attention import paged_attention as attention
            from llmdb.kernels.gpu.cache_write import rope_and_write_kv
        else:
            attention = cpu_attention(self.kernels)
        c = self.config
        t, h, d = input_ids.shape[0], c.num_heads, c.head_dim
        x = self.embed[input_ids]
        if self.project_in is not None:
            x = self.project_in(x)
        x = x + self.positions[positions + c.position_offset]
        hs = (c.hidden_size,)
        for (ln1_w, ln1_b, qkv_proj, o_proj, ln2_w, ln2_b, fc1, fc2), (k_cache, v_cache) in zip(
            self.layers, kv_caches, strict=True
        ):
            res = x
            if c.norm_before:
                x = F.layer_norm(x, hs, ln1_w, ln1_b)
            qkv = qkv_proj(x)
            if triton:  # no RoPE: the kernel only writes K/V into their slots
                q = rope_and_write_kv(qkv, positions, None, batch.slot_mapping, k_cache,
                                      v_cache, h, h, d)
                o = attention(q, k_cache, v_cache, batch, d**-0.5, num_splits=batch.num_splits)
            else:
                q, k, v = qkv.split(c.hidden_size, dim=-1)
                write_kv(k_cache, v_cache, k.reshape(t, h, d), v.reshape(t, h, d),
                         batch.slot_mapping)
                o = attention(q.reshape(t, h, d), k_cache, v_cache, batch, d**-0.5)
            x = res + o_proj(o.reshape(t, h * d))
            if not c.norm_before:
                x = F.layer_norm(x, hs, ln1_w, ln1_b)
            res = x
            if c.norm_before:
                x = F.layer_norm(x, hs, ln2_w, ln2_b)
            x = res + fc2(F.relu(fc1(x)))
            if not c.norm_before:
                x = F.layer_norm(x, hs, ln2_w, ln2_b)
        if self.final_norm[0] is not None:
            x = F.layer_norm(x, hs, *self.final_norm)
        if self.project_out is not None:
            x = self.project_out(x)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """In the model dtype: greedy argmax needs no fp32 copy of [rows, vocab]."""
        return vocab_projection(hidden, self.lm_head)
