"""OPT decoder (MHA, learned positions, LayerNorm, ReLU MLP) over a paged KV cache."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from llmdb.kernels.attention import AttentionBatch, write_kv
from llmdb.kernels.hidden_cache import HiddenBatch
from llmdb.kernels.linear import Linear, linear

from .checkpoint import Checkpoint, kv_projection
from .config import ModelConfig
from .hidden_attention import mixed_attention
from .llama import cpu_attention, vocab_projection


class OPTModel:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device | str = "cpu", kernels: str = "cpu"):
        self.config, self.dtype, self.kernels = config, dtype, kernels
        self.device = torch.device(device)
        w, p = Checkpoint(weights, dtype, self.device), "model.decoder."
        lin = partial(linear, batch_invariant=config.batch_invariant)
        self.embed = w(p + "embed_tokens.weight")
        self.positions = w(p + "embed_positions.weight")
        # OPT-350m projects between a narrower embedding and the hidden size.
        project_in, project_out = w.get(p + "project_in.weight"), w.get(p + "project_out.weight")
        self.project_in = None if project_in is None else lin(project_in)
        self.project_out = None if project_out is None else lin(project_out)
        self.final_norm = (w.get(p + "final_layer_norm.weight"),
                           w.get(p + "final_layer_norm.bias"))
        # (Some OPT checkpoints store no LM head though untied: the embeddings serve.)
        untied = not config.tie_embeddings and "lm_head.weight" in w
        self.lm_head = lin(w("lm_head.weight") if untied else self.embed)
        self.layers = []
        self.kv_projs: list[Linear] = []  # K and V alone: hidden-cache re-projection
        hidden_cache = config.hidden_cache_support()[0]
        for i in range(config.num_layers):
            q = f"{p}layers.{i}."
            qkv, qkv_bias = w.fused([q + f"self_attn.{n}_proj" for n in "qkv"])
            if hidden_cache:
                self.kv_projs.append(kv_projection(qkv, qkv_bias, config.hidden_size,
                                                   config.batch_invariant))
            self.layers.append((
                w(q + "self_attn_layer_norm.weight"), w(q + "self_attn_layer_norm.bias"),
                lin(qkv, qkv_bias), lin(*w.fused([q + "self_attn.out_proj"])),
                w(q + "final_layer_norm.weight"), w(q + "final_layer_norm.bias"),
                lin(*w.fused([q + "fc1"])), lin(*w.fused([q + "fc2"])),
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
        """Final hidden states [T, hidden]; `hidden` and `stores` as in LlamaModel.forward."""
        triton = self.kernels == "triton"
        if triton:
            from llmdb.kernels.gpu.attention import paged_attention
            from llmdb.kernels.gpu.cache_write import rope_and_write_kv

            attention = partial(paged_attention, invariant=self.config.batch_invariant)
        else:
            attention = cpu_attention(self.kernels)
        c = self.config
        t, h, d = input_ids.shape[0], c.num_heads, c.head_dim
        x = self.embed[input_ids]
        if self.project_in is not None:
            x = self.project_in(x)
        x = x + self.positions[positions + c.position_offset]
        # F.layer_norm needs no invariant form of its own (LLMEngine(batch_invariant=True)):
        # torch's CUDA kernel gives each row one block of a fixed size, the vectorized kernel
        # or the plain one chosen by the width and the tensors' alignment (whole fresh
        # tensors here), never by the number of rows (layer_norm_kernel.cu).
        hs = (c.hidden_size,)
        nk = t if hidden is None else hidden.first_row
        for i, ((ln1_w, ln1_b, qkv_proj, o_proj, ln2_w, ln2_b, fc1, fc2), kv_layer) in (
            enumerate(zip(self.layers, kv_caches, strict=True))
        ):
            res = x
            if c.norm_before:
                x = F.layer_norm(x, hs, ln1_w, ln1_b)
            qkv = qkv_proj(x)
            if triton:  # no RoPE: the kernel only writes K/V (not hidden-cache rows: slot -1)
                q = rope_and_write_kv(qkv, positions, None, batch.slot_mapping, *kv_layer,
                                      h, h, d)
            else:
                q, k, v = qkv.split(c.hidden_size, dim=-1)
                write_kv(*kv_layer, k.reshape(t, h, d)[:nk], v.reshape(t, h, d)[:nk],
                         batch.slot_mapping[:nk])
                q = q.reshape(t, h, d)
            if hidden is not None:
                o = mixed_attention(q, x, kv_layer, batch, d**-0.5, attention, hidden,
                                    stores[i], partial(self.reproject_kv, i), triton=triton)
            elif triton:
                o = attention(q, *kv_layer, batch, d**-0.5, num_splits=batch.num_splits)
            else:
                o = attention(q, *kv_layer, batch, d**-0.5)
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

    def reproject_kv(self, layer: int, states: torch.Tensor, positions: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [R, H, D] of hidden-cache states [R, hidden] (learned positions were added
        before the first layer: nothing position-dependent here)."""
        c = self.config
        kv = self.kv_projs[layer](states).view(states.shape[0], 2, c.num_heads, c.head_dim)
        return kv[:, 0].contiguous(), kv[:, 1].contiguous()

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """In the model dtype: greedy argmax needs no fp32 copy of [rows, vocab]. out: the
        tensor to write into."""
        return vocab_projection(hidden, self.lm_head, out)
