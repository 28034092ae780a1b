"""Pure-torch attention input prep: the models' CPU path and the Triton kernel's reference.

q/k RMSNorm per head (either Qwen weight convention, hkv_kernels/norm/reference.py),
rope on the first `rot` dims of each head (rotate-half form, as transformers' apply_rotary_pos_emb;
the rest passes through) and the new tokens' K/V written into one storage layer's cache.
"""

from __future__ import annotations

import torch

from hkv_kernels.kv_quant import store_rows
from hkv_kernels.norm.reference import rms_norm_ref


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos, sin: [T, D] -> [T, heads, D] (rotates all D dims)."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rope on the first rot dims of each head, the rest passes through; x: [T, H, D], cos/sin: [T, rot]."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return torch.cat((apply_rope(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)


def write_kv_ref(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 k: torch.Tensor, v: torch.Tensor, kv_scales: tuple[float, float] = (1.0, 1.0)) -> None:
    """Store new tokens' K/V at their flat slots (page * page_size + offset) of one storage layer.

    k_cache, v_cache: [P, page_size, Hkv, D]; slot_mapping: [T] int64; k, v: [T, Hkv, D];
    kv_scales: the layer's (K, V) scales when the caches are FP8 (hkv_kernels/kv_quant.py).
    """
    k_flat = k_cache.view(-1, *k_cache.shape[2:])  # [P * page_size, Hkv, D], shares the pool's storage
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    store_rows(k_flat, slot_mapping, k, kv_scales[0])
    store_rows(v_flat, slot_mapping, v, kv_scales[1])


def attention_prep_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    q_norm: torch.Tensor, k_norm: torch.Tensor, eps: float, plus_one: bool,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """q: [T, Hq, D], k, v: [T, Hkv, D] (projections, views allowed); cos, sin: [T, rot];
    q_norm, k_norm: [D] norm weights. Writes rope(norm(k)) and v into the caches at slot_mapping
    (FP8 caches: quantized with kv_scales); returns rope(norm(q)): [T, Hq, D]."""
    q = apply_partial_rope(rms_norm_ref(q, q_norm, eps, plus_one), cos, sin)
    k = apply_partial_rope(rms_norm_ref(k, k_norm, eps, plus_one), cos, sin)
    write_kv_ref(k_cache, v_cache, slot_mapping, k, v, kv_scales)
    return q
