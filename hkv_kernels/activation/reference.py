"""Pure-torch SiLU-and-multiply: the SwiGLU MLP's CPU path and the Triton kernel's reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, each rounded to the input dtype as torch computes it; gate, up: [T, I]."""
    return F.silu(gate) * up
