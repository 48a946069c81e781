"""Log-softmax and cumulative sums of the rows of a matrix, each row reduced by one program in
one fixed order: the batch-invariant mode's (LLMEngine(batch_invariant=True)) stand-ins for
torch's CUDA kernels, whose order of summation for a row depends on the rows beside it.

Why, from torch's CUDA sources:
- log_softmax (SoftMax.cu, cunn_SoftMaxForward) gives each row a block that loads 16-byte
  vectors from the row's first aligned address: with a vocabulary that is not a multiple of
  4 (fp32 rows), a row's threads take other elements, and its sum of exponentials rounds
  otherwise, depending on its index in the batch.
- cumsum (ScanUtils.cuh, scan_dim) scans a lone row with CUB's device-wide scan and several
  rows with a tree whose width follows the number of rows (get_log_num_threads_x_inner_scan):
  top-p's cumulative mass of a request's row depended on how many rows were drawn with it.

How: a program per row walks it in BLOCK-wide chunks, BLOCK fixed whatever the number of rows
(the order of a row's sums depends on its length alone). log_softmax: the maximum (exact in
any order), then the exponentials summed into a BLOCK-wide accumulator reduced once, then
(x - max) - log(sum) as torch writes it, in fp32. cumsum: a scan of each chunk plus the sum
carried from the chunks before it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Elements a program reads at once. Fixed: the association of a row's sums follows it.
_BLOCK = 1024


@triton.jit
def _log_softmax_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    out_row = out_ptr + row * stride_out
    cols = tl.arange(0, BLOCK)
    top = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, n_cols, BLOCK):
        ok = start + cols < n_cols
        x = tl.load(x_row + start + cols, mask=ok, other=float("-inf")).to(tl.float32)
        top = tl.maximum(top, x)
    m = tl.max(top, 0)
    total = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_cols, BLOCK):
        ok = start + cols < n_cols
        x = tl.load(x_row + start + cols, mask=ok, other=float("-inf")).to(tl.float32)
        total += tl.exp(x - m)
    log_sum = tl.log(tl.sum(total, 0))
    for start in range(0, n_cols, BLOCK):
        ok = start + cols < n_cols
        x = tl.load(x_row + start + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_row + start + cols, (x - m) - log_sum, mask=ok)


@triton.jit
def _cumsum_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    out_row = out_ptr + row * stride_out
    cols = tl.arange(0, BLOCK)
    carry = tl.sum(tl.zeros([BLOCK], tl.float32), 0)  # (a scalar the loop can carry)
    for start in range(0, n_cols, BLOCK):
        ok = start + cols < n_cols
        x = tl.load(x_row + start + cols, mask=ok, other=0.0).to(tl.float32)
        sums = tl.cumsum(x, 0) + carry
        tl.store(out_row + start + cols, sums, mask=ok)
        # The chunk's last sum goes on (masked columns add zeros, so a short last chunk's
        # value is its total too; nothing reads it).
        carry = tl.max(tl.where(cols == BLOCK - 1, sums, float("-inf")), 0)


def _launch(kernel, x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2:
        raise ValueError(f"expected a [rows, columns] matrix, got shape {tuple(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if x.numel():
        kernel[(x.shape[0],)](x, out, x.shape[1], x.stride(0), out.stride(0), BLOCK=_BLOCK,
                              num_warps=4)
    return out


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """x [N, V] (any float dtype) -> fp32 log-probabilities of each row, as
    x.float().log_softmax(-1), each row's bits a function of that row alone."""
    return _launch(_log_softmax_kernel, x)


def cumsum(x: torch.Tensor) -> torch.Tensor:
    """x [N, W] -> fp32 inclusive cumulative sums along each row, as x.float().cumsum(-1),
    each row's bits a function of that row alone."""
    return _launch(_cumsum_kernel, x)
