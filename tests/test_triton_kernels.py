"""The Triton kernels of the GPU path (kernels/gpu) equal their torch references.

Without a GPU they run under TRITON_INTERPRET=1 (set in conftest.py) on CPU tensors in fp32,
since the interpreter has no bf16 arithmetic; shapes are small because it is slow. With a GPU
they run compiled on it, in fp32 and in bf16 with looser tolerances.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the GPU kernels are not tested")

from llmdb.kernels.attention import AttentionBatch, paged_attention_reference  # noqa: E402
from llmdb.kernels.elementwise import (  # noqa: E402
    gelu_tanh_mul_reference,
    rms_norm_fp32,
    rms_norm_reference,
    silu_mul_reference,
)
from llmdb.kernels.gpu import attention as gpu_attention  # noqa: E402
from llmdb.kernels.gpu.cache_write import (  # noqa: E402
    rope_and_write_kv,
    rope_and_write_kv_reference,
)
from llmdb.kernels.gpu.norm import add_rms_norm, gelu_tanh_mul, rms_norm, silu_mul  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not 1 (conftest.py sets it before any kernel "
                "is defined; run through pytest)", allow_module_level=True)

# The interpreter has no bf16 arithmetic: bf16 runs only compiled, on a GPU.
DTYPES = [torch.float32, torch.bfloat16] if CUDA else [torch.float32]
BLOCK = 16


def _tol(dtype: torch.dtype) -> dict:
    return {"atol": 2e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


def _batch(query_lens: list[int], context_lens: list[int], seed: int,
           num_blocks: int = 64) -> AttentionBatch:
    """Sequences whose blocks are scattered over the pool in random order."""
    pool = list(range(num_blocks))
    random.Random(seed).shuffle(pool)
    tables = [[pool.pop() for _ in range(-(-ctx // BLOCK))] for ctx in context_lens]
    return AttentionBatch.build(query_lens, context_lens, tables, BLOCK, DEVICE)


def _with_padding(batch: AttentionBatch, num_pad: int) -> AttentionBatch:
    """Append num_pad padding sequences: one query row each, no keys, slot -1."""
    dev = batch.seq_lens.device
    end = int(batch.query_start_loc[-1])
    loc = torch.cat([batch.query_start_loc,
                     torch.arange(end + 1, end + num_pad + 1, dtype=torch.int32, device=dev)])
    tables = torch.cat([batch.block_tables, torch.zeros(num_pad, batch.block_tables.shape[1],
                                                        dtype=torch.int32, device=dev)])
    return AttentionBatch(
        query_start_loc=loc,
        seq_lens=torch.cat([batch.seq_lens, torch.zeros(num_pad, dtype=torch.int32, device=dev)]),
        block_tables=tables,
        slot_mapping=torch.cat([batch.slot_mapping,
                                torch.full((num_pad,), -1, dtype=torch.long, device=dev)]),
        block_size=batch.block_size,
        max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len,
    )


def _qkv_cache(batch: AttentionBatch, heads: int, kv_heads: int, dim: int, dtype: torch.dtype,
               seed: int, num_blocks: int = 64):
    g = torch.Generator().manual_seed(seed)
    t = int(batch.query_start_loc[-1])
    q = torch.randn(t, heads, dim, generator=g).to(DEVICE, dtype)
    kc = torch.randn(num_blocks * BLOCK, kv_heads, dim, generator=g).to(DEVICE, dtype)
    vc = torch.randn(num_blocks * BLOCK, kv_heads, dim, generator=g).to(DEVICE, dtype)
    return q, kc, vc


def _check_attention(batch: AttentionBatch, heads: int, kv_heads: int, dim: int,
                     dtype: torch.dtype, seed: int, num_splits: int = 1, **attn_args
                     ) -> torch.Tensor:
    """attn_args: window= and softcap=, for both."""
    q, kc, vc = _qkv_cache(batch, heads, kv_heads, dim, dtype, seed)
    scale = dim**-0.5
    ref = paged_attention_reference(q, kc, vc, batch, scale, **attn_args)
    out = gpu_attention.paged_attention(q, kc, vc, batch, scale, num_splits=num_splits,
                                        **attn_args)
    assert out.dtype == dtype and out.shape == q.shape and out.is_contiguous()
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), **_tol(dtype))
    return out


# Query lengths and context lengths (after the step) of the attention cases.
CASES = {
    # Full prefills and decodes whose context ends exactly on, and one past, a block edge.
    "block_edges": ([16, 17, 32, 1, 1, 33], [16, 17, 32, 16, 17, 33]),
    # Prefill chunks over cached prefixes (prefix 32, 65, 32, 15).
    "prefix_chunks": ([20, 5, 16, 1], [52, 70, 48, 16]),
}
HEAD_SHAPES = [(9, 3, 64), (8, 2, 32), (4, 4, 32)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim", HEAD_SHAPES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_attention_equals_reference(case, heads, kv_heads, dim, dtype):
    query_lens, context_lens = CASES[case]
    _check_attention(_batch(query_lens, context_lens, seed=1), heads, kv_heads, dim, dtype,
                     seed=2)


def _mixed_lens(seed: int) -> tuple[list[int], list[int]]:
    """A mixed step, sequences in random order: decodes, whole prefills, chunks over prefixes."""
    rng = random.Random(seed)
    seqs = [(1, rng.randint(1, 70)) for _ in range(4)]
    seqs += [(n, n) for n in (rng.randint(2, 40), 1)]
    seqs += [(q, q + rng.randint(1, 40)) for q in (rng.randint(2, 24), rng.randint(2, 24))]
    rng.shuffle(seqs)
    return [q for q, _ in seqs], [c for _, c in seqs]


@pytest.mark.parametrize("dtype", DTYPES)
# Also groups of 16 and 32 (one query token per 16-row decode tile, a 32-row tile), and
# heads of 256 (Gemma 2 2B's 8 and 4 heads, Gemma 3 1B's 4 and 1).
@pytest.mark.parametrize("heads,kv_heads,dim", HEAD_SHAPES + [(16, 1, 16), (32, 1, 16),
                                                             (8, 4, 256), (4, 1, 256)])
def test_attention_mixed_step(heads, kv_heads, dim, dtype):
    query_lens, context_lens = _mixed_lens(seed=heads)
    _check_attention(_batch(query_lens, context_lens, seed=3), heads, kv_heads, dim, dtype,
                     seed=4)


@pytest.mark.parametrize("num_splits", [2, 3])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 32)])
def test_split_kv_equals_one_split(heads, kv_heads, dim, num_splits):
    # Long decodes (the case splits are for), a short one with fewer tiles than splits, and a
    # prefill chunk over a prefix.
    batch = _batch([1, 1, 1, 12], [70, 65, 9, 50], seed=5)
    for dtype in DTYPES:
        split = _check_attention(batch, heads, kv_heads, dim, dtype, seed=6,
                                 num_splits=num_splits)
        whole = _check_attention(batch, heads, kv_heads, dim, dtype, seed=6)
        torch.testing.assert_close(split.float(), whole.float(), **_tol(dtype))


@pytest.mark.parametrize("num_splits", [1, 2])
def test_padding_and_empty_rows_give_zeros(num_splits):
    """Padding sequences (no keys), a sequence with no queries this step, and rows past the
    last sequence (a CUDA graph's padding) all come out as zeros, written into `out`."""
    heads, kv_heads, dim = 9, 3, 64
    real = _batch([3, 0, 1], [20, 17, 40], seed=7)
    batch = _with_padding(real, 2)
    q, kc, vc = _qkv_cache(batch, heads, kv_heads, dim, torch.float32, seed=8)
    q = torch.cat([q, torch.randn(3, heads, dim).to(DEVICE)])  # 3 rows past the last sequence
    k_before, v_before = kc.clone(), vc.clone()
    out = torch.full_like(q, float("nan"))
    res = gpu_attention.paged_attention(q, kc, vc, batch, dim**-0.5, out=out,
                                        num_splits=num_splits)
    assert res is out
    assert not out.isnan().any()
    assert (out[4:] == 0).all()
    torch.testing.assert_close(out, paged_attention_reference(q, kc, vc, batch, dim**-0.5),
                               **_tol(torch.float32))
    assert torch.equal(kc, k_before) and torch.equal(vc, v_before)


def test_attention_reads_strided_queries():
    """q as a view into a wider buffer (a fused projection's Q part) needs no copy."""
    heads, kv_heads, dim = 8, 2, 32
    batch = _batch([5, 1], [21, 33], seed=9)
    q, kc, vc = _qkv_cache(batch, heads, kv_heads, dim, torch.float32, seed=10)
    wide = torch.randn(q.shape[0], heads + 2 * kv_heads, dim, device=DEVICE)
    wide[:, :heads] = q
    out = gpu_attention.paged_attention(wide[:, :heads], kc, vc, batch, dim**-0.5)
    torch.testing.assert_close(out, paged_attention_reference(q, kc, vc, batch, dim**-0.5),
                               **_tol(torch.float32))


# Windows of 1, shorter than the contexts, one less than, equal to and one more than 32 and
# 33 (in CASES: contexts ending on and one past a block edge, and chunks over prefixes whose
# short windows start inside the prefix).
WINDOWS = [1, 6, 31, 32, 33]


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 32)])
@pytest.mark.parametrize("case", sorted(CASES))
def test_attention_window_equals_reference(case, heads, kv_heads, dim):
    query_lens, context_lens = CASES[case]
    batch = _batch(query_lens, context_lens, seed=1)
    for window in WINDOWS:
        for dtype in DTYPES:
            _check_attention(batch, heads, kv_heads, dim, dtype, seed=window, window=window)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window,softcap", [(0, 2.0), (5, 2.0), (5, 0.0)])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 32)])
