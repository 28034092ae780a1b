"""Issue 39 (FP8 weights), acceptance 1 through real processes: hkv-launch serves a tiny qwen3 checkpoint in
the published block-FP8 layout, and the float checkpoint with --quantize fp8, with greedy output equal to
transformers' over the same weights dequantized; an unsupported quant_method exits 2 with one line."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import signal

import aiohttp
import pytest
import torch

from tests.e2e.harness import assert_clean, launch, spawn
from tests.reference import assert_greedy_parity
from tools.fp8_checkpoint import write_dequantized_copy, write_fp8_copy

pytestmark = pytest.mark.e2e
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def fp8_dirs(qwen3_dir, tmp_path_factory):
    """(the FP8 twin of the e2e qwen3 folder, transformers over its weights dequantized to fp32)."""
    from transformers import Qwen3ForCausalLM

    root = tmp_path_factory.mktemp("fp8")
    write_fp8_copy(qwen3_dir, root / "fp8")
    write_dequantized_copy(root / "fp8", root / "dequantized")
    return root / "fp8", Qwen3ForCausalLM.from_pretrained(root / "dequantized", dtype=torch.float32).eval()


async def _complete_all(url: str, prompts: list[list[int]]) -> list[list[int]]:
    outputs = []
    async with aiohttp.ClientSession() as session:
        for prompt in prompts:
            body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True,
                    "ignore_eos": True}
            async with session.post(f"{url}/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                outputs.append((await resp.json())["choices"][0]["token_ids"])
    return outputs


def _serve_greedy(args: list[str], tmp_path, prompts: list[list[int]]) -> list[list[int]]:
    server = launch(args, tmp_path)
    pids = server.actor_pids()
    try:
        outputs = asyncio.run(_complete_all(server.url, prompts))
        assert "FP8 block-quantized" in server.log()  # the sizing line: weight bytes by dtype
    finally:
        assert server.stop(signal.SIGTERM) == 0, server.log()
    assert_clean(server, pids)
    return outputs


def test_fp8_checkpoint_and_quantize_serve_the_dequantized_reference(qwen3_dir, fp8_dirs, tmp_path):
    fp8_dir, reference = fp8_dirs
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 1536) for _ in range(n)] for n in (7, 150)]
    served = _serve_greedy(["--model", str(fp8_dir)], tmp_path, prompts)
    for prompt, output in zip(prompts, served):
        assert len(output) == MAX_TOKENS
        assert_greedy_parity(reference, prompt, output)
    quantized = _serve_greedy(["--model", str(qwen3_dir), "--quantize", "fp8"], tmp_path, prompts)
    assert quantized == served  # the same FP8 bytes, the same tokens


def test_unsupported_quant_method_exits_2_naming_it(fp8_dirs, tmp_path):
    folder = shutil.copytree(fp8_dirs[0], tmp_path / "gptq")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (folder / "config.json").write_text(json.dumps(config))
    server = spawn(["--model", str(folder)], tmp_path)
    assert server.proc.wait(60) == 2
    lines = [line for line in server.log().splitlines() if line.strip()]
    assert len(lines) == 1 and "quant_method 'gptq' is not supported" in lines[0], lines
