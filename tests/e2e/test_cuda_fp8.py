"""Issue 39 (FP8 weights) on the device (GPU only): hkv-launch serves block-FP8 checkpoints through the Triton
FP8 kernels (fused FP8 projections, FP8 experts, CUDA graphs) in fp32, and every greedy token is what
transformers in fp32 chooses over the same weights dequantized (tools/fp8_checkpoint.write_dequantized_copy),
teacher-forced and margin-aware.

- `small`: the benchmark model's layer layout shrunk (hidden 256), every projection out dim a multiple of
  128 so the FP8 parts fuse; 32 tokens;
- `moe` (acceptance 4): the MoE benchmark model, Qwen3-Next-80B-A3B's layer shapes, 4 layers (7.21 B
  parameters, 7.6 GB in FP8; the fp32 reference 29 GB on disk and on the GPU), 32 tokens. HKV_FP8_MOE_MODEL
  names an FP8 MoE benchmark model already written (tools/gpu/gpu_fp8.sh passes it).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
from pathlib import Path

import aiohttp
import pytest
import torch

from tests.e2e.harness import assert_clean, launch
from tests.reference import MARGIN
from tools.bench.make_bench_model import main as make_bench_model
from tools.fp8_checkpoint import write_dequantized_copy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.e2e,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
NEW_TOKENS = 32
SMALL = ["--layers", "4", "--hidden-size", "256", "--intermediate-size", "512", "--vocab-size", "2048"]


def _fp8_model(kind: str, root: Path) -> Path:
    given = os.environ.get("HKV_FP8_MOE_MODEL")
    if kind == "moe" and given:
        return Path(given)
    flags = ["--moe"] if kind == "moe" else SMALL
    assert make_bench_model([str(root / "fp8"), *flags, "--fp8", "--no-progress"]) == 0
    return root / "fp8"


async def _greedy(url: str, prompts: list[list[int]]) -> list[list[int]]:
    async with aiohttp.ClientSession() as session:
        async def one(prompt):
            body = {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "return_token_ids": True,
                    "ignore_eos": True}
            async with session.post(f"{url}/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                return (await resp.json())["choices"][0]["token_ids"]
        return await asyncio.gather(*(one(p) for p in prompts))


@pytest.mark.parametrize("kind", ["small", "moe"])
def test_fp8_model_serves_the_dequantized_fp32_reference(kind, tmp_path):
    from transformers import AutoModelForCausalLM

    fp8_dir = _fp8_model(kind, tmp_path)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 1536) for _ in range(n)] for n in (9, 200, 517)]
    server = launch(["--model", str(fp8_dir), "--device", "cuda", "--dtype", "float32", "--max-total-tokens", "8192",
                     "--max-running-requests", "8"], tmp_path)
    pids = server.actor_pids()
    try:
        outputs = asyncio.run(_greedy(server.url, prompts))
        assert "FP8 block-quantized" in server.log()
    finally:
        assert server.stop(signal.SIGTERM) == 0, server.log()
    assert_clean(server, pids)
    torch.cuda.empty_cache()
    write_dequantized_copy(fp8_dir, tmp_path / "dequantized")
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "dequantized", dtype=torch.float32).to("cuda").eval()
    for prompt, output in zip(prompts, outputs):
        assert len(output) == NEW_TOKENS
        with torch.inference_mode():
            logits = ref(input_ids=torch.tensor([prompt + output[:-1]], device="cuda")).logits[0, len(prompt) - 1:]
        for i, token in enumerate(output):
            best = int(logits[i].argmax())
            gap = float(logits[i, best] - logits[i, token])
            assert best == token or gap < MARGIN, f"prompt {len(prompt)}: token {i} {token} != {best} (gap {gap:.2e})"
