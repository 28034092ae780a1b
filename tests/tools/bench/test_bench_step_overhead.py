"""tools/bench/bench_step_overhead.py --free-forward: the ranks' model forward is replaced, so every sampled token is
FREE_TOKEN, whatever the prompt (a real hkv-launch server, the built-in dense and hybrid models)."""

from __future__ import annotations

import json
import signal
import urllib.request

import pytest

from tools.bench.bench_step_overhead import free_port, start_server
from tools.bench.free_forward.sitecustomize import FREE_TOKEN


@pytest.mark.parametrize("model", ["tiny-dense", "tiny-hybrid"])
def test_free_forward_samples_its_token_every_step(model, tmp_path, monkeypatch):
    monkeypatch.setenv("HKV_CACHE_DIR", str(tmp_path))
    port = free_port()
    proc = start_server(model, port, f"free{port}", ["--device", "cpu"], free_forward=True)
    try:
        body = {"prompt": "def main():", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            answer = json.load(resp)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    assert answer["choices"][0]["token_ids"] == [FREE_TOKEN] * 8
