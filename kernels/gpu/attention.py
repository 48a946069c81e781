"""Paged attention for a whole mixed step in one Triton launch.

Why one launch: a step packs prefill chunks (over cached prefixes) and decodes together, and
per-sequence launches would cost a launch and a host round trip each; one kernel over the
varlen layout of `AttentionBatch` keeps the step CUDA-graph capturable.

How (the shape of vLLM's Triton "unified attention"): the grid is (query blocks, kv heads,
splits). Query blocks are numbered across all sequences without a host-side table: sequence i
owns blocks starting at query_start_loc[i] // BLOCK_Q + i, so T // BLOCK_Q + S + 1 programs
cover every row, and each program finds its sequence by binary search. Rows past
query_start_loc[-1] (a graph's padding) belong to a virtual last sequence with no keys and get
zeros. One program takes BLOCK_Q query tokens times all `group` query heads of its kv head as
one BLOCK_M-row tile, so each K/V tile is read once per group. Keys go by in tiles of BLOCK_N,
each key's slot gathered through the block table, with an online softmax in fp32 (base 2).

Split-KV: when the grid would leave SMs idle (few long decodes), each split takes a
contiguous range of its program's key tiles and writes a normalized partial output and its
log-sum-exp to fp32 scratch; a second kernel merges the splits weighted by their LSEs.

Sliding windows: a program's key loop starts at the tile holding the first key its first
query's window reaches, so a decode over a long context reads about `window` keys; the
splits share those tiles only, and a split left with none writes an empty partial (LSE -inf)
that the merge weighs 0. Window and softcap are per-layer host values: plain arguments that a
CUDA graph bakes in per launch, with a compile-time switch for each so that layers without
them run the same code as before.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmdb.kernels.attention import AttentionBatch

# A global a kernel reads must be a tl.constexpr: Triton's compiler refuses a plain float
# (its interpreter, which CI runs, accepts one; tests/gpu_compile.py compiles for real).
_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _find_sequence(query_start_loc_ptr, num_seqs, pid, BLOCK_Q: tl.constexpr):
    """The last i in [0, num_seqs] whose first query block, qsl[i] // BLOCK_Q + i, is <= pid.

    Those first blocks strictly increase with i, so the answer is unique; i == num_seqs is the
    virtual sequence of rows past the last real one."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= pid:
            lo = mid
        else:
            hi = mid - 1
    return lo


