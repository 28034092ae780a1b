"""Paged attention kernel against the pure-torch reference: decode, prefill with prefix, ragged, edges."""

import pytest
import torch

from hkv_kernels.paged_attention.reference import paged_attention_ref
from hkv_kernels.paged_attention.triton_paged_attention import paged_attention
from hkv_kernels.meta import build_meta
from tests.kernels.helpers import assert_close, cases, nan_like

# (q_lens, kv_lens): decode, length 1, page boundaries, prefill over a cached prefix, empty sequences
SMALL = [
    ([1, 1, 1], [1, 4, 9]),
    ([3, 0, 5, 1], [3, 4, 12, 8]),
    ([9], [9]),
    ([4, 2], [8, 6]),
]
LARGE = [
    ([1] * 16, [1, 15, 16, 17, 31, 32, 33, 100, 255, 256, 257, 500, 64, 128, 1000, 7]),
    ([200, 0, 1, 37], [200, 5, 300, 100]),
    ([513], [1040]),
]


def _run(device, dtype, q_lens, kv_lens, heads, head_dim, page_size, seed):
    gen = torch.Generator().manual_seed(seed)
    num_q_heads, num_kv_heads = heads
    max_pages = max(-(-n // page_size) for n in kv_lens) + 1
    num_pages = len(kv_lens) * max_pages + 3
    k = torch.randn(num_pages, page_size, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    v = torch.randn(num_pages, page_size, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    # every sequence gets distinct, shuffled pages
    page_table = torch.randperm(num_pages, generator=gen)[: len(kv_lens) * max_pages].view(len(kv_lens), max_pages)
    page_table = page_table.to(device)
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=gen).to(device, dtype)
    scale = head_dim**-0.5
    meta = build_meta(q_lens, kv_lens, device, num_q_heads // num_kv_heads, head_dim, dtype)
    out = paged_attention(q, k, v, page_table, meta, scale, out=nan_like(q))
    ref = paged_attention_ref(q.float().cpu(), k.float().cpu(), v.float().cpu(), page_table.cpu(), q_lens, kv_lens, scale)
    return out, ref


@pytest.mark.parametrize("device,dtype", cases())
@pytest.mark.parametrize("heads", [(4, 2), (3, 3)], ids=["gqa", "mha"])
def test_paged_attention_matches_reference(device, dtype, heads):
    shapes, head_dim, page_size = (SMALL, 16, 4) if device == "cpu" else (LARGE, 128, 16)
    for i, (q_lens, kv_lens) in enumerate(shapes):
        out, ref = _run(device, dtype, q_lens, kv_lens, heads, head_dim, page_size, seed=i)
        assert_close(out, ref, dtype, f"case {i}")


@pytest.mark.parametrize("device,dtype", cases())
def test_paged_attention_large_group_and_odd_head_dim(device, dtype):
    # Qwen3-Next-like grouping (8 query heads per KV head), head dim not a power of two
    out, ref = _run(device, dtype, [1, 6], [7, 11], (8, 1), 24, 4, seed=11)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("device,dtype", cases())
@pytest.mark.parametrize("tile", [(32, 2), (64, 3)], ids=["n32", "n64"])
def test_split_decode_tiles_match_reference(device, dtype, tile):
    """Both decode tiles the launcher picks (hkv_kernels/paged_attention: 32 keys / 2 stages from 32
    programs up, else 64 / 3), split across programs, over lengths around the blocks and pages."""
    from hkv_kernels.paged_attention.triton_paged_attention import launch_paged_decode

    kv_lens = [1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 7] if device == "cpu" else [1, 31, 32, 33, 576, 1000] * 6
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, head_dim, page = 4, 2, 16 if device == "cpu" else 128, 16
    max_pages = max(-(-n // page) for n in kv_lens) + 1
    num_pages = len(kv_lens) * max_pages
    k = torch.randn(num_pages, page, kv_heads, head_dim, generator=gen).to(device, dtype)
    v = torch.randn(num_pages, page, kv_heads, head_dim, generator=gen).to(device, dtype)
    table = torch.randperm(num_pages, generator=gen).view(len(kv_lens), max_pages).to(device)
    q = torch.randn(len(kv_lens), heads, head_dim, generator=gen).to(device, dtype)
    meta = build_meta([1] * len(kv_lens), kv_lens, device, heads // kv_heads, head_dim, dtype)
    out = launch_paged_decode(q, k, v, table, meta, head_dim**-0.5, nan_like(q), block_n=tile[0], num_stages=tile[1],
                              splits=3)
    ref = paged_attention_ref(q.float().cpu(), k.float().cpu(), v.float().cpu(), table.cpu(), [1] * len(kv_lens),
                              kv_lens, head_dim**-0.5)
    assert_close(out, ref, dtype)
