"""The fast paged-attention paths equal the reference (gather, then dense attention)."""

from __future__ import annotations

import random

import pytest
import torch

from llmdb.kernels import attention
from llmdb.kernels.attention import AttentionBatch, paged_attention, paged_attention_reference

BLOCK = 16


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


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 32), (8, 1, 16)])
@pytest.mark.parametrize("cpp", [True, False])
def test_fast_path_equals_reference_fp32(monkeypatch, heads, kv_heads, dim, cpp):
    if not cpp:
        monkeypatch.setattr(attention, "supports_shape", lambda *shape: False)
    elif not attention.supports_shape(heads, kv_heads, dim):
        pytest.skip("no C++ compiler")
    for seed in range(3):
        q, k, v, batch = _random_batch(seed, heads, kv_heads, dim, torch.float32)
        ref = paged_attention_reference(q, k, v, batch, dim**-0.5)
        fast = paged_attention(q, k, v, batch, dim**-0.5)
        torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)


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
