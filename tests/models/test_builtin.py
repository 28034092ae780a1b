"""The shipped built-in model (hkv/models/builtin/tiny-hybrid, tools/train/train_tiny.py): its files are the
recorded bytes, it is an ordinary Qwen3.5 checkpoint to transformers, and hkv serves it like transformers."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors import safe_open

from hkv.config import BUILTIN_MODELS
from hkv.models.loader import describe_model, load_model
from hkv.models.tiny import BUILTIN_NAMES, SHIPPED_DIR, builtin_folder
from hkv.models.tokenizer import Tokenizer
from tests.models.test_qwen3_5 import PagedRun
from tests.reference import assert_greedy_parity

SERVING_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json"}
PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModelForCausalLM

    hf, info = AutoModelForCausalLM.from_pretrained(str(SHIPPED_DIR), dtype=torch.float32, output_loading_info=True)
    return hf.eval(), info


def test_the_shipped_files_are_the_recorded_bytes():
    digests = json.loads((SHIPPED_DIR / "digests.json").read_text())
    assert set(digests) == SERVING_FILES
    for name, want in digests.items():
        data = (SHIPPED_DIR / name).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (want["bytes"], want["sha256"]), name
    assert sum(p.stat().st_size for p in SHIPPED_DIR.iterdir()) < 16_000_000  # the repository's limit


def test_the_names_resolve(tmp_path):
    assert set(BUILTIN_MODELS) == set(BUILTIN_NAMES)
    assert builtin_folder("tiny-hybrid", tmp_path) == SHIPPED_DIR
    assert not any(tmp_path.iterdir())  # nothing written for the shipped model


def test_config_and_the_mtp_layout_of_published_checkpoints():
    config = json.loads((SHIPPED_DIR / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_text" and config["mtp_num_hidden_layers"] == 1
    assert config["layer_types"] == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + [
        "full_attention"]
    spec = describe_model(SHIPPED_DIR)
    assert spec.hybrid and spec.vocab_size == config["vocab_size"] and set(spec.eos_ids) == {0, 2}
    hidden = config["hidden_size"]
    with safe_open(str(SHIPPED_DIR / "model.safetensors"), framework="pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
        assert {f.get_slice(name).get_dtype() for name in f.keys()} == {"BF16"}
    mtp = {name: shape for name, shape in shapes.items() if name.startswith("mtp.")}
    attn = ["q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"]
    want = {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
            "mtp.layers.0.input_layernorm.weight", "mtp.layers.0.post_attention_layernorm.weight"}
    want |= {f"mtp.layers.0.self_attn.{n}.weight" for n in attn}
    want |= {f"mtp.layers.0.mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}
    assert set(mtp) == want
    assert mtp["mtp.fc.weight"] == (hidden, 2 * hidden)
    assert mtp["mtp.layers.0.self_attn.q_proj.weight"] == shapes["model.layers.3.self_attn.q_proj.weight"]
    assert "lm_head.weight" not in shapes  # tied to the embedding


def test_the_mtp_tensors_load_into_the_module_that_trained_them(reference):
    from safetensors.torch import load_file

    from tools.train.tiny_mtp import MTPHead

    tensors = load_file(str(SHIPPED_DIR / "model.safetensors"))
    MTPHead(reference[0].config).load_checkpoint_tensors(tensors)  # strict: no name missing or extra


def test_transformers_loads_it_and_ignores_only_the_mtp_weights(reference):
    hf, info = reference
    assert type(hf).__name__ == "Qwen3_5ForCausalLM"
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert all(name.startswith("mtp.") for name in info["unexpected_keys"])


def _hkv_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """hkv's greedy tokens after `prompt` (prefilled in two chunks), and the prompt's logits."""
    run = PagedRun(model, num_pages=64, num_slots=2)
    run.add("p", 1)
    half = len(prompt) // 2
    logits = torch.cat([run.step([("p", prompt[:half])])[0], run.step([("p", prompt[half:])])[0]])
    out = [int(logits[-1].argmax())]
    while len(out) < steps:
        out.append(int(run.step([("p", out[-1:])])[0][-1].argmax()))
    return out, logits


def test_hkv_writes_what_transformers_writes(reference):
    hf = reference[0]
    tok = Tokenizer.from_folder(SHIPPED_DIR)
    prompt = tok.encode(PROMPT)
    ours, logits = _hkv_greedy(load_model(SHIPPED_DIR, "float32", "cpu").model, prompt, NEW_TOKENS)
    theirs = []
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([prompt])).logits[0].float()
        for _ in range(NEW_TOKENS):  # plain greedy, no cache, no end-of-sequence rule
            theirs.append(int(hf(input_ids=torch.tensor([prompt + theirs])).logits[0, -1].argmax()))
    assert (logits - want).abs().max().item() < 1e-3
    assert_greedy_parity(hf, prompt, ours)
    assert ours == theirs, (tok.decode(ours), tok.decode(theirs))
