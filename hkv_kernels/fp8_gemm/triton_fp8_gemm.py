"""Triton block-FP8 GEMM: out = x W^T (+ bias) with W stored as float8_e4m3fn and a multiplier per
128 x 128 block (reference.dequantize).

Weight-only: the activations stay in the model dtype and each weight tile is dequantized in
registers, (fp32(q) * scale) rounded to the activation dtype, before it meets x. At decode (1 to 64
rows) the GEMM is bound by reading the weights, so one byte a weight instead of two is the whole
gain, and the dequantized tile equals the reference's weight element for element: an FP8 model
differs from its dequantized bf16 twin only by accumulation order (every path accumulates in fp32),
unless a tile sets scale_out (below).
(Quantizing the activations per token group, as DeepSeek's block FP8 does, would add a pass over x
and rounding the reference does not have, for compute that decode does not lack.)

Three kernels, picked per batch size by `fp8_tile` (the `kind` of an Fp8Tile):
- "gemv" (1 row by default, up to 4): no tensor cores. A program streams [BLOCK_N, BLOCK_K] weight tiles (K contiguous,
  several 16-byte rows per thread), loading the next tile while it dequantizes this one, and adds each
  tile's products with up to 4 activation rows into [BLOCK_N] fp32 sums: a dot would pad one row to 16
  and route every tile through the MMA layout for nothing.
- "dot" (decode batches): the weight tile is the MMA's M side, [BLOCK_N, BLOCK_K] x [BLOCK_K, BLOCK_M],
  so 64 or 128 weight rows fill it and the few activation rows are the narrow N side.
- "mm" (prefill): activations on the M side, 64 or 128 rows per tile.
"gemv" and "dot" tiles have BLOCK_N dividing 128, so one program's rows share a scale row and each
128-column step needs one scalar scale.

That scalar can multiply the step's fp32 sums instead of every weight: an Fp8Tile with scale_out runs
the gemv as s * sum(fp32(q) * x) and the dot as acc += dot(q, x) * s (one FMA per accumulator element).
On sm_90 dequantizing adds to the conversion the product needs anyway a multiply, a rounding to bf16
and, in the gemv, a widening back to f32: the M = 1 gemv's loop runs 9.3 SASS instructions a weight
element with it and 6.0 with scale_out (docs/kernels.md). At M = 1 the gemv must take in about 13
weight bytes a clock per SM to read at copy bandwidth, so instruction issue rather than memory may
bound it. scale_out is off in every default tile until the GPU sweep (tools/bench/bench_fp8_kernels.py)
picks it, because it rounds differently: the weight is never rounded to the activation dtype (fp8
values, and their products with bf16 or fp16 activations, are exact in fp32), so the result is nearer
the exact product with the fp8 weights than the reference, and an FP8 model then differs from its
dequantized twin by the reference's weight rounding (up to 2^-9 relative a bf16 weight), not by
accumulation order alone.

Few output tiles leave SMs idle: the K loop is then split over SPLIT programs that write fp32 partial
sums, added afterwards by one small kernel in split order (no atomics, so the result does not depend
on scheduling; the bias is added after the sum, as without a split). Nothing reads the host: the
launch is graph-safe.
That second kernel is a second launch for every decode GEMM (about 72 a step of the benchmark model),
each with its launch gap. An Fp8Tile with fused_sum drops it: each split program stores its partials,
then bumps its output tile's arrival counter (an acquire-release atomic, after a barrier so that every
thread's stores are issued), and the program that arrives last loads the tile's partials past L1 in
split order, adds them and the bias exactly as the sum kernel does (the result is the same bit for bit),
stores the output and resets the counter to zero for the next launch or graph replay. The counters
(tile_counters) are shared by every launch on a device, so two such GEMMs must not run at once on
different streams. fused_sum is off in every default tile until a GPU run of its CUDA-graph replay test
and the sweep: races between SMs cannot show in the interpreter, which runs programs one at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import torch
import triton
import triton.language as tl

from hkv_kernels.common import dot_precision
from hkv_kernels.fp8_gemm.reference import BLOCK, scale_shape
from hkv_kernels.meta import next_pow2


@triton.jit
def _dequant(q, s, dtype: tl.constexpr):
    """fp8 tile times its block's scale, in fp32, rounded to the activation dtype (the reference's weight)."""
    return (q.to(tl.float32) * s).to(dtype)


@triton.jit
def _scaled(sums, s, SCALE_OUT: tl.constexpr):
    """A step's fp32 sums times its scale where the weights went in undequantized (SCALE_OUT), else as they are."""
    if SCALE_OUT:
        sums = sums * s
    return sums


