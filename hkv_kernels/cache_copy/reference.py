"""Pure-torch cache copies: the CPU path and the references of the Triton kernels."""

from __future__ import annotations

import torch


def _valid_pairs(src_idx: torch.Tensor, dst_idx: torch.Tensor, num_src: int, num_dst: int) -> torch.Tensor:
    """Mask of the pairs whose source and destination indexes are both in range."""
    return (src_idx >= 0) & (src_idx < num_src) & (dst_idx >= 0) & (dst_idx < num_dst)


def copy_blocks_ref(src: torch.Tensor, dst: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor) -> None:
    """dst[:, dst_idx[i]] = src[:, src_idx[i]] for every pair whose two indexes are in range.

    src: [L, Ns, *block]; dst: [L, Nd, *block] (same block shape and dtype, any
    devices: a device pool and a pinned host pool, or one pool twice);
    src_idx, dst_idx: [M] int. Pairs with an index < 0 or past the end are skipped.
    Destinations must be distinct; mutates only dst's addressed blocks.
    """
    keep = _valid_pairs(src_idx, dst_idx, src.shape[1], dst.shape[1])
    # one strided copy_ per pair: on CPU 5-25x faster than index_select + index_copy_ (which
    # gathers into a temporary and, for bf16, copies element by element)
    for s, d in zip(src_idx[keep].tolist(), dst_idx[keep].tolist()):
        dst[:, d].copy_(src[:, s])


def ring_write_ref(ring: torch.Tensor, window_ids: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> None:
    """ring[window_ids[t], positions[t] % W] = values[t] for tokens with window_ids[t] >= 0.

    ring: [windows, W, Hkv, D] one draft layer's K (or V) ring buffers;
    window_ids, positions: [T] int; values: [T, Hkv, D] (cast to ring's dtype).
    """
    keep = window_ids >= 0
    W = ring.shape[1]
    ring[window_ids[keep].long(), positions[keep].long() % W] = values[keep].to(ring.dtype)
