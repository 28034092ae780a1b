"""FP8 KV pages in pure torch: how a value is stored and read back (the CPU path, and what the
Triton writers and readers are tested against).

A storage layer of FP8 pages has a K scale and a V scale (1.0 unless the checkpoint gives one):

    stored = fp8_e4m3fn(clamp(x / scale, -448, 448))      (x in fp32, round to nearest even)
    read   = float(stored) * scale, then the attention's dtype

Casting past 448 gives NaN in torch, so stores saturate first. A pool of another dtype stores a
plain cast and reads it back as is. On CPU torch has no index_copy_ for float8: rows move as bytes.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x as a pool of `dtype` stores it: fp8(clamp(x / scale)) computed in fp32, else a plain cast."""
    if dtype != FP8:
        return x.to(dtype)
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(dtype)


def dequantize(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Stored values in `dtype` (the attention's): FP8 times its scale, computed in fp32; else a cast."""
    if x.dtype != FP8:
        return x.to(dtype)
    return (x.float() * scale).to(dtype)


def store_rows(flat: torch.Tensor, rows: torch.Tensor, values: torch.Tensor, scale: float) -> None:
    """flat[rows[t]] = quantize(values[t]); flat: [N, *row] a pool view; rows: [T] int64; values: [T, *row]."""
    stored = quantize(values, flat.dtype, scale)
    if flat.dtype == FP8:  # no float8 index_copy_ on CPU: the same bytes as uint8
        flat.view(torch.uint8).index_copy_(0, rows, stored.view(torch.uint8))
        return
    flat.index_copy_(0, rows, stored)
