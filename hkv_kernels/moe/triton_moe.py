"""Triton MoE: routing, the sort by expert and the experts' two grouped GEMMs, all on the device.

A layer's routed experts run as five launches, none of which reads anything on the host, so a
forward with MoE layers can be captured in a CUDA graph:

    route      logits [T, E]  -> weights, ids [T, k]         softmax, top-k, renormalisation
    count      ids            -> tokens per expert [E]
    sort       ids, counts    -> sorted_pairs, block_expert, used: the (token, rank) pairs by expert,
                                 each expert's run padded to whole BLOCK_M blocks (reference.moe_align_ref)
    gate_up    x, w13         -> act [T*k, I] = silu(x w_gate^T) * (x w_up^T), one program per
                                 (block of one expert's pairs, BLOCK_N columns): gate and up tiles
                                 of the same columns in one pass over H
    down       act, w2        -> y [T*k, H] = weight * (act w_down^T), the same blocks
    combine    y, shared      -> out [T, H] = sum over k (fixed order) + sigmoid(gate) * shared

The grouped GEMMs' grids are sized for the worst case (reference.padded_pairs) and their blocks past
`used` return at once. Every pair's row is computed alone (no atomics), so results do not depend
on the order in which blocks run. Tiles (moe_tile) are picked by the pairs per hit expert. The pair
count is not specialised on (do_not_specialize): every graph bucket reuses one compiled variant.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hkv_kernels.common import dot_precision
from hkv_kernels.meta import next_pow2
from hkv_kernels.moe.reference import padded_pairs

_SCAN = 1024  # ids a count / sort program reads at a time


@triton.jit
def _moe_route_kernel(logits_ptr, weights_ptr, ids_ptr, stride_lt, num_experts,
                      TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, RENORM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    in_range = offs < num_experts
    x = tl.load(logits_ptr + t * stride_lt + offs, mask=in_range, other=float("-inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, 0))
    probs = tl.where(in_range, e / tl.sum(e, 0), -1.0)
    slots = tl.arange(0, BLOCK_K)
    values = tl.zeros([BLOCK_K], dtype=tl.float32)
    chosen = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(probs, 0)
        # the lowest id among equal probabilities; clamped, so a NaN row still names a real expert
        idx = tl.minimum(tl.min(tl.where(probs == best, offs, BLOCK_E), 0), num_experts - 1)
        values = tl.where(slots == j, best, values)
        chosen = tl.where(slots == j, idx, chosen)
        probs = tl.where(offs == idx, -2.0, probs)
    values = tl.where(slots < TOP_K, values, 0.0)
    if RENORM:
        values = values / tl.sum(values, 0)
    keep = slots < TOP_K
    tl.store(weights_ptr + t * TOP_K + slots, values.to(weights_ptr.dtype.element_ty), mask=keep)
    tl.store(ids_ptr + t * TOP_K + slots, chosen, mask=keep)


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_count_kernel(ids_ptr, counts_ptr, num_pairs, SCAN: tl.constexpr):
    expert = tl.program_id(0)
    offs = tl.arange(0, SCAN)
    hits = tl.zeros([SCAN], dtype=tl.int32)
    for start in range(0, num_pairs, SCAN):
        ids = tl.load(ids_ptr + start + offs, mask=start + offs < num_pairs, other=-1)
        hits += (ids == expert).to(tl.int32)
    tl.store(counts_ptr + expert, tl.sum(hits, 0))


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_sort_kernel(ids_ptr, counts_ptr, sorted_ptr, block_expert_ptr, used_ptr, num_pairs, num_experts,
                     BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, SCAN: tl.constexpr):
    expert = tl.program_id(0)
    others = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + others, mask=others < num_experts, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = tl.sum(tl.where(others < expert, padded, 0), 0)  # this expert's first row
    mine = tl.sum(tl.where(others == expert, counts, 0), 0)
    mine_padded = tl.sum(tl.where(others == expert, padded, 0), 0)
    if expert == 0:
        tl.store(used_ptr, tl.sum(padded, 0))
    offs = tl.arange(0, SCAN)
    row = start
    for first in range(0, num_pairs, SCAN):
        ids = tl.load(ids_ptr + first + offs, mask=first + offs < num_pairs, other=-1)
        hit = (ids == expert).to(tl.int32)
        tl.store(sorted_ptr + row + tl.cumsum(hit, 0) - 1, first + offs, mask=hit > 0)
        row += tl.sum(hit, 0)
    pad = tl.arange(0, BLOCK_M)
    tl.store(sorted_ptr + start + mine + pad, num_pairs, mask=mine + pad < mine_padded)
    blocks = mine_padded // BLOCK_M
    for b in range(0, blocks, SCAN):
        tl.store(block_expert_ptr + start // BLOCK_M + b + offs, expert, mask=b + offs < blocks)


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_gate_up_kernel(
    x_ptr, w_ptr, s_ptr, act_ptr, sorted_ptr, block_expert_ptr, used_ptr, num_pairs, hidden, inter, up_rows,
    stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_at,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr,
):
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(used_ptr):
        return
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]
    valid = pair < num_pairs
    token = (pair // TOP_K).to(tl.int64)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token[:, None] * stride_xt + ks[None, :]  # [BM, BK]
    gate_ptrs = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]  # [BK, BN]
    up_ptrs = gate_ptrs + inter * stride_wn
    # FP8: each column's block-scale row, gate blocks first, then up_rows = ceil(I/128) rows later
    gate_scales = s_ptr + expert * stride_se + (cols // 128).to(tl.int64) * stride_sn  # [BN]
    up_scales = gate_scales + up_rows * stride_sn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = ks < hidden - k0
        a = tl.load(x_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        if EVEN:
            w_gate = tl.load(gate_ptrs)
            w_up = tl.load(up_ptrs)
        else:
            w_mask = k_ok[:, None] & col_ok[None, :]
            w_gate = tl.load(gate_ptrs, mask=w_mask, other=0.0)
            w_up = tl.load(up_ptrs, mask=w_mask, other=0.0)
        if FP8:  # dequantized in registers, rounded as reference.dequantize rounds
            w_gate = (w_gate.to(tl.float32) * tl.load(gate_scales + k0 // 128, mask=col_ok)[None, :]).to(a.dtype)
            w_up = (w_up.to(tl.float32) * tl.load(up_scales + k0 // 128, mask=col_ok)[None, :]).to(a.dtype)
        acc_gate = tl.dot(a, w_gate, acc_gate, input_precision=PRECISION)
        acc_up = tl.dot(a, w_up, acc_up, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    dtype = act_ptr.dtype.element_ty
    # rounded where torch rounds: each projection, silu(gate), the product
    gate = acc_gate.to(dtype).to(tl.float32)
    up = acc_up.to(dtype).to(tl.float32)
    act = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32) * up
    out_ptrs = act_ptr + pair[:, None].to(tl.int64) * stride_at + cols[None, :]
    tl.store(out_ptrs, act.to(dtype), mask=valid[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_down_kernel(
    act_ptr, w_ptr, s_ptr, route_ptr, y_ptr, sorted_ptr, block_expert_ptr, used_ptr, num_pairs, hidden, inter,
    stride_at, stride_we, stride_wn, stride_se, stride_sn, stride_yt,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
    PRECISION: tl.constexpr, FP8: tl.constexpr,
):
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(used_ptr):
        return
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # [BM]
    valid = pair < num_pairs
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns, over H
    col_ok = cols < hidden
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + pair[:, None] * stride_at + ks[None, :]  # [BM, BK]
    w_ptrs = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]  # [BK, BN]
    scales = s_ptr + expert * stride_se + (cols // 128).to(tl.int64) * stride_sn  # [BN] (FP8)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_ok = ks < inter - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        if EVEN:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if FP8:
            w = (w.to(tl.float32) * tl.load(scales + k0 // 128, mask=col_ok)[None, :]).to(a.dtype)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    dtype = y_ptr.dtype.element_ty
    route = tl.load(route_ptr + pair, mask=valid, other=0.0).to(tl.float32)  # [BM] the top-k weight
    y = acc.to(dtype).to(tl.float32) * route[:, None]
    tl.store(y_ptr + pair[:, None] * stride_yt + cols[None, :], y.to(dtype), mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _moe_combine_kernel(y_ptr, shared_ptr, gate_ptr, out_ptr, hidden, stride_st, stride_gt, stride_ot,
                        TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, SHARED: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < hidden
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(y_ptr + (t * TOP_K + j) * hidden + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    out = acc.to(dtype).to(tl.float32)
    if SHARED:
        gate = tl.sigmoid(tl.load(gate_ptr + t * stride_gt).to(tl.float32)).to(dtype).to(tl.float32)
        shared = tl.load(shared_ptr + t * stride_st + cols, mask=mask, other=0.0).to(tl.float32)
        out = out + (gate * shared).to(dtype).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + cols, out.to(dtype), mask=mask)


@dataclass(frozen=True)
class MoeTile:
    """Tiles of the grouped GEMMs: BLOCK_M rows (pairs of one expert) for both, then per GEMM
    (BLOCK_N, BLOCK_K, num_warps, num_stages)."""

    block_m: int
    gate_up: tuple[int, int, int, int]
    down: tuple[int, int, int, int]


def moe_tile(num_pairs: int, num_experts: int, dtype: torch.dtype) -> MoeTile:
    """The tile for a step of `num_pairs` (token, expert) pairs: by the pairs each hit expert gets.

    Decode (a few pairs per expert) reads every hit expert's weights once with 16-row blocks and
    long K tiles to keep loads in flight; prefill widens the blocks. fp32 (exact ieee dots, the
    parity mode) gets small tiles, as the other kernels' fp32 paths do.
    """
    per_expert = num_pairs / max(1, min(num_experts, num_pairs))
    if dtype == torch.float32:
        return MoeTile(16, (32, 32, 4, 2), (32, 32, 4, 2))
    if per_expert <= 16:
        return MoeTile(16, (64, 128, 4, 4), (64, 128, 4, 4))
    if per_expert <= 48:
        return MoeTile(32, (64, 128, 4, 3), (64, 128, 4, 3))
    return MoeTile(64, (128, 64, 8, 3), (128, 64, 8, 3))


def moe_route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts in fp32, the top k (descending; the lowest id wins a tie), optionally
    renormalised to sum to one. logits: [T, E] (the experts' columns contiguous; may be a view of a
    wider GEMM). Returns weights [T, k] in logits' dtype and ids [T, k] int32."""
    num_tokens, num_experts = logits.shape
    assert logits.stride(1) == 1 and 0 < top_k <= num_experts
    weights = torch.empty(num_tokens, top_k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
    if num_tokens:
        _moe_route_kernel[(num_tokens,)](
            logits, weights, ids, logits.stride(0), num_experts, TOP_K=top_k, BLOCK_E=next_pow2(num_experts),
            BLOCK_K=next_pow2(top_k), RENORM=renormalize, num_warps=4 if num_experts >= 256 else 1,
        )
    return weights, ids


def moe_align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The device sort of reference.moe_align_ref: ids [N] int -> (sorted_pairs [padded_pairs(N, E,
    block_m)] int32, block_expert [that / block_m] int32, used [1] int32). Only `used` rows are
    written (padding rows hold N); nothing is read on the host."""
    num_pairs = ids.numel()
    rows = padded_pairs(num_pairs, num_experts, block_m)
    device = ids.device
    counts = torch.empty(num_experts, dtype=torch.int32, device=device)
    sorted_pairs = torch.empty(rows, dtype=torch.int32, device=device)
    block_expert = torch.empty(rows // block_m, dtype=torch.int32, device=device)
    used = torch.empty(1, dtype=torch.int32, device=device)
    _moe_count_kernel[(num_experts,)](ids, counts, num_pairs, SCAN=_SCAN, num_warps=4)
    _moe_sort_kernel[(num_experts,)](ids, counts, sorted_pairs, block_expert, used, num_pairs, num_experts,
                                     BLOCK_M=block_m, BLOCK_E=next_pow2(num_experts), SCAN=_SCAN, num_warps=4)
    return sorted_pairs, block_expert, used


def moe_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
    shared: torch.Tensor | None = None, shared_gate: torch.Tensor | None = None, tile: MoeTile | None = None,
    out: torch.Tensor | None = None, scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) (+ sigmoid(shared_gate[t]) * shared[t]) (Triton).

    x: [T, H] (H contiguous); w13: [E, 2I, H] each expert's gate rows then its up rows; w2: [E, H, I]
    (both contiguous in their last dim; expert e at index e); weights: [T, k] in x's dtype and
    ids: [T, k] (int32 or int64) from moe_route; shared: [T, H] the shared expert's output
    (H contiguous) and shared_gate: [T, 1] its gate logit (may be a column of a wider GEMM), or both
    None; tile: override moe_tile (benchmark sweeps); out: optional [T, H] to write into.
    scales: FP8 experts (w13, w2 float8_e4m3fn): their 128 x 128 block multipliers (fp32),
    s13 [E, 2 * ceil(I/128), ceil(H/128)] (the gate's blocks, then the up's) and s2 [E, ceil(H/128),
    ceil(I/128)]; the weights are dequantized in registers (hkv_kernels/fp8_gemm/reference.py).
    Returns out: [T, H] in x's dtype.
    """
    num_tokens, hidden = x.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    top_k = ids.shape[1]
    assert w13.shape == (num_experts, 2 * inter, hidden) and w2.shape == (num_experts, hidden, inter)
    assert x.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1
    if scales is not None:
        blocks_i, blocks_h = -(-inter // 128), -(-hidden // 128)
        assert scales[0].shape == (num_experts, 2 * blocks_i, blocks_h)
        assert scales[1].shape == (num_experts, blocks_h, blocks_i)
    if out is None:
        out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    num_pairs = num_tokens * top_k
    tile = tile or moe_tile(num_pairs, num_experts, x.dtype)
    sorted_pairs, block_expert, used = moe_align(ids.reshape(-1), num_experts, tile.block_m)
    routing = (weights.reshape(-1).contiguous(), sorted_pairs, block_expert, used)
    y = _grouped_gemms(x, w13, w2, scales, routing, tile, top_k)
    with_shared = shared is not None
    if with_shared:
        assert shared.stride(1) == 1 and shared_gate is not None
    block_h = min(1024, next_pow2(hidden))
    _moe_combine_kernel[(num_tokens, triton.cdiv(hidden, block_h))](
        y, shared if with_shared else y, shared_gate if with_shared else y, out, hidden,
        shared.stride(0) if with_shared else 0, shared_gate.stride(0) if with_shared else 0, out.stride(0),
        TOP_K=top_k, BLOCK_H=block_h, SHARED=with_shared, num_warps=4,
    )
    return out


def _grouped_gemms(x, w13, w2, scales, routing, tile: MoeTile, top_k: int) -> torch.Tensor:
    """The gate|up and down GEMMs over the sorted pairs: y [T*k, H], each pair's row times its route weight."""
    route, sorted_pairs, block_expert, used = routing
    num_pairs, hidden, inter = x.shape[0] * top_k, x.shape[1], w2.shape[2]
    blocks = sorted_pairs.numel() // tile.block_m
    precision = dot_precision(x.dtype)
    fp8 = scales is not None
    s13, s2 = scales if fp8 else (w13, w2)  # placeholders the kernels never read without FP8
    sstride = (lambda s: (s.stride(0), s.stride(1))) if fp8 else (lambda s: (0, 0))
    if fp8:
        assert 128 % tile.gate_up[1] == 0 and 128 % tile.down[1] == 0, "a K step must stay inside a scale block"
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    bn, bk, warps, stages = tile.gate_up
    _moe_gate_up_kernel[(blocks, triton.cdiv(inter, bn))](
        x, w13, s13, act, sorted_pairs, block_expert, used, num_pairs, hidden, inter, -(-inter // 128),
        x.stride(0), w13.stride(0), w13.stride(1), *sstride(s13), act.stride(0),
        TOP_K=top_k, BLOCK_M=tile.block_m, BLOCK_N=bn, BLOCK_K=bk, EVEN=hidden % bk == 0 and inter % bn == 0,
        PRECISION=precision, FP8=fp8, num_warps=warps, num_stages=stages,
    )
    y = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    bn, bk, warps, stages = tile.down
    _moe_down_kernel[(blocks, triton.cdiv(hidden, bn))](
        act, w2, s2, route, y, sorted_pairs, block_expert, used, num_pairs, hidden, inter,
        act.stride(0), w2.stride(0), w2.stride(1), *sstride(s2), y.stride(0),
        BLOCK_M=tile.block_m, BLOCK_N=bn, BLOCK_K=bk, EVEN=inter % bk == 0 and hidden % bn == 0,
        PRECISION=precision, FP8=fp8, num_warps=warps, num_stages=stages,
    )
    return y
