"""Linear layers whose weights are packed once into oneDNN's blocked layout.

`F.linear` on a bf16 weight hands it to oneDNN, which reorders it into its blocked layout on
every call. Packing once at load time (the op torch's own CPU compiler uses after freezing)
skips that: measured here with SmolLM2's shapes, 5-10% faster at 1,024 rows and 20-50% at
1-64 rows (decode steps), including the 49k-row vocabulary projection. The results are
bitwise those of `F.linear` (the same oneDNN kernels; one row padded to two, see SAME_BITS).

fp32 weights are packed too where oneDNN computes a row the same alone and among others
(checked once per process, _onednn_fp32_rows_independent): `F.linear` takes MKL's sgemm for
fp32, which on an AVX2-only EPYC (Zen 3, where the engine runs fp32) ran decode-sized
matmuls at 17-33 GFLOP/s against oneDNN's 75-120 (8-96 rows of 768 x 3,072). The bits differ
from MKL's in the last places; a row's bits do not depend on the rows beside it either way.
Elsewhere fp32 stays with `F.linear`, rows padded to a multiple of 4 (SAME_BITS).

On a GPU a Linear is cuBLAS's (`F.linear`), or, made with batch_invariant=True, the Triton
matmul of kernels/gpu/matmul.py, whose rows do not depend on the rows beside them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# The row count oneDNN picks its blocking for; any row count works with the packed weight.
_ROWS_HINT = 1024
# SAME_BITS: the CPU libraries compute a few rows with other kernels than the rest, and those
# sum in another order. oneDNN (packed bf16) takes another kernel for one row: for SmolLM2's
# 1,536-wide down projection about one row in ten then differs in its last bits from the
# same row computed among others. MKL (fp32) computes the rows past a multiple of 4 so, and
# every one of them differs. Measured on this VM's EPYC (AVX-512) at 1 to 1,024 rows. A
# request decoding alone (the last of a query, or a query of one row) then drifted to other
# tokens than in a batch: 8 of 24 greedy bf16 answers differed. So one bf16 row is computed
# as two, and fp32 rows in multiples of 4 (the extra rows copies of the last): a row's
# answer does not depend on the rows beside it. (bf16 pads only the one row: padding every
# step's rows would copy each matmul's input, ~5% of a 400-row decode step here.) Packed
# fp32 is not padded: it is packed only where its rows proved independent (the probe).
_FP32_ROW_MULTIPLE = 4


def _onednn() -> bool:
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def _packed_matmul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
                   ) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@functools.cache
def _onednn_fp32_rows_independent() -> bool:
    """Does oneDNN's packed fp32 give a row the same bits alone, among a few rows and in a
    prefill-sized batch, on this CPU? It did on the AVX2-only EPYC at every count tried (1 to
    4,096 rows; SmolLM2's and OPT-125m's layer shapes); kernels for other instruction sets are
    not known to, so it is asked once, on layer-like shapes, before an fp32 weight is packed."""
    if not _onednn():
        return False
    g = torch.Generator().manual_seed(0)
    for out_f, in_f in ((192, 576), (96, 1536)):
        w = torch.randn(out_f, in_f, generator=g)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, _ROWS_HINT)
        x = torch.randn(1040, in_f, generator=g)
        together = _packed_matmul(x, packed, None)
        for start, rows in ((0, 1), (517, 1), (1039, 1), (3, 2), (11, 3), (20, 5), (30, 17),
                            (64, 64), (100, 300)):
            if not torch.equal(_packed_matmul(x[start:start + rows], packed, None),
                               together[start:start + rows]):
                return False
    return True


def _can_pack(weight: torch.Tensor) -> bool:
    """bf16: where the CPU has oneDNN's bf16 path (AVX-512 or AVX-NE-CONVERT; on an AVX2-only
    CPU `_reorder_linear_weight` raises, and F.linear converts as it goes). fp32: where
    oneDNN's rows are independent of each other here (module docstring)."""
    if weight.device.type != "cpu" or not _onednn():
        return False
    if weight.dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return weight.dtype == torch.float32 and _onednn_fp32_rows_independent()


@dataclass(frozen=True)
class Linear:
    """y = x W^T + b for x [rows, in_features]."""

    weight: torch.Tensor | None  # [out, in], dense; None when packed
    packed: torch.Tensor | None  # oneDNN's layout of the same weight
    bias: torch.Tensor | None
    out_features: int
    # kernels/gpu/matmul.py's matmul where batch_invariant (then never packed), taken once
    # here rather than imported on every call of the per-layer hot path.
    invariant_matmul: Callable | None = None

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """out: a [rows, out_features] tensor to write into (a CUDA graph's shared buffer)."""
        if self.invariant_matmul is not None:
            return self.invariant_matmul(x, self.weight, self.bias, out)
        rows = x.shape[0]
        extra = self._padding(rows) if x.device.type == "cpu" else 0
        if extra:  # (see SAME_BITS)
            y = self(torch.cat([x, x[-1:].expand(extra, -1)]))[:rows]
            return y if out is None else out.copy_(y)
        if self.packed is not None:
            y = _packed_matmul(x, self.packed, self.bias)
            return y if out is None else out.copy_(y)
        if out is None:
            return F.linear(x, self.weight, self.bias)
        if self.bias is None:
            return torch.mm(x, self.weight.t(), out=out)
        return torch.addmm(self.bias, x, self.weight.t(), out=out)

    def _padding(self, rows: int) -> int:
        """Rows to add so that the CPU library computes these rows as it does among others."""
        if self.packed is not None:
            return 1 if rows == 1 and self.packed.dtype == torch.bfloat16 else 0
        return -rows % _FP32_ROW_MULTIPLE


def linear(weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           batch_invariant: bool = False) -> Linear:
    """A Linear over `weight` [out, in] (and `bias`), packed where that is exact;
    batch_invariant: by the Triton matmul (a GPU's, or the interpreter's in tests)."""
    weight = weight.contiguous()
    if batch_invariant:
        from .gpu.matmul import matmul  # (imports triton: only in this mode)

        return Linear(weight, None, bias, weight.shape[0], invariant_matmul=matmul)
    if _can_pack(weight):
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, _ROWS_HINT)
        return Linear(None, packed, bias, weight.shape[0])
    return Linear(weight, None, bias, weight.shape[0])
