"""Model-facing ops: the Triton kernels when tensors live on CUDA, the pure-torch references otherwise.

Every op takes raw tensors and the step's `KernelMeta` (hkv_kernels/meta.py), never
a model object. On CUDA no op builds metadata or copies host to device, so a forward
made of these ops can be captured in a CUDA graph. Kernel modules are imported lazily,
on the first CUDA call, so a CPU process never imports Triton (and the kernel tests can
choose the interpreter before the first import).
"""

from __future__ import annotations

import torch

from hkv_kernels.meta import CheckpointMeta, KernelMeta


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor, meta: KernelMeta,
    scale: float, gate: torch.Tensor | None = None, kv_scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """Each sequence's new queries over its paged K/V, causal among the new tokens.

    q: [T, Hq, D]; k_cache, v_cache: [P, page_size, Hkv, D] one storage layer (the new tokens'
    K/V already written; FP8 caches are read as fp8 * kv_scales, the layer's (K, V) scales);
    page_table: [R, max_pages], sequence b reads row meta.table_rows[b];
    gate: optional [T, Hq, D], then the result is out * sigmoid(gate).
    Returns [T, Hq, D] in q's dtype.
    """
    if not q.is_cuda:
        from hkv_kernels.paged_attention.reference import paged_attention_ref

        rows = page_table.index_select(0, meta.table_rows)
        out = paged_attention_ref(q, k_cache, v_cache, rows, meta.q_len.tolist(), meta.kv_len.tolist(), scale,
                                  kv_scales)
        if gate is None:
            return out
        # on flattened rows, as the models always computed it (sigmoid of a strided view rounds
        # differently in fp32 on CPU)
        num_tokens = q.shape[0]
        return (out.reshape(num_tokens, -1) * torch.sigmoid(gate.reshape(num_tokens, -1))).view(out.shape)
    from hkv_kernels.paged_attention.triton_paged_attention import paged_attention as paged_attention_triton

    return paged_attention_triton(q, k_cache, v_cache, page_table, meta, scale, gate=gate, kv_scales=kv_scales)


