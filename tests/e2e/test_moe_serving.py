"""MoE acceptance: parity on CPU through the fused path, with prefix hits, the CPU tier and --spec-tokens 2.

Tiny random Qwen3-Next and Qwen3.5-MoE checkpoints (8 experts, top-2, a shared expert; linear and full
attention layers) are built by transformers here, with random MTP weights whose layer is an MoE block
too. The qwen3_next one keeps the per-expert names transformers saves (`experts.{e}.*_proj.weight`);
the qwen3_5_moe one is rewritten to transformers 5's fused expert tensors (`experts.gate_up_proj`,
`experts.down_proj`), model layers and MTP layer alike. One server per checkpoint, with a small device
pool and a CPU tier, runs concurrent prompts of mixed lengths, a prompt sharing a long prefix with one
of them (a device hit), prompts that push that one off the device, and that one again (a CPU-tier hit).
Every greedy output equals the in-memory transformers model's (teacher-forced, margin-aware), drafts
are verified, and the server stops cleanly.
"""

from __future__ import annotations

import asyncio
import random
import signal

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.e2e.harness import assert_clean, launch
from tests.e2e.test_hybrid import CACHE_FLAGS, HYBRID, ROPE, VOCAB
from tests.e2e.test_prefix_cache import _body, _complete, _complete_all
from tests.e2e.test_spec_decoding import _metric, add_mtp_weights
from tests.models.test_qwen3_5 import build_hf
from tests.reference import assert_greedy_parity, copy_tokenizer

pytestmark = pytest.mark.e2e
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
OUT_TOKENS = 12
# 40 pages of 16: the first round fits, the pushing prompts overrun it and A's pages leave the device
FLAGS = ["--spec-tokens", "2", *CACHE_FLAGS, "--max-total-tokens", "640", "--cpu-cache-gb", "0.05"]


