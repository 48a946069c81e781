"""Paged attention over a slot-indexed KV cache.

The cache of one layer is a pair of tensors [num_slots, kv_heads, head_dim]; slot = block *
block_size + offset. A step's queries are packed sequence by sequence. Two implementations of
the same contract:
- `paged_attention_reference`: per sequence, gather K/V, expand GQA heads, fp32 softmax.
- `paged_attention`: the CPU fast path. Every query, decode or prefill, goes through the C++
  kernel (csrc/row_attention.cpp) as its own row with its own causal length, reading K/V in
  place from the blocks. Measured here (bf16, SmolLM2 shapes, 2 threads) it beats torch's
  fused SDPA on every chunk shape tried, 1-2048 queries over 436-4096 keys, by 1.3-3x, so
  there is no size threshold. Without a C++ compiler (or for a head shape the kernel does not
  take) each sequence goes through SDPA instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .cpu_ext import row_attention, supports_shape
from .transfer import to_device


@dataclass
class AttentionBatch:
    """One step's sequences in the varlen layout every attention kernel reads.

    Queries are packed sequence by sequence: sequence i owns rows
    query_start_loc[i]:query_start_loc[i + 1] and, after this step, seq_lens[i] tokens in the
    cache, the last (query length) of them new. Its blocks are block_tables[i]; columns past
    its last block hold anything. The tensors live on the engine's device and are built once
    a step, then shared by all layers. The cache is addressed by slot = block * block_size +
    offset, so a block's slots can hold any per-token vector (K, V, or later hidden states).
    """

    query_start_loc: torch.Tensor  # [S + 1] int32
    seq_lens: torch.Tensor  # [S] int32
    block_tables: torch.Tensor  # [S, W] int32
    slot_mapping: torch.Tensor  # [T] int64; -1 marks a padding row whose K/V is not written
    block_size: int
    max_query_len: int
    max_seq_len: int
    num_splits: int = 1  # split-KV partitions per sequence (GPU decode steps)
    _host: tuple | None = field(default=None, repr=False)
    _cpu_rows: tuple | None = field(default=None, repr=False)
    _slots: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionBatch:
        """From host lists (tests, the CPU runner); the GPU runner fills the same fields
        from its persistent step buffers."""
        starts, new_slots, pos = [0], [], 0
        for qlen, ctx, table in zip(query_lens, context_lens, block_tables, strict=True):
            pos += qlen
            starts.append(pos)
            new_slots.extend(table[p // block_size] * block_size + p % block_size
                             for p in range(ctx - qlen, ctx))
        width = max(map(len, block_tables), default=0)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables],
                              dtype=torch.int32).view(len(block_tables), width)
        return cls(
            query_start_loc=to_device(starts, device, torch.int32),
            seq_lens=to_device(context_lens, device, torch.int32),
            block_tables=to_device(tables, device),
            slot_mapping=to_device(new_slots, device, torch.long),
            block_size=block_size,
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(context_lens, default=0),
        )

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    def host(self) -> tuple[list[int], list[int], list[int]]:
        """(query starts, query lengths, context lengths) as host lists, read once."""
        if self._host is None:
            loc = self.query_start_loc.tolist()
            lens = [b - a for a, b in zip(loc, loc[1:], strict=False)]
            self._host = (loc[:-1], lens, self.seq_lens.tolist())
        return self._host

    def cpu_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The C++ kernel's view: one row per query with its sequence's block table [Q, W]
        and the number of keys it may see [Q] (causal: query j of a chunk of q over ctx keys
        sees ctx - q + j + 1), both int64."""
        if self._cpu_rows is None:
            starts, qlens, _ = self.host()
            qlens_t = torch.tensor(qlens, dtype=torch.long)
            total = int(qlens_t.sum())
            ends = self.seq_lens.long().repeat_interleave(qlens_t)
            firsts = torch.tensor(starts, dtype=torch.long).repeat_interleave(qlens_t)
            lens = ends - qlens_t.repeat_interleave(qlens_t) + 1 + torch.arange(total) - firsts
            tables = self.block_tables.long().repeat_interleave(qlens_t, dim=0)
            self._cpu_rows = (tables, lens)
        return self._cpu_rows

    def context_slots(self, i: int) -> torch.Tensor:
        """[context_len] slot indices of sequence i, in token order (computed once a step,
        not once a layer)."""
        if i not in self._slots:
            ctx = self.host()[2][i]
            blocks = self.block_tables[i, : -(-ctx // self.block_size)].long()
            offsets = torch.arange(self.block_size, device=blocks.device)
            slots = blocks[:, None] * self.block_size + offsets
            self._slots[i] = slots.flatten()[:ctx]
        return self._slots[i]


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    k_cache.index_copy_(0, slot_mapping, k)
    v_cache.index_copy_(0, slot_mapping, v)


def _causal_mask(qlen: int, ctx: int, device: torch.device | str = "cpu",
                 window: int = 0) -> torch.Tensor:
    """Query i sits at absolute position p = ctx - qlen + i and sees keys up to it; with a
    window w > 0, only keys p - w + 1 .. p (transformers' `sliding_window`)."""
    q_pos = torch.arange(ctx - qlen, ctx, device=device)[:, None]
    k_pos = torch.arange(ctx, device=device)[None, :]
    mask = k_pos <= q_pos
    return mask & (k_pos > q_pos - window) if window > 0 else mask


def _dense_attention(qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     window: int, softcap: float) -> torch.Tensor:
    """One sequence: qs [H, q, D] over k, v [H, ctx, D] (heads expanded), fp32 softmax."""
    qlen, ctx = qs.shape[1], k.shape[1]
    scores = (qs @ k.transpose(1, 2)) * scale  # [H, q, ctx]
    if softcap > 0:  # Gemma 2's attn_logit_softcapping, before the mask
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~_causal_mask(qlen, ctx, qs.device, window), float("-inf"))
    return scores.softmax(-1) @ v


def paged_attention_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch,
    scale: float, *, window: int = 0, softcap: float = 0.0,
) -> torch.Tensor:
    """q [T, H, D] -> [T, H, D]; the readable definition every fast path is tested against.

    window > 0: a query at position p sees only keys p - window + 1 .. p (sliding-window
    attention); softcap > 0: the scaled scores s become softcap * tanh(s / softcap) before
    the softmax (Gemma 2's attention logit soft-capping)."""
    out = torch.zeros_like(q)
    heads, kv_heads = q.shape[1], k_cache.shape[1]
    for i, (start, qlen, ctx) in enumerate(zip(*batch.host(), strict=True)):
        if qlen == 0 or ctx == 0:
            continue
        slots = batch.context_slots(i)
        qs = q[start : start + qlen].float().transpose(0, 1)  # [H, q, D]
        k = k_cache[slots].float().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        v = v_cache[slots].float().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        o = _dense_attention(qs, k, v, scale, window, softcap)
        out[start : start + qlen] = o.transpose(0, 1).to(q.dtype)
    return out


