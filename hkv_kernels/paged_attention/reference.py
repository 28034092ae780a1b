"""Pure-torch paged attention on raw cache tensors: the CPU path the Triton kernel is tested against.

It is the models' reference (`hkv.models.qwen3.attend` per sequence) on one
storage layer's K/V instead of a KVPool, so the kernel and the CPU path share
one signature.
"""

from __future__ import annotations

import torch

from hkv.models.qwen3 import attend


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    q_lens: list[int],
    kv_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """Each sequence's new queries over its paged K/V, causal among the new tokens.

    q: [T, Hq, D] new tokens of all sequences in order; k_cache, v_cache:
    [P, page_size, Hkv, D] one storage layer (new tokens' K/V already written);
    page_table: [B, max_pages] int; q_lens, kv_lens: [B] (kv_len counts cached + new).
    Returns [T, Hq, D] in q's dtype.
    """
    out = torch.empty_like(q)
    page_size, start = k_cache.shape[1], 0
    for b, (n, kv_len) in enumerate(zip(q_lens, kv_lens)):
        if n == 0:
            continue
        pages = page_table[b, : -(-kv_len // page_size)].long()
        k = k_cache.index_select(0, pages).flatten(0, 1)[:kv_len]  # [L, Hkv, D]
        v = v_cache.index_select(0, pages).flatten(0, 1)[:kv_len]  # [L, Hkv, D]
        out[start : start + n] = attend(q[start : start + n], k, v, scale)
        start += n
    return out
