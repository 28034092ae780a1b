"""Cache copy kernels against the references: pages by index lists (invalid skipped), slots, rings."""

import pytest
import torch

from hkv_kernels.cache_copy.reference import copy_blocks_ref, ring_write_ref
from hkv_kernels.cache_copy.triton_cache_copy import copy_blocks, ring_write
from tests.kernels.helpers import HAS_CUDA, cases


def _pools(device, dtype, src_device, dst_device, block, num_src, num_dst, gen):
    src = torch.randn(3, num_src, *block, generator=gen).to(dtype)
    dst = torch.randn(3, num_dst, *block, generator=gen).to(dtype)
    src = src.pin_memory() if src_device == "host" else src.to(device)
    dst = dst.pin_memory() if dst_device == "host" else dst.to(device)
    return src, dst


def _directions(device):
    if device == "cpu":
        return [("dev", "dev")]
    return [("dev", "dev"), ("dev", "host"), ("host", "dev")]


@pytest.mark.parametrize("device,dtype", cases())
def test_copy_pages_skips_invalid_indexes(device, dtype):
    gen = torch.Generator().manual_seed(0)
    block = (4, 2, 8) if device == "cpu" else (16, 8, 128)  # [page_size, kv_heads, head_dim]
    for src_side, dst_side in _directions(device):
        src, dst = _pools(device, dtype, src_side, dst_side, block, 10, 7, gen)
        src_idx = torch.tensor([3, -1, 9, 0, 12, 5])
        dst_idx = torch.tensor([0, 1, 6, 2, 3, 7])  # pair 1: src -1; pair 4: src 12 past the end; pair 5: dst 7 past
        expect = dst.cpu().clone()
        copy_blocks_ref(src.cpu(), expect, src_idx, dst_idx)
        dev = src.device if src.is_cuda else dst.device
        copy_blocks(src, dst, src_idx.to(dev), dst_idx.to(dev))
        if device == "cuda":
            torch.cuda.synchronize()
        assert torch.equal(dst.cpu(), expect), f"{src_side} -> {dst_side}"


@pytest.mark.parametrize("device,dtype", cases())
def test_copy_state_slots(device, dtype):
    # a checkpoint save: recurrent [L, slots, Hv, Dk, Dv] slot 2 -> 5 and 0 -> 1, within one pool
    gen = torch.Generator().manual_seed(1)
    pool = torch.randn(2, 6, 2, 8, 4, generator=gen).to(device, torch.float32)
    expect = pool.cpu().clone()
    src_idx, dst_idx = torch.tensor([2, 0]), torch.tensor([5, 1])
    copy_blocks_ref(expect.clone(), expect, src_idx, dst_idx)
    copy_blocks(pool, pool, src_idx.to(device), dst_idx.to(device))
    assert torch.equal(pool.cpu(), expect)


@pytest.mark.parametrize("device,dtype", cases())
def test_ring_write_wraps_and_skips(device, dtype):
    gen = torch.Generator().manual_seed(2)
    ring = torch.randn(3, 4, 2, 8, generator=gen).to(device, dtype)  # [windows, W, Hkv, D]
    values = torch.randn(5, 2, 8, generator=gen).to(device, dtype)
    window_ids = torch.tensor([0, 0, 2, -1, 1])
    positions = torch.tensor([3, 4, 9, 1, 0])  # 4 wraps to 0, 9 to 1
    expect = ring.cpu().clone()
    ring_write_ref(expect, window_ids, positions, values.cpu())
    ring_write(ring, window_ids.to(device), positions.to(device), values)
    assert torch.equal(ring.cpu(), expect)


@pytest.mark.skipif(HAS_CUDA, reason="CPU-only case")
def test_reference_handles_empty_index_lists():
    src, dst = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    before = dst.clone()
    copy_blocks_ref(src, dst, torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long))
    assert torch.equal(dst, before)
