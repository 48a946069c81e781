"""The fused bf16 RMSNorm and silu(gate) * up equal their torch references."""

from __future__ import annotations

import pytest
import torch

from llmdb.kernels import elementwise
from llmdb.kernels.elementwise import (
    rms_norm,
    rms_norm_reference,
    silu_mul,
    silu_mul_reference,
)

pytestmark = pytest.mark.skipif(elementwise.load_library() is None, reason="no C++ compiler")


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


def test_fp32_takes_the_reference_path():
    x, w = torch.randn(4, 8), torch.randn(8)
    assert torch.equal(rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5))
    gu = torch.randn(4, 16)
    assert torch.equal(silu_mul(gu), silu_mul_reference(gu))