def causal_conv1d(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, slots: torch.Tensor, meta: KernelMeta,
    keep_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """Ragged causal conv1d + silu over state slots (no bias, as Qwen3.5/Qwen3-Next use).

    x: [T, C]; conv_state: [S, C, K-1] one layer of the state pool (updated); weight: [C, K];
    slots: [B] int tensor; keep_slots: see the kernel. Returns [T, C] in x's dtype.
    """
    if not x.is_cuda:
        from hkv_kernels.conv1d.reference import causal_conv1d_ref

        return causal_conv1d_ref(x, conv_state, weight, meta.q_len.tolist(), slots.tolist(), keep_slots=keep_slots)
    from hkv_kernels.conv1d.triton_conv1d import causal_conv1d as causal_conv1d_triton

    return causal_conv1d_triton(x, conv_state, weight, slots, meta, keep_slots=keep_slots)


def conv_checkpoints(x: torch.Tensor, conv_state: torch.Tensor, checkpoints: CheckpointMeta) -> None:
    """The conv state at each in-chunk checkpoint: conv_state[slots[i]] = the K-1 conv inputs before
    rows[i], as [C, K-1] oldest first. x: [T, C] the conv inputs; conv_state: [S, C, K-1] one layer.
    Torch indexing on either device (prefill steps are eager)."""
    from hkv_kernels.conv1d.reference import conv_checkpoints_ref

    conv_checkpoints_ref(x, conv_state, checkpoints.rows, checkpoints.slots)


def gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    gate_params: tuple[torch.Tensor, torch.Tensor], state: torch.Tensor, slots: torch.Tensor, meta: KernelMeta,
    keep_slots: torch.Tensor | None = None, checkpoints: CheckpointMeta | None = None,
) -> torch.Tensor:
    """Ragged gated delta rule over state slots (qk l2norm on, scale Dk^-0.5), gates included.

    q, k: [T, Hk, Dk]; v: [T, Hv, Dv]; a, b: [T, Hv] the gate projections and gate_params =
    (A_log, dt_bias) [Hv] (g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b));
    state: [S, Hv, Dk, Dv] fp32 (updated); slots: [B] int tensor; keep_slots: None or [B, max_n];
    checkpoints: the step's in-chunk checkpoints (not with keep_slots): the state after
    checkpoints.tokens[i] tokens of sequence seq[i] is also written to slots[i].
    On CUDA: fla-core's chunk kernel when a sequence has > 1 token, inputs are bf16/fp16 (fla's
    fp32 path uses tf32 dots; fp32 serving is the exact parity mode), fla-core is installed and
    no keep_slots are given (checkpoints go to fla_chunk's hook; the decay is computed inside fla's
    chunk cumsum); hkv's recurrent kernel (gates fused in) otherwise, with checkpoints as keep slots. Returns [T, Hv, Dv] in q's dtype.
    """
    if checkpoints is not None and keep_slots is not None:
        raise ValueError("in-chunk checkpoints and keep_slots together")
    if not q.is_cuda:
        from hkv_kernels.gdn.reference import gated_delta_rule_ref, gdn_gates_ref

        g, beta = gdn_gates_ref(a, b, *gate_params)
        return gated_delta_rule_ref(q, k, v, g, beta, state, meta.q_len.tolist(), slots.tolist(), keep_slots=keep_slots,
                                    checkpoints=() if checkpoints is None else checkpoints.entries())
    from hkv_kernels.gdn.fla_chunk import fla_available, gated_delta_rule_chunked
    from hkv_kernels.gdn.triton_recurrent import gated_delta_rule_recurrent

    chunked = keep_slots is None and q.dtype != torch.float32 and meta.max_q_len > 1
    if chunked and fla_available():  # the gates go into fla's chunk cumsum (and one sigmoid)
        return gated_delta_rule_chunked(q, k, v, a, b, state, slots, meta, checkpoints=checkpoints,
                                        gate_params=gate_params)
    if checkpoints is not None:
        keep_slots = _checkpoint_keep_slots(slots, meta, checkpoints)
    return gated_delta_rule_recurrent(q, k, v, a, b, state, slots, meta, keep_slots=keep_slots, gate_params=gate_params)


