"""tools/bench/make_bench_model.py: the full-size layout's parameter count, and a shrunken folder that hkv and
transformers both load, with equal logits."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf
from safetensors import safe_open

from hkv.models.loader import load_model
from tests.models.test_qwen3_5 import TOL, ragged_parity
from tools.bench.make_bench_model import (
    DEFAULTS, MOE_DEFAULTS, PRESETS, bench_config, main, make_tensor, moe_bench_config, parameter_count, tensor_specs,
)

SMALL = ["--layers", "4", "--hidden-size", "64", "--intermediate-size", "128", "--vocab-size", "2048"]


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench") / "model"
    # 4 MB shards split the ~8 MB of weights into several files
    assert main([str(folder), *SMALL, "--shard-gb", "0.004", "--no-progress"]) == 0
    return folder


def test_full_size_layout():
    cfg = bench_config(**DEFAULTS, eot=0, im_end=2)
    assert parameter_count(cfg) == 1_987_748_224
    assert cfg["layer_types"].count("linear_attention") == 18
    assert [i for i, t in enumerate(cfg["layer_types"]) if t == "full_attention"] == [3, 7, 11, 15, 19, 23]
    assert cfg["tie_word_embeddings"] and not any(s.name.startswith("lm_head") for s in tensor_specs(cfg))


def test_writes_sharded_bf16_with_an_index(small_model):
    index = json.loads((small_model / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    config = json.loads((small_model / "config.json").read_text())
    assert set(index["weight_map"]) == {s.name for s in tensor_specs(config)}
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (small_model / name).is_file()
    with safe_open(str(small_model / files[0]), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
        assert f.get_tensor("model.layers.0.input_layernorm.weight").abs().max() == 0  # applied as 1 + w
        assert (f.get_tensor("model.layers.0.linear_attn.norm.weight") == 1).all()
        embed = f.get_tensor("model.embed_tokens.weight").float()
        assert 0.018 < embed.std() < 0.022


def test_tensors_depend_only_on_seed_and_name():
    spec = tensor_specs(bench_config(**{**DEFAULTS, "layers": 1, "vocab_size": 64}, eot=0, im_end=2))[-2]
    assert torch.equal(make_tensor(spec, 0), make_tensor(spec, 0))
    assert not torch.equal(make_tensor(spec, 0), make_tensor(spec, 1))


def _loads_alike(folder, cls) -> None:
    """transformers loads every tensor of the folder into `cls`, and hkv's model computes its logits."""
    ref, info = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert isinstance(ref, cls)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ours = load_model(folder, "float32", "cpu").model
    assert ragged_parity(ours, ref.eval(), 2048) < TOL


def test_hkv_and_transformers_load_it_alike(small_model):
    _loads_alike(small_model, tf.Qwen3_5ForCausalLM)


def test_prints_the_parameter_count(tmp_path, capsys):
    assert main([str(tmp_path / "m"), "--layers", "1", "--hidden-size", "8", "--intermediate-size", "8",
                 "--vocab-size", "1536", "--no-progress"]) == 0
    assert "parameters (0.00 B)" in capsys.readouterr().out


