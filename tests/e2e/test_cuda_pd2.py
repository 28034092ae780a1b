"""Issue 17 on two GPUs: a prefill instance on GPU 0 and a decode instance on GPU 1 move prompts over NCCL.

The same fp32 tiny Qwen3.5 as tests/e2e/test_cuda_pd.py, the instances
started by hkv-launch with CUDA_VISIBLE_DEVICES 0 and 1: their pools are on
different GPUs, so the pages and checkpoints travel over the pair group
(NCCL; hkv/engine/pd_pairing.py), not CUDA IPC. Five concurrent greedy
requests through the master are transformers' fp32 greedy choices
(margin-aware), every page inside prompt[:-1] is served as `peer` and was
moved over the pair group (nothing over the CPU-tier path, no device copy),
and a second turn moves only the pages the decode side lacks. Skipped
without two GPUs (the device tool lends nvidia-h200-x2 only at times).
"""

from __future__ import annotations

import random
import re
import urllib.request

import pytest
import torch

from tests.e2e.harness import launch
from tests.e2e.test_cuda_launch import _serve, checkpoint  # noqa: F401 (fixtures)
from tests.e2e.test_cuda_pd import FLAGS, OUT, PAGE, PROMPT_LENS, _assert_transformers
from tests.e2e.test_pd import _launch_all, _secret, stop_all

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.e2e,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="needs two CUDA devices (issue 17)"),
]


def _metric(url: str, name: str, labels: str = "") -> float:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.fixture(scope="module")
def pd2(checkpoint, tmp_path_factory, launch_command):  # noqa: F811 (pytest fixtures)
    folder = tmp_path_factory.mktemp("cuda-pd2")
    secret = _secret(folder)
    common = ["--model", str(checkpoint), "--secret-file", str(secret), *FLAGS]
    prefill, decode = _launch_all([([*common, "--mode", "prefill"], {"CUDA_VISIBLE_DEVICES": "0"}, None),
                                   ([*common, "--mode", "decode"], {"CUDA_VISIBLE_DEVICES": "1"}, None)], folder)
    master = launch(["--mode", "pd-master", "--secret-file", str(secret), "--prefill-url", prefill.url,
                     "--decode-url", decode.url], folder)
    servers = [master, prefill, decode]
    pids = [p for s in servers for p in s.actor_pids()]
    yield prefill, decode, master
    stop_all(servers, pids)


def test_prompts_move_over_nccl_and_output_equals_transformers(pd2, checkpoint, tmp_path):  # noqa: F811
    prefill, decode, master = pd2
    rng = random.Random(43)
    prompts = [[rng.randrange(3, 1536) for _ in range(n)] for n in PROMPT_LENS]
    choices = _serve(master.url, prompts, OUT, None)
    outputs = [c["token_ids"] for c in choices]
    assert all(len(o) == OUT for o in outputs)
    _assert_transformers(checkpoint, prompts, outputs, tmp_path)
    pages = sum((n - 1) // PAGE for n in PROMPT_LENS)
    peer = '{tier="peer"}'
    assert _metric(decode.url, "hkv_cache_hit_tokens_total", peer) == pages * PAGE  # every page of prompt[:-1]
    assert _metric(decode.url, "hkv_pd_pair_pages_total") == pages
    assert _metric(decode.url, "hkv_pd_pair_transfers_total", '{outcome="failed"}') == 0
    assert _metric(decode.url, "hkv_pd_pages_total", '{direction="received"}') == 0  # not the CPU-tier path
    assert "peer copy:" not in decode.log()  # nor CUDA IPC
    assert len(re.findall(r"pair transfer \d+ to ", prefill.log())) == sum(n > PAGE + 1 for n in PROMPT_LENS)
    # a second turn: only the pages the decode side lacks move
    first = prompts[3] + outputs[3] + [rng.randrange(3, 1536) for _ in range(80)]
    (two,) = _serve(master.url, [first], OUT, None)
    _assert_transformers(checkpoint, [first], [two["token_ids"]], tmp_path)
    moved = _metric(decode.url, "hkv_pd_pair_pages_total") - pages
    assert 0 < moved <= (len(first) - 1) // PAGE - (333 + OUT) // PAGE + 1, moved
    assert _metric(decode.url, "hkv_cache_hit_tokens_total", peer) == (pages + moved) * PAGE