@triton.jit
def _w_tile(ptrs, col_ok, ks, k_left, EVEN_K: tl.constexpr):
    """A [BLOCK_N, BLOCK_K] fp8 weight tile, zeros past N and past the split's end (k_left columns remain
    from ptrs; a tile at or past the end issues no memory traffic)."""
    if EVEN_K:
        q = tl.load(ptrs, mask=col_ok[:, None] & (k_left > 0), other=0.0)
    else:
        q = tl.load(ptrs, mask=col_ok[:, None] & (ks < k_left)[None, :], other=0.0)
    return q


@triton.jit
def _x_row(ptrs, row_ok, k_ok, EVEN_K: tl.constexpr):
    """One activation row's BLOCK_K columns as fp32 (zeros past M, and past K unless EVEN_K)."""
    if EVEN_K:
        x = tl.load(ptrs, mask=row_ok, other=0.0)
    else:
        x = tl.load(ptrs, mask=row_ok & k_ok, other=0.0)
    return x.to(tl.float32)


@triton.jit
def _store_row(ptrs, acc, bias_ptr, cols, ok, HAS_BIAS: tl.constexpr):
    """Add the bias to one output row's [BLOCK_N] fp32 sums and store them."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(ptrs, acc.to(ptrs.dtype.element_ty), mask=ok)


@triton.jit
def _sum_if_last(part_ptrs, sum_ptrs, ok, bias_ptrs, bias_ok, count_ptr, stride_os, HAS_BIAS: tl.constexpr):
    """Run by each split program of an output tile once its partials are stored (part_ptrs: the tile's
    addresses in split 0, stride_os apart): the one that arrives last adds the tile's partials in split
    order (+ bias, broadcast from bias_ptrs) and stores them at sum_ptrs, as _sum_splits_kernel does, then
    resets the tile's counter for the next launch or graph replay."""
    split = tl.num_programs(2)
    tl.debug_barrier()  # every thread's partial stores are issued before the arrival releases them
    arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel")  # release this program's partials, acquire the others'
    if arrived == split - 1:
        # .cg: read from L2, since another SM's L1 may hold a stale line and L1 is not coherent across SMs
        acc = tl.load(part_ptrs, mask=ok, other=0.0, cache_modifier=".cg")
        for _ in range(1, split):
            part_ptrs += stride_os  # pointer steps, as in _sum_splits_kernel
            acc += tl.load(part_ptrs, mask=ok, other=0.0, cache_modifier=".cg")
        if HAS_BIAS:
            acc += tl.load(bias_ptrs, mask=bias_ok, other=0.0).to(tl.float32)
        tl.store(sum_ptrs, acc.to(sum_ptrs.dtype.element_ty), mask=ok)
        tl.atomic_xchg(count_ptr, 0, sem="relaxed")  # the kernel's end orders it before the next launch


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, M, N, K, k_per_split,
    stride_xm, stride_wn, stride_sn, stride_om, stride_os, sum_ptr, count_ptr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_BLOCK: tl.constexpr,
    EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, SCALE_OUT: tl.constexpr, FUSED_SUM: tl.constexpr,
):
    pid_n = tl.program_id(0)
    row0 = tl.program_id(1) * ROWS
    split = tl.program_id(2)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * stride_wn + (k_start + ks)[None, :]  # [BN, BK]
    x_ptrs = x_ptr + row0.to(tl.int64) * stride_xm + k_start + ks  # [BK] of row row0
    s_row = s_ptr + ((pid_n * BLOCK_N) // SCALE_BLOCK).to(tl.int64) * stride_sn  # BLOCK_N divides 128
    dtype = x_ptr.dtype.element_ty
    acc0 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    # the next step's weights load while this step's are used: ptxas sinks a load to just before its
    # first use, so without this each step would wait out a full memory latency
    q = _w_tile(w_ptrs, col_ok, ks, k_end - k_start, EVEN_K)
    for k0 in range(k_start, k_end, BLOCK_K):
        q_next = _w_tile(w_ptrs + BLOCK_K, col_ok, ks, k_end - k0 - BLOCK_K, EVEN_K)
        s = tl.load(s_row + k0 // SCALE_BLOCK)  # BLOCK_K divides 128: one scale per step
        if SCALE_OUT:  # s scales the sums: fp8 values, and their products with x, are exact in fp32
            w = q.to(tl.float32)  # [BN, BK]
        else:
            w = _dequant(q, s, dtype).to(tl.float32)  # [BN, BK], the reference's weights
        k_ok = ks < k_end - k0
        acc0 += _scaled(tl.sum(w * _x_row(x_ptrs, row0 < M, k_ok, EVEN_K)[None, :], axis=1), s, SCALE_OUT)
        if ROWS > 1:
            x1 = _x_row(x_ptrs + stride_xm, row0 + 1 < M, k_ok, EVEN_K)
            acc1 += _scaled(tl.sum(w * x1[None, :], axis=1), s, SCALE_OUT)
        if ROWS > 2:
            x2 = _x_row(x_ptrs + 2 * stride_xm, row0 + 2 < M, k_ok, EVEN_K)
            x3 = _x_row(x_ptrs + 3 * stride_xm, row0 + 3 < M, k_ok, EVEN_K)
            acc2 += _scaled(tl.sum(w * x2[None, :], axis=1), s, SCALE_OUT)
            acc3 += _scaled(tl.sum(w * x3[None, :], axis=1), s, SCALE_OUT)
        q = q_next
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    part_bias: tl.constexpr = HAS_BIAS and not FUSED_SUM  # a fused sum adds the bias after the splits
    out_row = out_ptr + split.to(tl.int64) * stride_os + row0.to(tl.int64) * stride_om + cols
    _store_row(out_row, acc0, bias_ptr, cols, col_ok & (row0 < M), part_bias)
    if ROWS > 1:
        _store_row(out_row + stride_om, acc1, bias_ptr, cols, col_ok & (row0 + 1 < M), part_bias)
    if ROWS > 2:
        _store_row(out_row + 2 * stride_om, acc2, bias_ptr, cols, col_ok & (row0 + 2 < M), part_bias)
        _store_row(out_row + 3 * stride_om, acc3, bias_ptr, cols, col_ok & (row0 + 3 < M), part_bias)
    if FUSED_SUM:
        rows = row0 + tl.arange(0, ROWS)
        tile = rows[:, None].to(tl.int64) * stride_om + cols[None, :]  # [ROWS, BN] offsets in one [M, N]
        _sum_if_last(out_ptr + tile, sum_ptr + tile, (rows < M)[:, None] & col_ok[None, :], bias_ptr + cols[None, :],
                     col_ok[None, :], count_ptr + tl.program_id(1) * tl.num_programs(0) + pid_n, stride_os, HAS_BIAS)


@triton.jit
def _fp8_dot_kernel(
    x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, M, N, K, k_per_split,
    stride_xm, stride_wn, stride_sn, stride_om, stride_os, sum_ptr, count_ptr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_BLOCK: tl.constexpr,
    EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, SCALE_OUT: tl.constexpr,
    FUSED_SUM: tl.constexpr,
):
    pid_n = tl.program_id(0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    split = tl.program_id(2)
    col_ok = cols < N
    row_ok = rows < M
    ks = tl.arange(0, BLOCK_K)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * stride_wn + (k_start + ks)[None, :]  # [BN, BK]
    x_ptrs = x_ptr + rows[None, :].to(tl.int64) * stride_xm + (k_start + ks)[:, None]  # [BK, BM]: x^T
    s_row = s_ptr + ((pid_n * BLOCK_N) // SCALE_BLOCK).to(tl.int64) * stride_sn  # BLOCK_N divides 128
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            q = tl.load(w_ptrs, mask=col_ok[:, None], other=0.0)
            a = tl.load(x_ptrs, mask=row_ok[None, :], other=0.0)
        else:
            k_ok = ks < k_end - k0
            q = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            a = tl.load(x_ptrs, mask=k_ok[:, None] & row_ok[None, :], other=0.0)
        s = tl.load(s_row + k0 // SCALE_BLOCK)  # BLOCK_K divides 128: one scale per step
        if SCALE_OUT:  # fp8 values are exact in every dot dtype: a fresh dot per step, then one FMA
            acc += tl.dot(q.to(dtype), a, input_precision=PRECISION) * s  # [BN, BM]
        else:
            acc = tl.dot(_dequant(q, s, dtype), a, acc, input_precision=PRECISION)  # [BN, BM]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if HAS_BIAS and not FUSED_SUM:  # a fused sum adds the bias after the splits
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
    tile = rows[None, :].to(tl.int64) * stride_om + cols[:, None]  # [BN, BM] offsets in one [M, N]
    ok = col_ok[:, None] & row_ok[None, :]
    tl.store(out_ptr + split.to(tl.int64) * stride_os + tile, acc.to(out_ptr.dtype.element_ty), mask=ok)
    if FUSED_SUM:
        _sum_if_last(out_ptr + tile, sum_ptr + tile, ok, bias_ptr + cols[:, None], col_ok[:, None],
                     count_ptr + tl.program_id(1) * tl.num_programs(0) + pid_n, stride_os, HAS_BIAS)


@triton.jit
def _fp8_mm_kernel(
    x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, M, N, K, k_per_split,
    stride_xm, stride_wn, stride_sn, stride_om, stride_os,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_BLOCK: tl.constexpr,
    EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
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
        if EVEN_K:
            a = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            q = tl.load(w_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = ks < k_end - k0
            a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            q = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        s = tl.load(s_ptrs + k0 // SCALE_BLOCK, mask=col_ok, other=0.0)  # BLOCK_K divides SCALE_BLOCK
        acc = tl.dot(a, _dequant(q, s[None, :], dtype), acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + split.to(tl.int64) * stride_os + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _sum_splits_kernel(part_ptr, bias_ptr, out_ptr, numel, N, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK: tl.constexpr):
    """out = sum of SPLIT fp32 partials [SPLIT, M, N] in split order (+ bias), in out's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    part = part_ptr + offs
    acc = tl.load(part, mask=ok, other=0.0)
    for _ in tl.static_range(1, SPLIT):
        part += numel  # pointer steps: SPLIT * numel may pass 2^31
        acc += tl.load(part, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


KINDS = ("gemv", "dot", "mm")


@dataclass(frozen=True)
class Fp8Tile:
    """One launch's tiling.

    kind: "gemv" | "dot" | "mm" (module docstring). block_m: activation rows per program (gemv: 1, 2 or 4;
    dot and mm: >= 16, tl.dot's minimum). block_n: weight rows per program (gemv and dot: a divisor of 128;
    block_m, block_n and num_warps are powers of two).
    block_k: K columns per loop step, a divisor of 128 (gemv: also at most 16 * num_warps, so that the
    activation row's [BLOCK_K] load has fewer elements than the program has threads: Triton then loads it
    straight into the weight tile's layout, where a larger one keeps its own coalesced layout and goes
    through shared memory every step, see isExpensiveLoadOrStore). split_k: programs over K, or None to
    split until the grid has about per_sm programs per SM. scale_out (gemv and dot only): multiply each
    step's fp32 sums by the step's scale instead of dequantizing every weight, which saves a multiply and
    two conversions per weight element where decode may be bound by instruction issue (module docstring: it
    rounds differently from the reference). "mm" refuses it: prefill has tensor-core work to hide the
    dequantization behind. fused_sum (gemv and dot only): where K is split, the last split program of each
    output tile adds the partials in the same kernel instead of a second launch (module docstring); "mm"
    refuses it, as prefill tiles do not split.
    """

    kind: str
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int | None = None
    per_sm: int = 2
    scale_out: bool = False
    fused_sum: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Fp8Tile kind {self.kind!r} is not one of {KINDS}")
        for flag in ("scale_out", "fused_sum"):
            if getattr(self, flag) and self.kind == "mm":
                raise ValueError(f"{self}: {flag} is a decode-kernel variant (gemv, dot); mm does not take it")
        steps_ok = BLOCK % self.block_k == 0 and (self.kind != "gemv" or self.block_k <= 16 * self.num_warps)
        rows_ok = self.block_m in (1, 2, 4) if self.kind == "gemv" else self.block_m >= 16
        pow2 = all(v > 0 and v & (v - 1) == 0 for v in (self.block_m, self.block_n, self.num_warps))
        if not (pow2 and steps_ok and rows_ok and (self.kind == "mm" or BLOCK % self.block_n == 0)):
            raise ValueError(f"{self} does not fit its kind's constraints (Fp8Tile's docstring)")


# Decode tiles by batch size: (largest M, tile); M above the last entry is prefill. NOT TUNED on a GPU yet:
# `python3 -m tools.bench.bench_kernels --only fp8` times candidates per M on the benchmark model's
# projections and prints the entry to put here; gemv's and dot's block_m shrink to the batch. Chosen so
# far from sm_90 compiles only (tools/bench/fp8_compile_check.py): the M = 1 gemv holds 4 weight rows of
# 16 bytes a thread and prefetches the next step in 96 registers; the 4-row gemv needs 168 registers
# (about 3 programs an SM), while the dot's cp.async pipeline keeps 3 steps of 8 KB in flight.
DECODE_TILES: tuple[tuple[int, Fp8Tile], ...] = (
    (1, Fp8Tile("gemv", 1, 128, 64, 4, 1)),
    (4, Fp8Tile("dot", 16, 64, 128, 4, 4)),
    (16, Fp8Tile("dot", 16, 64, 128, 4, 4)),
    (32, Fp8Tile("dot", 32, 64, 128, 4, 4)),
    (64, Fp8Tile("dot", 64, 64, 128, 4, 4)),
)


@lru_cache(maxsize=8)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def fit_rows(tile: Fp8Tile, m: int) -> Fp8Tile:
    """tile with block_m shrunk to the batch: a gemv program holds at most next_pow2(m) rows, a dot or mm
    tile at most max(16, next_pow2(m))."""
    rows = min(4, next_pow2(m)) if tile.kind == "gemv" else max(16, next_pow2(m))
    return replace(tile, block_m=min(tile.block_m, rows))


def fp8_tile(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> Fp8Tile:
    """The tile for an [m, k] x [k, n] product: DECODE_TILES up to 64 rows, 64/128-row mm tiles above.
    fp32 (exact ieee dots, the parity mode and the interpreter) gets small tiles."""
    if dtype == torch.float32:
        return fit_rows(Fp8Tile("gemv", 4, 32, 64, 4, 1), m) if m <= 4 else Fp8Tile("mm", 16, 32, 32, 4, 2, 1)
    for rows, tile in DECODE_TILES:
        if m <= rows:
            return fit_rows(tile, m)
    return Fp8Tile("mm", 64 if m <= 128 else 128, 128, 128, 8, 3, 1)


def k_split(tile: Fp8Tile, m: int, n: int, k: int, device: torch.device) -> tuple[int, int]:
    """(K columns per split, number of splits) for tile on this device. Each split holds whole 128-column
    scale blocks; without tile.split_k, the split doubles while the grid has fewer than per_sm programs
    per SM."""
    groups = -(-k // BLOCK)
    split = tile.split_k
    if split is None:
        programs = -(-n // tile.block_n) * -(-m // tile.block_m)
        target = tile.per_sm * (_sm_count(device.index or 0) if device.type == "cuda" else 1)
        split = 1
        while split * 2 <= groups and programs * split < target:
            split *= 2
    k_per_split = -(-groups // max(1, min(split, groups))) * BLOCK
    return k_per_split, -(-k // k_per_split)


# MIN_COUNTERS: the first counter buffer's length in output tiles (256 KB), more than any benchmark-model
# projection's grid, so that a launch inside CUDA graph capture finds it big enough
MIN_COUNTERS = 1 << 16
# per device, every counter buffer fused_sum launches have used, the current (longest) last: a grown one's
# predecessors stay alive, since graphs captured before the growth still replay with them
_TILE_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The int32 arrival counters of fused_sum launches on device, one per output tile, at least `tiles`.

    Zero between launches (each launch's last program of a tile resets its own), so every launch on the
    device shares them: two fused_sum GEMMs must not run at once on different streams. hkv runs its FP8
    GEMMs on one stream per rank. Growing allocates, so a launch inside CUDA graph capture must find the
    buffer big enough (MIN_COUNTERS, or a larger launch made before the capture); it raises otherwise."""
    buffers = _TILE_COUNTERS.setdefault(device, [])
    if not buffers or buffers[-1].numel() < tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"fp8 fused_sum: {tiles} output tiles need a larger counter buffer, which cannot "
                               "be allocated during CUDA graph capture; run this shape once before capturing")
        size = max(tiles, MIN_COUNTERS, 2 * buffers[-1].numel() if buffers else 0)
        buffers.append(torch.zeros(size, dtype=torch.int32, device=device))
    return buffers[-1]


def _launch(tile: Fp8Tile, x2, weight, scale, bias, target, m: int, n: int, k: int, k_per_split: int,
            split: int, out: torch.Tensor | None = None) -> None:
    """One launch of tile's kernel into target ([M, N] in x's dtype, or [split, M, N] fp32 partials); with
    out ([M, N] with target's row stride, a fused_sum tile's split launch), the last split program of each
    output tile adds target into out (+ bias)."""
    grid = (triton.cdiv(n, tile.block_n), triton.cdiv(m, tile.block_m), split)
    args = (x2, weight, scale, scale if bias is None else bias, target, m, n, k, k_per_split,
            x2.stride(0), weight.stride(0), scale.stride(0), target.stride(-2), target.stride(0) if split > 1 else 0)
    common = dict(SCALE_BLOCK=BLOCK, EVEN_K=k % tile.block_k == 0, HAS_BIAS=bias is not None,
                  num_warps=tile.num_warps, num_stages=tile.num_stages)
    if tile.kind != "mm":  # the mm kernel has no SCALE_OUT or FUSED_SUM (Fp8Tile refuses them)
        fused = out is not None
        common.update(SCALE_OUT=tile.scale_out, FUSED_SUM=fused, sum_ptr=out if fused else target,
                      count_ptr=tile_counters(x2.device, grid[0] * grid[1]) if fused else target)
    if tile.kind == "gemv":
        _fp8_gemv_kernel[grid](*args, ROWS=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, **common)
        return
    kernel = _fp8_dot_kernel if tile.kind == "dot" else _fp8_mm_kernel
    kernel[grid](*args, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
                 PRECISION=dot_precision(x2.dtype), **common)


def _sum_splits(partials: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """out [M, N] = partials [S, M, N].sum(0) (+ bias) in split order, one launch."""
    numel, block = out.numel(), 1024
    _sum_splits_kernel[(triton.cdiv(numel, block),)](
        partials, partials if bias is None else bias, out, numel, out.shape[-1],
        SPLIT=partials.shape[0], HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
               tile: Fp8Tile | None = None) -> torch.Tensor:
    """x W^T (+ bias) with W = dequantize(weight, scale) (Triton).

    x: [..., K] (K contiguous) in fp32 / bf16 / fp16; weight: [N, K] float8_e4m3fn (K contiguous);
    scale: [ceil(N/128), ceil(K/128)] fp32 (may be a row slice of a wider one); bias: [N] or None;
    tile: override fp8_tile, used as given (tests, benchmark sweeps). Returns [..., N] in x's dtype.
    """
    n, k = weight.shape
    assert weight.dtype == torch.float8_e4m3fn and weight.stride(1) == 1 and x.shape[-1] == k
    assert tuple(scale.shape) == scale_shape(n, k) and scale.stride(1) == 1
    assert bias is None or (tuple(bias.shape) == (n,) and bias.stride(0) == 1)
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*x.shape[:-1], n)
    tile = tile or fp8_tile(m, n, k, x.dtype, x.device)
    k_per_split, split = k_split(tile, m, n, k, x.device)
    if split == 1:
        _launch(tile, x2, weight, scale, bias, out, m, n, k, k_per_split, split)
    else:
        partials = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
        if tile.fused_sum:
            _launch(tile, x2, weight, scale, bias, partials, m, n, k, k_per_split, split, out)
        else:
            _launch(tile, x2, weight, scale, None, partials, m, n, k, k_per_split, split)
            _sum_splits(partials, bias, out)
    return out.view(*x.shape[:-1], n)
