"""The MoE kernels against their references: routing, the sort by expert, and the experts' grouped GEMMs
with the shared expert (hkv_kernels/moe/), and the whole routed block against transformers' own."""

import pytest
import torch

from hkv_kernels.moe.reference import moe_align_ref, moe_experts_ref, moe_route_ref, padded_pairs
from hkv_kernels.moe.triton_moe import MoeTile, moe_align, moe_experts, moe_route
from tests.kernels.helpers import assert_close, cases, nan_like


def _randn(*shape, device, dtype, gen, scale=1.0):
    return (scale * torch.randn(*shape, generator=gen)).to(device, dtype)


@pytest.mark.parametrize("device,dtype", cases())
@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "raw"])
def test_route_picks_the_reference_experts(device, dtype, renormalize):
    gen = torch.Generator().manual_seed(1)
    wide = _randn(9, 40 + 3, device=device, dtype=dtype, gen=gen)  # router logits beside other columns
    logits = wide[:, :37]
    weights, ids = moe_route(logits, 5, renormalize)
    want_w, want_ids = moe_route_ref(logits.float().cpu(), 5, renormalize)
    assert torch.equal(ids.cpu().long(), want_ids)
    assert weights.dtype == dtype
    assert_close(weights, want_w, dtype, "weights")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
