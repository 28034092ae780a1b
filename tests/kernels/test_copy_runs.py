"""Page copies as runs (hkv_kernels/cache_copy/runs.py) against the per-pair reference, bit for bit."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hkv_kernels.cache_copy.reference import copy_blocks_ref
from hkv_kernels.cache_copy.runs import copy_runs, page_runs
from tests.kernels.helpers import HAS_CUDA

DEVICES = [pytest.param("cpu", id="cpu"),
           pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")])]


def test_page_runs_are_maximal_and_in_order():
    assert page_runs([], []) == []
    assert page_runs([4, 5, 6, 9, 10, 2], [0, 1, 2, 3, 4, 8]) == [(4, 0, 3), (9, 3, 2), (2, 8, 1)]
    # consecutive on one side only: a run ends
    assert page_runs([1, 2, 3], [7, 9, 10]) == [(1, 7, 1), (2, 9, 2)]
    with pytest.raises(ValueError, match="unequal"):
        page_runs([1, 2], [3])


def _pools(device, dtype, block, num_src, num_dst, seed):
    gen = torch.Generator().manual_seed(seed)
    src = torch.randn(3, num_src, *block, generator=gen).to(dtype).to(device)
    dst = torch.randn(3, num_dst, *block, generator=gen).to(dtype).to(device)
    return src, dst


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,block", [(torch.bfloat16, (4, 2, 8)), (torch.float32, (2, 3, 5)),
                                         (torch.float16, (3,)), (torch.float32, ())])
def test_copy_runs_equals_the_per_pair_copy(device, dtype, block):
    """Word-aligned blocks (8-byte words) and blocks that are not (elements), every layer, nothing else touched."""
    src, dst = _pools(device, dtype, block, 12, 9, 0)
    src_pages, dst_pages = [3, 4, 5, 6, 0, 11, 10], [0, 1, 2, 3, 8, 5, 6]
    expect = dst.cpu().clone()
    copy_blocks_ref(src.cpu(), expect, torch.tensor(src_pages), torch.tensor(dst_pages))
    copy_runs(src, dst, page_runs(src_pages, dst_pages))
    assert torch.equal(dst.cpu().view(torch.uint8) if dtype != torch.float32 else dst.cpu(),
                       expect.view(torch.uint8) if dtype != torch.float32 else expect)


def test_a_bad_run_copies_nothing():
    src, dst = _pools("cpu", torch.float32, (4,), 6, 4, 1)
    before = dst.clone()
    with pytest.raises(IndexError, match="outside the pools"):
        copy_runs(src, dst, [(0, 0, 2), (5, 3, 2)])  # the second runs past both pools' ends
    assert torch.equal(dst, before)
    with pytest.raises(ValueError, match="pools differ"):
        copy_runs(src, dst.to(torch.float16), [(0, 0, 1)])
    with pytest.raises(ValueError, match="contiguous"):
        copy_runs(src[..., ::2], dst[..., ::2], [(0, 0, 1)])


def test_an_unaligned_view_copies_elements():
    """A pool view starting 2 bytes into its storage cannot be read as 8-byte words: elements, same result."""
    base = torch.randn(3 * 5 * 4 + 1).to(torch.float16)
    src = base[1:].view(3, 5, 4)  # data_ptr 2 bytes past the allocation
    dst = torch.zeros(3, 5, 4, dtype=torch.float16)
    copy_runs(src, dst, [(1, 0, 3)])
    assert torch.equal(dst[:, :3], src[:, 1:4]) and not dst[:, 3:].any()


@settings(max_examples=60, deadline=None)
@given(st.integers(4, 24), st.integers(4, 24), st.data())
def test_any_scatter_as_runs_equals_the_reference(num_src, num_dst, data):
    n = data.draw(st.integers(0, min(num_src, num_dst)))
    src_pages = data.draw(st.permutations(range(num_src)))[:n]
    dst_pages = data.draw(st.permutations(range(num_dst)))[:n]
    if data.draw(st.booleans()):  # mostly consecutive, as a fresh prompt's pages are
        start_s, start_d = data.draw(st.integers(0, num_src - n)), data.draw(st.integers(0, num_dst - n))
        src_pages, dst_pages = list(range(start_s, start_s + n)), list(range(start_d, start_d + n))
    src, dst = _pools("cpu", torch.bfloat16, (2, 4), num_src, num_dst, n)
    expect = dst.clone()
    copy_blocks_ref(src, expect, torch.tensor(src_pages, dtype=torch.long), torch.tensor(dst_pages, dtype=torch.long))
    runs = page_runs(src_pages, dst_pages)
    assert sum(r[2] for r in runs) == n
    copy_runs(src, dst, runs)
    assert torch.equal(dst.view(torch.uint8), expect.view(torch.uint8))