def test_attention_mixed_step_window_and_softcap(heads, kv_heads, dim, window, softcap, dtype):
    query_lens, context_lens = _mixed_lens(seed=heads)
    _check_attention(_batch(query_lens, context_lens, seed=3), heads, kv_heads, dim, dtype,
                     seed=4, window=window, softcap=softcap)


@pytest.mark.parametrize("num_splits", [2, 3])
def test_split_kv_with_window(num_splits):
    """Splits share the window's key tiles only: a decode over 70 keys with a window of 6 has
    one 64-key tile left, so the other splits are empty and merge with weight 0; splitting
    changes nothing, and neither do NaNs in the blocks of every tile before the window's."""
    heads, kv_heads, dim = 9, 3, 64
    batch = _batch([1, 1, 1, 12], [70, 200, 9, 150], seed=5, num_blocks=64)
    # (With the window of 7 the decode over 70 keys starts at key 63, a tile's last.)
    for window, softcap in [(6, 0.0), (7, 0.0), (40, 0.0), (6, 2.0)]:
        attn_args = {"window": window, "softcap": softcap}
        split = _check_attention(batch, heads, kv_heads, dim, torch.float32, seed=6,
                                 num_splits=num_splits, **attn_args)
        whole = _check_attention(batch, heads, kv_heads, dim, torch.float32, seed=6, **attn_args)
        torch.testing.assert_close(split, whole, **_tol(torch.float32))
        # Poison the keys of every tile before the one where a sequence's first query's
        # window starts (for the decode over 200 keys: 192 of them with the window of 6).
        q, kc, vc = _qkv_cache(batch, heads, kv_heads, dim, torch.float32, seed=6)
        tile = gpu_attention._launch_config(heads // kv_heads, batch.max_query_len, dim, 4)[1]
        _, qlens, ctxs = batch.host()
        for i, (qlen, ctx) in enumerate(zip(qlens, ctxs, strict=True)):
            first_key = max(0, ctx - qlen - window + 1)
            stale = batch.context_slots(i)[: first_key // tile * tile]
            kc[stale], vc[stale] = float("nan"), float("nan")
        out = gpu_attention.paged_attention(q, kc, vc, batch, dim**-0.5,
                                            num_splits=num_splits, **attn_args)
        torch.testing.assert_close(out, whole, **_tol(torch.float32))


def test_choose_num_splits():
    choose = gpu_attention.choose_num_splits
    assert choose(num_seqs=256, kv_heads=8, max_seq_len=4096, num_sms=132) == 1  # full grid
    assert choose(num_seqs=4, kv_heads=3, max_seq_len=200, num_sms=132) == 1  # short contexts
    s = choose(num_seqs=8, kv_heads=3, max_seq_len=8192, num_sms=132)
    assert 2 <= s <= 16 and 8 * 3 * s >= 2 * 132  # enough programs for two per SM
    assert choose(num_seqs=1, kv_heads=1, max_seq_len=512, num_sms=132) == 4  # 128 keys each
    assert choose(num_seqs=1, kv_heads=1, max_seq_len=1 << 20, num_sms=132) == 16  # the cap
    assert choose(num_seqs=0, kv_heads=8, max_seq_len=0, num_sms=132) == 1


def _cos_sin(max_pos: int, dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2).double() / dim))
    angles = torch.arange(max_pos).double()[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=1).float().to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rope,norm", [(True, None), (False, None), (True, "qwen3"),
                                       (True, "gemma")])
