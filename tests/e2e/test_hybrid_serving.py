"""The built-in hybrids (Gated DeltaNet + gated attention) served end to end equal
transformers' Qwen3_5ForCausalLM on the same checkpoint (greedy, margin-aware): the
default, trained tiny-hybrid and the random tiny-hybrid-random; a long decode
leaves its checkpoints sparse; and a burst of requests for one prefix prefills it once."""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import urllib.request

import aiohttp
import pytest
import torch

from hkv.models.tiny import builtin_folder
from tests.e2e.harness import assert_clean, launch
from tests.e2e.test_prefix_cache import _body, _complete, inspect_json
from tests.reference import assert_greedy_parity

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("model", [None, "tiny-hybrid-random"])
def test_tiny_hybrid_concurrent_greedy_matches_transformers(tmp_path, builtin_dir, model):
    from transformers import Qwen3_5ForCausalLM

    folder = builtin_folder(model or "tiny-hybrid", builtin_dir)
    reference = Qwen3_5ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    # None: no --model flag, so the default (the trained tiny-hybrid) is served
    server = launch(["--chunked-prefill-size", "96", *(["--model", model] if model else [])], tmp_path)
    pids = server.actor_pids()
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 1536) for _ in range(n)] for n in (5, 80, 250)]

    async def run():
        async with aiohttp.ClientSession() as session:
            async def one(prompt):
                body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "return_token_ids": True,
                        "ignore_eos": True}
                async with session.post(server.url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    return (await resp.json())["choices"][0]["token_ids"]
            return await asyncio.gather(*(one(p) for p in prompts))

    try:
        outputs = asyncio.run(run())
    finally:
        assert server.stop(signal.SIGTERM) == 0, server.log()
    assert_clean(server, pids)
    for prompt, output in zip(prompts, outputs):
        assert len(output) == 16
        assert_greedy_parity(reference, prompt, output)


def test_a_long_decode_leaves_one_checkpoint_besides_the_prompts(tmp_path):
    """Issue 10, acceptance 2: decoding keeps one rolling checkpoint, not one per page.

        tokens  [0 ..... 32)[32 .. 36)[36 ...................... 224)[224 .. 236)
                 prompt ckpt            decode: the rolling one moves     finish: left at 224

    (Before: 13 checkpoints, one at every page boundary from 32 to 224.)
    """
    page, interval = 16, 256  # interval: the default, 16 pages
    server = launch(["--model", "tiny-hybrid-random", "--page-size", str(page)], tmp_path)
    pids = server.actor_pids()
    rng = random.Random(2)
    prompt = [rng.randrange(3, 1536) for _ in range(36)]
    try:
        answer = _complete(server.url, _body(prompt, 200))["choices"][0]["token_ids"]
        report = inspect_json(server.name)
        turn = _complete(server.url, _body(prompt + answer + [5, 6, 7], 4))
    finally:
        assert server.stop(signal.SIGTERM) == 0, server.log()
    assert_clean(server, pids)
    computed = len(prompt) + len(answer) - 1  # the last sampled token never ran
    depths = sorted(node["tokens"] for node in report["radix"]["checkpoint_nodes"])
    assert report["radix"]["checkpoints"] == len(depths) <= computed // interval + 2
    assert depths == [32, computed // page * page]  # the prompt's last page boundary and the finish's
    # the next turn hits the finish's checkpoint: multi-turn reuse is unchanged
    assert turn["usage"]["prompt_tokens_details"]["cached_tokens"] == computed // page * page


def test_a_burst_for_one_prefix_prefills_it_once(tmp_path, builtin_dir):
    """Four requests of one 512-token prefix reach the router in the same step (its rank stopped
    meanwhile), with a budget that would admit them all: one prefills the prefix, the other three
    wait a step and start from its checkpoint at 512, and every output equals transformers'."""
    from transformers import Qwen3_5ForCausalLM

    reference = Qwen3_5ForCausalLM.from_pretrained(builtin_folder("tiny-hybrid", builtin_dir),
                                                   dtype=torch.float32).eval()
    server = launch(["--chunked-prefill-size", "4096"], tmp_path)
    pids = server.actor_pids()
    rank = server.actor_pid("hkv.actors.rank")
    rng = random.Random(7)
    shared = [rng.randrange(3, 1536) for _ in range(512)]
    prompts = [shared + [rng.randrange(3, 1536) for _ in range(16)] for _ in range(4)]

    async def run():
        async with aiohttp.ClientSession() as session:
            async def one(body):
                async with session.post(server.url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    return await resp.json()
            # a decoding request keeps steps in flight; while the rank is stopped the burst queues up
            blocker = asyncio.ensure_future(one(_body([5, 6, 7], max_tokens=400)))
            await asyncio.sleep(0.3)
            os.kill(rank, signal.SIGSTOP)
            try:
                burst = [asyncio.ensure_future(one(_body(p, max_tokens=8))) for p in prompts]
                await asyncio.sleep(1.0)  # well under --stall-timeout (10 s)
            finally:
                os.kill(rank, signal.SIGCONT)
            return await asyncio.gather(*burst), await blocker

    try:
        answers, blocker = asyncio.run(run())
        metrics = urllib.request.urlopen(server.url + "/metrics").read().decode()
    finally:
        assert server.stop(signal.SIGTERM) == 0, server.log()
    assert_clean(server, pids)
    assert len(blocker["choices"][0]["token_ids"]) == 400
    cached = sorted(a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers)
    assert cached == [0, 512, 512, 512]
    assert re.search(r"^hkv_engine_prefix_waits_total 3\.0$", metrics, re.M), \
        [line for line in metrics.splitlines() if "prefix_waits" in line]
    for prompt, answer in zip(prompts, answers):
        assert_greedy_parity(reference, prompt, answer["choices"][0]["token_ids"])
