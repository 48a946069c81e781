"""The sampler draws what sorting and hashing the whole vocabulary draws (the definition in
reference_draw), though on the CPU it sorts and hashes only the tokens in reach of winning."""

from __future__ import annotations

import pytest
import torch

from llmdb.engine import sampling
from llmdb.engine.params import SamplingParams
from llmdb.engine.sampling import gumbel_noise, row_key, sample


def reference_draw(logits: torch.Tensor, p: SamplingParams, key: int) -> int:
    """One row by the definition: the whole row scaled and sorted, top-k's ranks and top-p's
    smallest prefix kept (none dropped at top_p = 1), then the argmax of the kept scaled
    logits plus every token's noise."""
    scaled = (logits - logits.max()) / p.temperature
    vocab = scaled.shape[-1]
    sorted_logits, order = scaled.sort(descending=True)
    drop = torch.arange(vocab) >= (p.top_k or vocab)
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    if p.top_p < 1:
        drop |= probs.cumsum(-1) - probs >= p.top_p
    noise = gumbel_noise(torch.tensor([key]), vocab)[0][order]
    return int(order[(sorted_logits + noise).masked_fill(drop, float("-inf")).argmax()])


def _logits(rows: int, vocab: int, spread: float, seed: int) -> torch.Tensor:
    """Language-model-like rows: a few leading tokens over a long tail, rounded to bf16 (as a
    bf16 model's are: many exact ties)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * spread
    x[:, :8] += torch.rand(rows, 8, generator=g) * 4 * spread
    return x[:, torch.randperm(vocab, generator=g)].to(torch.bfloat16).float()


PARAMS = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.0),
          SamplingParams(temperature=1.5), SamplingParams(temperature=0.7, top_p=0.9),
          SamplingParams(temperature=1.0, top_p=0.5), SamplingParams(temperature=0.8, top_k=40),
          SamplingParams(temperature=1.2, top_k=300, top_p=0.95),
          SamplingParams(temperature=1e-3), SamplingParams(temperature=20.0)]


def _draw(logits: torch.Tensor, params: list[SamplingParams], keys: list[int]) -> list[int]:
    return sample(logits, list(range(len(params))), params, keys).tolist()


@pytest.mark.parametrize("spread", [1.0, 2.5, 6.0])
def test_each_draw_is_the_whole_vocabularys(spread):
    rows = 96
    logits = _logits(rows, 4096, spread, seed=int(spread * 10))
    params = [PARAMS[i % len(PARAMS)] for i in range(rows)]
    keys = [row_key(7, i) for i in range(rows)]
    got = _draw(logits, params, keys)
    want = [reference_draw(logits[i], params[i], keys[i]) for i in range(rows)]
    assert got == want


def test_a_row_draws_the_same_alone_and_in_any_batch():
    """The width sorted is the batch's largest reach; a row's draw must not depend on it."""
    logits = torch.cat([_logits(40, 4096, 1.0, seed=1), _logits(40, 4096, 6.0, seed=2)])
    params = [PARAMS[i % len(PARAMS)] for i in range(80)]
    keys = [row_key(3, i) for i in range(80)]
    together = _draw(logits, params, keys)
    alone = [_draw(logits[i:i + 1], params[i:i + 1], keys[i:i + 1])[0] for i in range(80)]
    assert together == alone


def test_the_whole_sort_draws_the_same(monkeypatch):
    """The path a GPU (or a flat row on the CPU) takes: every token sorted."""
    logits = _logits(64, 4096, 2.5, seed=5)
    params = [PARAMS[i % len(PARAMS)] for i in range(64)]
    keys = [row_key(11, i) for i in range(64)]
    pruned = _draw(logits, params, keys)
    monkeypatch.setattr(sampling, "_WHOLE_SORT_SHARE", 0.0)
    assert _draw(logits, params, keys) == pruned


def test_the_noise_is_finite():
    """The largest hash value once rounded its uniform to 1.0 in fp32: +inf noise, a token
    that won whatever its probability (about 3 rows of 400 at SmolLM2's vocabulary)."""
    keys = torch.arange(400)
    noise = gumbel_noise(keys, 49152)
    assert torch.isfinite(noise).all()
    assert float(noise.max()) <= sampling.G_MAX


@pytest.mark.parametrize("top_k", [0, 4000])
def test_top_p_weighs_the_tokens_out_of_reach_too(top_k):
    """Tokens too far down to win still hold probability that top-p's sums must count: two
    near-even leaders and 4,000 tokens 14.5 below, whose mass (2e-3) decides whether the
    second leader is kept, with a top_p between the two ways of summing."""
    row = torch.full((4096,), -14.5)
    row[17], row[901] = 0.0, -0.1
    share, share_of_leaders = float(row.softmax(-1)[17]), float(row[[17, 901]].softmax(-1)[0])
    top_p = (share + share_of_leaders) / 2  # over the leader's share: the second one is kept
    p = SamplingParams(temperature=1.0, top_p=top_p, top_k=top_k)
    keys = [row_key(5, i) for i in range(200)]
    got = [_draw(row[None, :], [p], [k])[0] for k in keys]
    assert got == [reference_draw(row, p, k) for k in keys]
    assert set(got) == {17, 901}
