"""Pure-torch causal depthwise conv1d with carried state: the CPU path, and what the Triton kernel is tested against.

`causal_conv1d` runs one sequence's new chunk: from a zero state it equals
transformers' `causal_conv1d_fn` torch fallback (models/qwen3_5, left zero
padding), and from a carried state its `causal_conv1d_update`, but it returns
the new state instead of updating it in place, so a prefill split anywhere
continues exactly where it stopped. `causal_conv1d_ref` loops it over a
ragged batch whose states live in state-pool slots.

Names: T new tokens, C conv channels (q|k|v concatenated), K kernel size, S slots.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv over a new chunk, continuing from the carried inputs.

    x: [T, C] the chunk's conv inputs, token-major.
    conv_state: [C, K-1] the K-1 inputs before the chunk, oldest first (zeros
        for a fresh sequence, which equals transformers' left zero padding).
    weight: [C, K]; bias: [C] or None.
    Returns out: [T, C] in x's dtype, and the new conv state [C, K-1] (the
    last K-1 inputs, in conv_state's dtype). conv_state is not modified.
    """
    num_tokens = x.shape[0]
    state_len = weight.shape[-1] - 1
    window = torch.cat([conv_state.to(weight.dtype), x.t().to(weight.dtype)], dim=-1)  # [C, K-1+T]
    new_state = window[:, window.shape[-1] - state_len :].to(conv_state.dtype)  # [C, K-1]
    # F.conv1d on the unbatched [C, L] input, as transformers does on [1, C, L]
    out = F.conv1d(window.unsqueeze(0), weight.unsqueeze(1), bias, groups=window.shape[0])[0]  # [C, T]
    out = out[:, out.shape[-1] - num_tokens :]  # [C, T]
    if activation == "silu":
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"unsupported conv activation {activation!r}")
    return out.t().to(x.dtype), new_state


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


def conv_checkpoints_ref(x: torch.Tensor, conv_state: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
    """The conv state at in-chunk checkpoints: the K-1 conv inputs before each, oldest first.

    x: [T, C] the step's conv inputs (before the conv); conv_state: [S, C, K-1] one layer
    of the state pool; rows, slots: [N] int64 on x's device (CheckpointMeta.rows / slots).
    Checkpoint i's state is what `causal_conv1d` leaves after the tokens before row i
    (rows[i] - (K-1) >= the sequence's first row: checkpoints sit a GDN chunk or more in):

        x rows   [ ... rows[i]-(K-1) ... rows[i]-1 ][ rows[i] ... ]
        conv_state[slots[i]] = those K-1 rows as [C, K-1]

    Torch indexing only, so it runs as it is on CUDA tensors too.
    """
    width = conv_state.shape[-1]
    taps = rows[:, None] - width + torch.arange(width, device=rows.device)  # [N, K-1]
    conv_state.index_copy_(0, slots, x[taps].transpose(1, 2).to(conv_state.dtype))  # [N, C, K-1]
