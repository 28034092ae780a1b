"""Issue 15 on one GPU: prefill and decode instances sharing it move a prompt device to device (CUDA IPC).

A prefill, a decode and a pd-master instance (real hkv-launch processes) of
an fp32 tiny Qwen3.5 on the GPU: five concurrent greedy requests of 9 to 700
tokens through the master are transformers' fp32 greedy choices
(teacher-forced, margin-aware, as tests/e2e/test_cuda_launch.py), every page
inside prompt[:-1] is served as `peer`, the decode rank logs its peer copies
and its transporter pulled nothing over the CPU path; a second turn copies
only the pages the decode device lacks.
"""

from __future__ import annotations

import re
import urllib.request

import pytest
import torch

from tests.e2e.harness import launch
from tests.e2e.test_cuda_launch import _serve, _teacher_forced, checkpoint  # noqa: F401 (fixtures)
from tests.e2e.test_pd import _launch_all, _secret, stop_all
from tests.reference import MARGIN

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.e2e,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
PAGE = 16
OUT = 12
PROMPT_LENS = [9, 64, 150, 333, 700]
FLAGS = ["--device", "cuda", "--dtype", "float32", "--chunked-prefill-size", "256", "--max-total-tokens", "16384",
         "--max-running-requests", "16", "--cpu-cache-gb", "0.05", "--pd-timeout", "10", "--gpu-memory-fraction", "0.3",
         "--state-slots", "64"]


@pytest.fixture(scope="module")
def pd(checkpoint, tmp_path_factory, launch_command):  # noqa: F811 (pytest fixtures)
    folder = tmp_path_factory.mktemp("cuda-pd")
    secret = _secret(folder)
    common = ["--model", str(checkpoint), "--secret-file", str(secret), *FLAGS]
    prefill, decode = _launch_all([([*common, "--mode", "prefill"], None, None),
                                   ([*common, "--mode", "decode"], None, None)], folder)
    master = launch(["--mode", "pd-master", "--secret-file", str(secret), "--prefill-url", prefill.url,
                     "--decode-url", decode.url], folder)
    servers = [master, prefill, decode]
    pids = [p for s in servers for p in s.actor_pids()]
    yield prefill, decode, master
    stop_all(servers, pids)


def _received_pages(url: str) -> float:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    m = re.search(r'^hkv_pd_pages_total\{direction="received"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def _assert_transformers(checkpoint, prompts, outputs, work_dir) -> None:  # noqa: F811
    reference = _teacher_forced(checkpoint, "float32", prompts, outputs, work_dir)
    for prompt, output, ref in zip(prompts, outputs, reference):
        chosen = ref[torch.arange(len(output)), torch.tensor(output)]
        gaps = ref.max(dim=-1).values - chosen
        bad = [(i, output[i], int(ref[i].argmax()), float(gaps[i])) for i in range(len(output)) if gaps[i] >= MARGIN]
        assert not bad, f"prompt of {len(prompt)}: diverges from transformers at (pos, got, want, gap) {bad[:3]}"


def test_prompts_move_device_to_device_and_output_equals_transformers(pd, checkpoint, tmp_path):  # noqa: F811
    import random

    prefill, decode, master = pd
    rng = random.Random(41)
    prompts = [[rng.randrange(3, 1536) for _ in range(n)] for n in PROMPT_LENS]
    choices = _serve(master.url, prompts, OUT, None)
    outputs = [c["token_ids"] for c in choices]
    assert all(len(o) == OUT for o in outputs)
    _assert_transformers(checkpoint, prompts, outputs, tmp_path)
    copies = re.findall(r"peer copy: (\d+) pages", decode.log())
    assert sorted(int(n) for n in copies) == sorted((n - 1) // PAGE for n in PROMPT_LENS if n > PAGE + 1), copies
    assert _received_pages(decode.url) == 0  # nothing came over the CPU-tier path
    # a second turn: the decode device holds the first, the copy brings only the new pages
    first = prompts[3] + outputs[3] + [rng.randrange(3, 1536) for _ in range(80)]
    (two,) = _serve(master.url, [first], OUT, None)
    _assert_transformers(checkpoint, [first], [two["token_ids"]], tmp_path)
    last = int(re.findall(r"peer copy: (\d+) pages", decode.log())[-1])
    assert 0 < last <= (len(first) - 1) // PAGE - (333 + OUT) // PAGE + 1, last
