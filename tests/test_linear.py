"""kernels/linear.py: the prepacked bf16 Linear is bitwise F.linear; fp32 stays unpacked.

Proved: for bf16 weights of SmolLM2-like shapes, with and without bias, at row counts 0 to
300, `linear(w, b)(x)` equals `F.linear(x, w, b)` exactly (`torch.equal`; one row padded to
two) and the weight is held only in oneDNN's packed layout (where the CPU has oneDNN's bf16
path; elsewhere it stays dense, as fp32); for fp32 weights nothing is packed and the result
is exactly F.linear's on rows padded to a multiple of 4; in both, a row's result is the
same alone as among others (kernels/linear.py, SAME_BITS);
`out_features` is the weight's row count either way.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmdb.kernels.linear import linear

SHAPES = [(960, 576), (3072, 576), (576, 1536)]  # [out, in]: qkv-, up- and down-like
ROWS = [0, 1, 7, 64, 300]
# oneDNN packs bf16 where the CPU has its bf16 path (AVX-512 or AVX-NE-CONVERT); an AVX2-only
# CPU keeps bf16 weights dense, as fp32 ones.
PACKS_BF16 = (torch.backends.mkldnn.is_available()
              and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _f_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """F.linear on x's rows padded with copies of the last: packed bf16 one row to two,
    unpacked weights to a multiple of 4."""
    pad = int(len(x) == 1) if w.dtype == torch.bfloat16 and PACKS_BF16 else -len(x) % 4
    return F.linear(torch.cat([x, x[-1:].expand(pad, -1)]), w, b)[:len(x)]


def _operands(out_f: int, in_f: int, dtype: torch.dtype, with_bias: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(out_f, in_f, generator=g) * in_f**-0.5).to(dtype)
    b = torch.randn(out_f, generator=g).to(dtype) if with_bias else None
    return w, b, g


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_bf16_packed_is_bitwise_f_linear(shape, with_bias):
    out_f, in_f = shape
    w, b, g = _operands(out_f, in_f, torch.bfloat16, with_bias, seed=out_f + in_f)
    lin = linear(w, b)
    assert lin.out_features == out_f
    if PACKS_BF16:
        assert lin.packed is not None and lin.weight is None
    else:
        assert lin.packed is None and lin.weight is not None
    for rows in ROWS:
        x = torch.randn(rows, in_f, generator=g).to(torch.bfloat16)
        got, ref = lin(x), _f_linear(x, w, b)
        assert got.dtype == ref.dtype == torch.bfloat16
        assert got.shape == ref.shape == (rows, out_f)
        assert torch.equal(got, ref), f"{shape} bias={with_bias} rows={rows}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_a_row_alone_equals_the_row_among_others(shape, dtype):
    """oneDNN and MKL compute a few rows with kernels that sum in another order; a request
    decoding alone must get the bits it gets in a batch (kernels/linear.py, SAME_BITS)."""
    out_f, in_f = shape
    w, b, g = _operands(out_f, in_f, dtype, True, seed=3)
    lin = linear(w, b)
    x = torch.randn(300, in_f, generator=g).to(dtype)
    together = lin(x)
    for i in range(len(x)):
        assert torch.equal(lin(x[i:i + 1])[0], together[i]), f"{shape} row {i}"
    for start, rows in ((0, 7), (100, 13), (290, 10)):
        assert torch.equal(lin(x[start:start + rows]), together[start:start + rows])


def test_bf16_packed_takes_non_contiguous_weight():
    """A transposed (non-contiguous) weight is made contiguous before packing."""
    w_t, _, g = _operands(576, 960, torch.bfloat16, False, seed=1)
    w = w_t.t()  # [960, 576], non-contiguous
    lin = linear(w)
    x = torch.randn(7, 576, generator=g).to(torch.bfloat16)
    assert lin.out_features == 960
    assert torch.equal(lin(x), _f_linear(x, w, None))


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_fp32_is_not_packed_and_is_exactly_f_linear(shape, with_bias):
    out_f, in_f = shape
    w, b, g = _operands(out_f, in_f, torch.float32, with_bias, seed=2 * out_f + in_f)
    lin = linear(w, b)
    assert lin.packed is None
    assert lin.weight is not None and torch.equal(lin.weight, w)
    assert lin.out_features == out_f
    for rows in ROWS:
        x = torch.randn(rows, in_f, generator=g)
        got = lin(x)
        assert got.shape == (rows, out_f)
        assert torch.equal(got, _f_linear(x, w, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_out_is_written_in_place_with_the_same_result(dtype, with_bias):
    """out= (a CUDA graph's shared logits buffer): the rows are written into the given
    tensor, a row slice of a larger one, equal to the result without it."""
    w, b, g = _operands(960, 576, dtype, with_bias, seed=5)
    lin = linear(w, b)
    x = torch.randn(7, 576, generator=g).to(dtype)
    buf = torch.full((10, 960), float("nan"), dtype=dtype)
    got = lin(x, out=buf[:7])
    assert got.data_ptr() == buf.data_ptr()
    torch.testing.assert_close(buf[:7], lin(x), rtol=0, atol=1e-5)
    assert buf[7:].isnan().all()