@pytest.mark.parametrize("heads,kv_heads,dim,rotary", [
    (9, 3, 64, 64), (4, 2, 32, 32), (0, 2, 32, 32), (3, 1, 128, 96), (0, 2, 32, 24)])
def test_rope_and_write_kv_equals_reference(heads, kv_heads, dim, rotary, rope, norm, dtype):
    """heads 0: K/V alone (the hidden cache's re-projection); norm: a per-head Q/K RMSNorm
    before RoPE, fused: Qwen3's (weights in the model's dtype), Gemma 3's (fp32 scales);
    rotary < dim: only the first `rotary` dimensions of a head rotate (Phi-4-mini's 96 of
    128)."""
    g = torch.Generator().manual_seed(heads + dim)
    t, slots = 7, 8 * BLOCK
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, generator=g).to(DEVICE, dtype)
    positions = torch.tensor([0, 5, 17, 63, 1, 0, 40], device=DEVICE)
    slot_mapping = torch.tensor([3, 17, -1, 100, 64, -1, 127], device=DEVICE)
    cos_sin = _cos_sin(64, rotary) if rope else None
    kc = torch.randn(slots, kv_heads, dim, generator=g).to(DEVICE, dtype)
    vc = torch.randn(slots, kv_heads, dim, generator=g).to(DEVICE, dtype)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    args = (positions, cos_sin, slot_mapping)
    norm_args = {}
    if norm:
        weights = (1.0 + 0.3 * torch.randn(2, dim, generator=g)).to(DEVICE)
        if norm == "qwen3":
            weights = weights.to(dtype)
        norm_args = {"qk_norm": (weights[0] if heads else None, weights[1]), "eps": 1e-6,
                     "fp32_scale": norm == "gemma"}
    q = rope_and_write_kv(qkv, *args, kc, vc, heads, kv_heads, dim, **norm_args)
    q_ref = rope_and_write_kv_reference(qkv, *args, kc_ref, vc_ref, heads, kv_heads, dim,
                                        **norm_args)
    assert q.shape == (t, heads, dim) and q.dtype == dtype and q.is_contiguous()
    # fp32 math in another order: equal up to one rounding of the dtype.
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(q, q_ref, **tol)
    torch.testing.assert_close(kc, kc_ref, **tol)
    assert torch.equal(vc, vc_ref)  # V is copied as is; untouched slots stay as they were
    if not rope:
        assert torch.equal(q.flatten(1), qkv[:, : heads * dim])
    elif rotary < dim and not norm:  # the dimensions past `rotary` pass as they are
        assert torch.equal(q[..., rotary:], qkv[:, : heads * dim].view(t, heads, dim)[..., rotary:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_write_then_attention_with_padding(dtype):
    """A step as the GPU runner would run it: write this step's K/V, then attend; padding rows
    (slot -1, no keys) leave the cache as it was and attend to nothing."""
    heads, kv_heads, dim = 9, 3, 64
    real = _batch([6, 1, 1], [22, 17, 30], seed=11)
    batch = _with_padding(real, 2)
    t = int(batch.query_start_loc[-1])
    g = torch.Generator().manual_seed(12)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, generator=g).to(DEVICE, dtype)
    positions = torch.cat([torch.arange(16, 22), torch.tensor([16, 29, 0, 0])]).to(DEVICE)
    kc = torch.randn(64 * BLOCK, kv_heads, dim, generator=g).to(DEVICE, dtype)
    vc = torch.randn(64 * BLOCK, kv_heads, dim, generator=g).to(DEVICE, dtype)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    before = kc.clone()
    args = (positions, _cos_sin(64, dim), batch.slot_mapping)
    q = rope_and_write_kv(qkv, *args, kc, vc, heads, kv_heads, dim)
    q_ref = rope_and_write_kv_reference(qkv, *args, kc_ref, vc_ref, heads, kv_heads, dim)
    written = torch.zeros(kc.shape[0], dtype=torch.bool, device=DEVICE)
    written[real.slot_mapping] = True
    assert torch.equal(kc[~written], before[~written])
    out = gpu_attention.paged_attention(q, kc, vc, batch, dim**-0.5)
    ref = paged_attention_reference(q_ref, kc_ref, vc_ref, batch, dim**-0.5)
    torch.testing.assert_close(out.float(), ref.float(), **_tol(dtype))
    assert (out[-2:] == 0).all()


def _norm_tol(dtype: torch.dtype) -> dict:
    # bf16: results may differ by one rounding (fp32 sums in another order).
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-6,
                                                                         "rtol": 2**-7}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 576), (5, 100), (2, 3, 64)])
