"""Issue 40 on GPUs: --tp 2 over NCCL, the all-reduces and the logits gather inside the captured decode,
short prefill and verify CUDA graphs. Needs two CUDA devices (tools/gpu/gpu_tp.sh runs it on an x2 machine).

fp32 so that greedy output is comparable with transformers: qwen3 and the trained tiny-hybrid (graphs on, the
default), tiny-hybrid again with --spec-tokens 2 (verify graphs with the drafter), each with a repeated prompt
that hits its prefix; then a kill -9 of rank 1 mid-stream stops the instance cleanly.
"""

from __future__ import annotations

import asyncio
import signal

import pytest
import torch

from hkv.models.tiny import builtin_folder
from tests.e2e.harness import assert_clean, launch
from tests.e2e.test_hybrid import _prompts
from tests.e2e.test_prefix_cache import _body
from tests.e2e.test_tp import _check_greedy_and_hits, _rank_pid, _stream_until_killed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.e2e,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]
FLAGS = ["--device", "cuda", "--tp", "2", "--dtype", "float32", "--max-total-tokens", "16384",
         "--max-running-requests", "16", "--page-size", "16"]


@pytest.mark.parametrize("kind, extra", [("qwen3", []), ("tiny-hybrid", []), ("tiny-hybrid", ["--spec-tokens", "2"])])
def test_two_gpus_serve_like_transformers_through_graphs(kind, extra, qwen3_dir, qwen3_reference, builtin_dir,
                                                         tmp_path):
    if kind == "qwen3":
        model, reference = qwen3_dir, qwen3_reference
    else:
        from transformers import Qwen3_5ForCausalLM

        model = builtin_folder("tiny-hybrid", builtin_dir)
        reference = Qwen3_5ForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    server = launch(["--model", str(model), *FLAGS, *extra], tmp_path)
    pids = server.actor_pids()
    try:
        _check_greedy_and_hits(server, reference, _prompts(41, [5, 70, 150, 333]))
        if extra:  # once per model is enough: rank 1 dies mid-stream
            events = asyncio.run(_stream_until_killed(server.url, _body([5] * 40, 600), _rank_pid(server, 1)))
            assert "error" in events[-1], events[-3:]
            assert server.proc.wait(60) != 0
    finally:
        if server.proc.poll() is None:
            assert server.stop(signal.SIGTERM) == 0, server.log()
    assert_clean(server, pids)
