"""Small host-side helpers shared by the Triton launchers."""

from __future__ import annotations

import torch


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: exact fp32 for fp32 operands (parity runs), the fast default otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"
