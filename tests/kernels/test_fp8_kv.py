"""FP8 KV pages in the Triton kernels against the torch form (hkv_kernels/kv_quant.py): the store's
rounding byte for byte, the attention prep's writes, and paged attention reading FP8 pages."""

import pytest
import torch
import triton
import triton.language as tl

from hkv_kernels.fp8 import from_cache, to_cache
from hkv_kernels.kv_quant import FP8, dequantize, quantize
from hkv_kernels.meta import build_meta
from hkv_kernels.paged_attention.reference import paged_attention_ref
from hkv_kernels.paged_attention.triton_paged_attention import KV_DOTS, launch_paged_decode, paged_attention
from hkv_kernels.rope.reference import attention_prep_ref
from hkv_kernels.rope.triton_rope import attention_prep
from tests.kernels.helpers import assert_close, cases, nan_like, rel_err

SCALES = (0.5, 2.0)  # (K, V): not 1.0, so a scale applied twice or never shows


@triton.jit
def _store_kernel(x_ptr, y_ptr, scale, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n)
    tl.store(y_ptr + i, to_cache(x, scale, y_ptr.dtype.element_ty, True), mask=i < n)


@pytest.mark.parametrize("device,dtype", cases()[:2])
@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_fp8_store_rounds_like_torch(device, dtype, scale):
    """Every finite fp8 value, ties, subnormals, -0.0, and values past 448 saturate: the same bytes."""
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[~grid.isnan()] * scale
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([grid, (grid[1:] + grid[:-1]) / 2, torch.randn(4000, generator=gen) * 60,
                   torch.randn(1000, generator=gen) * 1e-3, torch.tensor([-0.0, 1e-12, 500.0, -1e6, 464.0, -464.0])])
    got = torch.empty(x.numel(), dtype=FP8, device=device)
    _store_kernel[(triton.cdiv(x.numel(), 1024),)](x.to(device), got, scale, x.numel(), BLOCK=1024)
    want = quantize(x, FP8, scale)
    bad = got.cpu().view(torch.uint8) != want.view(torch.uint8)
    assert not bad.any(), f"{int(bad.sum())} values differ, e.g. {x[bad][:4].tolist()}"


@triton.jit
def _read_kernel(x_ptr, y_ptr, scale, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n, other=0.0)
    tl.store(y_ptr + i, from_cache(x, scale, y_ptr.dtype.element_ty, True), mask=i < n)


@pytest.mark.parametrize("device,dtype", cases())
def test_fp8_read_is_the_dequantized_value(device, dtype):
    """Every FP8 byte read in a kernel (masked load, fp8 -> fp32, times the scale, to the attention's
    dtype) equals the torch form: the smallest piece of the paged attention's FP8 path, so a failure
    of the attention tests on a GPU shows whether the read itself is wrong."""
    values = torch.arange(256, dtype=torch.uint8).view(FP8)
    values = values[~values.float().isnan()]
    got = torch.empty(values.numel(), dtype=dtype, device=device)
    _read_kernel[(triton.cdiv(values.numel(), 128),)](values.to(device), got, 0.37, values.numel(), BLOCK=128)
    want = dequantize(values, dtype, 0.37)
    bad = got.cpu() != want
    assert not bad.any(), f"{int(bad.sum())} values differ, e.g. {values[bad][:4].float().tolist()}"


def _fp8_pages(pages, page_size, heads, dim, gen, scale):
    return quantize(torch.randn(pages, page_size, heads, dim, generator=gen) * 3, FP8, scale)


@pytest.mark.parametrize("device,dtype", cases())
def test_attention_prep_writes_fp8_pages(device, dtype):
    gen = torch.Generator().manual_seed(5)
    tokens, dim, rot = 5, 16, 8
    q = (torch.randn(tokens, 4, dim, generator=gen) * 4).to(device, dtype)
    k, v = ((torch.randn(tokens, 2, dim, generator=gen) * 4).to(device, dtype) for _ in range(2))
    qw, kw = ((torch.randn(dim, generator=gen) * 0.2).to(device, dtype) for _ in range(2))
    positions = torch.tensor([0, 3, 7, 100, 31], device=device)
    slots = torch.tensor([2, 9, 13, 0, 22], device=device)
    cos_table, sin_table = (torch.randn(128, rot, generator=gen).to(device, dtype) for _ in range(2))
    caches = [torch.zeros(8, 4, 2, dim, dtype=FP8) for _ in range(4)]  # reference K, V; kernel K, V
    want = attention_prep_ref(q.float().cpu(), k.float().cpu(), v.float().cpu(), cos_table.float().cpu()[positions.cpu()],
                              sin_table.float().cpu()[positions.cpu()], qw.float().cpu(), kw.float().cpu(), 1e-6,
                              True, caches[0], caches[1], slots.cpu(), SCALES)
    k_cache, v_cache = caches[2].to(device), caches[3].to(device)
    got = attention_prep(q, k, v, cos_table, sin_table, positions, qw, kw, 1e-6, True, k_cache, v_cache, slots,
                         kv_scales=SCALES)
    assert_close(got, want, dtype)
    for name, cache, ref, scale in (("k", k_cache, caches[0], SCALES[0]), ("v", v_cache, caches[1], SCALES[1])):
        written = cache.cpu().flatten(0, 1)[slots.cpu()]
        expect = ref.flatten(0, 1)[slots.cpu()]
        # one fp8 rounding of values that agree to the model dtype: at most a step apart, mostly equal
        err = rel_err(dequantize(written, torch.float32, scale), dequantize(expect, torch.float32, scale))
        assert err < (1e-3 if dtype == torch.float32 else 4e-2), f"{name} cache: relative error {err:.3g}"


