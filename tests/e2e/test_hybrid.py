"""Issue 4, acceptance 1-4: hybrid models served end to end with checkpointed prefix hits.

Tiny random Qwen3.5 and Qwen3-Next checkpoints are built and saved by
transformers here; every greedy output is checked against them (teacher-forced,
margin-aware), cache hits against a --no-prefix-cache run.
"""

from __future__ import annotations

import asyncio
import random
import signal

import pytest
import torch

from tests.e2e.harness import assert_clean, launch
from tests.e2e.test_prefix_cache import _body, _complete, _complete_all, inspect_json
from tests.models.test_qwen3_5 import perturb
from tests.reference import assert_greedy_parity, copy_tokenizer

pytestmark = pytest.mark.e2e
VOCAB = 1536
HYBRID = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
    linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, initializer_range=0.08,
    max_position_embeddings=2048, eos_token_id=2, tie_word_embeddings=False,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
)
ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
CACHE_FLAGS = ["--page-size", "16", "--checkpoint-interval", "64"]


def _build(kind: str, folder, tiny_dir):
    import transformers as tf

    if kind == "qwen3_5":
        config = tf.Qwen3_5TextConfig(**HYBRID, rope_parameters={**ROPE, "mrope_section": [2, 1, 1],
                                                                  "mrope_interleaved": True})
        cls = tf.Qwen3_5ForCausalLM
    else:
        config = tf.Qwen3NextConfig(**HYBRID, rope_parameters=ROPE, num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=32, shared_expert_intermediate_size=48)
        cls = tf.Qwen3NextForCausalLM
    torch.manual_seed(5)
    model = cls(config).eval()
    perturb(model, 5)
    model.save_pretrained(folder)
    copy_tokenizer(tiny_dir, folder)
    return cls.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tiny_dir(builtin_dir):
    from hkv.models.tiny import ensure_builtin

    return ensure_builtin("tiny-dense", builtin_dir)


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory, tiny_dir):
    folder = tmp_path_factory.mktemp("qwen3_5")
    return folder, _build("qwen3_5", folder, tiny_dir)


@pytest.fixture(scope="module")
def qwen3_5_server(qwen3_5, tmp_path_factory):
    server = launch(["--model", str(qwen3_5[0]), *CACHE_FLAGS], tmp_path_factory.mktemp("log"))
    pids = server.actor_pids()
    yield server
    assert server.stop(signal.SIGTERM) == 0, server.log()
    assert_clean(server, pids)


def _prompts(seed, lengths):
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


def _check_parity(reference, prompts, results):
    for prompt, result in zip(prompts, results):
        assert_greedy_parity(reference, prompt, result["choices"][0]["token_ids"])


def test_qwen3_5_six_concurrent_requests_match_transformers(qwen3_5, qwen3_5_server):
    prompts = _prompts(11, [5, 64, 150, 333, 512, 700])
    results = asyncio.run(_complete_all(qwen3_5_server.url, [_body(p, 12) for p in prompts]))
    _check_parity(qwen3_5[1], prompts, results)


def test_qwen3_next_six_concurrent_requests_match_transformers(tmp_path, tiny_dir):
    reference = _build("qwen3_next", tmp_path / "next", tiny_dir)
    server = launch(["--model", str(tmp_path / "next"), *CACHE_FLAGS], tmp_path)
    pids = server.actor_pids()
    try:
        prompts = _prompts(12, [5, 64, 150, 333, 512, 700])
        results = asyncio.run(_complete_all(server.url, [_body(p, 12) for p in prompts]))
    finally:
        assert server.stop(signal.SIGTERM) == 0, server.log()
    assert_clean(server, pids)
    _check_parity(reference, prompts, results)


def test_checkpointed_prefix_hits(qwen3_5, qwen3_5_server):
    reference, url = qwen3_5[1], qwen3_5_server.url
    (prompt,) = _prompts(13, [600])
    first = _complete(url, _body(prompt, 40))
    answer = first["choices"][0]["token_ids"]
    assert len(answer) == 40
    cases = {
        "a: the same prompt + 40 tokens": (prompt + _prompts(14, [40])[0], 576),
        "b: its first 300 tokens + 50 new": (prompt[:300] + _prompts(15, [50])[0], 256),
        "c: prompt + first answer + 50 new": (prompt + answer + _prompts(16, [50])[0], 608),
    }
    for name, (ids, at_least) in cases.items():
        result = _complete(url, _body(ids, 12))
        cached = result["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= at_least, f"{name}: cached {cached} < {at_least}"
        assert cached % 16 == 0 and cached < len(ids)
        assert_greedy_parity(reference, ids, result["choices"][0]["token_ids"])
    report = inspect_json(qwen3_5_server.name)
    assert report["pools"]["state_slots"]["cached"] == report["radix"]["checkpoints"] > 0
    depths = {node["tokens"] for node in report["radix"]["checkpoint_nodes"]}
    assert {64, 128, 256, 576, 592} <= depths  # interval boundaries and the prompt's last page boundary
    assert len(report["radix"]["checkpoint_nodes"]) == report["radix"]["checkpoints"]


def test_hits_equal_a_run_without_prefix_cache(qwen3_5, qwen3_5_server, tmp_path):
    base = _prompts(17, [200])[0]
    prompts = [base + tail for tail in _prompts(18, [30, 70, 5])] + _prompts(19, [90, 260])
    _complete(qwen3_5_server.url, _body(base, 4))  # warm the cache with the shared part
    with_cache = asyncio.run(_complete_all(qwen3_5_server.url, [_body(p, 16) for p in prompts]))
    assert sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in with_cache) >= 3 * 192
    cold = launch(["--model", str(qwen3_5[0]), *CACHE_FLAGS, "--no-prefix-cache"], tmp_path)
    pids = cold.actor_pids()
    try:
        without = asyncio.run(_complete_all(cold.url, [_body(p, 16) for p in prompts]))
    finally:
        assert cold.stop(signal.SIGTERM) == 0, cold.log()
    assert_clean(cold, pids)
    assert all(r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 for r in without)
    assert [r["choices"][0]["token_ids"] for r in with_cache] == [r["choices"][0]["token_ids"] for r in without]


def test_pressure_then_flush_leaves_nothing_in_use(qwen3_5, tmp_path):
    server = launch(["--model", str(qwen3_5[0]), *CACHE_FLAGS, "--max-total-tokens", "1024",
                     "--max-running-requests", "8", "--state-slots", "16"], tmp_path)
    pids = server.actor_pids()
    rng = random.Random(20)
    shared = [rng.randrange(3, VOCAB) for _ in range(128)]
    prompts = [shared + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(8, 64))] for _ in range(12)]
    prompts += _prompts(21, [rng.randrange(40, 200) for _ in range(12)])
    rng.shuffle(prompts)
    try:
        results = asyncio.run(_complete_all(server.url, [_body(p, 24) for p in prompts]))
        _check_parity(qwen3_5[1], prompts, results)
        assert sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in results) > 0
        status = asyncio.run(_post_flush(server.url))
        assert status == 200
        after = inspect_json(server.name)
        for name, pool in after["pools"].items():
            assert pool["in_use"] == 0, (name, pool)
            assert pool["total"] == pool["free"] + pool["cached"] + pool["in_use"], (name, pool)
        assert after["pools"]["state_slots"]["total"] == 16
    finally:
        assert server.stop(signal.SIGTERM) == 0, server.log()
    assert_clean(server, pids)


async def _post_flush(url):
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/cache/flush") as resp:
            return resp.status
