import hashlib
import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from hkv.models.loader import describe_model, load_model
from hkv.models.tiny import ensure_builtin
from hkv.storage.kv_pool import KVPool
from tests.models.test_qwen3 import make_seqs, run_paged

# sha256 of the files every machine must produce (torch's CPU generator, tokenizers' BPE trainer);
# if a dependency bump changes them, bump BUILTIN_VERSION so caches of the old bytes stay separate
GOLDEN = {
    "tiny-dense": {
        "model.safetensors": "58425c0f59e9c4c0020e8180c1c83ef76d4cc7cd24ffd38d3e7acd0d989e0d7c",
        "tokenizer.json": "964619a3a60f363ac9afbdcc88fae32778b5099e75bc8a74fd2023215d066ebe",
    },
    "tiny-hybrid-random": {
        "model.safetensors": "886443a65d6c42be5415a661a39d8f9c0eda4d9ec937e5178bc2cf6f7f5d3af9",
        "tokenizer.json": "964619a3a60f363ac9afbdcc88fae32778b5099e75bc8a74fd2023215d066ebe",
    },
}
FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {name: ensure_builtin(name, root) for name in GOLDEN}


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_builtin_is_deterministic(built, tmp_path, name):
    folder = built[name]
    assert folder.name == f"{name}-v1"
    digests = _digests(folder)
    assert sorted(digests) == sorted(FILES)
    assert _digests(ensure_builtin(name, tmp_path)) == digests
    for file_name, want in GOLDEN[name].items():
        assert digests[file_name] == want, f"{name}/{file_name} differs from the pinned bytes"


def test_existing_folder_is_reused(tmp_path):
    folder = ensure_builtin("tiny-dense", tmp_path)
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert ensure_builtin("tiny-dense", tmp_path) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp


def test_concurrent_first_use_leaves_one_complete_folder(tmp_path):
    results, errors = [], []

    def build():
        try:
            results.append(ensure_builtin("tiny-hybrid-random", tmp_path))
        except Exception as exc:  # surfaced by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(set(results)) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-hybrid-random-v1"]  # no temporary folders left
    assert sorted(_digests(results[0])) == sorted(FILES)


def test_unknown_builtin(tmp_path):
    with pytest.raises(ValueError, match="tiny-dense, tiny-hybrid-random"):
        ensure_builtin("tiny-moe", tmp_path)
    with pytest.raises(ValueError, match="unknown random built-in"):
        ensure_builtin("tiny-hybrid", tmp_path)  # the trained one is shipped, never written


def test_tiny_dense_matches_transformers(built):
    from transformers import AutoModelForCausalLM

    folder = built["tiny-dense"]
    hf, info = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, output_loading_info=True)
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    loaded = load_model(built["tiny-dense"], "float32", "cpu")
    spec = describe_model(folder)
    assert spec.max_context == 4096 and spec.eos_ids == (2, 0)
    assert loaded.hf_config["vocab_size"] == 1536
    model = loaded.model
    seqs = make_seqs(1536, [(37, 4, 0), (10, 6, 1)], seed=11)
    kv = KVPool(model.kv_layout(32, 16, "float32", "cpu"), model.layer_map)
    with torch.no_grad():
        ours = run_paged(model, kv, seqs, chunk_sizes=[16, 5, 11], free_pages=list(range(31, -1, -1)))
        for s, got in zip(seqs, ours):
            want = hf(torch.tensor([s.tokens])).logits[0].float()
            assert (got - want).abs().max().item() < 1e-4


def test_tiny_hybrid_random_loads_in_transformers(built):
    from transformers import AutoModelForCausalLM

    folder = built["tiny-hybrid-random"]
    hf, info = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, output_loading_info=True)
    assert type(hf).__name__ == "Qwen3_5ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    config = json.loads((folder / "config.json").read_text())
    assert config["layer_types"] == ["linear_attention", "full_attention"] * 2
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    # the MTP head transformers ignores is in the file, for speculative decoding
    assert {"mtp.fc.weight", "mtp.layers.0.self_attn.q_proj.weight", "mtp.norm.weight"} <= names
    hf_names = set(hf.state_dict())
    assert names - hf_names == {n for n in names if n.startswith("mtp.")}
    with torch.no_grad():
        logits = hf(torch.tensor([[1, 50, 300, 7, 2, 900]])).logits
    assert logits.shape == (1, 6, 1536) and torch.isfinite(logits).all()