@pytest.mark.parametrize("device,dtype", cases())
def test_paged_attention_reads_fp8_pages(device, dtype):
    """Prefill over a cached prefix, decode and ragged batches on FP8 pages with scales, against the
    reference on the same pages (which reads them as fp8 * scale)."""
    gen = torch.Generator().manual_seed(9)
    heads, kv_heads, dim, page = 4, 2, 16, 4
    for i, (q_lens, kv_lens) in enumerate([([1, 1, 1], [1, 4, 9]), ([3, 0, 5, 1], [3, 4, 12, 8]), ([4, 2], [8, 6])]):
        max_pages = max(-(-n // page) for n in kv_lens) + 1
        num_pages = len(kv_lens) * max_pages + 2
        k = _fp8_pages(num_pages, page, kv_heads, dim, gen, SCALES[0])
        v = _fp8_pages(num_pages, page, kv_heads, dim, gen, SCALES[1])
        table = torch.randperm(num_pages, generator=gen)[: len(kv_lens) * max_pages].view(len(kv_lens), max_pages)
        q = torch.randn(sum(q_lens), heads, dim, generator=gen).to(device, dtype)
        meta = build_meta(q_lens, kv_lens, device, heads // kv_heads, dim, dtype)
        out = paged_attention(q, k.to(device), v.to(device), table.to(device), meta, dim**-0.5, out=nan_like(q),
                              kv_scales=SCALES)
        ref = paged_attention_ref(q.float().cpu(), k, v, table, q_lens, kv_lens, dim**-0.5, SCALES)
        assert_close(out, ref, dtype, f"case {i}")


@pytest.mark.parametrize("device,dtype", cases())
@pytest.mark.parametrize("kv_dot", sorted(KV_DOTS))
def test_split_decode_reads_fp8_pages(device, dtype, kv_dot):
    """Each way of reading FP8 pages (KV_DOTS) against the reference, scales applied once: 2 and 3 run the dots
    in float16, so they are held to float16's bound where the queries are float32."""
    gen = torch.Generator().manual_seed(3)
    kv_lens = [1, 15, 16, 17, 33, 64, 65, 7] if device == "cpu" else [1, 33, 576, 4000] * 8
    heads, kv_heads, dim, page = 8, 2, 16 if device == "cpu" else 256, 16
    max_pages = max(-(-n // page) for n in kv_lens) + 1
    num_pages = len(kv_lens) * max_pages
    k = _fp8_pages(num_pages, page, kv_heads, dim, gen, SCALES[0])
    v = _fp8_pages(num_pages, page, kv_heads, dim, gen, SCALES[1])
    table = torch.randperm(num_pages, generator=gen).view(len(kv_lens), max_pages)
    q = torch.randn(len(kv_lens), heads, dim, generator=gen).to(device, dtype)
    meta = build_meta([1] * len(kv_lens), kv_lens, device, heads // kv_heads, dim, dtype)
    out = launch_paged_decode(q, k.to(device), v.to(device), table.to(device), meta, dim**-0.5, nan_like(q),
                              splits=3, kv_scales=SCALES, kv_dot=kv_dot)
    ref = paged_attention_ref(q.float().cpu(), k, v, table, [1] * len(kv_lens), kv_lens, dim**-0.5, SCALES)
    assert_close(out, ref, torch.float16 if kv_dot >= 2 and dtype == torch.float32 else dtype)


def test_split_decode_refuses_an_unknown_kv_dot():
    q = torch.randn(1, 2, 16)
    k = quantize(torch.randn(2, 4, 1, 16), FP8, 1.0)
    meta = build_meta([1], [5], "cpu", 2, 16, torch.float32)
    with pytest.raises(ValueError, match="kv_dot 4"):
        launch_paged_decode(q, k, k.clone(), torch.arange(2).view(1, 2), meta, 0.25, torch.empty_like(q), kv_dot=4)


def test_reference_reads_fp8_as_its_dequantized_values():
    """The reference on FP8 pages equals the reference on those pages dequantized: the scale is applied once."""
    gen = torch.Generator().manual_seed(1)
    k, v = _fp8_pages(6, 4, 2, 8, gen, SCALES[0]), _fp8_pages(6, 4, 2, 8, gen, SCALES[1])
    table = torch.arange(6).view(2, 3)
    q = torch.randn(4, 4, 8, generator=gen)
    got = paged_attention_ref(q, k, v, table, [3, 1], [10, 5], 0.3, SCALES)
    want = paged_attention_ref(q, k.float() * SCALES[0], v.float() * SCALES[1], table, [3, 1], [10, 5], 0.3)
    assert torch.equal(got, want)
