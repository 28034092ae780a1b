"""Issue 5, acceptance 1-5: the CPU and disk tiers on the tiny hybrid model, end to end.

One disk directory `D` lives through the module, in order:
1. prompt A, six other prompts that push A off the device, then A + 30: the
   CPU (or disk) tier serves >= 512 tokens, output equals transformers';
2. restart on D: the same request reads >= 512 tokens from disk, same output;
3. one byte flipped in the middle of every file of D, restart: same output
   (recomputed), no crash, the corruption counted;
4. restart on D with another model (tiny-dense): zero hits;
5. kill -9 the cache worker while it writes: the instance stops cleanly, and
   after a restart every file is whole (no temp file, nothing corrupt).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from hkv.models.tiny import ensure_builtin
from tests.e2e.harness import assert_clean, launch
from tests.e2e.test_lifecycle import _actor_pid
from tests.e2e.test_prefix_cache import _body, _complete, _complete_all, inspect_json
from tests.reference import assert_greedy_parity

pytestmark = pytest.mark.e2e
VOCAB = 1536
FLAGS = ["--max-total-tokens", "2048", "--cpu-cache-gb", "0.05"]
HYBRID_FLAGS = ["--model", "tiny-hybrid-random", *FLAGS]  # random ids in [3, VOCAB) probe it evenly
OUT_TOKENS = 8


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


PROMPT_A, *OTHERS = _prompts(50, [600] * 7)
PROMPT_A30 = PROMPT_A + _prompts(51, [30])[0]


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("disk-tier")


@pytest.fixture(scope="module")
def hybrid_reference(builtin_dir):
    from transformers import Qwen3_5ForCausalLM

    folder = ensure_builtin("tiny-hybrid-random", builtin_dir)
    return Qwen3_5ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def outputs() -> dict:
    """Outputs of PROMPT_A30 by path, for the cross-path equality checks."""
    return {}


def _serve(args: list[str], tmp_path: Path):
    server = launch(args, tmp_path)
    return server, server.actor_pids()


def _stop(server, pids) -> None:
    assert server.stop(signal.SIGTERM) == 0, server.log()
    assert_clean(server, pids)


def _settled_inspect(name: str, ready) -> dict:
    """hkv-inspect once `ready(report)` holds: the cache worker publishes its stats within 0.25 s."""
    deadline = time.monotonic() + 5.0
    while True:
        report = inspect_json(name)
        if ready(report) or time.monotonic() > deadline:
            return report
        time.sleep(0.1)


def _metrics(url: str) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        return resp.read().decode()


def _tier_tokens(result: dict) -> tuple[int, int, int]:
    cache = result["usage"]["cache"]
    return cache["gpu"], cache["cpu"], cache["disk"]


def test_1_a_prefix_pushed_off_the_device_comes_back_from_the_cpu_tier(
        disk_dir, hybrid_reference, outputs, tmp_path):
    server, pids = _serve([*HYBRID_FLAGS, "--disk-cache-dir", str(disk_dir), "--log-request-times"], tmp_path)
    try:
        first = _complete(server.url, _body(PROMPT_A, OUT_TOKENS))
        others = [_complete(server.url, _body(p, OUT_TOKENS)) for p in OTHERS]
        result = _complete(server.url, _body(PROMPT_A30, OUT_TOKENS))
        report = _settled_inspect(server.name, lambda r: r["tiers"]["cpu"]["stores"] >= 7 * 37)
        metrics = _metrics(server.url)
        # the prefix the CPU tier served stays on the device, its checkpoint with it: a prompt sharing just
        # that prefix hits the device there, with nothing loaded again
        served = sum(_tier_tokens(result))
        branch = PROMPT_A30[:served] + _prompts(52, [20])[0]
        again = _complete(server.url, _body(branch, OUT_TOKENS))
    finally:
        _stop(server, pids)
    # --log-request-times: the tier hit's line, with its lookup and its loads (pages and checkpoint)
    gpu, cpu, disk = _tier_tokens(result)
    lines = re.findall(rf"request \d+: {len(PROMPT_A30)} prompt tokens, cached gpu {gpu} cpu {cpu} disk {disk} peer 0; "
                       r"router [\d.]+ ms, tier [\d.]+ ms, admitted [\d.]+ ms "
                       r"\(step \d+, \d+ tokens, (\d+) cache ops\), first step done [\d.]+ ms \(forward [\d.]+ ms\), "
                       r"first token [\d.]+ ms, finished [\d.]+ ms \(length\)",
                       server.log_path.read_text(errors="replace"))
    assert len(lines) == 1 and int(lines[0]) >= 2, server.log()[-3000:]
    assert _tier_tokens(again) == (served, 0, 0), again["usage"]
    assert_greedy_parity(hybrid_reference, branch, again["choices"][0]["token_ids"])
    gpu, cpu, disk = _tier_tokens(result)
    assert cpu + disk >= 512, result["usage"]
    assert result["usage"]["prompt_tokens_details"]["cached_tokens"] == gpu + cpu + disk
    for prompt, done in zip([PROMPT_A, *OTHERS, PROMPT_A30], [first, *others, result]):
        assert_greedy_parity(hybrid_reference, prompt, done["choices"][0]["token_ids"])
    outputs["cpu"] = result["choices"][0]["token_ids"]
    cpu_pool = report["pools"]["cpu_pages"]
    assert cpu_pool["total"] > 0 and cpu_pool["total"] == cpu_pool["free"] + cpu_pool["cached"] + cpu_pool["in_use"]
    assert report["tiers"]["cpu"]["enabled"] and report["tiers"]["cpu"]["stores"] >= 7 * 37
    assert report["tiers"]["cpu"]["cached_tokens_served"] == cpu
    assert report["tiers"]["disk"]["enabled"] and report["tiers"]["disk"]["dir"] == str(disk_dir)
    assert f'hkv_cache_hit_tokens_total{{tier="cpu"}} {float(cpu)}' in metrics
    assert 'hkv_tier_pool{pool="cpu_pages",state="cached"}' in metrics
    files = [p for p in disk_dir.rglob("*.hkvp")]
    assert len(files) >= 37, "the drained stop should leave the stored pages on disk"


def test_2_a_restart_reads_the_prefix_from_disk(disk_dir, hybrid_reference, outputs, tmp_path):
    server, pids = _serve([*HYBRID_FLAGS, "--disk-cache-dir", str(disk_dir)], tmp_path)
    try:
        result = _complete(server.url, _body(PROMPT_A30, OUT_TOKENS))
        report = _settled_inspect(server.name, lambda r: r["tiers"]["disk"]["hit_pages"] > 0)
    finally:
        _stop(server, pids)
    gpu, cpu, disk = _tier_tokens(result)
    assert disk >= 512 and gpu == 0, result["usage"]
    tokens = result["choices"][0]["token_ids"]
    assert_greedy_parity(hybrid_reference, PROMPT_A30, tokens)
    assert tokens == outputs["cpu"]
    assert report["tiers"]["disk"]["hit_pages"] * 16 == disk
    assert report["tiers"]["disk"]["corrupt"] == 0


def test_3_corrupted_files_are_deleted_and_counted(disk_dir, hybrid_reference, outputs, tmp_path):
    files = sorted(disk_dir.rglob("*.hkvp"))
    assert files
    for path in files:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x5A
        path.write_bytes(bytes(data))
    server, pids = _serve([*HYBRID_FLAGS, "--disk-cache-dir", str(disk_dir)], tmp_path)
    try:
        result = _complete(server.url, _body(PROMPT_A30, OUT_TOKENS))
        again = _complete(server.url, _body(PROMPT_A30, OUT_TOKENS))  # the recomputed prefix is cached anew
        report = _settled_inspect(server.name, lambda r: r["tiers"]["disk"]["corrupt"] > 0)
        metrics = _metrics(server.url)
    finally:
        _stop(server, pids)
    assert _tier_tokens(result)[1:] == (0, 0), result["usage"]
    tokens = result["choices"][0]["token_ids"]
    assert_greedy_parity(hybrid_reference, PROMPT_A30, tokens)
    assert tokens == outputs["cpu"] == again["choices"][0]["token_ids"]
    disk = report["tiers"]["disk"]
    assert disk["corrupt"] >= 1 and disk["read_failed"] >= 1, disk
    assert f"hkv_tier_disk_corrupt_total {float(disk['corrupt'])}" in metrics


def test_4_another_model_gets_no_hits(disk_dir, builtin_dir, tmp_path):
    from transformers import Qwen3ForCausalLM

    reference = Qwen3ForCausalLM.from_pretrained(ensure_builtin("tiny-dense", builtin_dir),
                                                 dtype=torch.float32).eval()
    server, pids = _serve(["--model", "tiny-dense", *FLAGS, "--disk-cache-dir", str(disk_dir)], tmp_path)
    try:
        result = _complete(server.url, _body(PROMPT_A30, OUT_TOKENS))
        report = inspect_json(server.name)
    finally:
        _stop(server, pids)
    assert _tier_tokens(result) == (0, 0, 0), result["usage"]
    assert result["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert report["tiers"]["disk"]["hit_pages"] == 0
    assert_greedy_parity(reference, PROMPT_A30, result["choices"][0]["token_ids"])


def test_5_kill_9_of_the_cache_worker_mid_write(hybrid_reference, tmp_path):
    disk_dir = tmp_path / "kill"
    server, pids = _serve([*HYBRID_FLAGS, "--disk-cache-dir", str(disk_dir)], tmp_path)
    prompts = _prompts(52, [400] * 12)
    try:
        _complete(server.url, _body(prompts[0], 2))
        # keep the worker writing: requests finish and offload while we wait for the first files
        pending = _complete_all_in_thread(server.url, [_body(p, 2) for p in prompts[1:]])
        deadline = time.monotonic() + 60
        while len(list(disk_dir.rglob("*.hkvp"))) < 24 and time.monotonic() < deadline:
            time.sleep(0.005)
        os.kill(_actor_pid(server, "hkv.actors.cache_worker"), signal.SIGKILL)
        code = server.proc.wait(timeout=30)
    finally:
        if server.proc.poll() is None:
            server.stop(signal.SIGKILL)
    pending.join(60)
    assert code == 1
    assert_clean(server, pids, timeout=10)
    last = server.log().strip().splitlines()[-1]
    assert "hkv-launch: stopped: cache_worker exited with code -9" in last, last
    leftovers = len(list(disk_dir.rglob("*.tmp")))

    server, pids = _serve([*HYBRID_FLAGS, "--disk-cache-dir", str(disk_dir)], tmp_path)
    try:
        opened = inspect_json(server.name)["tiers"]["disk"]
        results = asyncio.run(_complete_all(server.url, [_body(p, 4) for p in prompts]))
        report = _settled_inspect(server.name, lambda r: r["tiers"]["disk"]["hit_pages"] > 0)["tiers"]["disk"]
    finally:
        _stop(server, pids)
    assert opened["temp_cleaned"] == leftovers  # every partial write was found and deleted, none read
    assert not list(disk_dir.rglob("*.tmp"))
    assert report["corrupt"] == 0 and report["read_failed"] == 0, report
    assert sum(r["usage"]["cache"]["disk"] for r in results) > 0  # whole files written before the kill serve
    for prompt, result in zip(prompts, results):
        assert_greedy_parity(hybrid_reference, prompt, result["choices"][0]["token_ids"])


def _complete_all_in_thread(url: str, bodies: list[dict]):
    import threading

    def run() -> None:
        try:
            asyncio.run(_complete_all(url, bodies))
        except Exception:  # the instance is killed under these requests on purpose
            pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_6_flush_empties_every_tier(tmp_path):
    disk_dir = tmp_path / "flush"
    server, pids = _serve([*HYBRID_FLAGS, "--disk-cache-dir", str(disk_dir)], tmp_path)
    try:
        _complete(server.url, _body(PROMPT_A, 2))
        before = _settled_inspect(server.name, lambda r: r["tiers"]["disk"]["files"] >= 37)
        req = urllib.request.Request(f"{server.url}/cache/flush", b"", method="POST")
        with urllib.request.urlopen(req, timeout=30) as resp:
            flushed = json.loads(resp.read())
        after = _settled_inspect(server.name, lambda r: r["pools"]["cpu_pages"]["cached"] == 0)
    finally:
        _stop(server, pids)
    assert before["pools"]["cpu_pages"]["cached"] >= 37
    assert flushed["cpu_pages"] == before["pools"]["cpu_pages"]["cached"]
    assert flushed["disk_files"] == before["tiers"]["disk"]["files"]
    for pool in ("gpu_pages", "state_slots", "cpu_pages", "cpu_states"):
        assert after["pools"][pool]["in_use"] == 0 and after["pools"][pool]["cached"] == 0, (pool, after["pools"])
    assert after["tiers"]["disk"]["files"] == 0 and not list(disk_dir.rglob("*.hkvp"))


def test_7_pressure_with_tiers_matches_transformers_and_flushes_clean(hybrid_reference, tmp_path):
    """Concurrent shared-prefix requests on a small device pool: preemption, holds, lookups and
    loads interleave; the router checks its books after every step (--log-level debug)."""
    disk_dir = tmp_path / "pressure"
    server, pids = _serve(["--model", "tiny-hybrid-random", "--max-total-tokens", "1024", "--max-running-requests", "8",
                           "--cpu-cache-gb", "0.05",
                           "--disk-cache-dir", str(disk_dir), "--log-level", "debug"], tmp_path)
    rng = random.Random(53)
    shared = _prompts(54, [300, 200])
    prompts = [shared[i % 2] + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(20, 120))] for i in range(16)]
    prompts += _prompts(55, [rng.randrange(50, 400) for _ in range(8)])
    rng.shuffle(prompts)
    try:
        first = asyncio.run(_complete_all(server.url, [_body(p, 12) for p in prompts]))
        second = asyncio.run(_complete_all(server.url, [_body(p, 12) for p in prompts]))
        req = urllib.request.Request(f"{server.url}/cache/flush", b"", method="POST")
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert resp.status == 200
        after = _settled_inspect(server.name, lambda r: r["pools"]["cpu_pages"]["cached"] == 0)
    finally:
        _stop(server, pids)
    assert "AssertionError" not in server.log()
    tiers = [sum(r["usage"]["cache"][t] for r in second) for t in ("cpu", "disk")]
    assert sum(tiers) > 0, "the second round should load some prefixes from the tiers"
    for prompt, a, b in zip(prompts, first, second):
        assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
        assert_greedy_parity(hybrid_reference, prompt, b["choices"][0]["token_ids"])
    for name, pool in after["pools"].items():
        assert pool["in_use"] == 0 and pool["total"] == pool["free"] + pool["cached"], (name, pool)
