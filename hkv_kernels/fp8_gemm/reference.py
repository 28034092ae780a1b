"""Pure-torch block FP8: the CPU path and the Triton kernels' reference.

A weight W [N, K] is stored as Q [N, K] float8_e4m3fn and S [ceil(N/B), ceil(K/B)] float32 with B = 128
(the checkpoints call S `weight_scale_inv`: a multiplier, despite the name):

    W[n, k] = float32(Q[n, k]) * S[n // B, k // B]

Dequantizing is exact in fp32 (an e4m3 value times an fp32 scale rounds once); the result is then
cast to the activation dtype, so a dequantized model in that dtype computes what the FP8 one does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 128  # rows and columns of one scale block (weight_block_size [128, 128])
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
FP8_DTYPE = torch.float8_e4m3fn


def scale_shape(rows: int, cols: int, block: int = BLOCK) -> tuple[int, int]:
    """The block-scale grid of a [rows, cols] weight: (ceil(rows / block), ceil(cols / block))."""
    return -(-rows // block), -(-cols // block)


def expand_scales(scale: torch.Tensor, rows: int, cols: int, block: int = BLOCK) -> torch.Tensor:
    """scale [..., ceil(rows/B), ceil(cols/B)] -> [..., rows, cols]: each block's multiplier on its elements."""
    return scale.repeat_interleave(block, dim=-2)[..., :rows, :].repeat_interleave(block, dim=-1)[..., :cols]


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, block: int = BLOCK) -> torch.Tensor:
    """weight [..., N, K] float8_e4m3fn, scale [..., ceil(N/B), ceil(K/B)] fp32 -> [..., N, K] in `dtype`
    (the product in fp32, rounded once to `dtype`)."""
    rows, cols = weight.shape[-2:]
    if tuple(scale.shape[-2:]) != scale_shape(rows, cols, block):
        raise ValueError(f"scale shape {tuple(scale.shape)} does not tile a {tuple(weight.shape)} weight "
                         f"in {block} x {block} blocks")
    return (weight.float() * expand_scales(scale.float(), rows, cols, block)).to(dtype)


def quantize(weight: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., N, K] (any float dtype) -> (float8_e4m3fn [..., N, K], fp32 scale [..., ceil(N/B), ceil(K/B)]).

    scale = amax(|block|) / 448 per block (an all-zero block gets 1.0), q = round(w / scale): the largest
    element of each block maps to +-448. Computed in fp32, so the same weights always give the same bytes.
    """
    rows, cols = weight.shape[-2:]
    grid_rows, grid_cols = scale_shape(rows, cols, block)
    w = weight.float()
    padded = F.pad(w, (0, grid_cols * block - cols, 0, grid_rows * block - rows))
    blocks = padded.unflatten(-1, (grid_cols, block)).unflatten(-3, (grid_rows, block))  # [..., R, B, C, B]
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., R, C]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w / expand_scales(scale, rows, cols, block)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale.contiguous()


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear over the dequantized weight: x [..., K] -> [..., N] in x's dtype; weight [N, K] fp8,
    scale [ceil(N/128), ceil(K/128)] fp32, bias [N] or None."""
    return F.linear(x, dequantize(weight, scale, x.dtype), bias)
