"""Apt-Serve's hidden cache: writes of hidden states into blocks and their block-wise gather.

A hidden-cache request keeps, per layer, the input of the QKV projection (the layer input
after its norm) instead of K and V. The store of one layer is a view [2 * num_slots, hidden]
over the layer's K/V tensor [2, num_slots, kv_heads, head_dim] (engine/cache/block_pool.py):
row r holds one token. A block b of block_size slots per half holds 2 x block_size tokens:
token p of a request sits in block block_ids[p // (2 block_size)], in its K half when
(p // block_size) is even, else in its V half, at offset p % block_size (`hidden_rows`).

At attention time the K/V of a hidden-cache sequence are re-projected from its gathered
hidden states into a scratch K/V buffer laid out as a paged cache of its own (each sequence
padded to whole blocks, its blocks consecutive), so the same paged-attention kernels serve
it. `HiddenBatch` carries what a step's hidden-cache sequences need.

The CPU path is torch's index_copy_/index_select over precomputed rows (multithreaded
copies; nothing to gain from C++); kernels/gpu/hidden_cache.py has the Triton versions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .attention import AttentionBatch


def hidden_rows(block_ids: list[int], positions: np.ndarray, block_size: int,
                num_slots: int) -> np.ndarray:
    """Store rows of the given token positions of a sequence whose blocks are block_ids."""
    blocks = np.asarray(block_ids, dtype=np.int64)[positions // (2 * block_size)]
    half = (positions // block_size) % 2
    return half * num_slots + blocks * block_size + positions % block_size


@dataclass
class HiddenBatch:
    """The hidden-cache sequences of one step. Their queries are the packed rows from
    first_row on (the KV-cache sequences' come first)."""

    first_row: int
    new_rows: torch.Tensor  # [T_h] int64: store rows of the tokens computed this step
    # [R] int64: store rows of every context token (new ones included), sequence by
    # sequence, each sequence padded to whole blocks with row 0 (never read as a key).
    context_rows: torch.Tensor
    context_positions: torch.Tensor  # [R] int64: each row's position (padding: 0)
    attention: AttentionBatch  # the queries over the scratch K/V [R, kv_heads, head_dim]

    @classmethod
    def build(cls, first_row: int, query_lens: list[int], context_lens: list[int],
              block_tables: list[list[int]], block_size: int, num_slots: int,
              device: torch.device | str = "cpu") -> HiddenBatch:
        new, ctx_rows, ctx_pos, scratch_tables = [], [], [], []
        scratch_blocks = 0
        for qlen, ctx, table in zip(query_lens, context_lens, block_tables, strict=True):
            nblocks = -(-ctx // block_size)
            pos = np.arange(nblocks * block_size, dtype=np.int64)
            pos[ctx:] = 0
            rows = hidden_rows(table, pos, block_size, num_slots)
            rows[ctx:] = 0
            new.append(rows[ctx - qlen : ctx])
            ctx_rows.append(rows)
            ctx_pos.append(pos)
            scratch_tables.append(list(range(scratch_blocks, scratch_blocks + nblocks)))
            scratch_blocks += nblocks

        def tensor(parts: list[np.ndarray]) -> torch.Tensor:
            flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
            return torch.from_numpy(flat).to(device)

        return cls(first_row, tensor(new), tensor(ctx_rows), tensor(ctx_pos),
                   AttentionBatch.build(query_lens, context_lens, scratch_tables, block_size,
                                        device))


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
            block, offset = table[p // (2 * block_size)], p % block_size
            half = (p // block_size) % 2
            tokens.append(store[half * num_slots + block * block_size + offset])
        out.append(torch.stack(tokens) if tokens else store[:0])
    return out
