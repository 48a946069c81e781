"""Fixed-size KV blocks: a free list and the per-layer tensors that hold them."""

from __future__ import annotations

from collections import deque

import torch

from ..models.config import ModelConfig


class BlockPool:
    """Hands out block ids; it never over-commits, so running out is a scheduling decision."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError("the KV cache budget is smaller than one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"allocating {n} blocks with {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(blocks)


class KVCache:
    """Per layer, K and V tensors [num_blocks * block_size, kv_heads, head_dim]."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype):
        slots = num_blocks * block_size
        shape = (slots, config.num_kv_heads, config.head_dim)
        # torch.empty maps memory lazily: only blocks that are written cost resident memory.
        self.layers = [
            (torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype))
            for _ in range(config.num_layers)
        ]

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        return config.kv_bytes_per_token * block_size * torch.finfo(dtype).bits // 8
