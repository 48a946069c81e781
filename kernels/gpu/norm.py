"""RMSNorm, residual add + RMSNorm, and SwiGLU's silu(gate) * up as Triton kernels.

Why: these are memory-bound, and torch runs each as several kernels with fp32 temporaries;
fused, each row is read and written once. `add_rms_norm` folds the residual add into the
norm that follows it: residual += x in place, then the norm of the new residual, one pass.

How: one program per row; the whole row sits in registers (hidden sizes up to a few
thousand), so the mean of squares needs no second read. The rounding follows the torch
references in kernels/elementwise.py so that results match bit for bit in most elements:
normalize in fp32, round to x's dtype, multiply by the weight in fp32, round to the result
dtype; silu(gate) is rounded to the dtype before the product with up, as F.silu(gate) * up is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _normalize(r, cols_ok, n_cols, eps):
    """r fp32 [BLOCK] (masked columns ignored) divided by its root mean square."""
    r = tl.where(cols_ok, r, 0.0)
    return r / tl.sqrt(tl.sum(r * r, 0) / n_cols + eps)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_cols, stride_x, stride_out, eps,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    y = _normalize(x.to(tl.float32), ok, n_cols, eps).to(x_ptr.dtype.element_ty)
    y = y.to(tl.float32) * w
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, n_cols, stride_x, stride_res,
                         stride_out, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    res = tl.load(res_ptr + row * stride_res + cols, mask=ok, other=0.0).to(tl.float32)
    # Round the sum to the residual's dtype first: that rounded value is what is stored and
    # what the reference normalizes.
    r = (x + res).to(res_ptr.dtype.element_ty)
    tl.store(res_ptr + row * stride_res + cols, r, mask=ok)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    y = _normalize(r.to(tl.float32), ok, n_cols, eps).to(res_ptr.dtype.element_ty)
    y = y.to(tl.float32) * w
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, n_cols, stride_gu, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    gate = tl.load(gu_ptr + row * stride_gu + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_gu + n_cols + cols, mask=ok, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (act * up).to(dt), mask=ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[..., N] as a [rows, N] view with a unit last stride (a copy only if it must)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _row_warps(n_cols: int) -> int:
    return 1 if n_cols <= 512 else 4 if n_cols <= 4096 else 8


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N], weight [N] -> [..., N] in torch.promote_types(x.dtype, weight.dtype)."""
    x2 = _rows(x)
    n = x2.shape[1]
    out = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype),
                      device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, weight, out, n, x2.stride(0), out.stride(0), eps,
            BLOCK=triton.next_power_of_2(n), num_warps=_row_warps(n),
        )
    return out.view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x (in place, in residual's dtype), then (rms_norm(residual), residual).

    residual must be viewable as [rows, N] with a unit last stride (contiguous will do)."""
    assert x.shape == residual.shape
    res2 = residual.view(-1, residual.shape[-1])
    assert res2.stride(-1) == 1, "residual is updated in place: it needs a unit last stride"
    x2 = _rows(x)
    n = res2.shape[1]
    out = torch.empty(res2.shape, dtype=torch.promote_types(residual.dtype, weight.dtype),
                      device=x.device)
    if res2.shape[0]:
        _add_rms_norm_kernel[(res2.shape[0],)](
            x2, res2, weight, out, n, x2.stride(0), res2.stride(0), out.stride(0), eps,
            BLOCK=triton.next_power_of_2(n), num_warps=_row_warps(n),
        )
    return out.view(residual.shape), residual


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2F] -> silu(gate) * up [..., F] in gate_up's dtype."""
    gu = _rows(gate_up)
    n = gu.shape[1] // 2
    out = torch.empty((gu.shape[0], n), dtype=gate_up.dtype, device=gate_up.device)
    if gu.shape[0] and n:
        block = min(1024, triton.next_power_of_2(n))
        _silu_mul_kernel[(gu.shape[0], triton.cdiv(n, block))](
            gu, out, n, gu.stride(0), out.stride(0), BLOCK=block,
            num_warps=4 if block >= 512 else 2,
        )
    return out.view(*gate_up.shape[:-1], n)
