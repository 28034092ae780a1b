"""Chunked Gated DeltaNet prefill through flash-linear-attention's kernels (fla-core), over state slots.

fla-core's chunk kernel is the prefill path on CUDA when the package is
installed (docs/kernels.md has the comparison); without it the prefill falls
back to hkv's recurrent Triton kernel, which is exact but token-serial.
"""

from __future__ import annotations

import functools

import torch


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
    q_lens: list[int],
    slots: torch.Tensor,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """Chunked delta rule of every sequence from its slot's state; final states written back (fla-core).

    q, k: [T, Hk, Dk]; v: [T, Hv, Dv]; g (log decay, fp32), beta: [T, Hv];
    state: [S, Hv, Dk, Dv] fp32, one layer of the state pool, updated in place;
    q_lens: [B] python ints; slots: [B] int on the GPU.
    Returns out: [T, Hv, Dv] in q's dtype.
    """
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    live = [b for b, n in enumerate(q_lens) if n > 0]
    slot_idx = slots[torch.tensor(live, dtype=torch.long, device=slots.device)].long()
    initial = state.index_select(0, slot_idx)  # [N, Hv, Dk, Dv]
    varlen = {}
    if len(live) > 1:
        bounds = [0]
        for b in live:
            bounds.append(bounds[-1] + q_lens[b])
        cu_seqlens_cpu = torch.tensor(bounds, dtype=torch.long)
        # chunk indices come from the host copy: no device sync
        varlen = dict(cu_seqlens=cu_seqlens_cpu.to(q.device, non_blocking=True), cu_seqlens_cpu=cu_seqlens_cpu)
    out, final = chunk_gated_delta_rule(
        q.contiguous()[None], k.contiguous()[None], v.contiguous()[None], g.float().contiguous()[None],
        beta.contiguous()[None], scale=q.shape[-1] ** -0.5, initial_state=initial, output_final_state=True,
        use_qk_l2norm_in_kernel=use_qk_l2norm, **varlen,
    )
    state.index_copy_(0, slot_idx, final.to(state.dtype))
    return out[0].to(q.dtype)
