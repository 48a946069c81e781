"""Triton hidden-cache I/O (Apt-Serve): writes of hidden states into their store rows, and the
gather of a step's context rows for re-projection. Same contracts as kernels/hidden_cache.py.

Why kernels rather than index_copy_/index_select: the store is a strided view (a prefix of
each K/V slot when hidden_size < kv_heads x head_dim) and the gathered rows feed a GEMM in
the model dtype. One program moves a [ROWS, COLS] tile, casting on the way; the rows of one
block are consecutive in the store, so a program's loads are block-wise contiguous (the
paper's block-wise hidden-cache reads). Whole rows in one tile did not fit a program's
registers at real widths: compiled for sm_90 (tests/gpu_compile.py), OPT-13B's 5,120
columns (padded to 8,192) spilled 4.9 KB a thread to local memory, Phi-3-mini's 3,072 took
all 255 registers and spilled too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS = 16  # rows per program: one block's half
COLS = 256  # columns per program at most: 32 values a thread at 4 warps


# num_rows changes with every step; specialized, a count of 1 or a multiple of 16 would each
# compile a variant of their own at first use, for nothing (the mask handles any count).
@triton.jit(do_not_specialize=["num_rows"])
def _copy_rows_kernel(src_ptr, dst_ptr, src_index_ptr, dst_index_ptr, num_rows, width,
                      stride_src, stride_dst, ROWS: tl.constexpr, COLS: tl.constexpr,
                      INDEX_SRC: tl.constexpr, INDEX_DST: tl.constexpr):
    """dst[dst_index[r]] = src[src_index[r]] for r in this program's rows and columns (an
    index that is not used is the identity)."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = r < num_rows
    cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
    mask = row_ok[:, None] & (cols[None, :] < width)
    src_row = r.to(tl.int64)
    dst_row = r.to(tl.int64)
    if INDEX_SRC:
        src_row = tl.load(src_index_ptr + r, mask=row_ok, other=0)
    if INDEX_DST:
        dst_row = tl.load(dst_index_ptr + r, mask=row_ok, other=0)
    x = tl.load(src_ptr + src_row[:, None] * stride_src + cols[None, :], mask=mask, other=0.0)
    tl.store(dst_ptr + dst_row[:, None] * stride_dst + cols[None, :],
             x.to(dst_ptr.dtype.element_ty), mask=mask)


def _copy_rows(src: torch.Tensor, dst: torch.Tensor, src_index: torch.Tensor | None,
               dst_index: torch.Tensor | None, num_rows: int) -> None:
    assert src.stride(1) == 1 and dst.stride(1) == 1 and src.shape[1] == dst.shape[1]
    if num_rows == 0:
        return
    index = src_index if src_index is not None else dst_index
    width = src.shape[1]
    cols = min(COLS, triton.next_power_of_2(width))
    _copy_rows_kernel[(triton.cdiv(num_rows, ROWS), triton.cdiv(width, cols))](
        src, dst, index if src_index is None else src_index,
        index if dst_index is None else dst_index, num_rows, width,
        src.stride(0), dst.stride(0), ROWS=ROWS, COLS=cols,
        INDEX_SRC=src_index is not None, INDEX_DST=dst_index is not None,
    )


def write_hidden(store: torch.Tensor, hidden: torch.Tensor, rows: torch.Tensor) -> None:
    """store[rows] = hidden (store [2 * slots, H], hidden [T, H], rows [T] int64)."""
    _copy_rows(hidden, store, None, rows, rows.shape[0])


def gather_hidden(store: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[R, H]: the store's rows, in order, contiguous."""
    out = torch.empty((rows.shape[0], store.shape[1]), dtype=store.dtype, device=store.device)
    _copy_rows(store, out, rows, None, rows.shape[0])
    return out