def _fuse_experts(folder) -> None:
    """Rewrite model.safetensors with every layer's experts (MTP layer included) as transformers 5 holds
    them: experts.gate_up_proj [E, 2I, H] (gate rows, then up rows) and experts.down_proj [E, H, I]."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    out = {k: v for k, v in tensors.items() if ".experts." not in k}
    for block in {k.split(".experts.")[0] for k in tensors if ".experts." in k}:
        get = (lambda e, p: tensors.pop(f"{block}.experts.{e}.{p}_proj.weight"))
        num = MOE["num_experts"]
        out[f"{block}.experts.gate_up_proj"] = torch.stack([torch.cat([get(e, "gate"), get(e, "up")])
                                                            for e in range(num)])
        out[f"{block}.experts.down_proj"] = torch.stack([get(e, "down") for e in range(num)])
    leftover = [k for k in tensors if ".experts." in k]
    assert not leftover, leftover
    save_file(out, path, metadata={"format": "pt"})


def _build(kind: str, folder, tiny_dir):
    """A saved checkpoint with MTP weights in `folder`; returns the transformers model (fp32, eval)."""
    import transformers as tf

    if kind == "qwen3_next":
        config = tf.Qwen3NextConfig(**HYBRID, **MOE, rope_parameters=ROPE)
        reference = build_hf(tf.Qwen3NextForCausalLM, config, folder, seed=6)
    else:
        text = {k: v for k, v in HYBRID.items() if k != "intermediate_size"}
        config = tf.Qwen3_5MoeTextConfig(**text, **MOE, rope_parameters={
            **ROPE, "mrope_section": [2, 1, 1], "mrope_interleaved": True})
        reference = build_hf(tf.Qwen3_5MoeForCausalLM, config, folder, seed=7)
    copy_tokenizer(tiny_dir, folder)
    add_mtp_weights(folder, 8)  # layer 1's tensors, its per-expert ones included, as mtp.layers.0.*
    if kind == "qwen3_5_moe":
        _fuse_experts(folder)
    _check_mtp_experts(folder, fused=kind == "qwen3_5_moe")
    return reference.float().eval()


def _check_mtp_experts(folder, fused: bool) -> None:
    """The checkpoint holds its layout in the model and MTP layers, and hkv stacks the MTP layer's experts
    from it (drafts are rejected whatever the drafter computes, so parity alone would not show this)."""
    from hkv.models.loader import load_model

    tensors = load_file(folder / "model.safetensors")
    for block in ("model.layers.0.mlp", "mtp.layers.0.mlp"):
        assert (f"{block}.experts.gate_up_proj" in tensors) == fused
        assert (f"{block}.experts.7.up_proj.weight" in tensors) != fused
    stacked = load_model(folder, "float32", "cpu", mtp=True).model.mtp.layer.mlp.experts.gate_up_proj
    block = "mtp.layers.0.mlp.experts"
    want = tensors[f"{block}.gate_up_proj"][7] if fused else torch.cat(
        [tensors[f"{block}.7.gate_proj.weight"], tensors[f"{block}.7.up_proj.weight"]])
    assert torch.equal(stacked[7], want)


@pytest.fixture(scope="module")
def tiny_dir(builtin_dir):
    from hkv.models.tiny import ensure_builtin

    return ensure_builtin("tiny-dense", builtin_dir)


def _prompts(seed, lengths):
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


def _run(url, prompts, concurrent=True):
    bodies = [_body(p, OUT_TOKENS) for p in prompts]
    if concurrent:
        return asyncio.run(_complete_all(url, bodies))
    return [_complete(url, b) for b in bodies]


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5_moe"])
def test_moe_checkpoint_serves_like_transformers(kind, tmp_path, tiny_dir):
    folder = tmp_path / kind
    reference = _build(kind, folder, tiny_dir)
    first = _prompts(30, [5, 40, 161, 230])  # concurrent, mixed lengths; A = first[2] (161 tokens)
    prompt_a = first[2]
    shared = [prompt_a[:150] + _prompts(31, [20])[0]]  # A's checkpoint at 128 is on the device
    pushers = _prompts(32, [200, 200, 200, 200])  # 4 x 14 pages through a 40-page pool, one at a time
    server = launch(["--model", str(folder), *FLAGS], tmp_path)
    pids = server.actor_pids()
    try:
        results = _run(server.url, first)
        results += _run(server.url, shared)
        results += _run(server.url, pushers, concurrent=False)
        results += _run(server.url, [prompt_a])
        verified = _metric(server.url, "hkv_spec_draft_tokens_total")
        accepted = _metric(server.url, "hkv_spec_accepted_tokens_total")
    finally:
        assert server.stop(signal.SIGTERM) == 0, server.log()
    assert_clean(server, pids)
    prompts = [*first, *shared, *pushers, prompt_a]
    usages = [r["usage"] for r in results]
    for prompt, result in zip(prompts, results):
        tokens = result["choices"][0]["token_ids"]
        assert len(tokens) == OUT_TOKENS
        assert_greedy_parity(reference, prompt, tokens)
    assert all(u["prompt_tokens_details"]["cached_tokens"] == 0 for u in usages[:4])
    device_hit, cpu_hit = usages[4], usages[-1]
    assert device_hit["cache"] == {"gpu": 128, "cpu": 0, "disk": 0, "peer": 0}, device_hit
    assert device_hit["prompt_tokens_details"]["cached_tokens"] == 128
    # all of A's pages left the device; its checkpoint at 160 (its last page boundary) comes back from the CPU
    assert cpu_hit["cache"] == {"gpu": 0, "cpu": 160, "disk": 0, "peer": 0}, cpu_hit
    assert cpu_hit["prompt_tokens_details"]["cached_tokens"] == 160
    assert results[-1]["choices"][0]["token_ids"] == results[2]["choices"][0]["token_ids"]
    assert 0 <= accepted <= verified and verified > 0
