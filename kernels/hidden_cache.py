"""Apt-Serve's hidden cache: writes of hidden states into blocks and their block-wise gather.

A hidden-cache request keeps, per layer, the input of the QKV projection (the layer input
after its norm) instead of K and V. The store of one layer is a view [2 * num_slots, hidden]
over the layer's K/V tensor [2, num_slots, kv_heads, head_dim] (engine/cache/kv_cache.py):
row r holds one token, so each block's K half and V half hold block_size tokens each. A
hidden request's table lists units, each a half block (unit u = half * num_blocks + block,
engine/cache/block_pool.py), and unit u is rows u * block_size onwards: token p of a request
sits at row units[p // block_size] * block_size + p % block_size (`hidden_rows`).

At attention time the K/V of a hidden-cache sequence are re-projected from its gathered
hidden states into a scratch K/V buffer laid out as a paged cache of its own (each sequence
padded to whole blocks, its blocks consecutive), so the same paged-attention kernels serve
it. A sequence whose table starts with KV blocks (a prompt prefix it found in the prefix
cache, shared with others) has those tokens' K/V copied into its scratch rows from the KV
cache instead: they are never stored as hidden states nor re-projected. `HiddenBatch`
carries what a step's hidden-cache sequences need.

The CPU path is torch's index_copy_/index_select over precomputed rows (multithreaded
copies; nothing to gain from C++); kernels/gpu/hidden_cache.py has the Triton versions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .attention import AttentionBatch
from .transfer import to_device


def hidden_rows(units: list[int], positions: np.ndarray, block_size: int) -> np.ndarray:
    """Store rows of the given token positions of a sequence whose half blocks are units."""
    return np.asarray(units, dtype=np.int64)[positions // block_size] * block_size + (
        positions % block_size)


@dataclass
class HiddenBatch:
    """The hidden-cache sequences of one step. Their queries are the packed rows from
    first_row on (the KV-cache sequences' come first)."""

    first_row: int
    new_rows: torch.Tensor  # [T_h] int64: store rows of the tokens computed this step
    # [R] int64: store rows of every context token held as hidden states (new ones
    # included), sequence by sequence, each sequence padded to whole blocks with row 0
    # (never read as a key).
    context_rows: torch.Tensor
    context_positions: torch.Tensor  # [R] int64: each row's position (padding: 0)
    attention: AttentionBatch  # the queries over the scratch K/V [S, kv_heads, head_dim]
    # Where some sequence has a KV prefix: the KV cache's slots of those tokens
    # (prefix_slots), the scratch rows they are copied to (prefix_rows), and the scratch
    # rows of the R re-projected ones (reprojected_rows). None where none has: then the
    # R re-projected rows are the scratch, in order (S = R).
    prefix_slots: torch.Tensor | None = None
    prefix_rows: torch.Tensor | None = None
    reprojected_rows: torch.Tensor | None = None

    @classmethod
    def build(cls, first_row: int, query_lens: list[int], context_lens: list[int],
              block_tables: list[list[int]], block_size: int,
              device: torch.device | str = "cpu",
              kv_prefixes: list[int] | None = None) -> HiddenBatch:
        """kv_prefixes: per sequence, how many of its table's first entries are KV blocks
        (the rest are hidden units); None: none."""
        new, ctx_rows, ctx_pos, scratch_tables = [], [], [], []
        pre_slots, pre_rows, proj_rows = [], [], []
        scratch_blocks = 0
        for i, (qlen, ctx, table) in enumerate(
                zip(query_lens, context_lens, block_tables, strict=True)):
            npre = kv_prefixes[i] if kv_prefixes else 0
            first = npre * block_size  # the first token held as a hidden state
            nblocks = -(-ctx // block_size)
            start = scratch_blocks * block_size
            held = np.arange(nblocks * block_size - first, dtype=np.int64)  # from `first` on
            rows = hidden_rows(table[npre:], held, block_size)
            pos = held + first
            rows[ctx - first:] = pos[ctx - first:] = 0
            new.append(rows[ctx - first - qlen : ctx - first])
            ctx_rows.append(rows)
            ctx_pos.append(pos)
            if kv_prefixes:
                kv_pos = np.arange(first, dtype=np.int64)
                kv_blocks = np.asarray(table[:npre], dtype=np.int64)
                pre_slots.append(kv_blocks[kv_pos // block_size] * block_size
                                 + kv_pos % block_size)
                pre_rows.append(start + kv_pos)
                proj_rows.append(np.arange(start + first, start + nblocks * block_size))
            scratch_tables.append(list(range(scratch_blocks, scratch_blocks + nblocks)))
            scratch_blocks += nblocks

        def tensor(parts: list[np.ndarray]) -> torch.Tensor:
            flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
            return to_device(flat.astype(np.int64, copy=False), device)

        prefix = (tensor(pre_slots), tensor(pre_rows), tensor(proj_rows)) if kv_prefixes \
            and any(kv_prefixes) else (None, None, None)
        return cls(first_row, tensor(new), tensor(ctx_rows), tensor(ctx_pos),
                   AttentionBatch.build(query_lens, context_lens, scratch_tables, block_size,
                                        device), *prefix)

    def scratch(self, projected: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        """The scratch K (or V) [S, kv_heads, head_dim] of the step's hidden-cache
        sequences: their re-projected rows `projected` [R, ...] and, where some has a KV
        prefix, its tokens' rows of `cache` [slots, ...]."""
        if self.prefix_slots is None:
            return projected
        rows = len(self.prefix_rows) + len(self.reprojected_rows)
        out = projected.new_empty((rows, *projected.shape[1:]))
        out.index_copy_(0, self.reprojected_rows, projected)
        out.index_copy_(0, self.prefix_rows, cache.index_select(0, self.prefix_slots))
        return out


def write_hidden(store: torch.Tensor, hidden: torch.Tensor, rows: torch.Tensor) -> None:
    """store[rows] = hidden (store [2 * slots, H], hidden [T, H], rows [T] int64)."""
    store.index_copy_(0, rows, hidden.to(store.dtype))


def gather_hidden(store: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[R, H]: the store's rows, in order."""
    return store.index_select(0, rows)


def gather_hidden_reference(store: torch.Tensor, block_tables: list[list[int]],
                            context_lens: list[int], block_size: int) -> list[torch.Tensor]:
    """Per sequence [ctx, H]: its hidden states token by token, read from the block layout
    as the module docstring defines it (the definition the fast paths are tested against)."""
    num_slots = store.shape[0] // 2
    out = []
    for table, ctx in zip(block_tables, context_lens, strict=True):
        tokens = []
        for p in range(ctx):
            half, block = divmod(table[p // block_size], num_slots // block_size)
            tokens.append(store[half * num_slots + block * block_size + p % block_size])
        out.append(torch.stack(tokens) if tokens else store[:0])
    return out
