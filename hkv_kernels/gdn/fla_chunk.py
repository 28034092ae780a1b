"""Chunked Gated DeltaNet prefill through flash-linear-attention's kernels (fla-core), over state slots.

fla-core's chunk kernel is the prefill path on CUDA when the package is
installed (docs/kernels.md has the comparison); without it the prefill falls
back to hkv's recurrent Triton kernel, which is exact but token-serial.
"""

from __future__ import annotations

import functools

import torch

from hkv_kernels.meta import CheckpointMeta, KernelMeta

FLA_CHUNK = 64  # fla-core's chunk size: in-chunk states exist at multiples of it


# the answer cannot change within a process, and a failed import is retried on every call otherwise
@functools.cache
def fla_available() -> bool:
    """True when fla-core's gated delta rule kernels can be imported (checked once per process)."""
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except ImportError:
        return False
    return True


def gated_delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    meta: KernelMeta,
    use_qk_l2norm: bool = True,
    checkpoints: CheckpointMeta | None = None,
    gate_params: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Chunked delta rule of every sequence from its slot's state; final states written back (fla-core).

    q, k: [T, Hk, Dk]; v: [T, Hv, Dv]; g (log decay, fp32), beta: [T, Hv], or with gate_params =
    (A_log, dt_bias) the raw a and b projections: g = -exp(A_log) * softplus(a + dt_bias) is then
    computed inside fla's chunk cumsum and beta = sigmoid(b) in torch (the model's rounding);
    state: [S, Hv, Dk, Dv] fp32, one layer of the state pool, updated in place;
    slots: [B] int on the GPU; meta: the step's KernelMeta (cu_seqlens, its host copy and fla's
    chunk metadata).
    checkpoints: in-chunk checkpoints (prefill steps only): state[checkpoints.slots[i]] must
    also receive the state of sequence seq[i] after its first tokens[i] tokens (a multiple
    of 64, fla's chunk size: one of the chunk-boundary states fla's forward materializes
    in its h tensor, row checkpoints.h_rows[i]), fp32, as the reference computes it (hkv_kernels/gdn/reference.py).
    Every sequence must have at least one new token (the runner never plans an empty chunk).
    Returns out: [T, Hv, Dv] in q's dtype.
    """
    bounds = meta.cu_seqlens_host
    if bool((bounds[1:] == bounds[:-1]).any()):
        raise ValueError("fla's varlen prefill needs every sequence to have new tokens")
    if gate_params is not None:
        beta = beta.sigmoid()
    slot_idx = slots.long()
    initial = state.index_select(0, slot_idx)  # [B, Hv, Dk, Dv]
    out, final, h = _chunked_with_states(
        q.contiguous()[None], k.contiguous()[None], v.contiguous()[None],
        (g.contiguous() if gate_params is not None else g.float().contiguous())[None], beta.contiguous()[None],
        initial, q.shape[-1] ** -0.5, meta, use_qk_l2norm, gate_params,
    )
    if checkpoints is not None:
        # fla keeps its chunk states in the input dtype (bf16): the checkpoints are those, widened
        state.index_copy_(0, checkpoints.slots, h[0].index_select(0, checkpoints.h_rows).to(state.dtype))
    state.index_copy_(0, slot_idx, final.to(state.dtype))
    return out[0].to(q.dtype)


def _chunked_with_states(q, k, v, g, beta, initial, scale, meta: KernelMeta, use_qk_l2norm: bool = True,
                         gate_params: tuple[torch.Tensor, torch.Tensor] | None = None):
    """fla-core's chunk forward (what ChunkGatedDeltaRuleFunction.forward runs), called kernel by
    kernel: no autograd node, no input guards, fla's varlen chunk metadata taken from the step's
    KernelMeta (made once per step on the host, so no layer derives it from cu_seqlens on the
    device, which would sync), and its per-chunk states come back too.

    g: [1, T, Hv] fp32 log decay, or with gate_params the raw a projection (fla's gate-in-kernel
    cumsum). Returns (out [1, T, Hv, Dv], final states [B, Hv, Dk, Dv] fp32, h [1, NT, Hv, Dk, Dv]):
    h[0, i] is the state *before* chunk i (64 tokens each, numbered across sequences in batch order).
    """
    from fla.modules.norm.l2norm import l2norm_fwd
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    from fla.ops.common.chunk_o import chunk_fwd_o
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.gated_delta_rule.gate import gdn_gate_chunk_cumsum
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    varlen = meta.num_seqs > 1
    cu = meta.cu_seqlens if varlen else None
    indices, offsets = (meta.fla_chunk_indices, meta.fla_chunk_offsets) if varlen else (None, None)
    if use_qk_l2norm:
        q, _ = l2norm_fwd(q)
        k, _ = l2norm_fwd(k)
    if gate_params is not None:
        a_log, dt_bias = gate_params
        g = gdn_gate_chunk_cumsum(g, a_log, chunk_size=FLA_CHUNK, scale=RCP_LN2, dt_bias=dt_bias, cu_seqlens=cu,
                                  chunk_indices=indices)
    else:
        g = chunk_local_cumsum(g, chunk_size=FLA_CHUNK, scale=RCP_LN2, cu_seqlens=cu, chunk_indices=indices)
    w, u, _ = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=g, beta=beta, cu_seqlens=cu, chunk_size=FLA_CHUNK,
                                               chunk_indices=indices)
    h, v_new, final = chunk_gated_delta_rule_fwd_h(k=k, w=w, u=u, g=g, initial_state=initial,
                                                   output_final_state=True, chunk_size=FLA_CHUNK, cu_seqlens=cu,
                                                   chunk_indices=indices, chunk_offsets=offsets)
    out = chunk_fwd_o(q=q, k=k, v=v_new, h=h, g=g, scale=scale, cu_seqlens=cu, chunk_size=FLA_CHUNK,
                      chunk_indices=indices)
    return out, final, h
