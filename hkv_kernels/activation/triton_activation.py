"""Triton SiLU-and-multiply: out = silu(gate) * up over a [T, I] pair (one fused gate|up GEMM's halves)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, o_ptr, n_cols, stride_gt, stride_ut, stride_ot, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(g_ptr + t * stride_gt + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + t * stride_ut + cols, mask=mask, other=0.0).to(tl.float32)
    # torch rounds silu(gate) to the model dtype before the product
    s = (g * tl.sigmoid(g)).to(o_ptr.dtype.element_ty).to(tl.float32)
    tl.store(o_ptr + t * stride_ot + cols, (s * u).to(o_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate, up: [T, I] (columns contiguous; e.g. the two halves of one [T, 2I] GEMM output).
    Returns out: [T, I] contiguous unless given."""
    assert gate.shape == up.shape and gate.stride(1) == 1 and up.stride(1) == 1
    tokens, n_cols = gate.shape
    if out is None:
        out = torch.empty(tokens, n_cols, dtype=gate.dtype, device=gate.device)
    if tokens == 0:
        return out
    block = 1024
    _silu_mul_kernel[(tokens, triton.cdiv(n_cols, block))](
        gate, up, out, n_cols, gate.stride(0), up.stride(0), out.stride(0), BLOCK=block, num_warps=4,
    )
    return out
