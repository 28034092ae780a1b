import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hkv.models.loader import ModelLoadError, cache_fingerprint, describe_model, load_model, weights_digest
from hkv.models.qwen3 import WeightLoadError
from hkv.models.registry import FAMILIES, resolve_family
from hkv.models.tokenizer import Tokenizer
from tests.models.test_qwen3 import hf_tiny_qwen3
from tests.openai.tokenizer_fixture import tiny_dense_folder
from tests.reference import copy_tokenizer


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loader")
    model = hf_tiny_qwen3(tied=False, seed=3)
    model.generation_config.eos_token_id = [7, 5]
    model.config.eos_token_id = 5
    model.save_pretrained(root / "single")
    model.save_pretrained(root / "sharded", max_shard_size="40KB")
    return {"single": root / "single", "sharded": root / "sharded"}


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_single_and_sharded_load_the_same_weights(saved):
    single = load_model(saved["single"], "float32", "cpu")
    sharded = load_model(saved["sharded"], "float32", "cpu")
    shards = sorted(p.name for p in saved["sharded"].glob("*.safetensors"))
    assert len(shards) > 2
    a, b = dict(single.model.named_parameters()), dict(sharded.model.named_parameters())
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in a.values())
    assert not single.model.training


def test_loaded_model_metadata(saved):
    loaded = load_model(saved["single"], "bfloat16", "cpu")
    assert loaded.hf_config["model_type"] == "qwen3"
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())


def test_describe_a_dense_model(saved, tmp_path):
    folder = _copy(saved["single"], tmp_path / "dense")
    for name in ("tokenizer.json", "tokenizer_config.json"):  # not its generation_config.json
        shutil.copy(tiny_dense_folder() / name, folder / name)
    spec = describe_model(folder)
    assert (spec.family, spec.hybrid, spec.layer_kinds) == ("qwen3", False, ("full",) * 3)
    assert spec.max_context == 512 and spec.vocab_size == loaded_vocab(folder)
    # generation_config first, then config.json, then the tokenizer's eos_token; deduplicated
    assert spec.eos_ids[:2] == (7, 5) and spec.eos_ids == Tokenizer.from_folder(folder).eos_token_ids
    assert spec.linear_layers == () and spec.conv_kernel == 0


def loaded_vocab(folder: Path) -> int:
    return json.loads((folder / "config.json").read_text())["vocab_size"]


@pytest.mark.parametrize("layer_types", [None, ["linear_attention", "full_attention"] * 2])
def test_describe_a_hybrid_model_from_its_interval_or_its_layer_types(tmp_path, layer_types):
    """A Qwen3.5 config with only full_attention_interval is the hybrid it is (issue 10's bug)."""
    text = dict(model_type="qwen3_5_text", vocab_size=300, hidden_size=32, num_hidden_layers=4,
                num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=1024,
                full_attention_interval=2, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4)
    if layer_types is not None:
        text["layer_types"] = layer_types
    (tmp_path / "config.json").write_text(json.dumps(text))
    copy_tokenizer(tiny_dense_folder(), tmp_path)
    spec = describe_model(tmp_path)
    assert spec.layer_kinds == ("linear", "full", "linear", "full") and spec.hybrid
    assert (spec.linear_layers, spec.full_layers) == ((0, 2), (1, 3))
    assert (spec.linear_k_heads, spec.linear_v_heads, spec.linear_k_dim, spec.conv_kernel) == (2, 4, 8, 4)


def test_describe_refuses_what_cannot_be_served(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 5}))
    with pytest.raises(ModelLoadError, match="missing"):
        describe_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="unsupported model_type"):
        describe_model(tmp_path)


