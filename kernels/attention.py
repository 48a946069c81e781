"""Paged attention over a slot-indexed KV cache.

The cache of one layer is a pair of tensors [num_slots, kv_heads, head_dim]; slot = block *
block_size + offset. A step's queries are packed: decodes (one query each) first, then
prefill chunks. Two implementations of the same contract:
- `paged_attention_reference`: per sequence, gather K/V, expand GQA heads, fp32 softmax.
- `paged_attention`: the CPU fast path: all decodes in one call of the C++ kernel that reads
  K/V in place from the blocks (csrc/decode_attention.cpp; where no compiler exists, one
  batched SDPA call over a padded gather), each prefill chunk in one SDPA call (torch's fused
  CPU kernel).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .cpu_ext import decode_attention, load_library


@dataclass
class AttentionBatch:
    """Tensor-level description of one step's sequences, built once and shared by all layers."""

    slot_mapping: torch.Tensor  # [T] slot where each new token's K/V is written
    query_starts: list[int]  # per sequence, offset of its first query in the packed batch
    query_lens: list[int]
    context_lens: list[int]  # tokens in the cache after this step, including the new ones
    context_slots: list[torch.Tensor]  # per sequence [context_len] slot indices
    num_decodes: int  # the first num_decodes sequences have exactly one query each
    block_size: int = 16
    decode_block_tables: torch.Tensor | None = None  # [D, max_blocks] int64, padded
    decode_context_lens: torch.Tensor | None = None  # [D] int64

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
    ) -> AttentionBatch:
        starts, slots, new_slots, pos = [], [], [], 0
        for qlen, ctx, table in zip(query_lens, context_lens, block_tables, strict=True):
            starts.append(pos)
            pos += qlen
            blocks = torch.tensor(table, dtype=torch.long)
            seq_slots = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:ctx]
            slots.append(seq_slots)
            new_slots.append(seq_slots[ctx - qlen :])
        num_decodes = 0
        while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
            num_decodes += 1
        batch = cls(
            slot_mapping=torch.cat(new_slots) if new_slots else torch.empty(0, dtype=torch.long),
            query_starts=starts,
            query_lens=query_lens,
            context_lens=context_lens,
            context_slots=slots,
            num_decodes=num_decodes,
            block_size=block_size,
        )
        if num_decodes:
            width = max(len(t) for t in block_tables[:num_decodes])
            batch.decode_block_tables = torch.tensor(
                [t + [0] * (width - len(t)) for t in block_tables[:num_decodes]], dtype=torch.long
            )
            batch.decode_context_lens = torch.tensor(context_lens[:num_decodes], dtype=torch.long)
        return batch

    def decode_gather_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[D, Lmax] padded slot indices of the decodes and a [D, 1, 1, Lmax] validity mask."""
        lens = self.context_lens[: self.num_decodes]
        lmax = max(lens)
        padded = torch.zeros(self.num_decodes, lmax, dtype=torch.long)
        mask = torch.zeros(self.num_decodes, lmax, dtype=torch.bool)
        for i, n in enumerate(lens):
            padded[i, :n] = self.context_slots[i]
            mask[i, :n] = True
        return padded, mask[:, None, None, :]


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    k_cache.index_copy_(0, slot_mapping, k)
    v_cache.index_copy_(0, slot_mapping, v)


def _causal_mask(qlen: int, ctx: int) -> torch.Tensor:
    """Query i sits at absolute position ctx - qlen + i and sees keys up to it."""
    q_pos = torch.arange(ctx - qlen, ctx)[:, None]
    return torch.arange(ctx)[None, :] <= q_pos


def paged_attention_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch,
    scale: float,
) -> torch.Tensor:
    """q [T, H, D] -> [T, H, D]; the readable definition every fast path is tested against."""
    out = torch.empty_like(q)
    heads, kv_heads = q.shape[1], k_cache.shape[1]
    for start, qlen, ctx, slots in zip(
        batch.query_starts, batch.query_lens, batch.context_lens, batch.context_slots,
        strict=True,
    ):
        qs = q[start : start + qlen].float().transpose(0, 1)  # [H, q, D]
        k = k_cache[slots].float().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        v = v_cache[slots].float().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        scores = (qs @ k.transpose(1, 2)) * scale  # [H, q, ctx]
        scores = scores.masked_fill(~_causal_mask(qlen, ctx), float("-inf"))
        out[start : start + qlen] = (scores.softmax(-1) @ v).transpose(0, 1).to(q.dtype)
    return out


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch,
    scale: float,
) -> torch.Tensor:
    """The CPU fast path: same contract as `paged_attention_reference`."""
    out = torch.empty_like(q)
    nd = batch.num_decodes
    if nd and load_library() is not None:
        decode_attention(q[:nd].contiguous(), k_cache, v_cache, batch.decode_block_tables,
                         batch.decode_context_lens, batch.block_size, scale, out[:nd])
    elif nd:
        idx, mask = batch.decode_gather_index()
        lmax = idx.shape[1]
        k = k_cache.index_select(0, idx.flatten()).view(nd, lmax, *k_cache.shape[1:])
        v = v_cache.index_select(0, idx.flatten()).view(nd, lmax, *v_cache.shape[1:])
        o = F.scaled_dot_product_attention(
            q[:nd, :, None, :],  # [D, H, 1, d]
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        out[:nd] = o[:, :, 0, :]
    for i in range(nd, len(batch.query_lens)):
        start, qlen, ctx = batch.query_starts[i], batch.query_lens[i], batch.context_lens[i]
        slots = batch.context_slots[i]
        k = k_cache.index_select(0, slots).transpose(0, 1)[None]
        v = v_cache.index_select(0, slots).transpose(0, 1)[None]
        qs = q[start : start + qlen].transpose(0, 1)[None]
        if ctx == qlen:
            o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale,
                                               enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=_causal_mask(qlen, ctx),
                                               scale=scale, enable_gqa=True)
        out[start : start + qlen] = o[0].transpose(0, 1)
    return out