def _sdpa_chunk(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                slots: torch.Tensor, qlen: int, ctx: int, scale: float, window: int,
                softcap: float) -> torch.Tensor:
    # Keys before the first query's window are seen by no query of the chunk; the mask only
    # depends on relative positions, so dropping them just shortens the context.
    first = max(0, ctx - qlen + 1 - window) if window > 0 else 0
    slots = slots[first:]
    ctx -= first
    k = k_cache.index_select(0, slots).transpose(0, 1)
    v = v_cache.index_select(0, slots).transpose(0, 1)
    qs = q.transpose(0, 1)
    if softcap > 0:  # SDPA has no soft-capping: the dense definition
        group = qs.shape[0] // k.shape[0]
        o = _dense_attention(qs.float(), k.float().repeat_interleave(group, 0),
                             v.float().repeat_interleave(group, 0), scale, window, softcap)
        return o.transpose(0, 1).to(q.dtype)
    mask = None if ctx == qlen and window == 0 else _causal_mask(qlen, ctx, q.device, window)
    o = F.scaled_dot_product_attention(qs[None], k[None], v[None], attn_mask=mask,
                                       is_causal=mask is None, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch,
    scale: float, *, window: int = 0, softcap: float = 0.0,
) -> torch.Tensor:
    """The CPU fast path: same contract as `paged_attention_reference`."""
    out = torch.empty(q.shape, dtype=q.dtype)
    if q.device.type == "cpu" and supports_shape(q.shape[1], k_cache.shape[1], q.shape[2]):
        tables, lens = batch.cpu_rows()
        row_attention(q.contiguous(), k_cache, v_cache, tables, lens, batch.block_size,
                      scale, out, window=window, softcap=softcap)
        return out
    starts, qlens, ctxs = batch.host()
    for i, (start, qlen) in enumerate(zip(starts, qlens, strict=True)):
        out[start : start + qlen] = _sdpa_chunk(
            q[start : start + qlen], k_cache, v_cache, batch.context_slots(i), qlen,
            ctxs[i], scale, window, softcap,
        )
    return out