def _checkpoint_keep_slots(slots: torch.Tensor, meta: KernelMeta, checkpoints: CheckpointMeta) -> torch.Tensor:
    """The recurrent kernel's keep slots [B, max_q_len] for in-chunk checkpoints (device ops, no sync):

        token t of sequence b   0 ... tokens[i]-1 ... q_len[b]-1
        keep[b, t]              -1    slots[i]   -1   slots[b]      (the live slot gets the final state)

    A sequence with no new tokens runs no token, so what its row holds is never read.
    """
    num_seqs = slots.shape[0]
    keep = torch.full((num_seqs, max(meta.max_q_len, 1)), -1, dtype=torch.int64, device=slots.device)
    keep[torch.arange(num_seqs, device=slots.device), meta.q_len - 1] = slots.long()
    keep[checkpoints.seq, checkpoints.tokens - 1] = checkpoints.slots
    return keep


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, plus_one: bool, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual) over the last dim; without residual (RMSNorm(x), x).

    plus_one: Qwen3.5's (1 + w) scale in fp32, else Qwen3's cast-then-scale. On CUDA the new
    residual is written in place into `residual`. x: [T, D] (or [T, H, D] without residual); weight: [D].
    """
    if not x.is_cuda:
        from hkv_kernels.norm.reference import add_rms_norm_ref

        return add_rms_norm_ref(x, residual, weight, eps, plus_one)
    from hkv_kernels.norm.triton_norm import rms_norm as rms_norm_triton

    out, summed = rms_norm_triton(x, weight, eps, plus_one, residual=residual)
    return out, x if summed is None else summed


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) * weight * silu(gate) over the last dim; x, gate: [T, H, D]; weight: [D]."""
    if not x.is_cuda:
        from hkv_kernels.norm.reference import gated_rms_norm_ref

        return gated_rms_norm_ref(x, gate, weight, eps)
    from hkv_kernels.norm.triton_norm import gated_rms_norm as gated_rms_norm_triton

    return gated_rms_norm_triton(x, gate, weight, eps)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up; gate, up: [T, I] (column-contiguous views allowed)."""
    if not gate.is_cuda:
        from hkv_kernels.activation.reference import silu_mul_ref

        return silu_mul_ref(gate, up)
    from hkv_kernels.activation.triton_activation import silu_mul as silu_mul_triton

    return silu_mul_triton(gate, up)


def attention_prep(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    positions: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, eps: float, plus_one: bool,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """Per-head q/k RMSNorm and rope, K/V written into one storage layer's cache at the slots
    (FP8 caches: stored as fp8(x / scale) with kv_scales, the layer's (K, V) scales).

    q: [T, Hq, D]; k, v: [T, Hkv, D]; cos, sin: per token [T, rot] on CPU, the rotary's
    [max_pos, rot] tables on CUDA (indexed by positions [T]). Returns q rotated: [T, Hq, D].
    """
    if not q.is_cuda:
        from hkv_kernels.rope.reference import attention_prep_ref

        return attention_prep_ref(q, k, v, cos, sin, q_norm, k_norm, eps, plus_one, k_cache, v_cache, slot_mapping,
                                  kv_scales)
    from hkv_kernels.rope.triton_rope import attention_prep as attention_prep_triton

    return attention_prep_triton(q, k, v, cos, sin, positions, q_norm, k_norm, eps, plus_one,
                                 k_cache, v_cache, slot_mapping, kv_scales=kv_scales)


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


def moe_route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (top-k weights [T, k] in logits' dtype, expert ids [T, k]): softmax in
    fp32, the k largest in descending order, renormalised to sum to one when asked."""
    if not logits.is_cuda:
        from hkv_kernels.moe.reference import moe_route_ref

        return moe_route_ref(logits, top_k, renormalize)
    from hkv_kernels.moe.triton_moe import moe_route as moe_route_triton

    return moe_route_triton(logits, top_k, renormalize)


def moe_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
    shared: torch.Tensor | None = None, shared_gate: torch.Tensor | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The routed experts' weighted sum, plus sigmoid(shared_gate) * shared when given.

    x: [T, H]; w13: [E, 2I, H] (gate rows, then up rows, per expert); w2: [E, H, I]; weights, ids:
    [T, k] from moe_route; shared: [T, H] and shared_gate: [T, 1], or None. CPU: transformers' loop over
    the hit experts; CUDA: the sort by expert and two grouped GEMMs, no host read (graph-safe).
    scales: FP8 experts' block multipliers (s13, s2; hkv_kernels/moe/reference.dequantize_experts), or
    None. Returns [T, H] in x's dtype.
    """
    if not x.is_cuda:
        from hkv_kernels.moe.reference import dequantize_experts, moe_experts_ref

        if scales is not None:  # the reference runs the dequantized weights
            w13, w2 = dequantize_experts(w13, w2, scales, x.dtype)
        return moe_experts_ref(x, w13, w2, weights, ids, shared, shared_gate)
    from hkv_kernels.moe.triton_moe import moe_experts as moe_experts_triton

    return moe_experts_triton(x, w13, w2, weights, ids, shared, shared_gate, scales=scales)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] times a block-FP8 weight [N, K] (float8_e4m3fn, with scale [ceil(N/128), ceil(K/128)]
    fp32 multipliers) transposed, plus bias [N] or None -> [..., N] in x's dtype. CPU: F.linear over the
    dequantized weight (the reference); CUDA: the Triton weight-only FP8 GEMM."""
    if not x.is_cuda:
        from hkv_kernels.fp8_gemm.reference import fp8_linear_ref

        return fp8_linear_ref(x, weight, scale, bias)
    from hkv_kernels.fp8_gemm.triton_fp8_gemm import fp8_linear as fp8_linear_triton

    return fp8_linear_triton(x, weight, scale, bias)
