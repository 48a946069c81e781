"""The sampler draws what sorting and hashing the whole vocabulary draws (the definition in
reference_draw), though on the CPU it sorts and hashes only the tokens in reach of winning."""

from __future__ import annotations

import pytest
import torch

from llmdb.engine import sampling
from llmdb.engine.params import SamplingParams
from llmdb.engine.sampling import gumbel_noise, row_key, sample


def reference_keep(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The tokens a row may draw, by the definition: top-k keeps each token with fewer than
    k tokens above it (strictly: equal logits stay or go together), top-p each token whose
    strictly more likely tokens hold less than top_p of what top-k kept (none dropped at
    top_p = 1)."""
    scaled = (logits - logits.max()) / p.temperature
    vocab = scaled.shape[-1]
    # [i]: the tokens strictly above token i
    above = vocab - torch.searchsorted(scaled.sort().values, scaled, side="right")
    keep = above < (p.top_k or vocab)
    if p.top_p < 1:
        probs = scaled.masked_fill(~keep, float("-inf")).softmax(-1)
        ascending = probs.sort().values
        mass_above = ascending.flip(0).cumsum(0)  # [j]: the j + 1 largest probabilities
        # The tokens strictly more likely than token i are the `n` largest.
        n = vocab - torch.searchsorted(ascending, probs, side="right")
        held = torch.where(n > 0, mass_above[(n - 1).clamp(min=0)], 0.0)
        keep &= held < p.top_p
    return keep


def reference_draw(logits: torch.Tensor, p: SamplingParams, key: int,
                   keep: torch.Tensor | None = None) -> int:
    """The argmax of the kept scaled logits plus every token's noise."""
    keep = reference_keep(logits, p) if keep is None else keep
    scaled = (logits - logits.max()) / p.temperature
    noise = gumbel_noise(torch.tensor([key]), scaled.shape[-1])[0]
    return int((scaled + noise).masked_fill(~keep, float("-inf")).argmax())


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


@pytest.fixture(params=["cpp", "torch"])
def path(request, monkeypatch):
    """Each draw through csrc/sampling.cpp and through the torch path (a machine without a
    C++ compiler, or a GPU's)."""
    if request.param == "torch":
        monkeypatch.setattr(sampling, "load_library", lambda: None)
    elif sampling.load_library() is None:
        pytest.skip("no C++ compiler: the torch path draws every row")
    return request.param


@pytest.mark.parametrize("spread", [1.0, 2.5, 6.0])
def test_each_draw_is_the_whole_vocabularys(spread, path):
    rows = 96
    logits = _logits(rows, 4096, spread, seed=int(spread * 10))
    params = [PARAMS[i % len(PARAMS)] for i in range(rows)]
    keys = [row_key(7, i) for i in range(rows)]
    got = _draw(logits, params, keys)
    want = [reference_draw(logits[i], params[i], keys[i]) for i in range(rows)]
    assert got == want


def test_a_row_draws_the_same_alone_and_in_any_batch(path):
    """The width sorted is the batch's largest reach; a row's draw must not depend on it."""
    logits = torch.cat([_logits(40, 4096, 1.0, seed=1), _logits(40, 4096, 6.0, seed=2)])
    params = [PARAMS[i % len(PARAMS)] for i in range(80)]
    keys = [row_key(3, i) for i in range(80)]
    together = _draw(logits, params, keys)
    alone = [_draw(logits[i:i + 1], params[i:i + 1], keys[i:i + 1])[0] for i in range(80)]
    assert together == alone


def test_the_whole_sort_draws_the_same(monkeypatch):
    """The path a GPU (or a flat row on the CPU without C++) takes: every token sorted."""
    monkeypatch.setattr(sampling, "load_library", lambda: None)
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
def test_top_p_weighs_the_tokens_out_of_reach_too(top_k, path):
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
    keep = reference_keep(row, p)
    assert got == [reference_draw(row, p, k, keep) for k in keys]
    assert set(got) == {17, 901}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_are_drawn_in_cpp_as_in_torch(dtype, monkeypatch):
    """On the CPU csrc/sampling.cpp draws every sampled row (one pass; few tokens hashed, or
    with top-p those in reach sorted; top-k a pass more): the same tokens as the torch path,
    for rows of a batch drawn or not."""
    if sampling.load_library() is None:
        pytest.skip("no C++ compiler: the torch path draws every row")
    logits = torch.cat([_logits(48, 4096, 1.0, seed=8), _logits(48, 4096, 6.0, seed=9)])
    logits = logits.to(dtype)
    temps = [1e-3, 0.3, 0.7, 1.0, 1.5, 20.0]
    drawn = [i for i in range(96) if i % 5]  # every fifth row greedy
    params = [SamplingParams(temperature=temps[i % 6], top_p=(0.9, 1.0, 0.5)[i % 3],
                             top_k=(0, 40, 1, 4095, 4096, 9000, 2)[i % 7]) for i in drawn]
    keys = [row_key(13, i) for i in drawn]
    calls = []
    cpp = sampling.gumbel_argmax
    monkeypatch.setattr(sampling, "gumbel_argmax",
                        lambda logits, *a: calls.append(len(logits)) or cpp(logits, *a))
    got = sample(logits, drawn, params, keys)
    assert calls == [len(drawn)]
    monkeypatch.setattr(sampling, "load_library", lambda: None)
    assert got.tolist() == sample(logits, drawn, params, keys).tolist()
    every = list(range(96))
    params = [SamplingParams(temperature=temps[i % 6], top_p=(1.0, 0.8)[i % 2],
                             top_k=(0, 0, 50)[i % 3]) for i in every]
    keys = [row_key(17, i) for i in every]
    want = sample(logits, every, params, keys)
    monkeypatch.undo()
    assert sample(logits, every, params, keys).tolist() == want.tolist()


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.65)])
def test_equal_logits_at_the_cut_are_kept_together(top_k, top_p, path):
    """A leader, then ten equal logits that top-k's (or top-p's) cut falls inside: all ten
    are kept, whatever order a sort puts them in (which changes with the batch's width)."""
    row = torch.full((4096,), -30.0)
    tied = torch.arange(100, 1100, 100)
    row[7], row[tied] = 1.6, 0.0  # the leader's share 0.33, each tied token's 0.067
    p = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p)
    keys = [row_key(9, i) for i in range(400)]
    got = [_draw(row[None, :], [p], [k])[0] for k in keys]
    keep = reference_keep(row, p)
    assert got == [reference_draw(row, p, k, keep) for k in keys]
    assert set(got) == {7, *tied.tolist()}


