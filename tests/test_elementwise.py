"""The fused C++ RMSNorm and silu(gate) * up (bf16 and fp32) equal their torch references,
and a row's result does not depend on the rows beside it."""

from __future__ import annotations

import pytest
import torch

from llmdb.kernels import cpu_ext
from llmdb.kernels.elementwise import (
    rms_norm,
    rms_norm_reference,
    silu_mul,
    silu_mul_reference,
)

pytestmark = pytest.mark.skipif(cpu_ext.load_library() is None, reason="no C++ compiler")


def _assert_bf16_close(fast: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal up to two bf16 rounding steps (fp32 math in another order), mostly bit-equal."""
    assert fast.dtype == ref.dtype == torch.bfloat16 and fast.shape == ref.shape
    f, r = fast.float(), ref.float()
    torch.testing.assert_close(f, r, atol=1e-6, rtol=2 ** -6)
    assert (f == r).float().mean() > 0.99


@pytest.mark.parametrize("rows,dim", [(1, 576), (37, 576), (300, 64)])
def test_rms_norm(rows, dim):
    torch.manual_seed(rows)
    x = (torch.randn(rows, dim) * 3).bfloat16()
    w = torch.randn(dim).bfloat16()
    _assert_bf16_close(rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5))


@pytest.mark.parametrize("rows,ffn", [(1, 1536), (53, 1536), (200, 96)])
def test_silu_mul(rows, ffn):
    torch.manual_seed(ffn)
    gate_up = (torch.randn(rows, 2 * ffn) * 4).bfloat16()
    _assert_bf16_close(silu_mul(gate_up), silu_mul_reference(gate_up))


@pytest.mark.parametrize("rows,dim", [(1, 576), (37, 576), (300, 64)])
def test_rms_norm_fp32(rows, dim):
    torch.manual_seed(rows)
    x, w = torch.randn(rows, dim) * 3, torch.randn(dim)
    # fp32 math in another order: a few ulps
    torch.testing.assert_close(rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5),
                               atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("rows,ffn", [(1, 1536), (53, 1536), (200, 96)])
def test_silu_mul_fp32(rows, ffn):
    torch.manual_seed(ffn)
    gate_up = torch.randn(rows, 2 * ffn) * 4
    torch.testing.assert_close(silu_mul(gate_up), silu_mul_reference(gate_up),
                               atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_dtypes_take_the_cpp_kernels(monkeypatch, dtype):
    calls = []
    for name in ("rms_norm", "silu_mul"):
        real = getattr(cpu_ext, name)
        monkeypatch.setattr(cpu_ext, name,
                            lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    rms_norm(torch.randn(3, 64).to(dtype), torch.randn(64).to(dtype), 1e-5)
    silu_mul(torch.randn(3, 128).to(dtype))
    assert calls == ["rms_norm", "silu_mul"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_alone_equals_it_among_others(dtype):
    torch.manual_seed(0)
    x, w = (torch.randn(45, 576) * 3).to(dtype), torch.randn(576).to(dtype)
    gate_up = (torch.randn(45, 2 * 1536) * 4).to(dtype)
    norm_all, act_all = rms_norm(x, w, 1e-5), silu_mul(gate_up)
    for r in (0, 17, 44):
        assert torch.equal(rms_norm(x[r : r + 1], w, 1e-5), norm_all[r : r + 1])
        assert torch.equal(silu_mul(gate_up[r : r + 1]), act_all[r : r + 1])


def test_other_inputs_take_the_reference_path():
    x, w = torch.randn(4, 8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    assert torch.equal(rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5))
    x32 = torch.randn(8, 4).t()  # not contiguous
    assert torch.equal(rms_norm(x32, w.float(), 1e-5),
                       rms_norm_reference(x32, w.float(), 1e-5))
    x16, w32 = torch.randn(4, 16).bfloat16(), torch.randn(16)  # dtypes that differ
    assert torch.equal(rms_norm(x16, w32, 1e-5), rms_norm_reference(x16, w32, 1e-5))
