"""Issue 10, acceptance 1: a Qwen3.5 config.json with `full_attention_interval` and no `layer_types`
serves as the hybrid it is (the scheduler once read it as dense while the rank built it hybrid, so
every step failed), with transformers' greedy output and checkpointed prefix hits."""

from __future__ import annotations

import json
import signal

import pytest

from tests.e2e.harness import assert_clean, launch
from tests.e2e.test_hybrid import CACHE_FLAGS, HYBRID, ROPE, _prompts
from tests.e2e.test_prefix_cache import _body, _complete, inspect_json
from tests.models.test_qwen3_5 import perturb
from tests.reference import assert_greedy_parity, copy_tokenizer

pytestmark = pytest.mark.e2e


def _interval_only_checkpoint(folder, tiny_dir):
    """A transformers-saved Qwen3.5 whose config.json names the layers only by full_attention_interval."""
    import torch
    import transformers as tf

    fields = {k: v for k, v in HYBRID.items() if k != "layer_types"}
    config = tf.Qwen3_5TextConfig(**fields, full_attention_interval=2, rope_parameters={**ROPE, "mrope_section": [2, 1, 1],
                                                             "mrope_interleaved": True})
    torch.manual_seed(6)
    model = tf.Qwen3_5ForCausalLM(config).eval()
    perturb(model, 6)
    model.save_pretrained(folder)
    copy_tokenizer(tiny_dir, folder)
    raw = json.loads((folder / "config.json").read_text())
    raw.pop("layer_types")
    raw["full_attention_interval"] = 2
    (folder / "config.json").write_text(json.dumps(raw))
    reference = tf.Qwen3_5ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert reference.config.layer_types == HYBRID["layer_types"]  # transformers reads the interval too
    return reference


def test_interval_only_config_serves_as_hybrid_with_hits(tmp_path, builtin_dir):
    from hkv.models.tiny import ensure_builtin

    reference = _interval_only_checkpoint(tmp_path / "model", ensure_builtin("tiny-dense", builtin_dir))
    server = launch(["--model", str(tmp_path / "model"), *CACHE_FLAGS], tmp_path)
    pids = server.actor_pids()
    try:
        (prompt,) = _prompts(31, [300])
        first = _complete(server.url, _body(prompt, 8))
        second_ids = prompt + _prompts(32, [40])[0]
        second = _complete(server.url, _body(second_ids, 8))
        report = inspect_json(server.name)
    finally:
        assert server.stop(signal.SIGTERM) == 0, server.log()
    assert_clean(server, pids)
    assert_greedy_parity(reference, prompt, first["choices"][0]["token_ids"])
    assert_greedy_parity(reference, second_ids, second["choices"][0]["token_ids"])
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 288  # the prompt's last page boundary
    assert report["pools"]["state_slots"]["total"] > 0 and report["radix"]["checkpoints"] > 0
