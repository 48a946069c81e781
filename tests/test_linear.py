"""kernels/linear.py: the prepacked bf16 Linear is bitwise F.linear; fp32 is packed where
oneDNN's rows are independent of each other on this CPU, else F.linear's bits.

Proved: for bf16 weights of SmolLM2-like shapes, with and without bias, at row counts 0 to
300, `linear(w, b)(x)` equals `F.linear(x, w, b)` exactly (`torch.equal`; one row padded to
two) and the weight is held only in oneDNN's packed layout (where the CPU has oneDNN's bf16
path; elsewhere it stays dense); fp32 weights are packed where the CPU's probe allows, and
agree with F.linear to rounding, else kept dense with exactly F.linear's result on rows
padded to a multiple of 4; in each, a row's result is the same alone as among others
(kernels/linear.py, SAME_BITS);
`out_features` is the weight's row count either way.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmdb.kernels import linear as linear_module
from llmdb.kernels.linear import linear

SHAPES = [(960, 576), (3072, 576), (576, 1536)]  # [out, in]: qkv-, up- and down-like
ROWS = [0, 1, 7, 64, 300]
# oneDNN packs bf16 where the CPU has its bf16 path (AVX-512 or AVX-NE-CONVERT); an AVX2-only
# CPU keeps bf16 weights dense, as fp32 ones.
PACKS_BF16 = (torch.backends.mkldnn.is_available()
              and torch.ops.mkldnn._is_mkldnn_bf16_supported())
# fp32 is packed where oneDNN's rows are independent of each other on this CPU (a probe).
PACKS_FP32 = linear_module._onednn_fp32_rows_independent()


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


def _take(path: str, monkeypatch) -> None:
    """as_probed: fp32 packed where this CPU's probe allows it; unpacked: fp32 by F.linear
    (MKL), as on CPUs where it does not. Both paths run on every machine."""
    if path == "unpacked":
        monkeypatch.setattr(linear_module, "_onednn_fp32_rows_independent", lambda: False)


@pytest.mark.parametrize("dtype,path", [(torch.float32, "as_probed"),
                                        (torch.float32, "unpacked"),
                                        (torch.bfloat16, "as_probed")])
@pytest.mark.parametrize("shape", SHAPES)
def test_a_row_alone_equals_the_row_among_others(shape, dtype, path, monkeypatch):
    """oneDNN and MKL compute a few rows with kernels that sum in another order; a request
    decoding alone must get the bits it gets in a batch (kernels/linear.py, SAME_BITS)."""
    _take(path, monkeypatch)
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


@pytest.mark.parametrize("path", ["as_probed", "unpacked"])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_fp32_packed_where_probed_else_exactly_f_linear(shape, with_bias, path, monkeypatch):
    """Packed, fp32 agrees with F.linear to fp32's rounding (oneDNN sums in another order than
    MKL); unpacked, it is F.linear's bits on rows padded to a multiple of 4."""
    _take(path, monkeypatch)
    out_f, in_f = shape
    w, b, g = _operands(out_f, in_f, torch.float32, with_bias, seed=2 * out_f + in_f)
    lin = linear(w, b)
    packed = path == "as_probed" and PACKS_FP32
    assert (lin.packed is not None) == packed and (lin.weight is None) == packed
    assert packed or torch.equal(lin.weight, w)
    assert lin.out_features == out_f
    for rows in ROWS:
        x = torch.randn(rows, in_f, generator=g)
        got = lin(x)
        assert got.shape == (rows, out_f)
        if packed:
            torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
        else:
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


@pytest.mark.skipif(not linear_module._onednn(), reason="torch has no oneDNN here")
def test_the_probe_refuses_a_kernel_whose_tail_rows_sum_otherwise(monkeypatch):
    """A kernel that computes the rows past a multiple of 4 differently (as MKL's sgemm does,
    SAME_BITS) is not packed for: the probe sees a row alone differ from it among others."""
    probe, real = linear_module._onednn_fp32_rows_independent, linear_module._packed_matmul

    def tails_apart(x, packed, bias):
        y = real(x, packed, bias)
        y[len(y) - len(y) % 4:] *= 1 + 2**-20
        return y

    monkeypatch.setattr(linear_module, "_packed_matmul", tails_apart)
    probe.cache_clear()
    try:
        assert probe() is False
    finally:
        probe.cache_clear()  # (the next caller probes the real kernel again)
