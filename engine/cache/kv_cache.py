"""The tensors behind the block pool's ids: per layer, K and V (or hidden states) by slot."""

from __future__ import annotations

import torch

from ..models.config import ModelConfig


class KVCache:
    """Per layer one tensor [2, num_blocks * block_size, kv_heads, head_dim]: K and V.

    Block b owns slots b * block_size ... (b + 1) * block_size - 1 of both halves. A block of
    a KV-cache request holds K in the first half and V in the second for block_size tokens;
    a hidden-cache request (Apt-Serve) holds the layer's QKV-projection input for block_size
    tokens in one half, so a block serves two hidden units (kernels/hidden_cache.py). Every
    request type takes any free block of the one pool."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        self.num_slots = slots = num_blocks * block_size
        shape = (2, slots, config.num_kv_heads, config.head_dim)
        # On the CPU torch.empty maps memory lazily: only blocks that are written cost
        # resident memory.
        self.storage = [torch.empty(shape, dtype=dtype, device=device)
                        for _ in range(config.num_layers)]
        self.layers = [(kv[0], kv[1]) for kv in self.storage]
        # Hidden-state views: row r of [2 * slots, hidden_size] (a prefix of slot r's values).
        self.hidden = []
        if config.hidden_cache_support()[0]:
            self.hidden = [kv.view(2 * slots, -1)[:, : config.hidden_size]
                           for kv in self.storage]

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        return config.kv_elems_per_token * block_size * torch.finfo(dtype).bits // 8

