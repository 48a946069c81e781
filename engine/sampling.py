"""The batched sampler, on whatever device the logits are (its parameters: params.py).

Every sampled row is drawn by the Gumbel-max trick, argmax(logits / T + g), with the noise g
a hash of (the request's seed, the index of the token being drawn, the token id) rather than
the state of a generator. So one request's draw depends on nothing else in its batch, a
preempted request draws the same tokens again, the whole batch is drawn with a few tensor
ops (no per-row generator, no host round trip), and the CPU and the GPU draw the same token
from the same logits (but for two scores within the last bit of each other, where their
logarithms round differently). Top-k and top-p are masks on the sorted logits before the argmax.
(On a GPU, top-p's cumulative sums by torch's scan round by the number of rows drawn together;
the engine's batch-invariant mode sums each row in one order: _cumsum.)

On the CPU only the tokens that can win are sorted and given noise, by
kernels/csrc/sampling.cpp in one pass over the logits (two with top-k), or in torch where no
C++ compiler is at hand. The noise is bounded (G_MAX below), so a token whose scaled logit is
more than G_MAX below the top token's score can never beat it; at T = 0.7 that leaves a
median of about 3,000 of SmolLM2's 49,152 tokens. Sorting and hashing the whole vocabulary
for every drawn row made a sampled job a fifth as fast as a greedy one there
(bench/RESULTS.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from llmdb.kernels.cpu_ext import gumbel_argmax, load_library, row_max
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


def gumbel_noise(keys: torch.Tensor, token_ids: torch.Tensor | int) -> torch.Tensor:
    """Standard Gumbel noise, a pure function of each row's key and the token id: [N, vocab]
    for token_ids = vocab (every id), else of the same shape as token_ids [N, W]."""
    if isinstance(token_ids, int):
        token_ids = torch.arange(token_ids, device=keys.device, dtype=torch.int64)[None, :]
    h = _mix_tensor(keys[:, None] ^ _mix_tensor(token_ids))
    u = ((h >> 8).to(torch.float32) + 0.5) * 2.0**-24  # 24 bits: uniform in (0, 1)
    # The top value, (2**24 - 0.5) / 2**24, rounds to 1.0 in fp32: noise +inf, a token that
    # won whatever its probability. It is taken as the fp32 below 1.
    u = u.clamp_(max=_U_MAX)
    return -torch.log(-torch.log(u))


_U_MAX = 1.0 - 2.0**-24  # the largest fp32 below 1
# The largest noise, as gumbel_noise computes it (about 15.94).
G_MAX = float(-torch.log(-torch.log(torch.tensor(_U_MAX))))
# Slack for the rounding of the scores compared with that bound: a token kept for nothing
# costs nothing, one left out could have won.
_BOUND_SLACK = 1e-3
# The torch path holds ~50 bytes per logit of the rows it draws at once (fp32 copies, the
# sort, the noise): on a GPU, where every row is sorted whole, 512 rows of a 262k vocabulary
# would take ~7 GB beside the KV pool. So it draws at most this many logits at a time (a
# row's draw does not depend on the rows beside it).
_DRAW_CHUNK = 1 << 24
# Past this share of the vocabulary in reach of winning (a high temperature, flat logits),
# the rows are sorted whole.
_WHOLE_SORT_SHARE = 0.25


def _sample_rows(logits: torch.Tensor, top: torch.Tensor, top_ids: torch.Tensor,
                 params: list[SamplingParams], keys: torch.Tensor, invariant: bool = False
                 ) -> torch.Tensor:
    """Tokens [N] for fp32 logits [N, V] (top: their row maxima, top_ids: its ids) drawn with
    params (temperature > 0) and noise keys: the argmax of the scaled logits plus noise over
    the tokens that top-k and top-p keep.

    On the CPU a row sorts and hashes only its top W tokens by logit: without top-k the
    tokens in reach of winning, those with a scaled logit of at least s0 - G_MAX, s0 being
    the top token's score (its noise: its scaled logit is 0); with top-k the tokens it keeps.
    Top-k and top-p keep either only tokens among the first, or all of them (a prefix of the
    sorted order), the top token included; the winner then scores at least s0, which no token
    out of reach can. So the top W hold the winner, and top-p's cumulative sums over them are
    those of the whole sort. Rows with most of the vocabulary in reach (a high temperature,
    flat logits) are sorted whole. (On a GPU every row is: the sort is cheap there, and
    counting the reach would cost a host sync.) invariant: as in `sample`."""
    vocab = logits.shape[-1]
    temperature = to_device([p.temperature for p in params], logits.device)
    # Shifted so that the top logit is 0 first: a tiny temperature then sends the others
    # to -inf, not every positive logit to +inf (a random draw among them, NaN probabilities).
    scaled = (logits - top[:, None]) / temperature[:, None]
    # A row whose maximum is not finite (a NaN, or an infinity: its scaled logits are NaN)
    # has no distribution to draw from: it gives greedy's token, as csrc/sampling.cpp does.
    broken = ~top.isfinite()
    if logits.device.type != "cpu":
        return torch.where(broken, top_ids, _draw(scaled, params, keys, vocab, invariant))
    least = gumbel_noise(keys, top_ids[:, None])[:, 0] - G_MAX - _BOUND_SLACK
    top_k = torch.tensor([p.top_k for p in params])
    if bool((top_k > 0).any()):  # (top-p weighs all that top-k keeps, in reach or not)
        k = top_k.clamp(1, vocab)
        kth = scaled.topk(int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])[:, 0]
        least = torch.where(top_k > 0, kth, least)
    # (at least 1: a broken row has none in reach, and a draw over no tokens fails)
    width = (scaled >= least[:, None]).sum(-1).clamp_(min=1)
    pruned = width <= vocab * _WHOLE_SORT_SHARE
    if bool(pruned.all()):
        return torch.where(broken, top_ids,
                           _draw(scaled, params, keys, int(width.max()), invariant))
    tokens = torch.empty(len(params), dtype=torch.int64)
    for rows in (pruned, ~pruned):
        r = rows.nonzero()[:, 0]
        if len(r):
            w = int(width[r].max()) if rows is pruned else vocab
            tokens[r] = _draw(scaled[r], [params[i] for i in r.tolist()], keys[r], w,
                              invariant)
    return torch.where(broken, top_ids, tokens)


def _draw(scaled: torch.Tensor, params: list[SamplingParams], keys: torch.Tensor,
          width: int, invariant: bool = False) -> torch.Tensor:
    """_sample_rows' draw from scaled logits [N, V] over each row's top `width` tokens.

    Equal logits are kept or dropped together: top-k keeps every token at least as large as
    the k-th largest, and top-p every token whose more likely tokens (strictly) hold less
    than top_p of the mass. Cutting through a run of equal values (common in bf16) would
    leave the draw to the order a sort gives them, which changes with the batch's width."""
    dev, vocab = scaled.device, scaled.shape[-1]
    top_p = to_device([p.top_p for p in params], dev)
    top_k = to_device([p.top_k for p in params], dev)
    vals, ids = scaled.topk(width, dim=-1)  # sorted, largest first
    k = torch.where(top_k > 0, top_k.clamp(max=width), width)
    drop = vals < vals.gather(1, (k - 1)[:, None])
    if any(p.top_p < 1.0 for p in params):
        # top-p's probabilities, over what top-k keeps (the whole row without it). A row's
        # mass is a cumulative sum, the same whatever the batch's width.
        exp = vals.exp().masked_fill(drop, 0.0)
        kept = (~drop).sum(-1)
        mass = _cumsum(exp, invariant).gather(1, (kept - 1)[:, None])[:, 0]
        if width < vocab and any(p.top_p < 1.0 and not p.top_k for p in params):
            # The whole row's, as a cumulative sum's last: one order a row. (torch's sum
            # splits a row alone between threads, and not a row among many: at 49,152
            # logits, 2 threads, half the rows' totals differed in the last bits.)
            mass = torch.where(top_k > 0, mass, scaled.exp().cumsum(-1)[:, -1])
        probs = exp / mass[:, None]
        before = _cumsum(probs, invariant) - probs
        # Each token's mass before it, that of its run of equal values' first token.
        rank = torch.arange(width, device=dev).expand_as(vals)
        starts = torch.ones_like(drop)
        starts[:, 1:] = vals[:, 1:] != vals[:, :-1]
        before = before.gather(1, torch.where(starts, rank, 0).cummax(-1).values)
        # The first run always stays (a top_p of 1e-46 is 0 in fp32); a top_p of 1 keeps
        # every token (its sums could round up to 1 before the last).
        drop |= (before >= top_p[:, None]) & (top_p < 1.0)[:, None] & (before > 0)
    noise = gumbel_noise(keys, ids)  # tied to token ids, not ranks
    pick = (vals + noise).masked_fill(drop, float("-inf")).argmax(-1)
    return ids.gather(1, pick[:, None])[:, 0]


