"""Issue 5 on CUDA: the tier copies on a GPU rank (Triton copy_blocks to and from the
cudaHostRegister'ed shm pool) serve a pushed-out prefix from the CPU tier, then from
disk after a restart, and the output stays transformers' (GPU only)."""

from __future__ import annotations

import signal

import pytest
import torch

from hkv.models.tiny import ensure_builtin
from tests.e2e.harness import assert_clean, launch
from tests.e2e.test_prefix_cache import _body, _complete
from tests.e2e.test_tiers import OTHERS, PROMPT_A, PROMPT_A30
from tests.models.torch_reference import reference_logits
from tests.reference import MARGIN

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.e2e,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
FLAGS = ["--model", "tiny-hybrid-random", "--device", "cuda", "--dtype", "float32", "--max-total-tokens", "2048",
         "--cpu-cache-gb", "0.05"]
OUT_TOKENS = 8


def _greedy_gaps(folder, prompt: list[int], output: list[int], work_dir) -> list[tuple[int, float]]:
    """(position, logit gap) where transformers' fp32 argmax beats the served token by MARGIN or more."""
    (logits,) = reference_logits(folder, "float32", [prompt + output[:-1]], work_dir)
    ref = logits[len(prompt) - 1 :]
    chosen = ref[torch.arange(len(output)), torch.tensor(output)]
    gaps = ref.max(dim=-1).values - chosen
    return [(i, float(g)) for i, g in enumerate(gaps) if g >= MARGIN]


def test_cuda_rank_loads_the_cpu_tier_then_disk(tmp_path, builtin_dir, launch_command):  # noqa: F811
    folder = ensure_builtin("tiny-hybrid-random", builtin_dir)
    disk_dir = tmp_path / "disk"
    server = launch([*FLAGS, "--disk-cache-dir", str(disk_dir)], tmp_path)
    pids = server.actor_pids()
    try:
        cold = _complete(server.url, _body(PROMPT_A, OUT_TOKENS))
        for prompt in OTHERS:
            _complete(server.url, _body(prompt, OUT_TOKENS))
        from_cpu = _complete(server.url, _body(PROMPT_A30, OUT_TOKENS))
    finally:
        assert server.stop(signal.SIGTERM) == 0, server.log()
    assert_clean(server, pids)
    server = launch([*FLAGS, "--disk-cache-dir", str(disk_dir)], tmp_path)
    pids = server.actor_pids()
    try:
        from_disk = _complete(server.url, _body(PROMPT_A30, OUT_TOKENS))
    finally:
        assert server.stop(signal.SIGTERM) == 0, server.log()
    assert_clean(server, pids)
    cpu_cache, disk_cache = from_cpu["usage"]["cache"], from_disk["usage"]["cache"]
    print(f"CUDA tiers: first run {cpu_cache}, after a restart {disk_cache}")
    assert cpu_cache["cpu"] + cpu_cache["disk"] >= 512, cpu_cache
    assert disk_cache["disk"] >= 512 and disk_cache["gpu"] == 0, disk_cache
    tokens = from_cpu["choices"][0]["token_ids"]
    assert tokens == from_disk["choices"][0]["token_ids"]
    assert not _greedy_gaps(folder, PROMPT_A, cold["choices"][0]["token_ids"], tmp_path)
    assert not _greedy_gaps(folder, PROMPT_A30, tokens, tmp_path)