def test_rms_norm_equals_reference(shape, dtype):
    g = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(*shape, generator=g) * 3).to(DEVICE, dtype)
    w = (1 + torch.randn(shape[-1], generator=g) * 0.1).to(DEVICE, dtype)
    out = rms_norm(x, w, 1e-5)
    ref = rms_norm_reference(x, w, 1e-5)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, **_norm_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 576), (5, 100), (2, 3, 64)])
def test_rms_norm_fp32_scale_equals_reference(shape, dtype):
    """Gemma's norm: an fp32 scale, the result in x's dtype."""
    g = torch.Generator().manual_seed(shape[-1] + 3)
    x = (torch.randn(*shape, generator=g) * 3).to(DEVICE, dtype)
    scale = (1 + torch.randn(shape[-1], generator=g) * 0.1).to(DEVICE)
    out = rms_norm(x, scale, 1e-6, fp32_scale=True)
    ref = rms_norm_fp32(x, scale, 1e-6)
    assert out.shape == ref.shape and out.dtype == dtype
    torch.testing.assert_close(out, ref, **_norm_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 576), (4, 100)])
def test_add_rms_norm_of_a_normalized_x(shape, dtype):
    """Gemma's sublayer output norm fused with the residual add and the next norm:
    residual += norm(x, x_scale), then norm(residual, scale), fp32 scales."""
    g = torch.Generator().manual_seed(shape[-1] + 4)
    x = (torch.randn(*shape, generator=g) * 5).to(DEVICE, dtype)
    residual = (torch.randn(*shape, generator=g) * 2).to(DEVICE, dtype)
    x_scale, scale = (1 + torch.randn(2, shape[-1], generator=g) * 0.3).to(DEVICE)
    expected_residual = residual + rms_norm_fp32(x, x_scale, 1e-6)
    expected = rms_norm_fp32(expected_residual, scale, 1e-6)
    normed, res = add_rms_norm(x, residual, scale, 1e-6, fp32_scale=True, x_weight=x_scale)
    assert res is residual and normed.dtype == dtype
    torch.testing.assert_close(residual, expected_residual, **_norm_tol(dtype))
    torch.testing.assert_close(normed, expected, **_norm_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 576), (4, 100)])
