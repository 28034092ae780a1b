"""Triton paged attention: GQA, page table, ragged batch, causal among new tokens.

One program owns a tile of BLOCK_M rows = (query token, query head of one KV
head's group) pairs, so a decode step (one token, G heads) and a prefill chunk
(many tokens) run the same code and every K/V block read serves the whole
group. Keys are gathered through the page table one block of BLOCK_N
positions at a time with an online softmax (exp2 form). FP8 pages are read as fp8 * scale in the
query's dtype, block by block (hkv_kernels/kv_quant.py), so the dots run as they do on bf16 pages.
The split decode kernel has three more ways to read them (KV_DOT, a DecodeTile's `kv_dot`; KV_DOTS).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hkv_kernels.common import dot_precision
from hkv_kernels.fp8 import from_cache
from hkv_kernels.meta import KernelMeta, next_pow2

_LOG2E = 1.4426950408889634


@triton.jit
def _attn_block(
    acc, m_i, l_i, q, k_ptr, v_ptr, pages_ptr, start, kv_end, q_pos, k_head_off, v_head_off, d, d_mask,
    stride_kp, stride_ks, stride_vp, stride_vs, qk_scale, k_scale, v_scale,
    MASKED: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr,
    KV_DOT: tl.constexpr,
):
    """One block of keys into the online softmax. FP8 K/V (KV_DOTS): 0 read as fp8 * scale in q's dtype; 1 and 2
    cast to q's dtype as stored (exact: e4m3 fits bfloat16 and float16), the caller folding k_scale into
    qk_scale and v_scale into the output; 3 read as fp8 * scale in float16 (q is float16 then)."""
    j = start + tl.arange(0, BLOCK_N)  # [N] key positions
    j_mask = j < kv_end
    page = tl.load(pages_ptr + j // PAGE_SIZE, mask=j_mask, other=0).to(tl.int64)
    off = (j % PAGE_SIZE).to(tl.int64)
    kv_mask = j_mask[:, None] & d_mask[None, :]
    k = tl.load(k_ptr + (page * stride_kp + off * stride_ks + k_head_off)[:, None] + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + (page * stride_vp + off * stride_vs + v_head_off)[:, None] + d[None, :], mask=kv_mask, other=0.0)
    if KV_DOT == 0:
        k = from_cache(k, k_scale, q.dtype, FP8)
        v = from_cache(v, v_scale, q.dtype, FP8)
    elif KV_DOT == 3:
        k = k.to(tl.float16) * tl.cast(k_scale, tl.float16)
        v = v.to(tl.float16) * tl.cast(v_scale, tl.float16)
    else:
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [M, N]
    if MASKED:
        s = tl.where(j_mask[None, :] & (j[None, :] <= q_pos[:, None]), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


# the grid size and the page-table width change every step: specializing on them (== 1, % 16)
# would compile new variants mid-serving
@triton.jit(do_not_specialize=["stride_pt", "num_blocks"])
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, gate_ptr, page_table_ptr, table_row_ptr, q_start_ptr, q_len_ptr, kv_len_ptr,
    block_seq_ptr, block_tok_ptr,
    stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_ot, stride_oh, stride_gt, stride_gh, stride_pt, qk_scale, num_blocks, k_scale, v_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    GATE: tl.constexpr, FP8: tl.constexpr,
):
    # last token blocks (the longest causal spans) first, so the tail of the grid is short work
    blk = num_blocks - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(block_seq_ptr + blk)
    t0 = tl.load(block_tok_ptr + blk)
    n = tl.load(q_len_ptr + seq)
    kv_len = tl.load(kv_len_ptr + seq)
    q_start = tl.load(q_start_ptr + seq)

    r = tl.arange(0, BLOCK_M)
    tok = t0 + r // GROUP
    head = kv_head * GROUP + r % GROUP
    row_mask = (r < BLOCK_T * GROUP) & (tok < n)
    q_pos = kv_len - n + tok  # absolute position of each row's query
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=row_mask[:, None] & d_mask[None, :], other=0.0)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    pages_ptr = page_table_ptr + tl.load(table_row_ptr + seq).to(tl.int64) * stride_pt
    k_head_off = kv_head * stride_kh
    v_head_off = kv_head * stride_vh
    # keys every row of the tile sees need no mask; the causal edge follows
    kv_end = tl.minimum(kv_len, kv_len - n + t0 + BLOCK_T)
    full_end = ((kv_len - n + t0 + 1) // BLOCK_N) * BLOCK_N
    for start in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attn_block(
            acc, m_i, l_i, q, k_ptr, v_ptr, pages_ptr, start, kv_end, q_pos, k_head_off, v_head_off,
            d, d_mask, stride_kp, stride_ks, stride_vp, stride_vs, qk_scale, k_scale, v_scale,
            False, PAGE_SIZE, BLOCK_N, PRECISION, FP8, 0,
        )
    for start in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _attn_block(
            acc, m_i, l_i, q, k_ptr, v_ptr, pages_ptr, start, kv_end, q_pos, k_head_off, v_head_off,
            d, d_mask, stride_kp, stride_ks, stride_vp, stride_vs, qk_scale, k_scale, v_scale,
            True, PAGE_SIZE, BLOCK_N, PRECISION, FP8, 0,
        )
    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = (acc / l_i[:, None]).to(o_ptr.dtype.element_ty)
    if GATE:
        # the output gate of gated attention, rounded like torch: out * sigmoid(gate), each in the model dtype
        g_rows = (q_start + tok).to(tl.int64) * stride_gt + head * stride_gh
        gate = tl.load(gate_ptr + g_rows[:, None] + d[None, :], mask=row_mask[:, None] & d_mask[None, :], other=0.0)
        sig = tl.sigmoid(gate.to(tl.float32)).to(o_ptr.dtype.element_ty)
        out = (out.to(tl.float32) * sig.to(tl.float32)).to(o_ptr.dtype.element_ty)
    o_rows = (q_start + tok).to(tl.int64) * stride_ot + head * stride_oh
    tl.store(o_ptr + o_rows[:, None] + d[None, :], out, mask=row_mask[:, None] & d_mask[None, :])


@triton.jit(do_not_specialize=["stride_pt"])
def _paged_decode_split_kernel(
    q_ptr, k_ptr, v_ptr, part_o_ptr, part_ml_ptr, page_table_ptr, table_row_ptr, q_start_ptr, kv_len_ptr,
    stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_pt, qk_scale,
    num_seqs, q_heads, k_scale, v_scale,
    SPLITS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    FP8: tl.constexpr, KV_DOT: tl.constexpr,
):
    """Decode (one query per sequence): split `split` of the sequence's keys, partial softmax state out.
    KV_DOT (FP8 pages; 0 otherwise): KV_DOTS; from 2 on the dots run in float16, q clamped to its range."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    kv_len = tl.load(kv_len_ptr + seq)
    q_row = tl.load(q_start_ptr + seq).to(tl.int64)
    r = tl.arange(0, BLOCK_M)
    head = kv_head * GROUP + r
    row_mask = r < GROUP
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + q_row * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    if KV_DOT >= 2:
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    if KV_DOT == 1 or KV_DOT == 2:
        qk_scale = qk_scale * k_scale
    q_pos = tl.zeros([BLOCK_M], dtype=tl.int32) + kv_len - 1
    per = tl.cdiv(tl.cdiv(kv_len, BLOCK_N), SPLITS) * BLOCK_N  # keys per split, whole blocks
    lo = split * per
    hi = tl.minimum(lo + per, kv_len)
    full_end = tl.maximum(lo, tl.minimum(hi, (kv_len // BLOCK_N) * BLOCK_N))
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    pages_ptr = page_table_ptr + tl.load(table_row_ptr + seq).to(tl.int64) * stride_pt
    for start in range(lo, full_end, BLOCK_N):
        acc, m_i, l_i = _attn_block(
            acc, m_i, l_i, q, k_ptr, v_ptr, pages_ptr, start, hi, q_pos, kv_head * stride_kh, kv_head * stride_vh,
            d, d_mask, stride_kp, stride_ks, stride_vp, stride_vs, qk_scale, k_scale, v_scale, False, PAGE_SIZE,
            BLOCK_N, PRECISION, FP8, KV_DOT,
        )
    for start in range(full_end, hi, BLOCK_N):
        acc, m_i, l_i = _attn_block(
            acc, m_i, l_i, q, k_ptr, v_ptr, pages_ptr, start, hi, q_pos, kv_head * stride_kh, kv_head * stride_vh,
            d, d_mask, stride_kp, stride_ks, stride_vp, stride_vs, qk_scale, k_scale, v_scale, True, PAGE_SIZE,
            BLOCK_N, PRECISION, FP8, KV_DOT,
        )
    if KV_DOT == 1 or KV_DOT == 2:
        acc = acc * v_scale
    # partials laid out [seq, split, q head, ...]; an empty split leaves m = -1e30, l = 0
    part = (seq.to(tl.int64) * SPLITS + split) * q_heads + head  # [BM]
    tl.store(part_o_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=row_mask[:, None] & d_mask[None, :])
    tl.store(part_ml_ptr + part, m_i, mask=row_mask)
    tl.store(part_ml_ptr + num_seqs * SPLITS * q_heads + part, l_i, mask=row_mask)


@triton.jit
def _paged_decode_reduce_kernel(
    part_o_ptr, part_ml_ptr, o_ptr, gate_ptr, q_start_ptr, stride_ot, stride_oh, stride_gt, stride_gh,
    num_seqs, q_heads, SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GATE: tl.constexpr,
):
    """Combine a query head's split partials (exp2 units) into its output row."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_row = tl.load(q_start_ptr + seq).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    base = seq.to(tl.int64) * SPLITS * q_heads + head
    l_off = num_seqs * SPLITS * q_heads
    m_tot = -1.0e30
    for s in tl.static_range(SPLITS):
        m_tot = tl.maximum(m_tot, tl.load(part_ml_ptr + base + s * q_heads))
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    l_tot = 0.0
    for s in tl.static_range(SPLITS):
        w = tl.exp2(tl.load(part_ml_ptr + base + s * q_heads) - m_tot)
        l_tot += w * tl.load(part_ml_ptr + l_off + base + s * q_heads)
        acc += w * tl.load(part_o_ptr + (base + s * q_heads) * HEAD_DIM + d, mask=d_mask, other=0.0)
    l_tot = tl.where(l_tot == 0.0, 1.0, l_tot)
    out = (acc / l_tot).to(o_ptr.dtype.element_ty)
    if GATE:
        gate = tl.load(gate_ptr + q_row * stride_gt + head * stride_gh + d, mask=d_mask, other=0.0)
        sig = tl.sigmoid(gate.to(tl.float32)).to(o_ptr.dtype.element_ty)
        out = (out.to(tl.float32) * sig.to(tl.float32)).to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + q_row * stride_ot + head * stride_oh + d, out, mask=d_mask)


def _fp8(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """The caches hold FP8 pages (both or neither)."""
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    assert fp8 == (v_cache.dtype == torch.float8_e4m3fn), "K and V caches of one dtype"
    return fp8


_SM_COUNT: dict[int, int] = {}


def decode_splits(num_seqs: int, kv_heads: int, device: torch.device) -> int:
    """Key splits per (sequence, KV head) of a decode step: enough programs for ~4 per SM, at most 16;
    1 (no split: the one-pass kernel) once sequences x KV heads alone give two programs per SM
    (the H200 sweep: B64 x 8 KV heads ran at 94% of copy bandwidth unsplit, 84% split in two)."""
    if device.type != "cuda":
        return 3  # the interpreter: a few splits, some empty, exercise the reduction
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    programs = max(1, num_seqs * kv_heads)
    if programs >= 2 * _SM_COUNT[index]:
        return 1
    return max(1, min(16, -(-4 * _SM_COUNT[index] // programs)))


@dataclass(frozen=True)
class DecodeTile:
    """The split decode's tile: keys a block, warps, pipeline stages, and the split count as a multiple
    of decode_splits' (the launcher takes max(1, int(splits * split_scale))). paged_attention takes the
    split path only where decode_splits gives more than one split, so the scale cannot turn it on.
    kv_dot: how bfloat16 queries read FP8 pages (KV_DOTS; the split kernel's KV_DOT); other queries, and
    other pages, always take 0."""

    block_n: int
    num_warps: int
    num_stages: int
    split_scale: float = 1.0
    kv_dot: int = 0


# The split decode's ways of reading FP8 pages (KV_DOT). Compiled for sm_90 (`compile_sm90` of
# tools/bench/bench_decode_fp8kv.py, B32's tile, Triton 3.6), a pair of stored values takes: in 0, 6 instructions
# (e4m3x2 -> f16x2, two f16 -> f32, two multiplies, f32x2 -> bf16x2), the tile then staged in shared memory
# again in bf16 for the MMA (57 KB of shared memory); in 1, 3 (e4m3x2 -> f16x2, two f16 -> bf16) and in 2, 1
# (e4m3x2 -> f16x2), both fusing the cast into the MMA operand loads, which read the FP8 tile from shared
# memory a byte at a time (25.6 KB); in 3, 3 (e4m3x2 -> f16x2, two f16 multiplies), staged like 0. The sweep
# says which is fastest. The float16 dots (2, 3) differ from the bfloat16 ones in rounding: float16 keeps
# 3 more mantissa bits (the probabilities lose less), queries are clamped to +-65504, and in 3 a stored
# value times its scale past 65504 overflows.
KV_DOTS = {0: "fp8 * scale in the query's dtype", 1: "cast to the query's dtype, scales outside the dots",
           2: "cast to float16, dots in float16, scales outside the dots", 3: "fp8 * scale in float16, dots in float16"}


# sequences x KV heads (programs before the split) from which the wide tile applies
WIDE_PROGRAMS = 32

# (narrow, wide) decode tiles by page dtype: FP8 pages (True) or not. bf16 pages: the H200 decode_short
# sweep's (launch_paged_decode's docstring). FP8 pages: the FP8 KV sweep's pick on an H100 at B1 / B32 x 32k
# keys (tools/bench/bench_decode_fp8kv.py, `bench_kernels --only decode_fp8kv`, which prints the entry to
# paste here; docs/benchmarks.md, "The decode attention sweep").
DECODE_TILES: dict[bool, tuple[DecodeTile, DecodeTile]] = {
    False: (DecodeTile(64, 4, 3), DecodeTile(32, 4, 2)),
    True: (DecodeTile(128, 8, 3, 2.0, kv_dot=2), DecodeTile(64, 4, 2, 0.5, kv_dot=2)),
}


def wide_decode(num_seqs: int, num_kv_heads: int) -> bool:
    """A decode step takes DECODE_TILES' wide tile: its sequences x KV heads reach WIDE_PROGRAMS."""
    return num_seqs * num_kv_heads >= WIDE_PROGRAMS


def decode_tile(num_seqs: int, num_kv_heads: int, fp8: bool) -> DecodeTile:
    """The DECODE_TILES entry for a decode step of num_seqs sequences over FP8 pages or not."""
    return DECODE_TILES[fp8][wide_decode(num_seqs, num_kv_heads)]


def scaled_splits(splits: int, scale: float) -> int:
    """A split count times a tile's split_scale, at least one split."""
    return max(1, int(splits * scale))


def launch_paged_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor, meta: KernelMeta,
    scale: float, out: torch.Tensor, gate: torch.Tensor | None = None, block_n: int | None = None,
    splits: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0), kv_dot: int | None = None,
) -> torch.Tensor:
    """Decode launcher (every sequence has one new token): keys split across programs, then reduced.

    Tile: decode_tile's (DECODE_TILES by page dtype). On bf16 pages, 32 keys a block and 2 stages once
    sequences x KV heads give 32 programs before the split, else 64 and 3. The H200 sweep
    (tools/bench/bench_kernels.py decode_short: the benchmark model's 6 attention layers, Hq 16 / Hkv 2 /
    D 256, in a graph) measured 32 / 2 at 1.29x the 64 / 3 tile at B32 x 576 keys, 1.16x at B64 x 576
    and 1.02x at B64 x 4,096; at B1 it was not among the best.
    block_n / splits / num_warps / num_stages / kv_dot override it (sweeps; kv_dot applies to FP8 pages only,
    whatever the queries' dtype)."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, page_size = k_cache.shape[2], k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    num_seqs = meta.num_seqs
    fp8 = _fp8(k_cache, v_cache)
    tile = decode_tile(num_seqs, num_kv_heads, fp8)
    splits = splits or scaled_splits(decode_splits(num_seqs, num_kv_heads, q.device), tile.split_scale)
    block_n = block_n or tile.block_n
    num_warps = num_warps or tile.num_warps
    num_stages = num_stages or tile.num_stages
    if kv_dot is None:
        kv_dot = tile.kv_dot if q.dtype == torch.bfloat16 else 0
    if kv_dot not in KV_DOTS:
        raise ValueError(f"kv_dot {kv_dot}: one of {sorted(KV_DOTS)}")
    part_o = torch.empty(num_seqs, splits, num_q_heads, head_dim, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(2, num_seqs, splits, num_q_heads, dtype=torch.float32, device=q.device)
    block_m = max(16, next_pow2(group))
    _paged_decode_split_kernel[(num_seqs, num_kv_heads, splits)](
        q, k_cache, v_cache, part_o, part_ml, page_table, meta.table_rows, meta.q_start, meta.kv_len,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), page_table.stride(0), scale * _LOG2E,
        num_seqs, num_q_heads, float(kv_scales[0]), float(kv_scales[1]),
        SPLITS=splits, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=next_pow2(head_dim), PAGE_SIZE=page_size,
        BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=dot_precision(q.dtype), FP8=fp8, KV_DOT=kv_dot if fp8 else 0,
        num_warps=num_warps, num_stages=num_stages,
    )
    gated = gate is not None
    _paged_decode_reduce_kernel[(num_seqs, num_q_heads)](
        part_o, part_ml, out, gate if gated else out, meta.q_start, out.stride(0), out.stride(1),
        gate.stride(0) if gated else 0, gate.stride(1) if gated else 0, num_seqs, num_q_heads,
        SPLITS=splits, HEAD_DIM=head_dim, BLOCK_D=next_pow2(head_dim), GATE=gated, num_warps=1,
    )
    return out


def launch_paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor, meta: KernelMeta,
    scale: float, out: torch.Tensor, gate: torch.Tensor | None = None, tile: tuple[int, int, int, int] | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """Launcher over the step's precomputed metadata (its block grid matches meta.attn_tile);
    writes `out`. tile: (BLOCK_M, BLOCK_N, num_warps, num_stages) overrides the rest of the tile
    (benchmark sweeps); its BLOCK_M must be meta.attn_tile's."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, page_size = k_cache.shape[2], k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    block_m, block_n, num_warps, num_stages = tile or meta.attn_tile
    if max(1, block_m // group) != meta.attn_block_t:
        raise ValueError(f"the attention blocks were cut for {meta.attn_block_t} tokens, the tile (BLOCK_M "
                         f"{block_m}, {group} query heads per KV head) runs {max(1, block_m // group)}")
    num_blocks = meta.attn_block_seq.numel()
    if num_blocks == 0:
        return out
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1 and q.stride(2) == 1 and out.stride(2) == 1
    gated = gate is not None
    if gated:
        assert gate.shape == out.shape and gate.stride(2) == 1
    _paged_attention_kernel[(num_blocks, num_kv_heads)](
        q, k_cache, v_cache, out, gate if gated else out, page_table, meta.table_rows, meta.q_start, meta.q_len,
        meta.kv_len, meta.attn_block_seq, meta.attn_block_tok,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1), gate.stride(0) if gated else 0, gate.stride(1) if gated else 0,
        page_table.stride(0), scale * _LOG2E, num_blocks, float(kv_scales[0]), float(kv_scales[1]),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=next_pow2(head_dim), PAGE_SIZE=page_size,
        BLOCK_M=block_m, BLOCK_T=meta.attn_block_t, BLOCK_N=block_n, PRECISION=dot_precision(q.dtype),
        GATE=gated, FP8=_fp8(k_cache, v_cache), num_warps=num_warps, num_stages=num_stages,
    )
    return out


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor, meta: KernelMeta,
    scale: float, out: torch.Tensor | None = None, gate: torch.Tensor | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """Attention of each sequence's new queries over its paged K/V (Triton).

    q: [T, Hq, D] new tokens of all B sequences, concatenated in batch order;
    k_cache, v_cache: [P, page_size, Hkv, D] one storage layer, the new tokens'
        K/V already written (Hq a multiple of Hkv; query head h reads KV head h // (Hq // Hkv));
    page_table: [R, max_pages] int32/int64; sequence b reads row meta.table_rows[b], whose first
        ceil(kv_len[b] / page_size) entries are used;
    meta: the step's KernelMeta (q_start, q_len, kv_len per sequence; the attention block grid);
    out: optional [T, Hq, D] to write into; gate: optional [T, Hq, D], then out * sigmoid(gate);
    kv_scales: the layer's (K, V) scales of FP8 caches, read as fp8 * scale in q's dtype.
    Query i of sequence b sits at position kv_len[b] - q_len[b] + i and sees keys up to it.
    Returns out: [T, Hq, D] in q's dtype.
    """
    if out is None:
        out = torch.empty_like(q)
    decode = meta.max_q_len == 1 and q.shape[0] == meta.num_seqs and meta.num_seqs
    if decode and decode_splits(meta.num_seqs, k_cache.shape[2], q.device) > 1:
        return launch_paged_decode(q, k_cache, v_cache, page_table, meta, scale, out, gate, kv_scales=kv_scales)
    return launch_paged_attention(q, k_cache, v_cache, page_table, meta, scale, out, gate, kv_scales=kv_scales)
