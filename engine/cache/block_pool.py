"""Fixed-size blocks: reference-counted ids and a prefix cache (the tensors: kv_cache.py).

Prefix caching: a full block is identified by a chained hash of its tokens (the hash of the
block before it, and its own tokens). A block whose last user frees it keeps its hash and
sits at the end of the free list, so it can be reused by a later request with the same
prefix until the allocator needs it (least recently freed first). A hit is verified against
the stored tokens, so a hash collision can never hand out wrong K/V.

Halves (Apt-Serve's hidden cache): a block has a K half and a V half of block_size slots
each. A hidden-cache request stores one vector per token, so one half holds block_size of its
tokens, and it takes blocks half by half: half h of block b is the unit h * num_blocks + b
(the row layout of kernels/hidden_cache.py). Halves come from blocks whose other half is
already taken by a hidden request before whole free blocks are split, so whole blocks stay
for KV-cache requests. A block with a hidden half in use is referenced, never free.

Sliding windows (ModelConfig.layer_windows): a block holds every layer's K/V of its tokens,
and a sequence keeps all its blocks, also those that have slid out of every layer's window
(Mistral 7B v0.1, where every layer has one) and that no query will read again. Freeing
them early is an optimisation left for later (the attention kernels already skip them; the
scheduler's memory budget and the cost model still count a sequence's whole context).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

# Hidden-cache memory per token over KV-cache memory per token (Apt-Serve's h/m) where the pool
# stores hidden states: one vector per token in a half block, where K/V take both halves.
HIDDEN_RATIO = 0.5


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
        # References beyond a block's first (prefix hits on blocks in use): the blocks the
        # requests hold, each request's counted whole, exceed the blocks in use by this many.
        self.shared_refs = 0
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_of: dict[int, int] = {}  # block -> hash, for cached blocks
        self._tokens_of: dict[int, tuple[int, ...]] = {}
        self._cached: dict[int, int] = {}  # hash -> block
        self._halves_used: dict[int, int] = {}  # hidden-owned block -> bit mask of its halves
        self._half_free: OrderedDict[int, None] = OrderedDict()  # one half used, one free

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (unreferenced cached blocks included)."""
        return len(self._free)

    @property
    def num_free_halves(self) -> int:
        """Halves that hidden-cache requests can allocate now."""
        return 2 * len(self._free) + len(self._half_free)

    def free_space(self) -> FreeSpace:
        """A snapshot of the free memory, for a policy to plan allocations against."""
        return FreeSpace(len(self._free), len(self._half_free))

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
        # the first to be evicted. A block that caches no prefix goes first of all: taking
        # it evicts nothing (behind the cached ones, it let them be evicted while it waited).
        for b in reversed(blocks):
            self.ref_count[b] -= 1
            if self.ref_count[b]:
                self.shared_refs -= 1
            else:
                self._free[b] = None
                if b not in self._hash_of:
                    self._free.move_to_end(b, last=False)

    def allocate_halves(self, n: int) -> list[int]:
        if n > self.num_free_halves:
            raise RuntimeError(f"allocating {n} halves with {self.num_free_halves} free")
        out = []
        for _ in range(n):
            if self._half_free:
                b, _ = self._half_free.popitem(last=False)
                half = 1 if self._halves_used[b] == 1 else 0
                self._halves_used[b] = 3
            else:
                b, half = self.allocate(1)[0], 0
                self._halves_used[b] = 1
                self._half_free[b] = None
            out.append(half * self.num_blocks + b)
        return out

    def free_halves(self, units: list[int]) -> None:
        for u in reversed(units):
            half, b = divmod(u, self.num_blocks)
            mask = self._halves_used[b] & ~(1 << half)
            if mask:
                self._halves_used[b] = mask
                self._half_free[b] = None
            else:
                del self._halves_used[b]
                self._half_free.pop(b, None)
                self.free([b])

    def blocks_freed_by(self, units: list[int]) -> int:
        """Whole blocks that freeing these halves would return to the free list."""
        mine: dict[int, int] = {}
        for u in units:
            half, b = divmod(u, self.num_blocks)
            mine[b] = mine.get(b, 0) | (1 << half)
        return sum(1 for b, mask in mine.items() if mask == self._halves_used[b])

    def lookup(self, h: int, tokens: tuple[int, ...]) -> int | None:
        b = self._cached.get(h)
        return b if b is not None and self._tokens_of[b] == tokens else None

    def touch(self, b: int) -> None:
        """Take a reference to a cached block (a prefix hit)."""
        if self.ref_count[b] == 0:
            del self._free[b]
        else:
            self.shared_refs += 1
        self.ref_count[b] += 1

    def register(self, b: int, h: int, tokens: tuple[int, ...]) -> None:
        """Publish a fully computed block; the first block computed for a hash wins."""
        if self.enable_prefix_caching and h not in self._cached and b not in self._hash_of:
            self._cached[h] = b
            self._hash_of[b] = h
            self._tokens_of[b] = tokens


@dataclass
class FreeSpace:
    """Free whole blocks and free halves of half-used blocks; take_* succeed (and subtract)
    as BlockPool.allocate / allocate_halves would."""

    whole: int
    half: int

    def take_blocks(self, n: int) -> bool:
        if n > self.whole:
            return False
        self.whole -= n
        return True

    def take_halves(self, n: int) -> bool:
        if n > 2 * self.whole + self.half:
            return False
        from_half = min(n, self.half)
        split = n - from_half
        self.whole -= -(-split // 2)
        self.half += split % 2 - from_half
        return True