def test_add_rms_norm_updates_residual_in_place(shape, dtype):
    g = torch.Generator().manual_seed(shape[-1] + 1)
    x = torch.randn(*shape, generator=g).to(DEVICE, dtype)
    residual = (torch.randn(*shape, generator=g) * 2).to(DEVICE, dtype)
    w = (1 + torch.randn(shape[-1], generator=g) * 0.1).to(DEVICE, dtype)
    expected_residual = residual + x
    expected = rms_norm_reference(expected_residual, w, 1e-6)
    res_ptr = residual.data_ptr()
    normed, res = add_rms_norm(x, residual, w, 1e-6)
    assert res is residual and res.data_ptr() == res_ptr
    assert torch.equal(residual, expected_residual)
    torch.testing.assert_close(normed, expected, **_norm_tol(dtype))


# name -> (kernel, reference, generator seed offset, gate scale). GeGLU's (Gemma's) gates run
# out to +-12, where gelu is 0 or the identity.
GATED = {
    "silu_mul": (silu_mul, silu_mul_reference, 2, 3),
    "gelu_tanh_mul": (gelu_tanh_mul, gelu_tanh_mul_reference, 5, 4),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 2 * 1536), (5, 2 * 100), (2, 2, 2 * 64)])
@pytest.mark.parametrize("name", list(GATED))
def test_gated_activation_equals_reference(name, shape, dtype):
    kernel, reference, seed, scale = GATED[name]
    g = torch.Generator().manual_seed(shape[-1] + seed)
    gate_up = (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype)
    out = kernel(gate_up)
    ref = reference(gate_up)
    assert out.shape == ref.shape and out.dtype == dtype
    torch.testing.assert_close(out, ref, **_norm_tol(dtype))