def sample(logits: torch.Tensor, drawn: list[int], params: list[SamplingParams],
           keys: list[int], invariant: bool = False) -> torch.Tensor:
    """Tokens [N] (on logits' device) for rows of logits [N, vocab]: the argmax (greedy,
    exact in any dtype; the first of equal maxima whatever the reduction's shape) except rows
    drawn[j], drawn with params[j] and noise key keys[j] (row_key). invariant (the engine's
    batch-invariant mode): the torch path's cumulative sums (top-p) by a kernel whose bits
    for a row do not depend on how many rows are drawn with it (see _cumsum)."""
    cpp = _drawn_in_cpp(logits)
    # The rows' maxima and their first ids, as torch's max(-1) gives them (on the CPU 3x
    # faster than argmax on bf16; row_max about 10x faster again: 1.8 vs 20.8 ms for 400 rows).
    top, tokens = row_max(logits) if cpp else logits.max(-1)
    if not drawn:
        return tokens
    if cpp:  # csrc/sampling.cpp draws the torch path's token in one or two passes a row
        sub = logits if drawn == list(range(len(logits))) else logits[drawn]
        tokens[drawn] = gumbel_argmax(
            sub, top[drawn].float(), tokens[drawn],
            torch.tensor([p.temperature for p in params]),
            torch.tensor([p.top_p for p in params]),
            torch.tensor([p.top_k for p in params], dtype=torch.int64),
            torch.tensor(keys, dtype=torch.int64), G_MAX + _BOUND_SLACK, _U_MAX)
        return tokens
    chunk = max(1, _DRAW_CHUNK // logits.shape[-1])
    for s in range(0, len(drawn), chunk):
        idx = to_device(drawn[s : s + chunk], logits.device)
        picked = _sample_rows(logits.index_select(0, idx).float(),
                              top.index_select(0, idx).float(), tokens.index_select(0, idx),
                              params[s : s + chunk],
                              to_device(keys[s : s + chunk], logits.device, torch.int64),
                              invariant)
        tokens.index_copy_(0, idx, picked)
    return tokens


def _drawn_in_cpp(logits: torch.Tensor) -> bool:
    return (logits.device.type == "cpu" and logits.dtype in (torch.bfloat16, torch.float32)
            and logits.stride(-1) == 1 and load_library() is not None)


def _cumsum(x: torch.Tensor, invariant: bool) -> torch.Tensor:
    """Cumulative sums along the rows of x [N, W]. torch's CUDA scan sums a row in an order
    set by the number of rows (kernels/gpu/rowwise.py says how); the batch-invariant mode
    takes rowwise.cumsum, one order a row."""
    if invariant:
        from llmdb.kernels.gpu.rowwise import cumsum

        return cumsum(x)
    return x.cumsum(-1)


def log_softmax(logits: torch.Tensor, invariant: bool = False) -> torch.Tensor:
    """fp32 log-probabilities of each row of logits [N, vocab]. torch's CUDA kernel sums a
    row in an order set by its place in the batch where the vocabulary is not a multiple of
    4 (kernels/gpu/rowwise.py says how); invariant (the engine's batch-invariant mode) takes
    rowwise.log_softmax, one order a row."""
    if invariant:
        from llmdb.kernels.gpu.rowwise import log_softmax as rowwise_log_softmax

        return rowwise_log_softmax(logits)
    return logits.float().log_softmax(-1)


def top_logprobs(logits: torch.Tensor, tokens: torch.Tensor, ks: list[int],
                 invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: the chosen token's log-probability [N], and the ks[i] most likely tokens'
    values and ids, [N, max(ks)] (log_softmax of the raw model logits; a row's columns past
    its own ks[i] hold -inf and id 0). invariant: as in log_softmax.

    Each row's top tokens come from a topk of its own k: which of equal values a topk
    returns, and in which order, depends on k (on the CPU and the GPU alike), so a topk of
    the batch's largest k gave a request other ids among tied log-probabilities (common in
    bf16) beside one asking for more. On a GPU a topk of a given k picks and orders a row's
    values however many rows it runs over (the values above the k-th, then those equal to
    it, by index, whether one block or several take the row: TensorTopK.cu)."""
    lp = log_softmax(logits, invariant)
    chosen = lp.gather(1, tokens[:, None])[:, 0]
    width = max(ks, default=0)
    if set(ks) == {width}:  # (the common case: one k for every row)
        values, ids = lp.topk(width, dim=-1)
        return chosen, values, ids
    values = lp.new_full((len(ks), width), float("-inf"))
    ids = torch.zeros((len(ks), width), dtype=torch.int64, device=lp.device)
    for k in set(ks) - {0}:
        idx = to_device([i for i, want in enumerate(ks) if want == k], lp.device)
        top = lp.index_select(0, idx).topk(k, dim=-1)
        values[idx, :k], ids[idx, :k] = top.values, top.indices
    return chosen, values, ids
