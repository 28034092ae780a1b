"""Qwen3.5-MoE (hkv.models.qwen3_5_moe) against transformers on tiny random checkpoints (fp32): the text
checkpoint as transformers saves it (per-expert names), one with transformers 5's fused expert tensors,
the composite one with a vision tower, its MTP layer's experts, and the expert loader's refusals."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file, save_file

from hkv.models.loader import load_model
from hkv.models.moe import SparseMoeBlock
from hkv.models.qwen3 import WeightLoadError
from hkv.models.qwen3_5_moe import Qwen3_5MoeConfig, Qwen3_5MoeForCausalLM
from hkv.models.registry import resolve_family
from tests.models.test_qwen3_5 import TEXT_CONFIG, TOL, build_hf, ragged_parity

MOE_CONFIG = {**{k: v for k, v in TEXT_CONFIG.items() if k != "intermediate_size"},
              "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
              "shared_expert_intermediate_size": 48}
VOCAB = MOE_CONFIG["vocab_size"]


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_5_moe_text")
    ref = build_hf(tf.Qwen3_5MoeForCausalLM, tf.Qwen3_5MoeTextConfig(**MOE_CONFIG), folder, seed=3)
    return folder, ref


def _fused_copy(src, dst):
    """The checkpoint with each layer's experts as transformers 5 holds them: experts.gate_up_proj [E, 2I, H]
    and experts.down_proj [E, H, I] (gate rows first), written under those names."""
    tensors = load_file(src / "model.safetensors")
    out = {k: v for k, v in tensors.items() if ".experts." not in k}
    layers = {k.split(".experts.")[0] for k in tensors if ".experts." in k}
    for layer in layers:
        num = len({k.split(".")[-3] for k in tensors if k.startswith(layer + ".experts.")})
        get = (lambda e, p: tensors[f"{layer}.experts.{e}.{p}_proj.weight"])
        out[f"{layer}.experts.gate_up_proj"] = torch.stack([torch.cat([get(e, "gate"), get(e, "up")]) for e in range(num)])
        out[f"{layer}.experts.down_proj"] = torch.stack([get(e, "down") for e in range(num)])
    dst.mkdir()
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


def test_registry_and_config(moe_ckpt):
    folder, ref = moe_ckpt
    hf_config = json.loads((folder / "config.json").read_text())
    assert hf_config["model_type"] == "qwen3_5_moe_text"
    assert resolve_family(hf_config) is Qwen3_5MoeForCausalLM
    cfg = Qwen3_5MoeConfig.from_hf(hf_config)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (6, 2, 32)
    assert cfg.shared_expert_intermediate_size == 48 and cfg.full_layers == (2,)
    assert resolve_family({"model_type": "qwen3_5_moe"}) is Qwen3_5MoeForCausalLM


def test_per_expert_checkpoint_matches_transformers(moe_ckpt):
    folder, ref = moe_ckpt
    names = load_file(folder / "model.safetensors")
    assert "model.layers.0.mlp.experts.5.up_proj.weight" in names  # transformers 5.25 saves per-expert names
    ours = load_model(folder, "float32", "cpu").model
    blocks = [layer.mlp for layer in ours.model.layers]
    assert all(isinstance(b, SparseMoeBlock) and b.renormalize for b in blocks)
    assert blocks[0].experts.gate_up_proj.shape == (6, 64, 64) and blocks[0].experts.down_proj.shape == (6, 64, 32)
    assert ragged_parity(ours, ref, VOCAB, seed=8) < TOL


def test_fused_expert_tensors_load_like_per_expert_ones(moe_ckpt, tmp_path):
    folder, ref = moe_ckpt
    fused = _fused_copy(folder, tmp_path / "fused")
    ours = load_model(fused, "float32", "cpu").model
    per_expert = load_model(folder, "float32", "cpu").model
    for a, b in zip(ours.state_dict().values(), per_expert.state_dict().values()):
        assert torch.equal(a, b)
    assert ragged_parity(ours, ref, VOCAB, seed=9) < TOL


def test_composite_checkpoint_skips_the_vision_tower(tmp_path):
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64,
                  patch_size=4, num_position_embeddings=16)
    config = tf.Qwen3_5MoeConfig(text_config=MOE_CONFIG, vision_config=vision)
    ref = build_hf(tf.Qwen3_5MoeForConditionalGeneration, config, tmp_path, seed=4)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3_5_moe"
    ours = load_model(tmp_path, "float32", "cpu").model
    assert isinstance(ours, Qwen3_5MoeForCausalLM)
    assert ragged_parity(ours, ref, VOCAB, seed=10) < TOL


def test_mtp_layer_has_stacked_experts(moe_ckpt):
    folder, ref = moe_ckpt
    cfg = Qwen3_5MoeConfig.from_hf(json.loads((folder / "config.json").read_text()))
    weights = load_file(folder / "model.safetensors")
    mtp = {"mtp." + k.removeprefix("model."): v.clone() + 0.01 for k, v in weights.items()
           if k.startswith("model.layers.2.")}
    mtp = {k.replace("mtp.layers.2.", "mtp.layers.0."): v for k, v in mtp.items()}
    for name in ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"):
        mtp[name] = torch.zeros(64)
    mtp["mtp.fc.weight"] = torch.zeros(64, 128)
    model = Qwen3_5MoeForCausalLM(cfg)
    model.enable_mtp()
    model.load_weights({**weights, **mtp}.items())
    stacked = model.mtp.layer.mlp.experts.gate_up_proj
    want = torch.cat([mtp["mtp.layers.0.mlp.experts.4.gate_proj.weight"], mtp["mtp.layers.0.mlp.experts.4.up_proj.weight"]])
    assert torch.equal(stacked[4], want)


@pytest.mark.parametrize("change, message", [
    (lambda w: w.pop("model.layers.1.mlp.experts.3.down_proj.weight"), r"model\.layers\.1\.mlp\.experts\.3\.down_proj"),
    (lambda w: w.update({"model.layers.1.mlp.experts.6.up_proj.weight": torch.zeros(32, 64)}), "expert 6 out of range"),
    (lambda w: w.update({"model.layers.0.mlp.experts.1.gate_proj.weight": torch.zeros(32, 63)}), r"\(32, 63\)"),
    (lambda w: w.update({"model.layers.0.mlp.experts.gate_up_proj": torch.zeros(6, 64, 64)}),
     "model.layers.0.mlp.experts.gate_up_proj comes both fused and as per-expert"),
], ids=["missing", "out-of-range", "mis-shaped", "both-layouts"])
def test_bad_expert_tensors_are_named(moe_ckpt, change, message):
    folder, _ = moe_ckpt
    cfg = Qwen3_5MoeConfig.from_hf(json.loads((folder / "config.json").read_text()))
    weights = load_file(folder / "model.safetensors")
    change(weights)
    with pytest.raises(WeightLoadError, match=message):
        Qwen3_5MoeForCausalLM(cfg).load_weights(weights.items())
