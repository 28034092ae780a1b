"""Triton RMSNorms: one program per row, the residual add fused in, and the gated GDN output norm.

Rounding follows the references (hkv_kernels/norm/reference.py) step by step: the
residual sum is rounded to the model dtype before it is normalized, and each
convention rounds where transformers rounds, so bf16 results match torch's to the
last bit up to the order of the fp32 sum of squares.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hkv_kernels.meta import next_pow2


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, heads,
    stride_xt, stride_xh, stride_rt, stride_ot, stride_oh, stride_st, eps,
    HAS_RES: tl.constexpr, PLUS_ONE: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    t = (row // heads).to(tl.int64)
    h = row % heads
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + t * stride_xt + h * stride_xh + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + t * stride_rt + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + t * stride_st + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if PLUS_ONE:
        y = xf * rstd * (1.0 + w)
    else:
        y = (xf * rstd).to(out_ptr.dtype.element_ty).to(tl.float32) * w
    tl.store(out_ptr + t * stride_ot + h * stride_oh + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr, z_ptr, w_ptr, out_ptr, n_cols, heads,
    stride_xt, stride_xh, stride_zt, stride_zh, stride_ot, stride_oh, eps, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    t = (row // heads).to(tl.int64)
    h = row % heads
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    xf = tl.load(x_ptr + t * stride_xt + h * stride_xh + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    hn = (xf * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    hn = (w * hn).to(out_ptr.dtype.element_ty).to(tl.float32)
    z = tl.load(z_ptr + t * stride_zt + h * stride_zh + cols, mask=mask, other=0.0).to(tl.float32)
    y = hn * (z * tl.sigmoid(z))
    tl.store(out_ptr + t * stride_ot + h * stride_oh + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> tuple[int, int, int, int]:
    """(tokens, heads, token stride, head stride) of a [T, D] or [T, H, D] view with D contiguous."""
    assert x.stride(-1) == 1
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), 0
    return x.shape[0], x.shape[1], x.stride(0), x.stride(1)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, plus_one: bool,
    residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm over the last dim of x ([T, D] or [T, H, D] with D contiguous, rows may be strided).

    residual: None, or [T, D]: then x + residual is normalized and also returned, written in
    place into `residual` (the decoder's residual stream). weight: [D].
    Returns (out [same shape as x, contiguous unless given], the new residual or None).
    """
    tokens, heads, stride_xt, stride_xh = _rows(x)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _, _, stride_ot, stride_oh = _rows(out)
    n_cols = x.shape[-1]
    if tokens * heads == 0:
        return out, residual
    has_res = residual is not None
    if has_res:
        assert heads == 1 and residual.stride(-1) == 1 and residual.shape == x.shape
    _rms_norm_kernel[(tokens * heads,)](
        x, residual if has_res else x, weight, out, residual if has_res else out, n_cols, heads,
        stride_xt, stride_xh, residual.stride(0) if has_res else 0, stride_ot, stride_oh,
        residual.stride(0) if has_res else 0, eps,
        HAS_RES=has_res, PLUS_ONE=plus_one, BLOCK=next_pow2(n_cols), num_warps=4 if n_cols >= 1024 else 1,
    )
    return out, residual


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm(x) * weight * silu(gate) over the last dim; x, gate: [T, H, D] (D contiguous, gate
    may be a strided view); weight: [D]. Returns out: [T, H, D] (contiguous unless given)."""
    tokens, heads, stride_xt, stride_xh = _rows(x)
    _, _, stride_zt, stride_zh = _rows(gate)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _, _, stride_ot, stride_oh = _rows(out)
    n_cols = x.shape[-1]
    if tokens * heads == 0:
        return out
    _gated_rms_norm_kernel[(tokens * heads,)](
        x, gate, weight, out, n_cols, heads, stride_xt, stride_xh, stride_zt, stride_zh, stride_ot, stride_oh,
        eps, BLOCK=next_pow2(n_cols), num_warps=1,
    )
    return out
