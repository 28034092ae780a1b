"""Issue 3, acceptance 2 and 3: dense prefix hits end to end, and the books balance under pressure.

- a request extending an earlier prompt reports the page-aligned shared length
  as cached and its greedy output equals transformers';
- with --no-prefix-cache nothing is cached;
- 24 concurrent requests (half sharing a 128-token prefix) in a 1024-token KV
  pool all finish with transformers-equal output, and after /cache/flush
  hkv-inspect --json shows every pool with in_use == 0 and total == free + cached + in_use.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from tests.e2e.harness import assert_clean, launch
from tests.reference import assert_greedy_parity

pytestmark = pytest.mark.e2e
INSPECT = str(Path(sys.executable).with_name("hkv-inspect"))
PAGE = 16


def _body(prompt, max_tokens=12):
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True,
            "ignore_eos": True}


async def _complete_all(url, bodies):
    async with aiohttp.ClientSession() as session:
        async def one(body):
            async with session.post(f"{url}/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                return await resp.json()
        return await asyncio.gather(*(one(b) for b in bodies))


def _complete(url, body):
    return asyncio.run(_complete_all(url, [body]))[0]


def inspect_json(name: str) -> dict:
    proc = subprocess.run([INSPECT, "--name", name, "--json"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_extending_a_prompt_hits_its_pages(qwen3_server, qwen3_reference):
    rng = random.Random(7)
    first = [rng.randrange(3, 1536) for _ in range(300)]
    extended = first + [rng.randrange(3, 1536) for _ in range(40)]
    a = _complete(qwen3_server.url, _body(first))
    assert a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    b = _complete(qwen3_server.url, _body(extended))
    cached = b["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == 300 // PAGE * PAGE  # the shared 300 tokens, page-aligned
    assert b["usage"]["cache"] == {"gpu": cached, "cpu": 0, "disk": 0, "peer": 0}
    assert_greedy_parity(qwen3_reference, extended, b["choices"][0]["token_ids"])
    # the same prompt again: everything but the last page is reused (one token is always recomputed)
    c = _complete(qwen3_server.url, _body(extended))
    assert c["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(extended) - 1) // PAGE * PAGE
    assert c["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]


def test_no_prefix_cache_reports_zero(qwen3_dir, qwen3_reference, tmp_path):
    server = launch(["--model", str(qwen3_dir), "--no-prefix-cache"], tmp_path)
    pids = server.actor_pids()
    try:
        prompt = list(range(5, 205))
        _complete(server.url, _body(prompt))
        again = _complete(server.url, _body(prompt + [9, 10, 11]))
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert_greedy_parity(qwen3_reference, prompt + [9, 10, 11], again["choices"][0]["token_ids"])
        report = inspect_json(server.name)
        assert report["pools"]["gpu_pages"]["cached"] == 0
    finally:
        assert server.stop(signal.SIGTERM) == 0
    assert_clean(server, pids)


def test_pressure_with_shared_prefixes_then_flush(qwen3_dir, qwen3_reference, tmp_path):
    server = launch(["--model", str(qwen3_dir), "--max-total-tokens", "1024", "--max-running-requests", "16"],
                    tmp_path)
    pids = server.actor_pids()
    rng = random.Random(3)
    shared = [rng.randrange(3, 1536) for _ in range(128)]
    prompts = [shared + [rng.randrange(3, 1536) for _ in range(rng.randrange(8, 64))] for _ in range(12)]
    prompts += [[rng.randrange(3, 1536) for _ in range(rng.randrange(60, 220))] for _ in range(12)]
    rng.shuffle(prompts)
    try:
        results = asyncio.run(_complete_all(server.url, [_body(p, 40) for p in prompts]))
        for prompt, result in zip(prompts, results):
            assert result["choices"][0]["finish_reason"] == "length"
            assert_greedy_parity(qwen3_reference, prompt, result["choices"][0]["token_ids"])
        assert sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in results) > 0
        before = inspect_json(server.name)
        assert before["pools"]["gpu_pages"]["cached"] > 0
        assert before["steps"]["preemptions"] > 0  # the pool really was too small for the load
        async def flush():
            async with aiohttp.ClientSession() as session:
                async with session.post(f"{server.url}/cache/flush") as resp:
                    return resp.status, await resp.json()
        status, flushed = asyncio.run(flush())
        assert status == 200 and flushed["pages"] == before["pools"]["gpu_pages"]["cached"]
        after = inspect_json(server.name)
        for name, pool in after["pools"].items():
            assert pool["in_use"] == 0, (name, pool)
            assert pool["total"] == pool["free"] + pool["cached"] + pool["in_use"], (name, pool)
        assert after["pools"]["gpu_pages"]["free"] == 1024 // PAGE
        assert after["requests"] == []
    finally:
        assert server.stop(signal.SIGTERM) == 0
    assert_clean(server, pids)


def test_metrics_expose_the_engine_and_cache(qwen3_server):
    import re
    import urllib.request

    _complete(qwen3_server.url, _body(list(range(10, 60)), 4))
    text = urllib.request.urlopen(f"{qwen3_server.url}/metrics", timeout=10).read().decode()
    steps = float(re.search(r"^hkv_engine_steps_total (\S+)$", text, re.M).group(1))
    cached = float(re.search(r'^hkv_cache_pool\{pool="gpu_pages",state="cached"\} (\S+)$', text, re.M).group(1))
    assert steps > 0 and cached > 0
    assert re.search(r'^hkv_requests_total\{endpoint="/v1/completions",status="200"\} ', text, re.M)