# Step sizes change every step: specializing on them (Triton compiles a variant for values
# divisible by 16 and for 1) would compile new variants mid-run, a second or so each. So does
# the block tables' row stride of the hidden cache's scratch batch (its longest context).
@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "num_splits", "window", "stride_bt"])
def _attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_ptr, lse_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
    num_seqs, num_tokens, num_splits, qk_scale, window, softcap,
    stride_qt, stride_qh, stride_qd,
    stride_ks, stride_kh, stride_kd,
    stride_vs, stride_vh, stride_vd,
    stride_ot, stride_oh,
    stride_bt,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    IEEE_DOT: tl.constexpr, SLIDING: tl.constexpr, SOFTCAP: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_sequence(query_start_loc_ptr, num_seqs, pid, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    first_block = q_start // BLOCK_Q + seq
    if seq < num_seqs:
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        ctx = tl.load(seq_lens_ptr + seq)
    else:
        q_len = num_tokens - q_start
        ctx = q_len * 0
    q_block = pid - first_block
    if q_block * BLOCK_Q >= q_len:
        return

    # Row m of the tile is query token m // GROUP, query head kv_head * GROUP + m % GROUP.
    rows = tl.arange(0, BLOCK_M)
    tok = q_block * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    prefix = ctx - q_len
    # Query j of the chunk sits at position prefix + j and sees keys 0..prefix + j.
    last_key = prefix + tok
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM

    tok_abs = (q_start + tok).to(tl.int64)
    q_off = tok_abs[:, None] * stride_qt + head[:, None] * stride_qh
    q_off += dims[None, :] * stride_qd
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    # Keys this tile of queries can see at all, and this split's share of their tiles.
    key_end = tl.minimum(ctx, prefix + tl.minimum(q_len, (q_block + 1) * BLOCK_Q))
    key_end = tl.maximum(key_end, 0)
    num_tiles = tl.cdiv(key_end, BLOCK_N)
    first_tile = 0
    if SLIDING:
        # Query j sees keys from prefix + j - window + 1 on: the tile's first query the
        # earliest.
        first_key = tl.maximum(prefix + q_block * BLOCK_Q - window + 1, 0)
        first_tile = tl.minimum(first_key // BLOCK_N, num_tiles)
    per_split = tl.cdiv(num_tiles - first_tile, num_splits)
    tile_lo = first_tile + split * per_split
    tile_hi = tl.minimum(num_tiles, tile_lo + per_split)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_hi):
        keys = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        key_ok = keys < key_end
        block = tl.load(table + keys // BLOCK_SIZE, mask=key_ok, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + keys % BLOCK_SIZE
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + slot[:, None] * stride_ks + kv_head * stride_kh
                    + dims[None, :] * stride_kd, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + slot[:, None] * stride_vs + kv_head * stride_vh
                    + dims[None, :] * stride_vd, mask=kv_mask, other=0.0)
        if IEEE_DOT:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if SOFTCAP:
            # softcap * tanh(s / softcap) on the natural-log scale (qk_scale carries log2(e)),
            # tanh written with exp2 (no tanh in Triton's core language): exact at the
            # extremes, absolute error ~1e-7 x softcap near 0.
            x = s * (qk_scale / softcap)  # (s x scale / softcap) x log2(e)
            s = (softcap * _LOG2E) * (1.0 - 2.0 / (tl.exp2(2.0 * x) + 1.0))
        else:
            s = s * qk_scale
        visible = (keys[None, :] <= last_key[:, None]) & key_ok[None, :]
        if SLIDING:
            visible = visible & (keys[None, :] > last_key[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no key yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE_DOT:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    # Rows with no visible key (empty sequences, padding) have acc = 0 and l = 0: divide by 1
    # to give zeros, not 0/0.
    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    o = acc / l_safe[:, None]
    store_mask = row_ok[:, None] & dim_ok[None, :]
    if not SPLIT:
        o_off = tok_abs[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        # Scratch is [num_splits, T, H, D] and [num_splits, T, H], contiguous.
        row_idx = (split * num_tokens + tok_abs) * NUM_HEADS + head
        lse = tl.where(has_keys, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_ptr + row_idx[:, None] * HEAD_DIM + dims[None, :], o, mask=store_mask)
        tl.store(lse_ptr + row_idx, lse, mask=row_ok)


@triton.jit(do_not_specialize=["num_tokens", "num_splits"])
def _merge_splits_kernel(
    part_ptr, lse_ptr, out_ptr, num_tokens, num_splits,
    stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < num_splits
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    row_idx = (splits * num_tokens + tok) * NUM_HEADS + head
    lse = tl.load(lse_ptr + row_idx, mask=split_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m_shift = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m_shift)
    total = tl.sum(w, 0)
    w = w / tl.where(total > 0.0, total, 1.0)
    part = tl.load(part_ptr + row_idx[:, None] * HEAD_DIM + dims[None, :],
                   mask=split_ok[:, None] & dim_ok[None, :], other=0.0)
    o = tl.sum(part * w[:, None], 0)
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + dims, o.to(out_ptr.dtype.element_ty),
             mask=dim_ok)


# The split count is a runtime argument and the merge reads a fixed-width row of splits, so
# every split count shares one compiled kernel (graphs of each batch size pick their own).
_SPLITS_PAD = 16


def choose_num_splits(num_seqs: int, kv_heads: int, max_seq_len: int, num_sms: int,
                      min_keys_per_split: int = 128, max_splits: int = 16) -> int:
    """How many key ranges to split each sequence into (1: no split).

    A decode step runs about num_seqs * kv_heads programs. Split when that is under two per
    SM, into enough splits to reach two per SM, as long as each split still gets
    min_keys_per_split keys (the merge pass and the fp32 scratch cost more than shorter ranges
    gain). Measured on an H100 under CUDA graphs (bf16 decode, 132 SMs): 8 SmolLM2 decodes
    over 4096 keys 62 -> 12 us with 11 splits, 64 of them 105 -> 84 us with 2; from 128 of them
    (384 programs) up, no split is fastest."""
    programs = max(1, num_seqs * kv_heads)
    target = 2 * num_sms
    if programs >= target:
        return 1
    by_occupancy = -(-target // programs)
    by_length = max(1, max_seq_len // min_keys_per_split)
    return max(1, min(by_occupancy, by_length, max_splits))


def _launch_config(group: int, max_query_len: int, head_dim: int, elem_bytes: int = 2,
                   tall: bool = False) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): a tiling hint only, any choice is correct.

    tl.dot needs M >= 16; decode-only steps use the smallest tile that holds a group so no
    rows are wasted, steps with prefill chunks a taller one. On an H100, 64-key tiles beat 32
    for decodes and prefills alike, and 128-row tiles only helped whole prefills at head dim
    128 while slowing mixed steps. Heads wider than 128 (Gemma's 256) take 32-key tiles, the
    bytes of a 64-key tile at 128: with 64 keys a 64-row tile's pipelined K/V loads need
    104 KiB of shared memory on sm_80/sm_89 and 160 KiB on sm_90 (tests/gpu_compile.py), more
    than an L4, A10 or RTX 4090 has (99 KiB); with 32, 68 and 96 KiB. So the key tile is
    sized by a head's bytes, not its width (fp32's 256-wide heads take 16 keys), and fp32
    (elem_bytes 4) prefills take 32-row tiles: compiled for sm_89, fp32 needed 115 KiB at
    head dim 128 and 140 KiB at 256 with the bf16 tiles, and its 64-row tiles spilled 1-9 KB
    a thread at every head dim; now at most 74 KiB and 72 bytes. tall: the prefill tile
    whatever the step (the batch-invariant mode)."""
    row_bytes = triton.next_power_of_2(head_dim) * elem_bytes
    rows = triton.next_power_of_2(max(group, 16))
    if tall or group * max(1, max_query_len) > rows:
        rows = max(rows, 64 if elem_bytes <= 2 else 32)
    return rows, 64 if row_bytes <= 256 else 32 if row_bytes <= 512 else 16, 4


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch,
    scale: float, out: torch.Tensor | None = None, num_splits: int = 1, *, window: int = 0,
    softcap: float = 0.0, invariant: bool = False,
) -> torch.Tensor:
    """q [T, H, D] -> out [T, H, D] in q's dtype; same contract as
    `paged_attention_reference`. No host sync: the grid depends on shapes and host ints only.

    q, k_cache, v_cache [num_slots, KVH, D] may have any strides; out, if given, needs a unit
    stride on its last dim. Rows of q past query_start_loc[-1] get zeros. batch.max_query_len
    only picks the tile shape and max_seq_len is not read, so a graph captured for one batch
    stays correct when replayed with other lengths of the same T and S. num_splits > 1 takes
    fp32 scratch of (num_splits * T * H * (D + 1)) floats from torch's allocator (a
    graph's private pool under capture). window and softcap as in
    `paged_attention_reference`.

    invariant: a row's result depends on its own query and keys alone, not on the step around
    it (the engine's batch-invariant mode): every step takes the prefill tile shape, a decode
    alone as much as one beside prefill chunks, and num_splits is ignored (a split sequence
    sums its keys in another order, and the split count follows the batch). A row's key loop
    then runs over the same key tiles in the same order whatever the chunking of its prompt:
    tiles past its last key, which a taller chunk's tile also visits, are masked whole and
    add exact zeros."""
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    assert num_heads % kv_heads == 0, "query heads must be a multiple of kv heads"
    group = num_heads // kv_heads
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    assert out.shape == q.shape and out.stride(-1) == 1
    if num_tokens == 0:
        return out
    num_seqs = batch.seq_lens.shape[0]
    block_m, block_n, num_warps = _launch_config(group, batch.max_query_len, head_dim,
                                                 q.element_size(), tall=invariant)
    block_q = block_m // group
    num_splits = 1 if invariant else max(1, int(num_splits))
    if num_splits > 1:
        part = torch.empty((num_splits, num_tokens, num_heads, head_dim), dtype=torch.float32,
                           device=q.device)
        lse = torch.empty((num_splits, num_tokens, num_heads), dtype=torch.float32,
                          device=q.device)
    else:
        part = lse = out  # unused by the kernel without splits
    head_dim_pad = triton.next_power_of_2(head_dim)
    grid = (num_tokens // block_q + num_seqs + 1, kv_heads, num_splits)
    _attention_kernel[grid](
        q, k_cache, v_cache, out, part, lse,
        batch.query_start_loc, batch.seq_lens, batch.block_tables,
        num_seqs, num_tokens, num_splits, scale * _LOG2E.value, int(window), float(softcap),
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        batch.block_tables.stride(0),
        NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=batch.block_size, BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n,
        SPLIT=num_splits > 1, IEEE_DOT=q.dtype == torch.float32, SLIDING=window > 0,
        SOFTCAP=softcap > 0, num_warps=num_warps,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            part, lse, out, num_tokens, num_splits, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
            SPLITS_PAD=max(_SPLITS_PAD, triton.next_power_of_2(num_splits)),
            num_warps=1 if head_dim <= 64 else 2,
        )
    return out
