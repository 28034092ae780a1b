"""Fixtures for end-to-end tests: a transformers-built qwen3 folder and a served instance."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest
import torch

from hkv.models.tiny import ensure_builtin
from tests.e2e import harness
from tests.e2e.harness import assert_clean, launch
from tests.reference import copy_tokenizer


@pytest.fixture(scope="session")
def builtin_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("builtin")


@pytest.fixture(scope="session", autouse=True)
def _builtin_cache_env(builtin_dir, monkeypatch_session):
    monkeypatch_session.setenv("HKV_CACHE_DIR", str(builtin_dir))


@pytest.fixture(scope="session")
def monkeypatch_session():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.fixture(scope="module", autouse=True)
def launch_command(tmp_path_factory):
    """hkv-launch beside the interpreter, or a shim where hkv runs from PYTHONPATH uninstalled (the GPU scripts)."""
    if Path(harness.LAUNCH).exists():
        yield harness.LAUNCH
        return
    shim = tmp_path_factory.mktemp("bin") / "hkv-launch"
    shim.write_text(f"#!{sys.executable}\nfrom hkv.launcher import main\n\nmain()\n")
    shim.chmod(0o755)
    patch = pytest.MonkeyPatch()
    patch.setattr(harness, "LAUNCH", str(shim))
    yield str(shim)
    patch.undo()


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory, builtin_dir) -> Path:
    """A tiny random Qwen3ForCausalLM built and saved by transformers, with the tiny tokenizer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tiny = ensure_builtin("tiny-dense", builtin_dir)
    folder = tmp_path_factory.mktemp("qwen3")
    config = Qwen3Config(
        vocab_size=1536,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        initializer_range=0.08,
        tie_word_embeddings=False,
        eos_token_id=2,
        bos_token_id=None,
    )
    torch.manual_seed(1234)
    model = Qwen3ForCausalLM(config).eval()
    model.save_pretrained(folder)
    copy_tokenizer(tiny, folder)
    return folder


@pytest.fixture(scope="session")
def qwen3_reference(qwen3_dir):
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def qwen3_server(qwen3_dir, tmp_path_factory):
    """One instance serving the qwen3 folder for a whole test module; checked clean on exit."""
    server = launch(["--model", str(qwen3_dir), "--chunked-prefill-size", "256"], tmp_path_factory.mktemp("log"))
    pids = server.actor_pids()
    yield server
    code = server.stop(signal.SIGTERM)
    assert code == 0, server.log()
    assert_clean(server, pids)