@pytest.mark.parametrize("num_pairs,num_experts,block,skew", [
    (1, 8, 16, False), (40, 8, 16, False), (300, 12, 16, True), (64, 64, 32, False), (2100, 512, 16, False),
], ids=["one-pair", "few-experts", "all-to-one", "one-each", "many"])
def test_align_sorts_pairs_by_expert_into_whole_blocks(device, num_pairs, num_experts, block, skew):
    if device == "cpu" and torch.cuda.is_available():
        pytest.skip("CPU-only case")
    gen = torch.Generator().manual_seed(num_pairs)
    ids = torch.randint(0, num_experts, (num_pairs,), generator=gen, dtype=torch.int32)
    if skew:  # most pairs on one expert: its run spans many blocks
        ids[: num_pairs * 3 // 4] = num_experts - 2
    sorted_pairs, block_expert, used = moe_align(ids.to(device), num_experts, block)
    want_pairs, want_experts, want_used = moe_align_ref(ids, num_experts, block)
    assert sorted_pairs.numel() == padded_pairs(num_pairs, num_experts, block) == want_pairs.numel()
    assert int(used) == want_used
    assert torch.equal(sorted_pairs[:want_used].cpu(), want_pairs[:want_used])
    assert torch.equal(block_expert[: want_used // block].cpu(), want_experts[: want_used // block])


def _experts(tokens, hidden, inter, num_experts, top_k, device, dtype, seed, skew=False):
    gen = torch.Generator().manual_seed(seed)
    x = _randn(tokens, hidden, device=device, dtype=dtype, gen=gen)
    w13 = _randn(num_experts, 2 * inter, hidden, device=device, dtype=dtype, gen=gen, scale=hidden**-0.5)
    w2 = _randn(num_experts, hidden, inter, device=device, dtype=dtype, gen=gen, scale=inter**-0.5)
    logits = _randn(tokens, num_experts, device=device, dtype=dtype, gen=gen)
    if skew:
        logits[:, 1] += 6.0  # every token picks expert 1
    weights, ids = moe_route_ref(logits.float().cpu(), top_k, True)
    return x, w13, w2, weights.to(device, dtype), ids.to(device)


def _ref(x, w13, w2, weights, ids, shared=None, gate=None):
    f = (lambda t: None if t is None else t.float().cpu())
    return moe_experts_ref(f(x), f(w13), f(w2), f(weights), ids.cpu(), f(shared), f(gate))


@pytest.mark.parametrize("device,dtype", cases())
@pytest.mark.parametrize("tokens,hidden,inter,num_experts,top_k,skew", [
    (1, 64, 32, 8, 2, False), (7, 64, 48, 6, 3, False), (37, 96, 32, 16, 4, True), (70, 64, 32, 5, 1, False),
], ids=["decode-1", "uneven-tiles", "skewed", "top-1"])
def test_experts_match_the_reference(device, dtype, tokens, hidden, inter, num_experts, top_k, skew):
    x, w13, w2, weights, ids = _experts(tokens, hidden, inter, num_experts, top_k, device, dtype, tokens, skew)
    out = moe_experts(x, w13, w2, weights, ids, out=nan_like(x))
    assert_close(out, _ref(x, w13, w2, weights, ids), dtype)


@pytest.mark.parametrize("device,dtype", cases())
def test_shared_expert_and_its_gate_are_added(device, dtype):
    x, w13, w2, weights, ids = _experts(11, 64, 32, 8, 2, device, dtype, 3)
    gen = torch.Generator().manual_seed(4)
    shared = _randn(11, 64, device=device, dtype=dtype, gen=gen)
    wide = _randn(11, 10, device=device, dtype=dtype, gen=gen)  # the gate logit as a column of a wider GEMM
    gate = wide[:, 8:9]
    out = moe_experts(x, w13, w2, weights, ids, shared, gate, out=nan_like(x))
    assert_close(out, _ref(x, w13, w2, weights, ids, shared, gate), dtype)


@pytest.mark.parametrize("device,dtype", cases())
@pytest.mark.parametrize("tile", [MoeTile(16, (16, 16, 4, 2), (16, 32, 4, 2)), MoeTile(32, (32, 64, 4, 2), (64, 16, 4, 2))],
                         ids=["small", "wide"])
def test_every_tile_computes_the_same_function(device, dtype, tile):
    x, w13, w2, weights, ids = _experts(23, 64, 48, 7, 3, device, dtype, 5)
    out = moe_experts(x, w13, w2, weights, ids, tile=tile, out=nan_like(x))
    assert_close(out, _ref(x, w13, w2, weights, ids), dtype)


@pytest.mark.parametrize("device,dtype", cases())
def test_routed_block_equals_transformers_sparse_block(device, dtype):
    """transformers' Qwen3NextSparseMoeBlock on a batch, against hkv's route + grouped experts on its weights."""
    tf = pytest.importorskip("transformers")
    config = tf.Qwen3NextConfig(hidden_size=64, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                                shared_expert_intermediate_size=48, norm_topk_prob=True)
    torch.manual_seed(7)
    block = tf.models.qwen3_next.modeling_qwen3_next.Qwen3NextSparseMoeBlock(config).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.1)
        x = torch.randn(19, 64)
        want = block(x[None])[0]
    to = (lambda t: t.detach().to(device, dtype))
    xd = to(x)
    weights, ids = moe_route(to(torch.nn.functional.linear(x, block.gate.weight)), 3, True)
    s = block.shared_expert
    shared = torch.nn.functional.linear(torch.nn.functional.silu(xd @ to(s.gate_proj.weight).T) * (xd @ to(s.up_proj.weight).T),
                                        to(s.down_proj.weight))
    gate = xd @ to(block.shared_expert_gate.weight).T
    got = moe_experts(xd, to(block.experts.gate_up_proj), to(block.experts.down_proj), weights, ids, shared, gate,
                      out=nan_like(xd))
    assert_close(got, want, dtype)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only case: the interpreter runs the model's MoE kernels")
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
def test_tiny_models_through_the_triton_moe_path_match_transformers(family, tmp_path, monkeypatch):
    """A whole tiny MoE model on CPU with its MoE layers on the Triton kernels (interpreted, fp32): ragged
    prefill chunks and decodes beside each other give transformers' logits, as the reference path does."""
    tf = pytest.importorskip("transformers")
    from hkv.models.loader import load_model
    from hkv_kernels import dispatch
    from tests.models.test_qwen3_5 import TOL, build_hf, ragged_parity
    from tests.models.test_qwen3_5_moe import MOE_CONFIG
    from tests.models.test_qwen3_next import BASE, VARIANTS

    if family == "qwen3_next":
        ref = build_hf(tf.Qwen3NextForCausalLM, tf.Qwen3NextConfig(**BASE, **VARIANTS["renorm"]), tmp_path, seed=12)
    else:
        ref = build_hf(tf.Qwen3_5MoeForCausalLM, tf.Qwen3_5MoeTextConfig(**MOE_CONFIG), tmp_path, seed=13)
    ours = load_model(tmp_path, "float32", "cpu").model
    calls = []
    monkeypatch.setattr(dispatch, "moe_route", lambda *a: calls.append("route") or moe_route(*a))
    monkeypatch.setattr(dispatch, "moe_experts", lambda *a: calls.append("experts") or moe_experts(*a))
    assert ragged_parity(ours, ref, ref.config.vocab_size, seed=14) < TOL
    assert calls.count("route") == calls.count("experts") > 0
