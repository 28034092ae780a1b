"""HKV_GRAMMAR_DEVICE_WAIT=1 (hkv/engine/mask_wait.py) on a GPU: constrained greedy requests give the same tokens with
the device-side wait as without it (one at a time, so that batching cannot change a float32 argmax: every decode step
after a request's first has its grammar row behind, the deferred path), the ranks log that the wait is on, and all
of them at once beside plain ones (several grammar rows a step, filled on the mask threads) keep to their
constraints. Its one GPU run (2026-12-05) printed nothing before the call's limit; `DEVICE_WAIT=tests bash
tools/gpu/gpu_structured.sh` runs it alone, its -v output in $OUT/device_wait_tests.log. A suspect found since on
the CPU: a launch allocated pinned host memory behind its own wait (the ids' buffer, the mask rows' upload, the
penalty counts' upload), which may block the rank's thread until the device drains, a deadlock while the device
waits for a fill that thread has yet to start; launches now take them before the wait
(tests/engine/test_mask_wait.py)."""

from __future__ import annotations

import json
import re
import signal
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.e2e.harness import assert_clean, launch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.e2e,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
FLAGS = ["--device", "cuda", "--dtype", "float32", "--max-running-requests", "16", "--max-total-tokens", "16384", "--grammar-threads", "2"]
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



def _complete(url: str, body: dict) -> dict:
    request = {"max_tokens": 48, "temperature": 0, "return_token_ids": True, **body}
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(request).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as answer:
        return json.loads(answer.read())["choices"][0]


def _keeps_to_its_constraint(body: dict, choice: dict) -> bool:
    if choice["finish_reason"] != "stop" or "prompt" in body and body["prompt"].startswith("Plain"):
        return True  # cut at max_tokens (a prefix), or unconstrained
    if "structured_outputs" in body:
        return re.fullmatch(body["structured_outputs"]["regex"], choice["text"]) is not None
    answer = json.loads(choice["text"])
    return set(answer) == {"name", "age", "tags"} and len(answer["name"]) <= 12 and isinstance(answer["age"], int)


def _serve(folder: Path, tmp_path: Path, env: dict) -> tuple[list[list[int]], list[dict], str]:
    """(each body's token ids, sent one at a time; each body's choice, all sent at once; the server's log)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    server = launch(["--model", str(folder), *FLAGS], tmp_path, env=env)
    pids = server.actor_pids()
    try:
        alone = [_complete(server.url, body)["token_ids"] for body in BODIES]
        with ThreadPoolExecutor(len(BODIES)) as pool:
            together = list(pool.map(lambda body: _complete(server.url, body), BODIES))
    finally:
        assert server.stop(signal.SIGTERM) == 0, server.log()
    assert_clean(server, pids)
    return alone, together, server.log()


def test_constrained_greedy_tokens_are_the_same_with_the_device_wait(builtin_dir, tmp_path):
    from hkv.models.tiny import ensure_builtin

    folder = ensure_builtin("tiny-dense", builtin_dir)
    want, _, _ = _serve(folder, tmp_path / "plain", {"HKV_GRAMMAR_DEVICE_WAIT": "0"})
    got, together, log = _serve(folder, tmp_path / "wait", {"HKV_GRAMMAR_DEVICE_WAIT": "1"})
    assert "the device waits for them" in log, log[-3000:]
    assert all(want), want  # every request answered something
    assert got == want
    assert all(_keeps_to_its_constraint(body, choice) for body, choice in zip(BODIES, together)), together