def test_weights_digest_is_stable_and_content_based(saved, tmp_path):
    first = weights_digest([saved["single"] / "model.safetensors"])
    assert len(first) == 64
    copy = _copy(saved["single"], tmp_path / "copy")
    assert weights_digest([copy / "model.safetensors"]) == first
    assert weights_digest([copy / "model.safetensors"], chunk_bytes=1000) == first  # chunking does not matter
    fingerprint = cache_fingerprint(copy, "float32", 16, 1, "cpu")
    assert fingerprint.weights_digest == first and fingerprint == cache_fingerprint(saved["single"], "float32", 16, 1, "cpu")
    tensors = load_file(copy / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    assert weights_digest([copy / "model.safetensors"]) != first
    changed = cache_fingerprint(copy, "float32", 16, 1, "cpu")
    assert changed.weights_digest != first and changed.root_key() != fingerprint.root_key()
    # every field roots the keys elsewhere
    for args in (("bfloat16", 16, 1, "cpu"), ("float32", 32, 1, "cpu"), ("float32", 16, 2, "cpu"),
                 ("float32", 16, 1, "cuda")):
        assert cache_fingerprint(saved["single"], *args).root_key() != fingerprint.root_key()


def test_weights_digest_cache_skips_unchanged_files(saved, tmp_path, monkeypatch):
    from hkv.models import loader

    copy = _copy(saved["single"], tmp_path / "copy")
    weights = copy / "model.safetensors"
    cache = tmp_path / "cache" / "digests.json"
    reads = []
    real = loader._file_sha256
    monkeypatch.setattr(loader, "_file_sha256", lambda path, *a: reads.append(path) or real(path, *a))
    plain = weights_digest([weights])
    assert weights_digest([weights], cache=cache) == plain and reads == [weights, weights]
    assert weights_digest([weights], cache=cache) == plain and len(reads) == 2  # unchanged: not read again
    assert oct(cache.stat().st_mode & 0o777) == "0o600"
    tensors = load_file(weights)
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * 2
    save_file(tensors, weights, metadata={"format": "pt"})
    changed = weights_digest([weights], cache=cache)
    assert changed != plain and len(reads) == 3 and changed == weights_digest([weights])
    cache.write_text("{not json")  # a corrupt cache is ignored and rewritten
    assert weights_digest([weights], cache=cache) == changed and len(reads) == 5
    assert weights_digest([weights], cache=cache) == changed and len(reads) == 5


def test_missing_folder_config_and_weights(saved, tmp_path):
    with pytest.raises(ModelLoadError, match="model folder not found"):
        load_model(tmp_path / "nope", "float32", "cpu")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(empty, "float32", "cpu")
    no_weights = _copy(saved["single"], tmp_path / "no_weights")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*.safetensors weights"):
        load_model(no_weights, "float32", "cpu")
    (no_weights / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ModelLoadError, match="pickle-based weights are not supported"):
        load_model(no_weights, "float32", "cpu")


def test_missing_shard_and_bad_index(saved, tmp_path):
    folder = _copy(saved["sharded"], tmp_path / "missing_shard")
    victim = sorted(folder.glob("*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(ModelLoadError, match=f"shard {victim.name} named by model.safetensors.index.json is missing"):
        load_model(folder, "float32", "cpu")

    folder = _copy(saved["sharded"], tmp_path / "bad_index")
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first_file = sorted(set(index["weight_map"].values()))[0]
    index["weight_map"]["model.ghost.weight"] = first_file
    index_path.write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="not in it, e.g. model.ghost.weight"):
        load_model(folder, "float32", "cpu")

    index["weight_map"]["model.ghost.weight"] = "../outside.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="bad shard file name"):
        load_model(folder, "float32", "cpu")


def _rewrite_weights(folder: Path, edit) -> None:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def test_weight_mismatches_are_named(saved, tmp_path):
    folder = _copy(saved["single"], tmp_path / "missing_tensor")
    _rewrite_weights(folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(WeightLoadError, match="model.layers.1.mlp.up_proj.weight"):
        load_model(folder, "float32", "cpu")

    folder = _copy(saved["single"], tmp_path / "extra_tensor")
    _rewrite_weights(folder, lambda t: t.update({"model.layers.9.mlp.up_proj.weight": torch.zeros(2, 2)}))
    with pytest.raises(WeightLoadError, match="1 unexpected"):
        load_model(folder, "float32", "cpu")

    folder = _copy(saved["single"], tmp_path / "int_tensor")
    _rewrite_weights(folder, lambda t: t.update({"model.norm.weight": torch.zeros(64, dtype=torch.int8)}))
    with pytest.raises(ModelLoadError, match="model.norm.weight has dtype torch.int8"):
        load_model(folder, "float32", "cpu")


def test_config_problems(saved, tmp_path):
    folder = _copy(saved["single"], tmp_path / "cfg")
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    with pytest.raises(ModelLoadError, match="dtype 'auto'"):
        load_model(folder, "auto", "cpu")
    config_path.write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'.*supported: .*qwen3"):
        load_model(folder, "float32", "cpu")
    config_path.write_text(json.dumps({**config, "quantization_config": {"quant_method": "bitsandbytes"}}))
    with pytest.raises(ModelLoadError, match="quant_method 'bitsandbytes' is not supported"):
        load_model(folder, "float32", "cpu")
    config_path.write_text(json.dumps({**config, "quantization_config": {"quant_method": "fp8"}}))  # no block size
    with pytest.raises(ModelLoadError, match="weight_block_size None"):
        load_model(folder, "float32", "cpu")
    config_path.write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_model(folder, "float32", "cpu")


def test_registry():
    assert FAMILIES["qwen3"] == "hkv.models.qwen3:Qwen3ForCausalLM"
    assert resolve_family({"model_type": "qwen3"}).__name__ == "Qwen3ForCausalLM"
    with pytest.raises(ValueError, match="unsupported model_type None"):
        resolve_family({})
