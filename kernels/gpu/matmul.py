"""y = x W^T (+ b) with every row computed the same way whatever rows are beside it: the
matmul of the engine's batch-invariant mode (LLMEngine(batch_invariant=True)).

Why: cuBLAS picks its kernel (tile shape, split-K) by the matrix shape, so a row of x is
rounded differently when it is multiplied among 1, 7 or 400 rows, and on a GPU a row's
answer depends on the rows batched with it: a SQL query's answer for one row changes when a
WHERE clause drops other rows. The CPU path pads its matmuls to shapes whose rows agree
(kernels/linear.py); here one Triton kernel with one tile shape per dtype serves every row
count, and a row's K loop runs over the same tiles in the same order, so its result depends
on its own values and the weight alone. (No split-K: a small batch keeps fewer SMs busy than
cuBLAS would, which is the price of the mode.)

How: the tiled GEMM of Triton's tutorial: a program per [BLOCK_M, BLOCK_N] tile of y, tiles
taken GROUP_M rows of tiles at a time so that a W tile is reused from L2 by the programs that
follow, fp32 accumulation, the bias added in fp32, one rounding to y's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) per input element size: one shape for
# every row count (what makes a row's result independent of them). bf16/fp16 tiles need
# 72 KiB of shared memory with 3 stages, under the 99 KiB of an L4, A10 or RTX 4090; fp32
# (exact IEEE dots, for tests) takes smaller ones. tests/gpu_compile.py compiles both.
_CONFIG = {2: (64, 128, 64, 4, 3), 4: (32, 64, 32, 4, 2)}
_GROUP_M = 8


# The row count changes every step: specializing on it would compile variants mid-run.
@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ym,
    HAS_BIAS: tl.constexpr, IEEE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % (GROUP_M * tiles_n)) % group_m
    tile_n = (pid % (GROUP_M * tiles_n)) // group_m

    rows = (tile_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (tile_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + (k0 + ks)[None, :] * stride_xk,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols[None, :] * stride_wn + (k0 + ks)[:, None] * stride_wk,
                    mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        if IEEE_DOT:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T + bias [N] -> [M, N] in x's dtype (into `out`, whose last
    dimension must have a unit stride, if given). Any strides for x and weight."""
    m, k = x.shape
    n, k_w = weight.shape
    if k != k_w:
        raise ValueError(f"matmul: x has {k} columns, the weight {k_w}")
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if out.shape != (m, n) or out.stride(1) != 1:
        raise ValueError(f"matmul: out must be [{m}, {n}] with unit column stride")
    if m == 0:
        return out
    block_m, block_n, block_k, num_warps, num_stages = _CONFIG[min(x.element_size(), 4)]
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _matmul_kernel[grid](
        x, weight, out if bias is None else bias, out, m, n, k,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0),
        HAS_BIAS=bias is not None, IEEE_DOT=x.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=_GROUP_M,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