def test_refuses_a_non_empty_folder_and_a_small_vocab(tmp_path, capsys):
    (tmp_path / "keep").write_text("x")
    with pytest.raises(SystemExit) as exc:
        main([str(tmp_path), *SMALL])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        main([str(tmp_path / "new"), *SMALL[:-1], "100"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "not empty" in err[0] and "below the tokenizer" in err[1]


MOE_SMALL = ["--moe", "--layers", "4", "--hidden-size", "64", "--vocab-size", "2048", "--experts", "8",
             "--experts-per-token", "2", "--moe-intermediate-size", "32", "--shared-expert-intermediate-size", "48"]


def test_moe_full_size_layout():
    cfg = moe_bench_config(**MOE_DEFAULTS, eot=0, im_end=2)
    assert cfg["model_type"] == "qwen3_next" and not cfg["tie_word_embeddings"]
    assert cfg["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]) == (512, 10, 512)
    assert parameter_count(cfg) == 7_210_003_520  # 14.4 GB in bf16: fits the GPU machine's disk and memory
    names = {s.name for s in tensor_specs(cfg)}
    assert "model.layers.3.mlp.experts.511.down_proj.weight" in names and "lm_head.weight" in names
    assert not any(n.startswith("mtp.") for n in names)


def test_moe_model_loads_alike_in_hkv_and_transformers(tmp_path):
    folder = tmp_path / "moe"
    assert main([str(folder), *MOE_SMALL, "--no-progress"]) == 0
    _loads_alike(folder, tf.Qwen3NextForCausalLM)


def test_moe_flags_need_moe(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main([str(tmp_path / "m"), "--experts", "8"])
    assert exc.value.code == 2 and "--experts needs --moe" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main([str(tmp_path / "m"), *MOE_SMALL, "--experts-per-token", "9"])
    assert exc.value.code == 2 and "exceeds --experts 8" in capsys.readouterr().err


def test_ships_a_given_tokenizer_and_refuses_one_without_the_special_tokens(tmp_path, capsys):
    """--tokenizer: a benchmark that needs a large vocabulary (structured output's masks) brings its own."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from hkv.models.tiny import SPECIAL_TOKENS, build_tokenizer

    given = build_tokenizer()
    given.add_tokens(["<think>", "</think>"])
    path = tmp_path / "given.json"
    given.save(str(path))
    tiny = ["--layers", "1", "--hidden-size", "8", "--intermediate-size", "8", "--vocab-size", "4160", "--no-progress"]
    assert main([str(tmp_path / "m"), *tiny, "--tokenizer", str(path)]) == 0
    shipped = Tokenizer.from_file(str(tmp_path / "m" / "tokenizer.json"))
    assert shipped.get_vocab_size() == given.get_vocab_size() and shipped.token_to_id("</think>") is not None
    bare = Tokenizer(models.BPE())
    bare.pre_tokenizer = pre_tokenizers.ByteLevel()
    bare.save(str(tmp_path / "bare.json"))
    with pytest.raises(SystemExit) as exc:
        main([str(tmp_path / "n"), *tiny, "--tokenizer", str(tmp_path / "bare.json")])
    assert exc.value.code == 2
    assert f"lacks the special tokens {list(SPECIAL_TOKENS)}" in capsys.readouterr().err


def test_qwen3_5_27b_preset_layout():
    """--preset qwen3.5-27b: Qwen3.5-27B's layer shapes, 16 layers, 17.3 GB in bf16 (issue 38's large layers)."""
    dims, overrides = PRESETS["qwen3.5-27b"]
    cfg = bench_config(**{**DEFAULTS, **dims}, eot=0, im_end=2, overrides=overrides)
    assert parameter_count(cfg) == 8_631_101_056
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (24, 4, 256)
    assert (cfg["linear_num_key_heads"], cfg["linear_num_value_heads"], cfg["linear_value_head_dim"]) == (16, 48, 128)
    assert cfg["layer_types"].count("full_attention") == 4 and not cfg["tie_word_embeddings"]
    assert "lm_head.weight" in {s.name for s in tensor_specs(cfg)}


def test_preset_shrunk_loads_alike_in_hkv_and_transformers(tmp_path, capsys):
    """The preset's head layout (24 / 4 query / KV heads, 48 GDN value heads) at a test's width."""
    folder = tmp_path / "p"
    assert main([str(folder), "--preset", "qwen3.5-27b", *SMALL, "--no-progress"]) == 0
    assert json.loads((folder / "config.json").read_text())["linear_num_value_heads"] == 48
    _loads_alike(folder, tf.Qwen3_5ForCausalLM)
    with pytest.raises(SystemExit) as exc:
        main([str(tmp_path / "q"), "--preset", "qwen3.5-27b", "--moe"])
    assert exc.value.code == 2 and "--preset and --moe" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [[], ["--moe", "--experts", "4", "--experts-per-token", "2",
                                        "--moe-intermediate-size", "136", "--shared-expert-intermediate-size", "128"]],
                         ids=["dense", "moe"])
def test_fp8_variant_is_the_published_layout_of_the_same_draws(tmp_path, flags):
    """--fp8: the bf16 model's projections block-quantized (same draws), loaded by hkv as FP8, equal to
    hkv's load of the bf16 model with --quantize fp8."""
    from hkv.models.fp8 import Fp8Linear

    small = ["--layers", "4", "--hidden-size", "160", "--intermediate-size", "256", "--vocab-size", "2048"]
    assert main([str(tmp_path / "bf16"), *small, *flags, "--no-progress"]) == 0
    assert main([str(tmp_path / "fp8"), *small, *flags, "--fp8", "--no-progress"]) == 0
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    quant = config["quantization_config"]
    assert (quant["quant_method"], quant["weight_block_size"]) == ("fp8", [128, 128])
    assert any(m.endswith("in_proj_a") or m.endswith("in_proj_ba") for m in quant["modules_to_not_convert"])
    index = json.loads((tmp_path / "fp8" / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.0.linear_attn.out_proj.weight_scale_inv" in index
    if flags:
        assert "model.layers.0.mlp.experts.3.down_proj.weight_scale_inv" in index
    fp8 = load_model(tmp_path / "fp8", "float32", "cpu").model
    quantized = dict(load_model(tmp_path / "bf16", "float32", "cpu", quantize="fp8").model.named_parameters())
    assert any(isinstance(m, Fp8Linear) for m in fp8.modules())
    for name, param in fp8.named_parameters():
        assert param.dtype == quantized[name].dtype and torch.equal(param.float(), quantized[name].float()), name
