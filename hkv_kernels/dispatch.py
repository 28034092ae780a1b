"""Model-facing ops: the Triton kernels when tensors live on CUDA, the pure-torch references otherwise.

Every op takes raw tensors with the signature of its `hkv_kernels/<op>/reference.py`
function (slots as an int tensor instead of a list): the model files call these
on CPU and CUDA alike and pick the pool layers and batch fields themselves.
Kernel modules are imported lazily, on the first CUDA call, so a CPU process
never imports Triton (and the kernel tests can choose the interpreter before
the first import).
"""

from __future__ import annotations

import torch


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    q_lens: list[int],
    kv_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """Each sequence's new queries over its paged K/V, causal among the new tokens.

    q: [T, Hq, D] all new tokens in batch order; k_cache, v_cache: [P, page_size, Hkv, D]
    one storage layer with the new tokens' K/V already written; page_table: [B, max_pages]
    int (moved to q's device if it is not there); q_lens, kv_lens: [B] (kv_len counts
    cached + new). Returns [T, Hq, D] in q's dtype.
    """
    if not q.is_cuda:
        from hkv_kernels.paged_attention.reference import paged_attention_ref

        return paged_attention_ref(q, k_cache, v_cache, page_table, q_lens, kv_lens, scale)
    from hkv_kernels.paged_attention.triton_paged_attention import paged_attention as paged_attention_triton

    page_table = page_table.to(q.device, non_blocking=True)
    return paged_attention_triton(q, k_cache, v_cache, page_table, q_lens, kv_lens, scale)


def causal_conv1d(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    q_lens: list[int],
    slots: torch.Tensor,
    keep_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """Ragged causal conv1d + silu over state slots (no bias, as Qwen3.5/Qwen3-Next use).

    x: [T, C]; conv_state: [S, C, K-1] one layer of the state pool (updated);
    weight: [C, K]; q_lens: [B]; slots: [B] int tensor; keep_slots: see the kernel.
    Returns [T, C] in x's dtype.
    """
    if not x.is_cuda:
        from hkv_kernels.conv1d.reference import causal_conv1d_ref

        return causal_conv1d_ref(x, conv_state, weight, q_lens, slots.tolist(), keep_slots=keep_slots)
    from hkv_kernels.conv1d.triton_conv1d import causal_conv1d as causal_conv1d_triton

    return causal_conv1d_triton(x, conv_state, weight, q_lens, slots.to(x.device), keep_slots=keep_slots)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    q_lens: list[int],
    slots: torch.Tensor,
    keep_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """Ragged gated delta rule over state slots (qk l2norm on, scale Dk^-0.5).

    q, k: [T, Hk, Dk]; v: [T, Hv, Dv]; g, beta: [T, Hv]; state: [S, Hv, Dk, Dv] fp32
    (updated); q_lens: [B]; slots: [B] int tensor; keep_slots: None or [B, max_n].
    On CUDA: fla-core's chunk kernel when a sequence has > 1 token, inputs are
    bf16/fp16 (fla's fp32 path uses tf32 dots; fp32 serving is the exact parity
    mode), fla-core is installed and no intermediate states are kept; hkv's
    recurrent kernel otherwise.
    Returns [T, Hv, Dv] in q's dtype.
    """
    if not q.is_cuda:
        from hkv_kernels.gdn.reference import gated_delta_rule_ref

        return gated_delta_rule_ref(q, k, v, g, beta, state, q_lens, slots.tolist(), keep_slots=keep_slots)
    from hkv_kernels.gdn.fla_chunk import fla_available, gated_delta_rule_chunked
    from hkv_kernels.gdn.triton_recurrent import gated_delta_rule_recurrent

    slots = slots.to(q.device)
    chunked = keep_slots is None and q.dtype != torch.float32 and max(q_lens, default=0) > 1
    if chunked and fla_available():
        return gated_delta_rule_chunked(q, k, v, g, beta, state, q_lens, slots)
    return gated_delta_rule_recurrent(q, k, v, g, beta, state, q_lens, slots, keep_slots=keep_slots)


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor) -> None:
    """dst[:, dst_idx[i]] = src[:, src_idx[i]] for in-range pairs (KV pages, state slots, host <-> device).

    src: [L, Ns, *block]; dst: [L, Nd, *block]. The Triton kernel runs when either
    side is on CUDA (a host side must then be pinned); the reference otherwise.
    """
    if not (src.is_cuda or dst.is_cuda):
        from hkv_kernels.cache_copy.reference import copy_blocks_ref

        copy_blocks_ref(src, dst, src_idx, dst_idx)
        return
    from hkv_kernels.cache_copy.triton_cache_copy import copy_blocks as copy_blocks_triton

    dev = src.device if src.is_cuda else dst.device
    copy_blocks_triton(src, dst, src_idx.to(dev), dst_idx.to(dev))


def ring_write(ring: torch.Tensor, window_ids: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> None:
    """ring[window_ids[t], positions[t] % W] = values[t] (window_ids[t] >= 0); ring: [windows, W, Hkv, D]."""
    if not ring.is_cuda:
        from hkv_kernels.cache_copy.reference import ring_write_ref

        ring_write_ref(ring, window_ids, positions, values)
        return
    from hkv_kernels.cache_copy.triton_cache_copy import ring_write as ring_write_triton

    ring_write_triton(ring, window_ids.to(ring.device), positions.to(ring.device), values)
