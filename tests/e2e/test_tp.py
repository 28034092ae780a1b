"""Issue 40: tensor parallelism on the CPU (gloo), two ranks per instance, through real hkv-launch processes.

- qwen3 and qwen3_next (tiny random checkpoints saved by transformers): greedy output equals transformers',
  a repeated prompt hits its prefix and still does, and seeded samples equal a --tp 1 instance's; then a
  kill -9 of rank 1 mid-stream ends the stream with an error event and stops the instance cleanly.
- qwen3_5_text (the trained built-in tiny-hybrid, with its MTP head) with --spec-tokens 2: the CPU tier
  round trip of tests/e2e/test_spec_tiers.py, then the disk tier after a restart, at --tp 2.
- A disk tier folder written at --tp 2 is refused at --tp 1 (exit 2, one line saying what to do), and
  read again at --tp 2 (hkv/cache/disk_marker.py).
(`--tp 3` on a model whose heads it does not divide is in tests/e2e/test_lifecycle.py.)
"""

from __future__ import annotations

import asyncio
import json
import os
import signal

import aiohttp
import pytest

from tests.e2e.harness import assert_clean, launch, shm_segments, spawn
from tests.e2e.test_hybrid import _build, _prompts
from tests.e2e.test_prefix_cache import _body, _complete, _complete_all
from tests.e2e.test_spec_tiers import FLAGS, _check_cpu_round_trip, _serve, folder, prompts, reference  # noqa: F401
from tests.reference import assert_greedy_parity

pytestmark = pytest.mark.e2e
TP = ["--tp", "2"]  # the harness runs --device cpu


def _seeded(prompt: list[int]) -> dict:
    return {"prompt": prompt, "max_tokens": 12, "temperature": 0.9, "top_p": 0.95, "seed": 17,
            "return_token_ids": True, "ignore_eos": True}


def _tokens(results) -> list[list[int]]:
    return [r["choices"][0]["token_ids"] for r in results]


async def _stream_until_killed(url: str, body: dict, victim: int) -> list[dict]:
    """Stream `body`; after the first token kill -9 `victim`; every SSE event until the stream ends."""
    events = []
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/completions", json={**body, "stream": True}) as resp:
            assert resp.status == 200
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                events.append(json.loads(line[5:]))
                if len(events) == 1:
                    os.kill(victim, signal.SIGKILL)
    return events


def _check_greedy_and_hits(server, reference, prompts) -> None:
    """Greedy outputs equal transformers'; the same prompts again hit their prefixes and agree."""
    cold = _tokens(asyncio.run(_complete_all(server.url, [_body(p, 12) for p in prompts])))
    for prompt, out in zip(prompts, cold):
        assert_greedy_parity(reference, prompt, out)
    again = asyncio.run(_complete_all(server.url, [_body(p, 12) for p in prompts]))
    assert _tokens(again) == cold
    assert any(r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for r in again)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_next"])
def test_two_ranks_serve_like_one_and_stop_when_one_dies(kind, qwen3_dir, qwen3_reference, qwen3_server,
                                                         tmp_path, builtin_dir):
    if kind == "qwen3":
        model, reference, single = qwen3_dir, qwen3_reference, qwen3_server
    else:
        from hkv.models.tiny import ensure_builtin

        model = tmp_path / "next"
        reference, single = _build("qwen3_next", model, ensure_builtin("tiny-dense", builtin_dir)), None
    prompts = _prompts(40, [5, 70, 150])
    hybrid = ["--checkpoint-interval", "64"] if kind != "qwen3" else []
    server = launch(["--model", str(model), *TP, "--page-size", "16", *hybrid], tmp_path)
    pids = server.actor_pids()
    try:
        _check_greedy_and_hits(server, reference, prompts)
        if single is not None:  # the same seeded samples as one rank
            seeded = _tokens(asyncio.run(_complete_all(server.url, [_seeded(p) for p in prompts])))
            assert seeded == _tokens(asyncio.run(_complete_all(single.url, [_seeded(p) for p in prompts])))
        events = asyncio.run(_stream_until_killed(server.url, _body(prompts[1], 400), _rank_pid(server, 1)))
        assert "error" in events[-1], events[-3:]
        assert server.proc.wait(60) != 0
    finally:
        if server.proc.poll() is None:
            server.stop(signal.SIGKILL)
    assert_clean(server, pids)
    assert not shm_segments(server.name)


def _rank_pid(server, rank: int) -> int:
    from tests.e2e.harness import cmdline

    for pid in server.actor_pids():
        argv = cmdline(pid)
        if "hkv.actors.rank" in argv and argv[-2:] == ["--rank", str(rank)]:
            return pid
    raise AssertionError(f"no rank {rank} among {server.actor_pids()}")


def test_tiny_hybrid_drafts_through_the_cpu_and_disk_tiers_on_two_ranks(folder, reference, prompts,  # noqa: F811
                                                                        tmp_path):
    prompt, others = prompts
    flags = ["--model", str(folder), *TP, *FLAGS, "--draft-window", "16", "--disk-cache-dir", str(tmp_path / "d")]
    cold, accepted = _check_cpu_round_trip(_serve(flags, tmp_path, [prompt, *others, prompt]), reference, prompt,
                                           others)
    [(disk, usage, disk_accepted)] = _serve(flags, tmp_path, [prompt])
    assert usage["cache"]["disk"] == len(prompt) - 1 and usage["cache"]["gpu"] == 0, usage
    assert disk == cold and disk_accepted == accepted, (accepted, disk_accepted)


def test_a_disk_folder_of_two_ranks_is_refused_at_one_and_read_again_at_two(qwen3_dir, qwen3_reference, tmp_path):
    disk = tmp_path / "disk"
    flags = ["--model", str(qwen3_dir), "--page-size", "16", "--cpu-cache-gb", "0.05", "--disk-cache-gb", "0.05",
             "--disk-cache-dir", str(disk)]
    prompt = _prompts(41, [70])[0]

    def serve_once() -> dict:
        server = launch([*flags, *TP], tmp_path)
        pids = server.actor_pids()
        try:
            result = _complete(server.url, _body(prompt, 8))
        finally:
            assert server.stop(signal.SIGTERM) == 0, server.log()  # drained: the CPU tier's pages go to disk
        assert_clean(server, pids)
        return result

    cold = serve_once()
    assert_greedy_parity(qwen3_reference, prompt, cold["choices"][0]["token_ids"])
    files = sorted(p.relative_to(disk) for p in disk.rglob("*.hkvp"))
    assert files, "the drain wrote no page to the disk tier"

    one = spawn([*flags, "--tp", "1"], tmp_path)
    assert one.proc.wait(120) == 2
    errors = [line for line in one.log().splitlines() if line.startswith("hkv-launch: error:")]
    assert errors == [f"hkv-launch: error: --disk-cache-dir {disk} holds this model's pages written with --tp 2, and "
                      f"this instance runs --tp 1 (its pages would never be read): start with --tp 2, give another "
                      f"--disk-cache-dir, or delete {disk}"], one.log()
    assert not shm_segments(one.name)
    assert sorted(p.relative_to(disk) for p in disk.rglob("*.hkvp")) == files  # the refusal touched no page

    warm = serve_once()
    assert warm["choices"][0]["token_ids"] == cold["choices"][0]["token_ids"]
    assert warm["usage"]["cache"]["disk"] == 64 and warm["usage"]["cache"]["gpu"] == 0, warm["usage"]
