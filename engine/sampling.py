"""The batched sampler, on whatever device the logits are (its parameters: params.py).

Every sampled row is drawn by the Gumbel-max trick, argmax(logits / T + g), with the noise g
a hash of (the request's seed, the index of the token being drawn, the token id) rather than
the state of a generator. So one request's draw depends on nothing else in its batch, a
preempted request draws the same tokens again, the whole batch is drawn with a few tensor
ops (no per-row generator, no host round trip), and the CPU and the GPU draw the same token
from the same logits. Top-k and top-p are masks on the sorted logits before the argmax.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from llmdb.kernels.transfer import to_device

if TYPE_CHECKING:
    from .params import SamplingParams

_MASK32 = 0xFFFFFFFF


def _mix32(x: int) -> int:
    """A 32-bit integer hash (the "lowbias32" finalizer), on the host."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def row_key(seed: int, index: int) -> int:
    """The noise key of a request's index-th generated token: 31 bits of a hash of both."""
    seed &= (1 << 64) - 1
    h = _mix32((seed & _MASK32) ^ _mix32((seed >> 32) ^ _mix32(index & _MASK32)))
    return h & 0x7FFFFFFF


def _mix_tensor(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit hash of int64 values < 2**32, elementwise. The multipliers stay below 2**31
    so that no int64 product overflows (signed overflow is not portable across devices)."""
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _MASK32
    return x ^ (x >> 16)


def gumbel_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, vocab] standard Gumbel noise, a pure function of each row's key and the token id."""
    ids = torch.arange(vocab, device=keys.device, dtype=torch.int64)
    h = _mix_tensor(keys[:, None] ^ _mix_tensor(ids)[None, :])
    u = ((h >> 8).to(torch.float32) + 0.5) * 2.0**-24  # 24 bits: uniform in (0, 1)
    return -torch.log(-torch.log(u))


def _sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                 top_k: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Tokens [N] for fp32 logits [N, V] with per-row temperature (> 0), top-p, top-k
    (0 = no limit) and noise keys."""
    # Shifted so that the top logit is 0 first: a tiny temperature then sends the others
    # to -inf, not every positive logit to +inf (a random draw among them, NaN probabilities).
    scaled = (logits - logits.max(-1, keepdim=True).values) / temperature[:, None]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    vocab = scaled.shape[-1]
    rank = torch.arange(vocab, device=scaled.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab)
    drop = rank >= k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    drop |= probs.cumsum(-1) - probs >= top_p[:, None]
    noise = gumbel_noise(keys, vocab).gather(1, order)  # tied to token ids, not ranks
    pick = (sorted_logits + noise).masked_fill(drop, float("-inf")).argmax(-1)
    return order.gather(1, pick[:, None])[:, 0]


def sample(logits: torch.Tensor, drawn: list[int], params: list[SamplingParams],
           keys: list[int]) -> torch.Tensor:
    """Tokens [N] (on logits' device) for rows of logits [N, vocab]: the argmax (greedy,
    exact in any dtype) except rows drawn[j], drawn with params[j] and noise key keys[j]
    (row_key)."""
    tokens = logits.max(-1).indices  # on the CPU 3x faster than argmax on bf16, same ids
    if not drawn:
        return tokens
    dev = logits.device
    idx = to_device(drawn, dev)
    picked = _sample_rows(
        logits.index_select(0, idx).float(),
        to_device([p.temperature for p in params], dev),
        to_device([p.top_p for p in params], dev),
        to_device([p.top_k for p in params], dev),
        to_device(keys, dev, torch.int64),
    )
    return tokens.index_copy(0, idx, picked)


def top_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: the chosen token's log-probability [N], and the k most likely tokens' values
    and ids [N, k] (raw model logits, fp32)."""
    lp = logits.float().log_softmax(-1)
    chosen = lp.gather(1, tokens[:, None])[:, 0]
    top = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    return chosen, top[0], top[1]
