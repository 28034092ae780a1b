"""Triton attention input prep: per-head q/k RMSNorm, rope from a cos/sin table, K/V cache write.

One program per (token, head) over Hq query heads then Hkv key heads: a query
program writes its normed, rotated row to `q_out`; a key program writes its normed,
rotated key and the value row into the caches at the token's slot. Rounding follows
hkv_kernels/rope/reference.py step by step (norm, then x*cos and rotate_half(x)*sin
each rounded to the model dtype, then their sum), so bf16 results match torch's. FP8 caches
store fp8(x / scale) of those model-dtype values, rounded as hkv_kernels/kv_quant.py does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hkv_kernels.fp8 import to_cache
from hkv_kernels.meta import next_pow2


@triton.jit
def _normed(x, rstd, w, PLUS_ONE: tl.constexpr, OUT_DTYPE: tl.constexpr):
    xf = x.to(tl.float32)
    if PLUS_ONE:
        return (xf * rstd * (1.0 + w.to(tl.float32))).to(OUT_DTYPE)
    return ((xf * rstd).to(OUT_DTYPE).to(tl.float32) * w.to(tl.float32)).to(OUT_DTYPE)


@triton.jit
def _prep_row(src, dst, w_ptr, cos_row, sin_row, head_dim, eps, scale, PLUS_ONE: tl.constexpr,
              ROT: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr,
              dtype: tl.constexpr, FP8: tl.constexpr):
    """Norm + rope one head row from `src` to `dst` (pointers to the rows' first elements), computed
    in `dtype` (the model's); an FP8 `dst` gets fp8(row / scale)."""
    out_dtype = dst.dtype.element_ty
    d = tl.arange(0, BLOCK_D)
    xf = tl.load(src + d, mask=d < head_dim, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / head_dim + eps)
    half = ROT // 2
    i = tl.arange(0, BLOCK_H)
    im = i < half
    n1 = _normed(tl.load(src + i, mask=im, other=0.0), rstd, tl.load(w_ptr + i, mask=im, other=0.0), PLUS_ONE, dtype)
    n2 = _normed(tl.load(src + half + i, mask=im, other=0.0), rstd, tl.load(w_ptr + half + i, mask=im, other=0.0),
                 PLUS_ONE, dtype)
    c1 = tl.load(cos_row + i, mask=im, other=0.0).to(tl.float32)
    c2 = tl.load(cos_row + half + i, mask=im, other=0.0).to(tl.float32)
    s1 = tl.load(sin_row + i, mask=im, other=0.0).to(tl.float32)
    s2 = tl.load(sin_row + half + i, mask=im, other=0.0).to(tl.float32)
    f1, f2 = n1.to(tl.float32), n2.to(tl.float32)
    o1 = (f1 * c1).to(dtype).to(tl.float32) + (-f2 * s1).to(dtype).to(tl.float32)
    o2 = (f2 * c2).to(dtype).to(tl.float32) + (f1 * s2).to(dtype).to(tl.float32)
    tl.store(dst + i, to_cache(o1.to(dtype), scale, out_dtype, FP8), mask=im)
    tl.store(dst + half + i, to_cache(o2.to(dtype), scale, out_dtype, FP8), mask=im)
    j = ROT + tl.arange(0, BLOCK_P)
    jm = j < head_dim
    npass = _normed(tl.load(src + j, mask=jm, other=0.0), rstd, tl.load(w_ptr + j, mask=jm, other=0.0), PLUS_ONE, dtype)
    tl.store(dst + j, to_cache(npass, scale, out_dtype, FP8), mask=jm)


@triton.jit
def _attention_prep_kernel(
    q_ptr, k_ptr, v_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr,
    q_heads, head_dim, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_cs, stride_ch, stride_table, eps, k_scale, v_scale,
    PLUS_ONE: tl.constexpr, ROT: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr,
    FP8: tl.constexpr,
):
    dtype = q_out_ptr.dtype.element_ty
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos_row = cos_ptr + pos * stride_table
    sin_row = sin_ptr + pos * stride_table
    if h < q_heads:
        _prep_row(q_ptr + t * stride_qt + h * stride_qh, q_out_ptr + t * stride_ot + h * stride_oh, qw_ptr,
                  cos_row, sin_row, head_dim, eps, 1.0, PLUS_ONE, ROT, BLOCK_D, BLOCK_H, BLOCK_P, dtype, False)
    else:
        kh = h - q_heads
        slot = tl.load(slot_ptr + t).to(tl.int64)
        dst = slot * stride_cs + kh * stride_ch
        _prep_row(k_ptr + t * stride_kt + kh * stride_kh, k_cache_ptr + dst, kw_ptr,
                  cos_row, sin_row, head_dim, eps, k_scale, PLUS_ONE, ROT, BLOCK_D, BLOCK_H, BLOCK_P, dtype, FP8)
        d = tl.arange(0, BLOCK_D)
        vv = tl.load(v_ptr + t * stride_vt + kh * stride_vh + d, mask=d < head_dim, other=0.0)
        tl.store(v_cache_ptr + dst + d, to_cache(vv.to(dtype), v_scale, v_cache_ptr.dtype.element_ty, FP8),
                 mask=d < head_dim)


def attention_prep(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
    positions: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, eps: float, plus_one: bool,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, out: torch.Tensor | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """q: [T, Hq, D], k, v: [T, Hkv, D] (head rows contiguous, views of projections allowed);
    cos_table, sin_table: [max_pos, rot] in the model dtype (the rotary's tables); positions,
    slot_mapping: [T] int; q_norm, k_norm: [D]; k_cache, v_cache: [P, page_size, Hkv, D] one
    contiguous storage layer (FP8: stored as fp8(x / scale), kv_scales the layer's (K, V) scales).
    Writes K/V at the slots; returns out: [T, Hq, D] (q rotated)."""
    tokens, q_heads, head_dim = q.shape
    kv_heads, rot = k.shape[1], cos_table.shape[1]
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1 and cos_table.stride(1) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and rot % 2 == 0 and rot <= head_dim
    if out is None:
        out = torch.empty(tokens, q_heads, head_dim, dtype=q.dtype, device=q.device)
    if tokens == 0:
        return out
    _attention_prep_kernel[(tokens, q_heads + kv_heads)](
        q, k, v, out, k_cache, v_cache, q_norm, k_norm, cos_table, sin_table, positions, slot_mapping,
        q_heads, head_dim, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), k_cache.stride(1), k_cache.stride(2), cos_table.stride(0), eps,
        float(kv_scales[0]), float(kv_scales[1]), FP8=k_cache.dtype == torch.float8_e4m3fn, PLUS_ONE=plus_one, ROT=rot, BLOCK_D=next_pow2(head_dim), BLOCK_H=next_pow2(max(rot // 2, 1)),
        BLOCK_P=next_pow2(max(head_dim - rot, 1)), num_warps=1 if head_dim <= 128 else 2,
    )
    return out
