"""One layer's attention for a step that mixes KV-cache and hidden-cache sequences.

The KV-cache sequences' queries come first and attend over the paged KV cache as always.
The hidden-cache sequences (Apt-Serve) store this step's QKV-projection inputs in their
blocks, then their whole context's hidden states are gathered, re-projected to K/V (RoPE at
each token's own position where the model has it) into a scratch paged cache, and their
queries attend over that with the same kernel; a KV prefix of theirs (prefix-cache hits) is
copied into the scratch from the KV cache. The models supply the re-projection.

The scratch cache holds each context at its own positions, so a sliding window means the
same there. (The whole context is re-projected even where a window reads only its last keys:
re-projecting just the window is an optimisation left for later.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from llmdb.kernels.attention import AttentionBatch
from llmdb.kernels.hidden_cache import HiddenBatch

# (q, k_cache, v_cache, batch, scale, window=, softcap=) -> out, as in kernels/attention.py
Attention = Callable[..., torch.Tensor]
# (gathered hidden states [R, hidden], their positions [R]) -> scratch (K, V) [R, KVH, D]
Reproject = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def hidden_io(triton: bool) -> tuple[Callable, Callable]:
    """(write_hidden, gather_hidden) of the kernel set: Triton on GPUs, torch on the CPU."""
    if triton:
        from llmdb.kernels.gpu import hidden_cache as io
    else:
        from llmdb.kernels import hidden_cache as io
    return io.write_hidden, io.gather_hidden


def mixed_attention(q: torch.Tensor, h: torch.Tensor, kv_layer: tuple[torch.Tensor, torch.Tensor],
                    batch: AttentionBatch, scale: float, attention: Attention,
                    hidden: HiddenBatch, store: torch.Tensor, reproject: Reproject,
                    triton: bool = False, *, window: int = 0, softcap: float = 0.0
                    ) -> torch.Tensor:
    """q [T, H, D], h [T, hidden] (this step's QKV-projection inputs) -> [T, H, D]. The
    KV-cache rows' K/V must already be in the cache. window and softcap: the layer's, for
    both attention calls."""
    write_hidden, gather_hidden = hidden_io(triton)
    nk = hidden.first_row
    write_hidden(store, h[nk:], hidden.new_rows)
    k, v = reproject(gather_hidden(store, hidden.context_rows), hidden.context_positions)
    k, v = hidden.scratch(k, kv_layer[0]), hidden.scratch(v, kv_layer[1])
    o_hidden = attention(q[nk:], k, v, hidden.attention, scale, window=window, softcap=softcap)
    if nk == 0:
        return o_hidden
    o_kv = attention(q[:nk], *kv_layer, batch, scale, window=window, softcap=softcap)
    return torch.cat([o_kv, o_hidden])
