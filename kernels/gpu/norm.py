"""RMSNorm, residual add + RMSNorm, and gated MLP activations (SwiGLU's silu(gate) * up,
GeGLU's gelu(gate) * up) as Triton kernels.

Why: these are memory-bound, and torch runs each as several kernels with fp32 temporaries;
fused, each row is read and written once. `add_rms_norm` folds the residual add into the
norm that follows it: residual += x in place, then the norm of the new residual, one pass.
Gemma normalizes each sublayer's output before the residual add as well: with x_weight, x is
normalized in the same pass before it is added.

How: one program per row; the whole row sits in registers (hidden sizes up to a few
thousand), so the mean of squares needs no second read. The rounding follows the torch
references in kernels/elementwise.py so that results match bit for bit in most elements:
Llama's norm (the default) normalizes in fp32, rounds to x's dtype, multiplies by the weight
in fp32 and rounds to the result dtype; Gemma's (fp32_scale) multiplies the fp32 normalized
row by an fp32 scale and rounds once, to x's dtype. An activation is rounded to the dtype
before the product with up, as F.silu(gate) * up is.
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
def _scale(r, w, dt, FP32_SCALE: tl.constexpr):
    """The normalized fp32 row r times the fp32 weight w: with r first rounded to dt
    (Llama), or not (Gemma). Returns fp32."""
    if not FP32_SCALE:
        r = r.to(dt).to(tl.float32)
    return r * w


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_cols, stride_x, stride_out, eps,
                     BLOCK: tl.constexpr, FP32_SCALE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    y = _scale(_normalize(x.to(tl.float32), ok, n_cols, eps), w, x_ptr.dtype.element_ty,
               FP32_SCALE)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, xw_ptr, out_ptr, n_cols, stride_x,
                         stride_res, stride_out, eps, BLOCK: tl.constexpr,
                         FP32_SCALE: tl.constexpr, NORM_X: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if NORM_X:  # x's own norm first, rounded to x's dtype as an unfused norm's output is
        xw = tl.load(xw_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        x = _scale(_normalize(x.to(tl.float32), ok, n_cols, eps), xw, x_ptr.dtype.element_ty,
                   FP32_SCALE).to(x_ptr.dtype.element_ty)
    res = tl.load(res_ptr + row * stride_res + cols, mask=ok, other=0.0).to(tl.float32)
    # Round the sum to the residual's dtype first: that rounded value is what is stored and
    # what the reference normalizes.
    r = (x.to(tl.float32) + res).to(res_ptr.dtype.element_ty)
    tl.store(res_ptr + row * stride_res + cols, r, mask=ok)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    y = _scale(_normalize(r.to(tl.float32), ok, n_cols, eps), w, res_ptr.dtype.element_ty,
               FP32_SCALE)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


# sqrt(2 / pi), in the tanh approximation of gelu (a tl.constexpr: a kernel may read no plain
# float global, see attention.py's _LOG2E).
_GELU_C = tl.constexpr(0.7978845608028654)


@triton.jit
def _gated_act_kernel(gu_ptr, out_ptr, n_cols, stride_gu, stride_out, BLOCK: tl.constexpr,
                      GELU: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    gate = tl.load(gu_ptr + row * stride_gu + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_gu + n_cols + cols, mask=ok, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    if GELU:
        # 0.5 (1 + tanh(u)) = sigmoid(2u): gelu_tanh(g) = g / (1 + exp(-2u)), with
        # u = sqrt(2 / pi) (g + 0.044715 g^3); no tanh needed (Triton has none).
        z = -2.0 * _GELU_C * (gate + 0.044715 * gate * gate * gate)
    else:
        z = -gate
    act = (gate / (1.0 + tl.exp(z))).to(dt).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (act * up).to(dt), mask=ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[..., N] as a [rows, N] view with a unit last stride (a copy only if it must)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _row_warps(n_cols: int) -> int:
    return 1 if n_cols <= 512 else 4 if n_cols <= 4096 else 8


def _out_dtype(x: torch.Tensor, weight: torch.Tensor, fp32_scale: bool) -> torch.dtype:
    return x.dtype if fp32_scale else torch.promote_types(x.dtype, weight.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, fp32_scale: bool = False
             ) -> torch.Tensor:
    """x [..., N], weight [N] -> [..., N] in torch.promote_types(x.dtype, weight.dtype);
    fp32_scale: Gemma's norm (elementwise.rms_norm_fp32), weight an fp32 scale, in x's
    dtype."""
    x2 = _rows(x)
    n = x2.shape[1]
    out = torch.empty(x2.shape, dtype=_out_dtype(x, weight, fp32_scale), device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, weight, out, n, x2.stride(0), out.stride(0), eps,
            BLOCK=triton.next_power_of_2(n), FP32_SCALE=fp32_scale, num_warps=_row_warps(n),
        )
    return out.view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float, fp32_scale: bool = False, x_weight: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x (in place, in residual's dtype), then (rms_norm(residual), residual).
    With x_weight, x is normalized with it first: residual += rms_norm(x, x_weight).
    fp32_scale: Gemma's norms, as in rms_norm.

    residual must be viewable as [rows, N] with a unit last stride (contiguous will do)."""
    assert x.shape == residual.shape
    res2 = residual.view(-1, residual.shape[-1])
    assert res2.stride(-1) == 1, "residual is updated in place: it needs a unit last stride"
    x2 = _rows(x)
    n = res2.shape[1]
    out = torch.empty(res2.shape, dtype=_out_dtype(residual, weight, fp32_scale),
                      device=x.device)
    if res2.shape[0]:
        _add_rms_norm_kernel[(res2.shape[0],)](
            x2, res2, weight, weight if x_weight is None else x_weight, out, n, x2.stride(0),
            res2.stride(0), out.stride(0), eps, BLOCK=triton.next_power_of_2(n),
            FP32_SCALE=fp32_scale, NORM_X=x_weight is not None, num_warps=_row_warps(n),
        )
    return out.view(residual.shape), residual


def _gated_act(gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
    gu = _rows(gate_up)
    n = gu.shape[1] // 2
    out = torch.empty((gu.shape[0], n), dtype=gate_up.dtype, device=gate_up.device)
    if gu.shape[0] and n:
        block = min(1024, triton.next_power_of_2(n))
        _gated_act_kernel[(gu.shape[0], triton.cdiv(n, block))](
            gu, out, n, gu.stride(0), out.stride(0), BLOCK=block, GELU=gelu,
            num_warps=4 if block >= 512 else 2,
        )
    return out.view(*gate_up.shape[:-1], n)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2F] -> silu(gate) * up [..., F] in gate_up's dtype."""
    return _gated_act(gate_up, gelu=False)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2F] -> gelu(gate) (tanh approximation) * up [..., F] in gate_up's
    dtype (elementwise.gelu_tanh_mul)."""
    return _gated_act(gate_up, gelu=True)
