"""Issue 14 on the GPU: `hkv-launch --device cuda --spec-tokens K` serves what transformers computes.

The tiny Qwen3.5 of tests/e2e/test_cuda_launch.py, with random MTP weights added in the published
layout, in fp32 on CUDA (the verify forward runs the Triton recurrent GDN kernel with keep_slots,
the drafter the Triton rope and ring kernels): five concurrent greedy requests of 5 to 700 tokens
with `--spec-tokens 2 --draft-window 16` and `--spec-tokens 3 --draft-window 0`, every output token
transformers' fp32 greedy choice (teacher-forced, margin-aware), and second requests that hit the
cached prefixes. The trained built-in tiny-hybrid then shows drafts accepted on the GPU.
"""

from __future__ import annotations

import signal

import pytest
import torch

from tests.e2e.harness import assert_clean, launch
from tests.e2e.test_cuda_launch import FLAGS, _prompts, _serve, checkpoint  # noqa: F401 (fixtures)
from tests.e2e.test_spec_decoding import _metric, add_mtp_weights
from tests.models.torch_reference import reference_logits
from tests.reference import MARGIN

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.e2e,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _check_greedy(folder, prompts, outputs, work_dir):
    logits = reference_logits(folder, "float32", [p + o[:-1] for p, o in zip(prompts, outputs)], work_dir)
    for prompt, output, rows in zip(prompts, outputs, logits):
        for i, token in enumerate(output):
            row = rows[len(prompt) - 1 + i]
            best = int(row.argmax())
            assert best == token or float(row[best] - row[token]) < MARGIN, (len(prompt), i, token, best)


@pytest.mark.parametrize("spec_flags", [["--spec-tokens", "2", "--draft-window", "16"],
                                        ["--spec-tokens", "3", "--draft-window", "0"]], ids=["ring16", "paged"])
def test_speculative_fp32_on_cuda_matches_transformers(checkpoint, tmp_path, spec_flags):  # noqa: F811
    folder = tmp_path / "with_mtp"
    folder.mkdir()
    for f in checkpoint.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    add_mtp_weights(folder, 9)
    server = launch(["--model", str(folder), "--dtype", "float32", *FLAGS, *spec_flags,
                     "--page-size", "16", "--checkpoint-interval", "64"], tmp_path)
    pids = server.actor_pids()
    prompts = _prompts()
    second = [prompts[3][:300] + [7, 8, 9], prompts[4][:650]]
    try:
        first = _serve(server.url, prompts, 16, None)
        again = _serve(server.url, second, 16, None)
        cached = _metric(server.url, 'hkv_cache_hit_tokens_total{tier="gpu"}')
        verified = _metric(server.url, "hkv_spec_draft_tokens_total")
    finally:
        assert server.stop(signal.SIGTERM) == 0, server.log()
    assert_clean(server, pids)
    assert "speculative decoding:" in server.log() and verified > 0 and cached >= 2 * 256
    outs = [c["token_ids"] for c in first + again]
    assert all(len(o) == 16 for o in outs)
    _check_greedy(folder, prompts + second, outs, tmp_path)


def test_trained_tiny_hybrid_accepts_drafts_on_cuda(tmp_path, builtin_dir, launch_command):  # noqa: F811
    from hkv.models.tiny import builtin_folder
    from hkv.models.tokenizer import Tokenizer

    folder = builtin_folder("tiny-hybrid", builtin_dir)
    tok = Tokenizer.from_folder(folder)
    code = tok.encode("import os\nimport sys\n\n\ndef main(argv):\n    \"\"\"Run the command line.\"\"\"\n", False)
    server = launch(["--device", "cuda", "--dtype", "float32", "--spec-tokens", "3", "--draft-window", "16",
                     "--max-total-tokens", "16384", "--max-running-requests", "16"], tmp_path)
    pids = server.actor_pids()
    try:
        out = _serve(server.url, [code, code[:20]], 48, None)
        accepted = _metric(server.url, "hkv_spec_accepted_tokens_total")
    finally:
        assert server.stop(signal.SIGTERM) == 0, server.log()
    assert_clean(server, pids)
    _check_greedy(folder, [code, code[:20]], [c["token_ids"] for c in out], tmp_path)
    assert accepted > 0
