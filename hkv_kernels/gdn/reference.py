"""Pure-torch ragged Gated DeltaNet over state slots: loops of the `hkv.models.gdn` references.

Prefill chunks use the chunked reference, single tokens the recurrent one,
exactly as the model's per-sequence path does; `keep_slots` runs token by
token and keeps the state after every token (speculative verification).
"""

from __future__ import annotations

import torch

from hkv.models.gdn import chunk_gated_delta_rule, recurrent_gated_delta_rule


def gated_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    q_lens: list[int],
    slots: list[int],
    keep_slots: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """Delta rule for each sequence from its slot's state, writing the state back.

    q, k: [T, Hk, Dk]; v: [T, Hv, Dv]; g (log decay), beta: [T, Hv];
    state: [S, Hv, Dk, Dv] fp32, one layer of the state pool; q_lens, slots: [B].
    keep_slots: None (final state overwrites slots[b]) or [B, max_n] int: the
    state after token t goes to keep_slots[b, t] (entries < 0 skipped), slots[b] untouched.
    Returns out: [T, Hv, Dv] in q's dtype.
    """
    out = v.new_empty(v.shape, dtype=q.dtype)
    start = 0
    for b, (n, slot) in enumerate(zip(q_lens, slots)):
        if n == 0:
            continue
        rows = slice(start, start + n)
        if keep_slots is None:
            rule = recurrent_gated_delta_rule if n == 1 else chunk_gated_delta_rule
            out[rows], final = rule(q[rows], k[rows], v[rows], g[rows], beta[rows], state[slot], use_qk_l2norm)
            state[slot].copy_(final)
        else:
            current = state[slot].clone()
            for t in range(n):
                row = slice(start + t, start + t + 1)
                out[row], current = recurrent_gated_delta_rule(
                    q[row], k[row], v[row], g[row], beta[row], current, use_qk_l2norm
                )
                if int(keep_slots[b, t]) >= 0:
                    state[int(keep_slots[b, t])].copy_(current)
        start += n
    return out