@pytest.mark.parametrize("cpp", [True, False])
def test_vanishing_temperature_and_top_p(cpp, monkeypatch):
    """Values that are 0 in fp32: a temperature is greedy (0/0 made the top token's score
    NaN), a top_p keeps the most likely tokens (torch's path dropped every token and failed
    the whole step)."""
    if not cpp:
        monkeypatch.setattr(sampling, "load_library", lambda: None)
    p = SamplingParams(temperature=1e-46)
    p.validate()
    assert p.temperature == 0.0 and p.greedy
    row = _logits(1, 4096, 2.5, seed=3)
    row[:, [5, 900, 2000]] = row.max() + 1  # three equal leaders
    p = SamplingParams(temperature=1.0, top_p=1e-46)
    p.validate()
    assert {_draw(row, [p], [row_key(1, i)])[0] for i in range(60)} == {5, 900, 2000}


def test_rows_are_drawn_in_chunks_of_bounded_memory(monkeypatch):
    """The torch path draws at most _DRAW_CHUNK logits at a time, with the same tokens."""
    monkeypatch.setattr(sampling, "load_library", lambda: None)  # every row through torch
    logits = _logits(40, 4096, 2.5, seed=21)
    drawn = [i for i in range(40) if i % 4]
    params = [PARAMS[i % len(PARAMS)] for i in drawn]
    keys = [row_key(5, i) for i in drawn]
    whole = sample(logits, drawn, params, keys).tolist()
    sizes = []
    real = sampling._sample_rows
    monkeypatch.setattr(sampling, "_sample_rows",
                        lambda lg, *a: sizes.append(len(lg)) or real(lg, *a))
    monkeypatch.setattr(sampling, "_DRAW_CHUNK", 7 * 4096 + 100)
    assert sample(logits, drawn, params, keys).tolist() == whole
    assert sizes == [7, 7, 7, 7, 2]


