"""The C++ row maximum (greedy ids) and RoPE + K/V cache write give torch's results to the bit:
torch's max(-1), and kernels/rope.rotate with index_copy_ into the caches."""

from __future__ import annotations

import pytest
import torch

from llmdb.engine import sampling
from llmdb.kernels import rope
from llmdb.kernels.cpu_ext import load_library, row_max

pytestmark = pytest.mark.skipif(load_library() is None,
                                reason="no C++ compiler: the torch paths run everywhere")

DTYPES = [torch.bfloat16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [49152, 1000, 15])  # a multiple of 16, a tail, no vector
def test_row_max_is_torchs(dtype, vocab):
    """Values and first ids of each row's maximum, with ties (the first one wins), a NaN
    (the first NaN wins), all -inf, +inf, and rows read through a stride."""
    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(40, vocab + 3, generator=g) * 5).to(dtype)[:, 2:-1]
    logits[1, [3, 9]] = 1e4  # tie: 3 wins
    logits[2, [vocab - 1, 4]] = 1e4
    logits[3, [vocab - 2, 7]] = float("nan")
    logits[4] = float("-inf")
    logits[5, 6] = float("inf")
    logits[6] = 0.0
    logits[6, 5] = -0.0
    logits[7] = logits[7].round()  # many ties in the row
    assert logits.stride(0) == vocab + 3
    top, ids = row_max(logits)
    want_top, want_ids = logits.max(-1)
    assert ids.tolist() == want_ids.tolist()
    assert torch.equal(top.isnan(), want_top.isnan())
    finite = ~top.isnan()
    assert torch.equal(top[finite], want_top.float()[finite])


def test_greedy_rows_take_the_cpp_maximum(monkeypatch):
    """sample() takes its greedy ids from row_max on the CPU, the same as torch's."""
    logits = (torch.randn(64, 4096, generator=torch.Generator().manual_seed(1)) * 3)
    logits = logits.to(torch.bfloat16)
    calls = []
    monkeypatch.setattr(sampling, "row_max", lambda x: calls.append(x.shape) or row_max(x))
    got = sampling.sample(logits, [], [], [])
    assert calls == [logits.shape]
    assert got.tolist() == logits.max(-1).indices.tolist()


def _reference(qkv, positions, table, slots, k_cache, v_cache, heads, kv_heads, written):
    """The torch ops the C++ pass replaces."""
    rows, dim = qkv.shape[0], k_cache.shape[-1]
    qk, v = qkv.split([(heads + kv_heads) * dim, kv_heads * dim], dim=-1)
    qk = qk.view(rows, heads + kv_heads, dim)
    if table is not None:
        qk = rope.rotate(qk, table[0][positions][:, None], table[1][positions][:, None])
    q, k = qk.split([heads, kv_heads], dim=1)
    k_cache.index_copy_(0, slots[:written], k[:written])
    v_cache.index_copy_(0, slots[:written], v.reshape(rows, kv_heads, dim)[:written])
    return q


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim,half", [
    (9, 3, 64, 32),    # SmolLM2: GQA, all of a head rotates
    (8, 2, 96, 32),    # partial rotary (Phi-4-mini's 3/4 of a head; here 2/3)
    (4, 4, 32, 16),    # MHA
    (6, 2, 64, None),  # a layer without RoPE (SmolLM3's NoPE layers)
])
@pytest.mark.parametrize("written", [37, 20])  # every row; the rest hidden-cache rows
def test_rope_and_kv_write_are_torchs(dtype, heads, kv_heads, dim, half, written):
    g = torch.Generator().manual_seed(heads * dim + written)
    rows, positions_in_table, num_slots = 37, 300, 200
    qkv = (torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=g) * 3).to(dtype)
    positions = torch.randint(0, positions_in_table, (rows,), generator=g)
    table = None if half is None else (torch.randn(positions_in_table, half, generator=g),
                                       torch.randn(positions_in_table, half, generator=g))
    slots = torch.randperm(num_slots, generator=g)[:rows]
    caches = [torch.randn(num_slots, kv_heads, dim, generator=g).to(dtype) for _ in "kv"]
    want_caches = [c.clone() for c in caches]
    q = rope.rotate_and_write_kv(qkv, positions, table, slots, *caches, heads, kv_heads,
                                 written)
    want = _reference(qkv, positions, table, slots, *want_caches, heads, kv_heads, written)
    assert q.shape == (rows, heads, dim)
    assert torch.equal(q, want)
    assert torch.equal(caches[0], want_caches[0]) and torch.equal(caches[1], want_caches[1])


def test_rope_falls_back_to_torch_off_the_fast_path():
    """fp16 (no C++ kernel) and a non-contiguous projection take the torch ops, same result."""
    g = torch.Generator().manual_seed(0)
    table = (torch.randn(50, 8, generator=g), torch.randn(50, 8, generator=g))
    positions, slots = torch.arange(10), torch.arange(10) * 2
    for dtype, wide in ((torch.float16, False), (torch.bfloat16, True)):
        qkv = torch.randn(10, (4 + 2 * 2) * 16 * (2 if wide else 1), generator=g).to(dtype)
        qkv = qkv[:, ::2] if wide else qkv
        caches = [torch.zeros(20, 2, 16, dtype=dtype) for _ in "kv"]
        want_caches = [c.clone() for c in caches]
        q = rope.rotate_and_write_kv(qkv, positions, table, slots, *caches, 4, 2, 10)
        want = _reference(qkv, positions, table, slots, *want_caches, 4, 2, 10)
        assert torch.equal(q, want)
        assert all(torch.equal(a, b) for a, b in zip(caches, want_caches, strict=True))
