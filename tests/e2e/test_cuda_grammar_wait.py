"""HKV_GRAMMAR_DEVICE_WAIT=1 (hkv/engine/mask_wait.py) on a GPU: constrained greedy requests, several at once beside
plain ones so that decode steps carry grammar rows behind their matchers, give the same tokens with the device-side
wait as without it, and the ranks log that the wait is on. Not yet run on a GPU (tools/gpu/gpu_structured.sh with
DEVICE_WAIT=1 runs the benchmark side; this file runs under the GPU scripts' pytest rounds)."""

from __future__ import annotations

import json
import signal
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.e2e import harness
from tests.e2e.harness import assert_clean, launch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.e2e,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
FLAGS = ["--device", "cuda", "--max-running-requests", "16", "--max-total-tokens", "16384", "--grammar-threads", "2"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}, "tags": {"type": "array",
                                                                                "items": {"type": "string"}}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
BODIES = [
    *({"prompt": f"Person {i}:", "response_format": {"type": "json_schema",
                                                      "json_schema": {"name": "person", "schema": SCHEMA}}}
      for i in range(6)),
    *({"prompt": f"Digits {i}:", "structured_outputs": {"regex": "[0-9]{3}-[a-z]{2,8}"}} for i in range(3)),
    *({"prompt": f"Plain {i}:"} for i in range(3)),
]


@pytest.fixture(scope="module", autouse=True)
def launch_command(tmp_path_factory):
    """hkv-launch beside the interpreter, or a shim where hkv runs from PYTHONPATH uninstalled (the GPU script)."""
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


def _complete(url: str, body: dict) -> list[int]:
    request = {"max_tokens": 48, "temperature": 0, "return_token_ids": True, **body}
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(request).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as answer:
        choice = json.loads(answer.read())["choices"][0]
    return choice.get("token_ids") or []


def _served_tokens(folder: Path, tmp_path: Path, env: dict) -> tuple[list[list[int]], str]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    server = launch(["--model", str(folder), *FLAGS], tmp_path, env=env)
    pids = server.actor_pids()
    try:
        with ThreadPoolExecutor(len(BODIES)) as pool:  # at once: decode steps carry several grammar rows
            tokens = list(pool.map(lambda body: _complete(server.url, body), BODIES))
    finally:
        assert server.stop(signal.SIGTERM) == 0, server.log()
    assert_clean(server, pids)
    return tokens, server.log()


def test_constrained_greedy_tokens_are_the_same_with_the_device_wait(builtin_dir, tmp_path):
    from hkv.models.tiny import ensure_builtin

    folder = ensure_builtin("tiny-dense", builtin_dir)
    want, _ = _served_tokens(folder, tmp_path / "plain", {"HKV_GRAMMAR_DEVICE_WAIT": "0"})
    got, log = _served_tokens(folder, tmp_path / "wait", {"HKV_GRAMMAR_DEVICE_WAIT": "1"})
    assert "the device waits for them" in log, log[-3000:]
    assert all(want[:9]), want  # every constrained request answered something
    assert got == want