@pytest.mark.parametrize("whole_sort", [False, True])
def test_a_row_without_a_finite_maximum_gives_greedys_token(whole_sort, path, monkeypatch):
    """Rows whose maximum is NaN or an infinity (their scaled logits are NaN) have nothing to
    draw from: each gives greedy's token (its first NaN, its first maximum), beside rows
    drawn as they are alone. The torch path drew token 0 for a NaN row, and failed the whole
    step (an index of -1) when such rows were all its pruned draw held."""
    if whole_sort:  # (the GPU's path: every row sorted whole)
        monkeypatch.setattr(sampling, "_WHOLE_SORT_SHARE", 0.0)
    logits = _logits(8, 4096, 2.5, seed=8)
    logits[1, 300] = float("nan")
    logits[2] = float("nan")
    logits[3] = float("-inf")
    logits[4, 17] = float("inf")
    logits[5] = float("inf")
    logits[6] *= 30  # flat after scaling: sorted whole
    greedy = logits.max(-1).indices.tolist()
    assert greedy[1:6] == [300, 0, 0, 17, 0]
    for top_k in (0, 1, 3):
        params = [SamplingParams(temperature=20.0 if i == 6 else 0.7, top_k=top_k,
                                 top_p=0.9 if i % 2 else 1.0) for i in range(8)]
        keys = [row_key(4, i) for i in range(8)]
        got = _draw(logits, params, keys)
        assert got[1:6] == greedy[1:6]
        alone = [_draw(logits[i:i + 1], params[i:i + 1], keys[i:i + 1])[0] for i in (0, 6, 7)]
        assert [got[0], got[6], got[7]] == alone


def test_a_top_p_draw_at_49k_vocabulary_does_not_depend_on_the_batch(monkeypatch):
    """The torch path's total of a row's probabilities, where only the tokens in reach are
    sorted: torch's sum over 49,152 logits with 2 threads splits a row alone between them,
    and not a row of a batch, and the totals differed in the last bits (for half of 256
    random rows). Here one row, a leader and a second token out-drawing it (this key), over
    a tail out of reach; top_p swept over the 64 fp32 values around the leader's share, which
    is where the cut between keeping the second token and dropping it falls. Drawn alone and
    as 64 rows (one a top_p) the draws must be the same, bit for bit."""
    monkeypatch.setattr(sampling, "load_library", lambda: None)  # the torch path
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        vocab, leader, second = 49_152, 17, 901
        g = torch.Generator().manual_seed(0)
        row = -20.0 + torch.randn(vocab, generator=g)  # (out of reach: mass 1e-4 in all)
        row[leader], row[second] = 0.0, -0.1
        # A key whose noise draws the second token where both are kept.
        key = next(k for k in (row_key(2, i) for i in range(100))
                   if reference_draw(row, SamplingParams(temperature=1.0), k,
                                     keep=torch.isin(torch.arange(vocab),
                                                     torch.tensor([leader, second]))) == second)
        share = torch.tensor(1.0) / row.exp().sum()
        top_ps = [share]
        for _ in range(32):
            top_ps = [torch.nextafter(top_ps[0], torch.tensor(0.0)), *top_ps,
                      torch.nextafter(top_ps[-1], torch.tensor(1.0))]
        params = [SamplingParams(temperature=1.0, top_p=float(p)) for p in top_ps[:64]]
        batch = _draw(row.expand(64, vocab).contiguous(), params, [key] * 64)
        alone = [_draw(row[None, :], [p], [key])[0] for p in params]
    finally:
        torch.set_num_threads(threads)
    assert batch == alone
    assert set(alone) == {leader, second}  # (the sweep crosses the cut)
