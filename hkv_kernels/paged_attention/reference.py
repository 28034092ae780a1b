"""Pure-torch paged attention on raw cache tensors: the CPU path, and what the Triton kernel is tested against.

`attend` is one sequence's attention: over a whole prompt it computes what
transformers' `sdpa_attention_forward` (integrations/sdpa_attention.py, the
default attention of its Qwen3 / Qwen3.5 models) does with the causal mask and
GQA; for new tokens after a cached prefix the mask is causal among the new
tokens and full over the prefix.
`paged_attention_ref` reads each sequence's K/V through its page-table row and
calls `attend`.

Names: T new tokens in the batch, n new tokens of one sequence, L tokens in
its K/V (cached + new), Hq / Hkv query / KV heads, D head dim, P pages.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hkv_kernels.kv_quant import dequantize


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of one sequence's n new queries over its L cached keys (the new ones last).

    q: [n, Hq, D]; k, v: [L, Hkv, D] -> [n, Hq, D]. Query i sits at position L - n + i
    and sees keys 0 .. L - n + i: causal among the new tokens, full over the prefix.
    """
    n, L = q.shape[0], k.shape[0]
    mask = None
    if n > 1:
        key_pos = torch.arange(L, device=q.device)
        query_pos = torch.arange(L - n, L, device=q.device)
        mask = key_pos[None, :] <= query_pos[:, None]  # [n, L]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale, enable_gqa=True
    )  # [Hq, n, D]
    return out.transpose(0, 1)


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    q_lens: list[int],
    kv_lens: list[int],
    scale: float,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """Each sequence's new queries over its paged K/V, causal among the new tokens.

    q: [T, Hq, D] new tokens of all sequences in order; k_cache, v_cache:
    [P, page_size, Hkv, D] one storage layer (new tokens' K/V already written); FP8 caches are
    read as fp8 * kv_scales (K, V) in q's dtype (hkv_kernels/kv_quant.py);
    page_table: [B, max_pages] int; q_lens, kv_lens: [B] (kv_len counts cached + new).
    Returns [T, Hq, D] in q's dtype.
    """
    out = torch.empty_like(q)
    page_size, start = k_cache.shape[1], 0
    for b, (n, kv_len) in enumerate(zip(q_lens, kv_lens)):
        if n == 0:
            continue
        pages = page_table[b, : -(-kv_len // page_size)].long()
        k = dequantize(k_cache.index_select(0, pages).flatten(0, 1)[:kv_len], q.dtype, kv_scales[0])  # [L, Hkv, D]
        v = dequantize(v_cache.index_select(0, pages).flatten(0, 1)[:kv_len], q.dtype, kv_scales[1])  # [L, Hkv, D]
        out[start : start + n] = attend(q[start : start + n], k, v, scale)
        start += n
    return out
