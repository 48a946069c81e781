"""Fixed-size blocks: reference-counted ids and a prefix cache (the tensors: kv_cache.py).

Prefix caching: a full block is identified by a chained hash of its tokens (the hash of the
block before it, and its own tokens). A block whose last user frees it keeps its hash and
sits at the end of the free list, so it can be reused by a later request with the same
prefix until the allocator needs it (least recently freed first). A hit is verified against
the stored tokens, so a hash collision can never hand out wrong K/V.
"""

from __future__ import annotations

from collections import OrderedDict


def block_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


class BlockPool:
    """Hands out block ids; it never over-commits, so running out is a scheduling decision."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError("the KV cache budget is smaller than one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_of: dict[int, int] = {}  # block -> hash, for cached blocks
        self._tokens_of: dict[int, tuple[int, ...]] = {}
        self._cached: dict[int, int] = {}  # hash -> block

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (unreferenced cached blocks included)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"allocating {n} blocks with {len(self._free)} free")
        out = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            h = self._hash_of.pop(b, None)
            if h is not None:  # evict its cached prefix
                del self._cached[h]
                del self._tokens_of[b]
            self.ref_count[b] = 1
            out.append(b)
        return out

    def free(self, blocks: list[int]) -> None:
        # Reversed: a sequence's tail blocks are the least likely to be shared, so they are
        # the first to be evicted.
        for b in reversed(blocks):
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                self._free[b] = None

    def lookup(self, h: int, tokens: tuple[int, ...]) -> int | None:
        b = self._cached.get(h)
        return b if b is not None and self._tokens_of[b] == tokens else None

    def touch(self, b: int) -> None:
        """Take a reference to a cached block (a prefix hit)."""
        if self.ref_count[b] == 0:
            del self._free[b]
        self.ref_count[b] += 1

    def register(self, b: int, h: int, tokens: tuple[int, ...]) -> None:
        """Publish a fully computed block; the first block computed for a hash wins."""
        if self.enable_prefix_caching and h not in self._cached and b not in self._hash_of:
            self._cached[h] = b
            self._hash_of[b] = h
            self._tokens_of[b] = tokens
