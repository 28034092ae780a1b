"""Block FP8 (hkv_kernels/fp8_gemm/): the quantize/dequantize reference, the weight-only FP8 GEMM and the
MoE kernels' FP8 experts against the dequantizing reference."""

import pytest
import torch

from hkv_kernels.fp8_gemm.reference import FP8_MAX, dequantize, fp8_linear_ref, quantize, scale_shape
from hkv_kernels.fp8_gemm.triton_fp8_gemm import Fp8Tile, fp8_linear
from hkv_kernels.moe.reference import dequantize_experts, moe_experts_ref, moe_route_ref
from hkv_kernels.moe.triton_moe import moe_experts
from tests.kernels.helpers import assert_close, cases


def test_quantize_maps_each_block_amax_to_the_fp8_max_and_dequantizes_close():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=gen)
    w[:128, :128] *= 100.0  # blocks of very different ranges keep their own scales
    w[128:256, 128:] = 0.0  # an all-zero block gets scale 1
    q, scale = quantize(w)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (3, 2)
    assert scale_shape(300, 200) == (3, 2) and scale[1, 1] == 1.0
    assert q[:128, :128].float().abs().max() == FP8_MAX and q[256:, :128].float().abs().max() == FP8_MAX
    back = dequantize(q, scale, torch.float32)
    assert torch.all(back[128:256, 128:] == 0)
    # e4m3 keeps 3 mantissa bits: a relative error of at most 2^-4 per element (plus subnormals near 0)
    assert ((back - w).abs() <= w.abs() / 16 + scale.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
            * 2**-9).all()
    assert torch.equal(quantize(back)[0].float(), q.float())  # dequantized weights requantize to the same bytes


def test_dequantize_refuses_a_scale_grid_that_does_not_tile_the_weight():
    q, scale = quantize(torch.randn(256, 128))
    with pytest.raises(ValueError, match="does not tile"):
        dequantize(q, scale[:1], torch.float32)


def _fp8_weight(n, k, seed):
    gen = torch.Generator().manual_seed(seed)
    return quantize(torch.randn(n, k, generator=gen) * k**-0.5)


@pytest.mark.parametrize("device,dtype", cases())
@pytest.mark.parametrize("m,n,k,bias,tile", [
    (1, 256, 384, False, None), (5, 200, 300, True, None), (33, 130, 128, False, None),
    (3, 256, 512, True, Fp8Tile(16, 64, 64, 4, 4, 2)),  # the K split: fp32 partials added in order
    (70, 128, 200, False, Fp8Tile(32, 128, 128, 1, 4, 2)),
], ids=["decode", "ragged-bias", "one-k-block", "split-k", "prefill"])
def test_fp8_linear_matches_the_dequantized_reference(device, dtype, m, n, k, bias, tile):
    q, scale = _fp8_weight(n, k, seed=m + n)
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    b = torch.randn(n, generator=gen).to(device, dtype) if bias else None
    out = fp8_linear(x, q.to(device), scale.to(device), b, tile=tile)
    want = fp8_linear_ref(x.float().cpu(), q, scale, None if b is None else b.float().cpu())
    assert out.dtype == dtype and out.shape == (m, n)
    assert_close(out, want, dtype)


@pytest.mark.parametrize("device,dtype", cases())
def test_fp8_linear_on_a_row_slice_of_fused_weights(device, dtype):
    """A fused projection's part: rows of a concatenated weight and the matching rows of its scales."""
    q, scale = _fp8_weight(384, 256, seed=4)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(5)).to(device, dtype)
    out = fp8_linear(x, q[128:].to(device), scale[1:].to(device))
    assert_close(out, fp8_linear_ref(x.float().cpu(), q[128:], scale[1:]), dtype)


def _fp8_experts(num_experts, hidden, inter, seed):
    gen = torch.Generator().manual_seed(seed)
    gate, up = (torch.randn(num_experts, inter, hidden, generator=gen) * hidden**-0.5 for _ in range(2))
    down = torch.randn(num_experts, hidden, inter, generator=gen) * inter**-0.5
    (qg, sg), (qu, su), (q2, s2) = quantize(gate), quantize(up), quantize(down)
    return torch.cat([qg, qu], 1), q2, (torch.cat([sg, su], 1), s2)


@pytest.mark.parametrize("device,dtype", cases())
@pytest.mark.parametrize("tokens,hidden,inter", [(3, 256, 128), (9, 160, 200)], ids=["aligned", "ragged"])
def test_moe_fp8_experts_match_the_dequantized_reference(device, dtype, tokens, hidden, inter):
    num_experts, top_k = 6, 2
    w13, w2, scales = _fp8_experts(num_experts, hidden, inter, seed=tokens)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(tokens, hidden, generator=gen)
    weights, ids = moe_route_ref(torch.randn(tokens, num_experts, generator=gen), top_k, True)
    shared, shared_gate = torch.randn(tokens, hidden, generator=gen), torch.randn(tokens, 1, generator=gen)
    d13, d2 = dequantize_experts(w13, w2, scales, torch.float32)
    want = moe_experts_ref(x, d13, d2, weights, ids, shared, shared_gate)
    to = lambda t: t.to(device, dtype)  # noqa: E731
    out = moe_experts(to(x), w13.to(device), w2.to(device), to(weights), ids.to(device), to(shared), to(shared_gate),
                      scales=tuple(s.to(device) for s in scales))
    assert_close(out, want, dtype)


def test_dequantize_experts_tiles_gate_and_up_halves_separately():
    w13, w2, (s13, s2) = _fp8_experts(2, 130, 70, seed=1)
    d13, d2 = dequantize_experts(w13, w2, (s13, s2), torch.float32)
    assert s13.shape == (2, 2, 2) and torch.equal(d13[:, 70:], dequantize(w13[:, 70:], s13[:, 1:], torch.float32))
    assert torch.equal(d2, dequantize(w2, s2, torch.float32))
