"""Pure-torch ragged causal conv1d over state slots: a loop of `hkv.models.gdn.causal_conv1d` calls."""

from __future__ import annotations

import torch

from hkv.models.gdn import causal_conv1d


def causal_conv1d_ref(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    q_lens: list[int],
    slots: list[int],
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    keep_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """Conv of each sequence's new tokens, continuing from and writing back its slot's state.

    x: [T, C] new tokens of all sequences in order; conv_state: [S, C, K-1] one
    layer of the state pool; weight: [C, K]; q_lens, slots: [B].
    keep_slots: None (the final state overwrites slots[b]) or [B, max_n] int:
    the state after token t of sequence b goes to keep_slots[b, t] and slots[b]
    is left as it was (speculative verification keeps every candidate);
    entries < 0 are skipped.
    Returns out: [T, C] in x's dtype.
    """
    out = torch.empty_like(x)
    start = 0
    for b, (n, slot) in enumerate(zip(q_lens, slots)):
        if n == 0:
            continue
        rows = slice(start, start + n)
        out[rows], new_state = causal_conv1d(x[rows], conv_state[slot], weight, bias, activation)
        if keep_slots is None:
            conv_state[slot].copy_(new_state)
        else:
            state = conv_state[slot].clone()
            for t in range(n):
                _, state = causal_conv1d(x[start + t : start + t + 1], state, weight, bias, activation)
                if int(keep_slots[b, t]) >= 0:
                    conv_state[int(keep_slots[b, t])].copy_(state)
        start += n
    return out
