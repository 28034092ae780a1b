"""FP8 KV pages through prefill/decode on one GPU (issue 39 deliverable 4, the device-copy half).

A prefill and a decode instance with --kv-cache-dtype fp8_e4m3 share the GPU: the decode rank copies the
prompt's FP8 pages device to device (CUDA IPC, its log says `peer copy`), nothing comes over the CPU path,
and greedy tokens equal one FP8-KV instance's (the rule a hit never changes the output). A decode instance
with model-dtype pages on the same GPU takes the CPU path instead and refuses the FP8 pages with the line
naming both KV dtypes (tests/e2e/test_pd_fp8.py checks the same on CPU for the pair and CPU-tier paths).
"""

from __future__ import annotations

import asyncio
import random
import re

import pytest
import torch

from tests.e2e.harness import launch
from tests.e2e.test_cuda_launch import checkpoint  # noqa: F401 (fixtures)
from tests.e2e.test_cuda_pd import FLAGS, PAGE, _received_pages
from tests.e2e.test_pd import _launch_all, _post_all, _secret, stop_all
from tests.e2e.test_pd_fp8 import REFUSAL

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.e2e,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
FP8 = ["--kv-cache-dtype", "fp8_e4m3"]
LENGTHS = [70, 333, 700]
OUT = 12


def _body(prompt: list[int]) -> dict:
    return {"prompt": prompt, "max_tokens": OUT, "temperature": 0, "return_token_ids": True, "ignore_eos": True}


@pytest.fixture(scope="module")
def servers(checkpoint, tmp_path_factory, launch_command):  # noqa: F811 (pytest fixtures)
    folder = tmp_path_factory.mktemp("cuda-pd-fp8")
    secret = _secret(folder)
    share = FLAGS.index("--gpu-memory-fraction") + 1
    flags = [*FLAGS[:share], "0.2", *FLAGS[share + 1:]]  # four instances on the GPU
    common = ["--model", str(checkpoint), "--secret-file", str(secret), *flags]
    single, prefill, decode, model_dtype = _launch_all(
        [(["--model", str(checkpoint), *FP8, *flags], None, None), ([*common, *FP8, "--mode", "prefill"], None, None),
         ([*common, *FP8, "--mode", "decode"], None, None), ([*common, "--mode", "decode"], None, None)], folder)
    masters = [launch(["--mode", "pd-master", "--secret-file", str(secret), "--prefill-url", prefill.url,
                       "--decode-url", d.url], folder) for d in (decode, model_dtype)]
    every = [*masters, single, prefill, decode, model_dtype]
    pids = [p for s in every for p in s.actor_pids()]
    yield single, decode, model_dtype, masters
    stop_all(every, pids)


def test_fp8_pages_copied_device_to_device_give_the_single_instance_tokens(servers):
    single, decode, _, (master, _) = servers
    rng = random.Random(39)
    prompts = [[rng.randrange(3, 1536) for _ in range(n)] for n in LENGTHS]
    bodies = [_body(p) for p in prompts]
    want = asyncio.run(_post_all(single.url, bodies))
    got = asyncio.run(_post_all(master.url, bodies))
    for prompt, (s1, a1), (s2, a2) in zip(prompts, want, got):
        assert s1 == 200 and s2 == 200, (a1, a2)
        assert a2["choices"][0]["token_ids"] == a1["choices"][0]["token_ids"], len(prompt)
        assert a2["usage"]["cache"]["peer"] == (len(prompt) - 1) // PAGE * PAGE, a2["usage"]
    copies = re.findall(r"peer copy: (\d+) pages", decode.log())
    assert sorted(int(n) for n in copies) == sorted((n - 1) // PAGE for n in LENGTHS), copies
    assert _received_pages(decode.url) == 0  # nothing came over the CPU-tier path


def test_a_model_dtype_decode_instance_on_the_gpu_refuses_fp8_pages(servers):
    _, _, model_dtype, (_, master) = servers
    prompt = [random.Random(40).randrange(3, 1536) for _ in range(100)]
    ((status, answer),) = asyncio.run(_post_all(master.url, [_body(prompt)]))
    assert status == 502, answer
    assert REFUSAL in answer["error"]["message"], answer
    assert "peer copy" not in model_dtype.log()
