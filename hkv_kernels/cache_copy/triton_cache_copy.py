"""Triton cache copies: one launch moves many pages (or slots) between two pools.

A pool on the host must be pinned: the kernel then reads or writes it directly
over PCIe (zero-copy), so pages scattered on both sides move in one launch
instead of one memcpy per page and layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 2048  # elements a program moves when one side is a pinned host pool (PCIe-bound)
_D2D_BLOCK = 8192  # both on the GPU: 4 KiB a program left a 32k-token peer copy at 18% of a plain copy


@triton.jit
def _copy_blocks_kernel(
    src_ptr, dst_ptr, src_idx_ptr, dst_idx_ptr, num_src, num_dst, block_numel,
    stride_src_l, stride_src_b, stride_dst_l, stride_dst_b,
    BLOCK: tl.constexpr,
):
    pair = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    chunk = tl.program_id(2)
    s = tl.load(src_idx_ptr + pair).to(tl.int64)
    d = tl.load(dst_idx_ptr + pair).to(tl.int64)
    valid = (s >= 0) & (s < num_src) & (d >= 0) & (d < num_dst)
    e = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = valid & (e < block_numel)
    x = tl.load(src_ptr + layer * stride_src_l + s * stride_src_b + e, mask=mask)
    tl.store(dst_ptr + layer * stride_dst_l + d * stride_dst_b + e, x, mask=mask)


@triton.jit
def _ring_write_kernel(
    ring_ptr, window_ptr, pos_ptr, val_ptr, ring_len, row_numel, stride_rw, stride_rp, stride_vt,
    BLOCK: tl.constexpr,
):
    tok = tl.program_id(0)
    chunk = tl.program_id(1)
    w = tl.load(window_ptr + tok).to(tl.int64)
    p = tl.load(pos_ptr + tok).to(tl.int64) % ring_len
    e = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = (w >= 0) & (e < row_numel)
    x = tl.load(val_ptr + tok.to(tl.int64) * stride_vt + e, mask=mask)
    tl.store(ring_ptr + w * stride_rw + p * stride_rp + e, x.to(ring_ptr.dtype.element_ty), mask=mask)


def _block_numel(t: torch.Tensor) -> int:
    """Elements of one block t[l, i]; the block must be contiguous."""
    numel = 1
    for n in t.shape[2:]:
        numel *= n
    expect = 1
    for dim in range(t.dim() - 1, 1, -1):
        assert t.stride(dim) == expect, "a block must be contiguous"
        expect *= t.shape[dim]
    return numel


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor) -> None:
    """dst[:, dst_idx[i]] = src[:, src_idx[i]] for every in-range pair, in one launch (Triton).

    src: [L, Ns, *block]; dst: [L, Nd, *block], same block shape and dtype, each
        block contiguous; either may be a pinned host tensor (then the other is on the GPU);
    src_idx, dst_idx: [M] int32/int64 on the GPU. A pair with an index < 0 or
        past its pool's end is skipped. Destinations must be distinct.
    KV pages: call once for K and once for V; state slots: once for conv, once for recurrent.
    """
    assert src.dtype == dst.dtype and src.shape[0] == dst.shape[0] and src.shape[2:] == dst.shape[2:]
    numel = _block_numel(src)
    assert _block_numel(dst) == numel
    num_pairs = src_idx.numel()
    if num_pairs == 0:
        return
    block = _D2D_BLOCK if src.is_cuda and dst.is_cuda else _BLOCK
    block = min(block, triton.next_power_of_2(numel))
    grid = (num_pairs, src.shape[0], triton.cdiv(numel, block))
    _copy_blocks_kernel[grid](
        src, dst, src_idx, dst_idx, src.shape[1], dst.shape[1], numel,
        src.stride(0), src.stride(1), dst.stride(0), dst.stride(1), BLOCK=block, num_warps=8 if block > 2048 else 4,
    )


def ring_write(ring: torch.Tensor, window_ids: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> None:
    """ring[window_ids[t], positions[t] % W] = values[t] for tokens with window_ids[t] >= 0 (Triton).

    ring: [windows, W, Hkv, D] one draft layer's K (or V) ring buffers, rows contiguous;
    window_ids, positions: [T] int (absolute token positions; the ring keeps the last W);
    values: [T, Hkv, D], rows contiguous (cast to ring's dtype).
    """
    num_tokens = values.shape[0]
    if num_tokens == 0:
        return
    row_numel = values[0].numel()
    assert values[0].is_contiguous()
    assert ring[0, 0].is_contiguous() and ring[0, 0].numel() == row_numel
    block = min(_BLOCK, triton.next_power_of_2(row_numel))
    _ring_write_kernel[(num_tokens, triton.cdiv(row_numel, block))](
        ring, window_ids, positions, values, ring.shape[1], row_numel, ring.stride(0), ring.stride(1),
        values.stride(0), BLOCK=block, num_warps=4,
    )
