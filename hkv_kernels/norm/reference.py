"""Pure-torch RMSNorms: the models' exact CPU path and the references of the Triton kernels.

Two weight conventions, as transformers computes them:

- plus_one (Qwen3.5 / Qwen3-Next, Gemma style): normalize in fp32, scale by (1 + w) in fp32,
  round once to the input dtype (transformers' Qwen3_5RMSNorm);
- not plus_one (Qwen3): normalize in fp32, round to the input dtype, then multiply by w in
  the model dtype (transformers' Qwen3RMSNorm).

`gated_rms_norm_ref` is transformers' Qwen3_5RMSNormGated: RMSNorm(x) * w (plain weight),
then times silu(gate) in fp32, rounded once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, plus_one: bool) -> torch.Tensor:
    """x: [..., D]; weight: [D] -> [..., D] in x's dtype."""
    if plus_one:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return (h * (1.0 + weight.float())).type_as(x)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    # cast before scaling, as transformers does, so bf16 rounding matches
    return weight * x32.to(x.dtype)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, plus_one: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pre-norm step of a decoder layer: residual' = x + residual (x itself when residual is
    None), then (rms_norm(residual'), residual'). x, residual: [T, D]."""
    summed = x if residual is None else x + residual
    return rms_norm_ref(summed, weight, eps, plus_one), summed


def gated_rms_norm_ref(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x, gate: [..., D]; weight: [D] -> [..., D] in x's dtype: norm first, gate second."""
    in_dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(in_dtype)
    h = h * F.silu(gate.to(torch.float32))
    return h.to(in_dtype)
