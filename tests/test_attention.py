"""The fast paged-attention paths equal the reference (gather, then dense attention)."""

from __future__ import annotations

import random

import pytest
import torch

from llmdb.kernels import attention
from llmdb.kernels.attention import AttentionBatch, paged_attention, paged_attention_reference

BLOCK = 16


def _take_path(monkeypatch, cpp: bool, heads: int, kv_heads: int, dim: int) -> None:
    """paged_attention's C++ kernel (skipped where none can be built for the shape) or, with
    cpp False, its per-sequence SDPA path, as for shapes the kernel does not take."""
    if not cpp:
        monkeypatch.setattr(attention, "supports_shape", lambda *shape: False)
    elif not attention.supports_shape(heads, kv_heads, dim):
        pytest.skip("no C++ compiler")


def _random_batch(seed: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_blocks = 128
    k_cache = torch.randn(num_blocks * BLOCK, kv_heads, dim).to(dtype)
    v_cache = torch.randn(num_blocks * BLOCK, kv_heads, dim).to(dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)  # blocks of a sequence are scattered over the pool
    qlens, ctxs, tables = [], [], []
    for i in range(8):
        # Decodes, short chunks and long ones, in any order.
        qlen = 1 if i < 3 else rng.randint(2, 30) if i < 6 else rng.randint(40, 90)
        ctx = qlen + rng.randint(0, 60)
        need = -(-ctx // BLOCK)
        tables.append([free.pop() for _ in range(need)])
        qlens.append(qlen)
        ctxs.append(ctx)
    order = list(range(len(qlens)))
    rng.shuffle(order)
    qlens, ctxs, tables = ([xs[j] for j in order] for xs in (qlens, ctxs, tables))
    batch = AttentionBatch.build(qlens, ctxs, tables, BLOCK)
    q = torch.randn(sum(qlens), heads, dim).to(dtype)
    return q, k_cache, v_cache, batch


# Shapes the kernel compiles (query heads, K/V heads, head dim; csrc/row_attention.cpp's
# pick): SmolLM2, Llama-3.2-1B, Qwen2.5-0.5B, Phi-3, Llama-2-7B, Llama-3-8B, Qwen2.5-1.5B and
# -7B, Gemma 2, and groups of 1, 2, 5 and 8.
KERNEL_SHAPES = [(9, 3, 64), (8, 2, 64), (14, 2, 64), (4, 4, 96), (8, 8, 128), (32, 8, 128),
                 (12, 2, 128), (14, 2, 128), (8, 4, 256), (16, 2, 256), (4, 4, 64), (4, 2, 64),
                 (10, 2, 64), (16, 2, 64), (16, 2, 128)]


@pytest.mark.parametrize("heads,kv_heads,dim",
                         [*KERNEL_SHAPES, (4, 4, 32), (8, 1, 16), (6, 2, 40)])
@pytest.mark.parametrize("cpp", [True, False])
def test_fast_path_equals_reference_fp32(monkeypatch, heads, kv_heads, dim, cpp):
    _take_path(monkeypatch, cpp, heads, kv_heads, dim)
    for seed in range(3):
        q, k, v, batch = _random_batch(seed, heads, kv_heads, dim, torch.float32)
        ref = paged_attention_reference(q, k, v, batch, dim**-0.5)
        fast = paged_attention(q, k, v, batch, dim**-0.5)
        torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (32, 8, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_alone_equals_it_among_others(monkeypatch, heads, kv_heads, dim, dtype):
    """The C++ kernel computes each query row on its own: a decode, or one position of a
    prefill chunk, gives the same bits alone as among the step's other rows."""
    _take_path(monkeypatch, True, heads, kv_heads, dim)
    q, k, v, batch = _random_batch(4, heads, kv_heads, dim, dtype)
    together = paged_attention(q, k, v, batch, dim**-0.5)
    starts = batch.query_start_loc.tolist()
    for i in range(len(starts) - 1):
        ctx = int(batch.seq_lens[i])
        table = batch.block_tables[i].tolist()[: -(-ctx // BLOCK)]
        for row in sorted({starts[i], starts[i + 1] - 1}):
            row_ctx = ctx - (starts[i + 1] - 1 - row)  # causal: its own visible keys
            one = AttentionBatch.build([1], [row_ctx], [table], BLOCK)
            alone = paged_attention(q[row : row + 1], k, v, one, dim**-0.5)
            assert torch.equal(alone, together[row : row + 1]), (i, row)


def test_fast_path_close_to_reference_bf16():
    q, k, v, batch = _random_batch(7, 9, 3, 64, torch.bfloat16)
    ref = paged_attention_reference(q, k, v, batch, 0.125)
    fast = paged_attention(q, k, v, batch, 0.125)
    torch.testing.assert_close(fast.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_reference_equals_dense_causal_attention():
    """A single sequence laid out in scattered blocks is plain causal attention."""
    q, k, v, _ = _random_batch(3, 4, 2, 32, torch.float32)
    ctx = 37
    table = [5, 9, 2]
    batch = AttentionBatch.build([ctx], [ctx], [table], BLOCK)
    q = torch.randn(ctx, 4, 32)
    keys, values = k[batch.context_slots(0)], v[batch.context_slots(0)]
    dense = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), keys.repeat_interleave(2, 1).transpose(0, 1),
        values.repeat_interleave(2, 1).transpose(0, 1), is_causal=True,
    ).transpose(0, 1)
    torch.testing.assert_close(paged_attention_reference(q, k, v, batch, 32**-0.5), dense,
                               atol=1e-5, rtol=1e-5)


def test_shapes_beyond_the_kernel_take_the_sdpa_path():
    """Head dims or query groups larger than the kernel's stack arrays must not reach it."""
    assert not attention.supports_shape(32, 1, 64)  # a group of 32 query heads
    assert not attention.supports_shape(4, 4, 512)
    q, k, v, batch = _random_batch(5, 4, 4, 512, torch.float32)
    torch.testing.assert_close(paged_attention(q, k, v, batch, 512**-0.5),
                               paged_attention_reference(q, k, v, batch, 512**-0.5),
                               atol=1e-5, rtol=1e-5)


# ---- sliding windows and soft-capping ------------------------------------------------------


def _dense_windowed(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                    window: int, softcap: float) -> torch.Tensor:
    """One whole sequence, query by query: position p attends to keys[max(0, p - w + 1):p + 1]
    (all of keys[:p + 1] without a window) with a plain softmax. Heads already expanded."""
    out = torch.empty_like(q)
    for p in range(q.shape[0]):
        lo = max(0, p - window + 1) if window else 0
        s = torch.einsum("hd,khd->hk", q[p], keys[lo : p + 1]) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        out[p] = torch.einsum("hk,khd->hd", s.softmax(-1), values[lo : p + 1])
    return out


@pytest.mark.parametrize("window,softcap", [(0, 2.0), (1, 0.0), (6, 0.0), (6, 2.0), (37, 0.0)])
def test_reference_window_and_softcap_equal_dense_attention(window, softcap):
    ctx, table = 37, [5, 9, 2]
    torch.manual_seed(11)
    k, v = torch.randn(16 * BLOCK, 2, 32), torch.randn(16 * BLOCK, 2, 32)
    batch = AttentionBatch.build([ctx], [ctx], [table], BLOCK)
    q = torch.randn(ctx, 4, 32)
    slots = batch.context_slots(0)
    dense = _dense_windowed(q, k[slots].repeat_interleave(2, 1), v[slots].repeat_interleave(2, 1),
                            32**-0.5, window, softcap)
    got = paged_attention_reference(q, k, v, batch, 32**-0.5, window=window, softcap=softcap)
    torch.testing.assert_close(got, dense, atol=1e-5, rtol=1e-5)
    # The same sequence split into a prefix and a chunk over it: the chunk's rows agree.
    chunk = AttentionBatch.build([9], [ctx], [table], BLOCK)
    torch.testing.assert_close(
        paged_attention_reference(q[-9:], k, v, chunk, 32**-0.5, window=window,
                                  softcap=softcap), dense[-9:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("qlen,ctx,window", [(37, 37, 6), (9, 37, 6), (1, 37, 6), (8, 8, 1),
                                             (5, 20, 19), (5, 20, 20)])
def test_window_is_transformers_sliding_window(qlen, ctx, window):
    """The reference's mask is the one transformers builds for Mistral's layers and the local
    layers of Qwen2 and Gemma 2/3 (sliding_window_causal_mask_function), for a chunk of qlen
    queries after ctx - qlen cached keys. (llama.cpp's standard n_swa masks the same keys:
    p1 - p0 >= n_swa.)"""
    masking = pytest.importorskip("transformers.masking_utils")
    theirs = masking.sdpa_mask(
        batch_size=1, q_length=qlen, kv_length=ctx, q_offset=ctx - qlen,
        mask_function=masking.sliding_window_causal_mask_function(window),
        allow_is_causal_skip=False)[0, 0]
    assert torch.equal(attention._causal_mask(qlen, ctx, window=window), theirs)


# (query lengths, context lengths after the step) of a step; block size 16.
WINDOW_CASES = {
    # Decodes whose context ends on, and one past, a block edge.
    "decodes": ([1, 1, 1, 1], [16, 17, 32, 33]),
    # Whole prefills ending on and one past a block edge.
    "prefills": ([32, 33], [32, 33]),
    # Chunks over a cached prefix of 32: a short window starts inside the prefix.
    "chunks": ([5, 12, 20, 1], [37, 44, 52, 50]),
}
# 1; shorter than the contexts; one less than, equal to and longer than 32 and 33.
WINDOWS = [1, 6, 31, 32, 33]


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 32)])
@pytest.mark.parametrize("cpp", [True, False])
def test_fast_path_window_and_softcap_equal_reference(monkeypatch, heads, kv_heads, dim, cpp):
    _take_path(monkeypatch, cpp, heads, kv_heads, dim)
    cases = [_random_batch(0, heads, kv_heads, dim, torch.float32)]  # a mixed step
    for qlens, ctxs in WINDOW_CASES.values():
        q, k, v, _ = cases[0]
        tables = [list(range(j * 8, j * 8 + -(-c // BLOCK))) for j, c in enumerate(ctxs)]
        batch = AttentionBatch.build(qlens, ctxs, tables, BLOCK)
        cases.append((torch.randn(sum(qlens), heads, dim), k, v, batch))
    for window, softcap in [(w, 0.0) for w in WINDOWS] + [(0, 2.0), (6, 2.0)]:
        for q, k, v, batch in cases:
            ref = paged_attention_reference(q, k, v, batch, dim**-0.5, window=window,
                                            softcap=softcap)
            fast = paged_attention(q, k, v, batch, dim**-0.5, window=window, softcap=softcap)
            torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)


def test_fast_path_window_bf16_close_to_reference():
    q, k, v, batch = _random_batch(7, 9, 3, 64, torch.bfloat16)
    for window, softcap in [(5, 0.0), (5, 2.0)]:
        ref = paged_attention_reference(q, k, v, batch, 0.125, window=window, softcap=softcap)
        fast = paged_attention(q, k, v, batch, 0.125, window=window, softcap=softcap)
        torch.testing.assert_close(fast.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("cpp", [True, False])
def test_window_reads_no_key_before_it(monkeypatch, cpp):
    """A decode over 200 keys with a window of 20 reads the blocks of keys 180..199 only:
    poisoning every block before them with NaN changes nothing."""
    _take_path(monkeypatch, cpp, 4, 2, 32)
    torch.manual_seed(3)
    table = list(range(13))[::-1]
    batch = AttentionBatch.build([1, 4], [200, 200], [table, table], BLOCK)
    k, v = torch.randn(13 * BLOCK, 2, 32), torch.randn(13 * BLOCK, 2, 32)
    q = torch.randn(5, 4, 32)
    want = paged_attention_reference(q, k, v, batch, 32**-0.5, window=20)
    # The chunk's first query reaches back to key 177, in the block from 176 on.
    stale = batch.context_slots(0)[:176]
    k[stale], v[stale] = float("nan"), float("nan")
    got = paged_attention(q, k, v, batch, 32**-0.5, window=20)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
