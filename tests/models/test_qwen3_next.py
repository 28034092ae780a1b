"""Qwen3-Next hybrid MoE (hkv.models.qwen3_next) against transformers on tiny random checkpoints (fp32)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf

from hkv.models.loader import load_model
from hkv.models.qwen3_next import Qwen3NextConfig, Qwen3NextForCausalLM, SparseMoeBlock
from hkv.models.registry import resolve_family
from tests.models.test_qwen3_5 import TOL, PagedRun, build_hf, hf_logits, ragged_parity

BASE = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
    linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, initializer_range=0.1,
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
)
VARIANTS = {
    # MoE everywhere but layer 1, top-k renormalised, layer types from full_attention_interval
    "renorm": dict(decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True),
    # MoE on odd layers only, raw top-k probabilities, tied embeddings, attention first
    "sparse-step": dict(decoder_sparse_step=2, norm_topk_prob=False, tie_word_embeddings=True,
                        layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"]),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def next_ckpt(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"qwen3_next_{request.param}")
    config = tf.Qwen3NextConfig(**BASE, **VARIANTS[request.param])
    ref = build_hf(tf.Qwen3NextForCausalLM, config, folder, seed=11)
    return folder, ref


def test_registry_and_config(next_ckpt):
    folder, ref = next_ckpt
    hf_config = json.loads((folder / "config.json").read_text())
    assert resolve_family(hf_config) is Qwen3NextForCausalLM
    cfg = Qwen3NextConfig.from_hf(hf_config)
    sparse = [cfg.is_sparse(i) for i in range(4)]
    assert sparse == [hasattr(layer.mlp, "experts") for layer in ref.model.layers]
    assert isinstance(cfg.mlp_only_layers, tuple)


def test_ragged_chunked_prefill_and_decode_match_transformers(next_ckpt):
    folder, ref = next_ckpt
    ours = load_model(folder, "float32", "cpu").model
    assert any(isinstance(layer.mlp, SparseMoeBlock) for layer in ours.model.layers)
    assert ragged_parity(ours, ref, BASE["vocab_size"], seed=5) < TOL


def test_restored_checkpoint_continues_like_the_original(next_ckpt):
    folder, ref = next_ckpt
    ours = load_model(folder, "float32", "cpu").model
    tokens = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(6)).tolist()
    run = PagedRun(ours)
    run.add("orig", slot=4)
    run.step([("orig", tokens[:4])])
    run.state.copy_slot(4, 1)
    original = torch.cat(run.step([("orig", tokens[4:11])]))
    run.fork("orig", "resumed", slot=2, upto=4)
    run.state.copy_slot(1, 2)
    resumed = torch.cat(run.step([("resumed", tokens[4:11])]))
    assert torch.equal(original, resumed)
    assert (original - hf_logits(ref, tokens[:11])[4:]).abs().max() < TOL


def test_missing_expert_weight_is_named(next_ckpt):
    folder, ref = next_ckpt
    cfg = Qwen3NextConfig.from_hf(json.loads((folder / "config.json").read_text()))
    weights = {k: v for k, v in ref.state_dict().items() if "experts" not in k}
    with pytest.raises(ValueError, match=r"mlp\.experts\.\d\.(gate|up|down)_proj\.weight"):
        Qwen3NextForCausalLM(cfg).load_weights(weights.items())
