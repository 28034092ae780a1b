"""Triton block-FP8 GEMM: out = x W^T (+ bias) with W stored as float8_e4m3fn and a multiplier per
128 x 128 block (reference.dequantize).

Weight-only: the activations stay in the model dtype and each weight tile is dequantized in
registers, (fp32(q) * scale) rounded to the activation dtype, before a tensor-core dot in that dtype.
At decode (1 to 64 rows) the GEMM is bound by reading the weights, so one byte a weight instead of two
is the whole gain, and the dequantized tile equals the reference's weight element for element: an
FP8 model differs from its dequantized bf16 twin only by accumulation order. (Quantizing the
activations per token group, as DeepSeek's block FP8 does, would add a pass over x and rounding the
reference does not have, for compute that decode does not lack.)

Few rows leave few output tiles, too few to keep every SM reading: the K loop is then split over
SPLIT_K programs that write fp32 partial sums, added in a fixed order afterwards (no atomics, so the
result does not depend on scheduling). Nothing reads the host: the launch is graph-safe.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

from hkv_kernels.common import dot_precision
from hkv_kernels.fp8_gemm.reference import BLOCK, scale_shape
from hkv_kernels.meta import next_pow2


@triton.jit
def _fp8_gemm_kernel(
    x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, M, N, K, k_per_split,
    stride_xm, stride_wn, stride_sn, stride_om, stride_os,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
):
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    row_ok = rows < M
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + (k_start + ks)[None, :]  # [BM, BK]
    w_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_wn + (k_start + ks)[:, None]  # [BK, BN]
    s_ptrs = s_ptr + (cols // SCALE_BLOCK).to(tl.int64) * stride_sn  # [BN], the block column added per step
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_ok = ks < k_end - k0
        a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        q = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        s = tl.load(s_ptrs + k0 // SCALE_BLOCK, mask=col_ok, other=0.0)  # BLOCK_K divides SCALE_BLOCK
        w = (q.to(tl.float32) * s[None, :]).to(dtype)  # the reference's dequantized weight
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + split.to(tl.int64) * stride_os + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@dataclass(frozen=True)
class Fp8Tile:
    """BLOCK_M x BLOCK_N output tiles, BLOCK_K (a divisor of 128) per step, SPLIT_K programs over K."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


@lru_cache(maxsize=8)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def fp8_tile(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> Fp8Tile:
    """The tile for an [m, k] x [k, n] product: decode-sized m gets narrow tiles and a K split until
    about two programs per SM are reading weights; prefill gets 128-wide tiles and no split. fp32
    (exact ieee dots, the parity mode and the interpreter) gets small tiles."""
    if dtype == torch.float32:
        return Fp8Tile(16, 32, 32, 1, 4, 2)
    if m > 64:
        return Fp8Tile(64 if m <= 128 else 128, 128, 128, 1, 8, 3)
    block_m = max(16, next_pow2(m))
    tiles = -(-n // 64)
    sms = _sm_count(device.index or 0) if device.type == "cuda" else 1
    chunks = -(-k // 128)
    split = 1
    while split * 2 <= chunks and tiles * split < 2 * sms:
        split *= 2
    return Fp8Tile(block_m, 64, 128, split, 4, 4)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
               tile: Fp8Tile | None = None) -> torch.Tensor:
    """x W^T (+ bias) with W = dequantize(weight, scale) (Triton).

    x: [..., K] (K contiguous) in fp32 / bf16 / fp16; weight: [N, K] float8_e4m3fn (K contiguous);
    scale: [ceil(N/128), ceil(K/128)] fp32 (may be a row slice of a wider one); bias: [N] or None;
    tile: override fp8_tile (benchmark sweeps). Returns [..., N] in x's dtype.
    """
    n, k = weight.shape
    assert weight.dtype == torch.float8_e4m3fn and weight.stride(1) == 1 and x.shape[-1] == k
    assert tuple(scale.shape) == scale_shape(n, k) and scale.stride(1) == 1
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*x.shape[:-1], n)
    tile = tile or fp8_tile(m, n, k, x.dtype, x.device)
    assert BLOCK % tile.block_k == 0
    k_per_split = -(-(-(-k // tile.split_k)) // BLOCK) * BLOCK  # whole scale blocks per split
    split = -(-k // k_per_split)
    target = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, tile.block_n), triton.cdiv(m, tile.block_m), split)
    has_bias = bias is not None and split == 1
    _fp8_gemm_kernel[grid](
        x2, weight, scale, bias if has_bias else scale, target, m, n, k, k_per_split,
        x2.stride(0), weight.stride(0), scale.stride(0), target.stride(-2), target.stride(0) if split > 1 else 0,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, SCALE_BLOCK=BLOCK,
        HAS_BIAS=has_bias, PRECISION=dot_precision(x.dtype), num_warps=tile.num_warps, num_stages=tile.num_stages,
    )
    if split > 1:
        total = target.sum(dim=0)  # fixed order: deterministic
        if bias is not None:
            total += bias.float()
        out.copy_(total)
    return out.view(*x.shape[:-1], n)
