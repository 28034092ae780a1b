"""Tensor parallelism (hkv/models/parallel.py): shard rules, the sharded config, and 2 gloo ranks in
their own processes giving the logits of one rank on tiny checkpoints of every family (fp32)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers as tf
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hkv.models.loader import load_model
from hkv.models.parallel import ShardPlan, Split, TPConfigError, shard_config
from hkv.models.qwen3_5 import Qwen3_5Config
from tests.models.test_qwen3 import hf_tiny_qwen3
from tests.models.test_qwen3_5 import TEXT_CONFIG, build_hf
from tests.models.test_qwen3_5_moe import MOE_CONFIG
from tests.models.test_qwen3_next import BASE, VARIANTS
from tests.models.tp_worker import schedule_logits

REPO = Path(__file__).resolve().parents[2]
TOL = 2e-5  # fp32: the same sums in another order (row-parallel all-reduce)


def test_shard_config_divides_heads_and_widths():
    cfg = Qwen3_5Config.from_hf({"model_type": "qwen3_5_text", **TEXT_CONFIG})
    half = shard_config(cfg, 2)
    assert (half.num_attention_heads, half.num_key_value_heads, half.intermediate_size) == (2, 1, 48)
    assert (half.linear_num_key_heads, half.linear_num_value_heads, half.conv_dim) == (1, 2, 16 + 16 + 16)
    wide = dataclasses.replace(cfg, linear_num_key_heads=4, linear_num_value_heads=8)
    assert shard_config(wide, 4).num_key_value_heads == 1  # 2 KV heads over 4 ranks: replicated
    with pytest.raises(TPConfigError, match="--tp 3 does not divide the model's 4 attention heads"):
        shard_config(cfg, 3)


def test_split_ranges():
    kv = Split("heads", heads=2)
    assert [kv.ranges(32, r, 4) for r in range(4)] == [[(0, 16)], [(0, 16)], [(16, 32)], [(16, 32)]]
    assert Split("heads", heads=4).ranges(64, 1, 2) == [(32, 64)]
    qkv = Split("segments", sizes=(4, 4, 8))
    assert qkv.ranges(16, 1, 2) == [(2, 4), (6, 8), (12, 16)]
    vocab = Split("vocab")
    assert [vocab.ranges(211, r, 2) for r in range(2)] == [[(0, 106)], [(106, 211)]]
    assert vocab.padded_length(211, 2) == 106
    with pytest.raises(TPConfigError):
        Split("even", dim=1).ranges(5, 0, 2)


def test_plan_reads_only_the_rank_slice(tmp_path):
    path = tmp_path / "w.safetensors"
    full = torch.arange(6 * 4, dtype=torch.float32).view(6, 4)
    save_file({"a.embed_tokens.weight": full, "x.self_attn.o_proj.bias": full[0].clone(),
               "x.norm.weight": full[1].clone()}, str(path))
    rules = [(r"embed_tokens\.weight$", Split("vocab")), (r"o_proj\.bias$", Split("first"))]
    with safe_open(str(path), framework="pt") as f:
        last = ShardPlan(rules, rank=3, tp=4).read(f, "a.embed_tokens.weight")  # rows 6..7 of 6: padding only
        assert last.shape == (2, 4) and not last.any()
        assert torch.equal(ShardPlan(rules, rank=1, tp=4).read(f, "a.embed_tokens.weight"), full[2:4])
        assert not ShardPlan(rules, rank=1, tp=2).read(f, "x.self_attn.o_proj.bias").any()
        assert torch.equal(ShardPlan(rules, rank=0, tp=2).read(f, "x.self_attn.o_proj.bias"), full[0])
        assert torch.equal(ShardPlan(rules, rank=1, tp=2).read(f, "x.norm.weight"), full[1])  # replicated


def _qwen3(folder: Path, **overrides) -> None:
    model = hf_tiny_qwen3(tied=overrides.pop("tied", False), bias=overrides.pop("bias", False), seed=5)
    if overrides:  # another head layout: rebuild from the changed config
        config = model.config
        for key, value in overrides.items():
            setattr(config, key, value)
        torch.manual_seed(5)
        model = tf.Qwen3ForCausalLM(config).eval()
    model.save_pretrained(folder)


CHECKPOINTS = {
    # odd vocab (211: padded vocab shards), o_proj bias added once
    "qwen3-bias": lambda d: _qwen3(d, bias=True),
    # one KV head over two ranks (replicated), tied embeddings as the output head
    "qwen3-kv1": lambda d: _qwen3(d, tied=True, num_key_value_heads=1),
    "qwen3_5_text": lambda d: build_hf(tf.Qwen3_5ForCausalLM, tf.Qwen3_5TextConfig(**TEXT_CONFIG), d, seed=2),
    "qwen3_next": lambda d: build_hf(tf.Qwen3NextForCausalLM, tf.Qwen3NextConfig(**BASE, **VARIANTS["renorm"]),
                                     d, seed=11),
    "qwen3_next-tied": lambda d: build_hf(tf.Qwen3NextForCausalLM,
                                          tf.Qwen3NextConfig(**BASE, **VARIANTS["sparse-step"]), d, seed=12),
    "qwen3_5_moe": lambda d: build_hf(tf.Qwen3_5MoeForCausalLM, tf.Qwen3_5MoeTextConfig(**MOE_CONFIG), d, seed=3),
}


@pytest.fixture(scope="module")
def tp2_logits(tmp_path_factory) -> dict[str, tuple[Path, dict[str, torch.Tensor]]]:
    """Each checkpoint's schedule logits from 2 gloo ranks (rank 0's, the gathered ones)."""
    root = tmp_path_factory.mktemp("tp")
    folders = []
    for name, build in CHECKPOINTS.items():
        folders.append(root / name)
        build(folders[-1])
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    store = root / "store"
    procs = [subprocess.Popen([sys.executable, "-m", "tests.models.tp_worker", str(r), "2", str(store), str(root),
                               *map(str, folders)], cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    errors = [p.communicate(timeout=300)[1] for p in procs]
    for p, err in zip(procs, errors):
        assert p.returncode == 0, err[-3000:]
    return {name: (folder, load_file(str(root / f"{i}.safetensors")))
            for i, (name, folder) in enumerate(zip(CHECKPOINTS, folders))}


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_two_ranks_give_the_logits_of_one(tp2_logits, name):
    folder, sharded = tp2_logits[name]
    model = load_model(folder, "float32", "cpu").model
    whole = schedule_logits(model, model.cfg.vocab_size)
    assert sharded.keys() == whole.keys()
    for seq in whole:
        assert sharded[seq].shape == whole[seq].shape
        torch.testing.assert_close(sharded[seq], whole[seq], rtol=TOL, atol=TOL)
        assert torch.equal(sharded[seq].argmax(-1), whole[seq].argmax(-1))
