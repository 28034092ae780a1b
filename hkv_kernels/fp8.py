"""Triton helpers of FP8 KV pages (the torch form and the format: hkv_kernels/kv_quant.py)."""

from __future__ import annotations

import triton
import triton.language as tl

FP8_MAX = 448.0


@triton.jit
def fp8_bits(x, scale):
    """fp8_e4m3fn(clamp(x / scale, -448, 448)), rounded to nearest even, as its byte (uint8).

    Built by hand because the interpreter's fp32 -> fp8 cast is wrong when the rounding carries
    (127.0 gave 64.0) and drops the sign of zero; on the GPU this equals the hardware's cast.
    """
    # division rounded to nearest as torch's is (the GPU's `/` is an approximation: ties then round apart)
    y = tl.minimum(tl.maximum(tl.div_rn(x.to(tl.float32), scale), -448.0), 448.0)
    negative = y.to(tl.int32, bitcast=True) < 0
    a = tl.abs(y)
    exponent = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    # 3 mantissa bits; below 2^-6 the subnormals' fixed step 2^-9
    # (powers of two built from their bits: exact, where the GPU's exp2 and division are approximations)
    step = tl.maximum(exponent, -6) - 3  # in [-9, 5]
    ulp = ((step + 127) << 23).to(tl.float32, bitcast=True)
    inverse = ((127 - step) << 23).to(tl.float32, bitcast=True)
    a = ((a * inverse + 12582912.0) - 12582912.0) * ulp  # 1.5 * 2^23: fp32 addition rounds to an integer, ties even
    abits = a.to(tl.int32, bitcast=True)
    exponent = ((abits >> 23) & 0xFF) - 127  # rounding may carry into the next binade
    normal = ((exponent + 7) << 3) | ((abits >> 20) & 7)
    subnormal = (a * 512.0).to(tl.int32)
    magnitude = tl.where(exponent >= -6, normal, subnormal)
    return (magnitude | tl.where(negative, 128, 0)).to(tl.uint8)


@triton.jit
def to_cache(x, scale, CACHE_DTYPE: tl.constexpr, FP8: tl.constexpr):
    """A value as a cache of CACHE_DTYPE stores it: fp8(x / scale) for FP8 pages, else a cast."""
    # one return: Triton's code generator (not its interpreter) visits a statement after a constexpr branch's
    # return as well, and two returns of different types do not compile
    if FP8:
        y = fp8_bits(x, scale).to(CACHE_DTYPE, bitcast=True)
    else:
        y = x.to(CACHE_DTYPE)
    return y


@triton.jit
def from_cache(x, scale, DTYPE: tl.constexpr, FP8: tl.constexpr):
    """Stored values in DTYPE (the attention's): FP8 times its scale, computed in fp32."""
    if FP8:  # one return (see to_cache)
        y = (x.to(tl.float32) * scale).to(DTYPE)
    else:
        y = x
    return y
