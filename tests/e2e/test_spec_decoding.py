"""Issue 14, acceptance 1: MTP speculative decoding served end to end equals transformers' target-only
greedy output (teacher-forced, margin-aware).

Models: the trained built-in tiny-hybrid (its MTP head drafts well, so many drafts are accepted) and
tiny transformers-built qwen3_5_text and qwen3_next checkpoints with random MTP weights added in the
published layout (mtp.fc, mtp.pre_fc_norm_*, mtp.layers.0.*, mtp.norm; drafts mostly rejected).
Prompts shorter and longer than the draft window, concurrent requests of mixed lengths, and second
requests that hit a cached prefix on the device.
"""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import sys
import urllib.request

import pytest
import torch
from safetensors.torch import load_file, save_file

from hkv.models.tiny import builtin_folder
from tests.e2e.harness import assert_clean, launch
from tests.e2e.test_hybrid import CACHE_FLAGS, VOCAB, _build
from tests.e2e.test_prefix_cache import _body, _complete_all
from tests.reference import assert_greedy_parity

pytestmark = pytest.mark.e2e
LAUNCH = [sys.executable, "-c", "from hkv.launcher import main; main()"]


def add_mtp_weights(folder, seed: int) -> None:
    """Random MTP weights in the published layout, written into the folder's model.safetensors: the
    decoder layer is a perturbed copy of the checkpoint's first full-attention layer (layer 1)."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    g = torch.Generator().manual_seed(seed)
    hidden = tensors["model.norm.weight"].shape[0]
    for name, t in list(tensors.items()):
        if name.startswith("model.layers.1."):
            tensors["mtp.layers.0." + name.removeprefix("model.layers.1.")] = t + 0.02 * torch.randn(
                t.shape, generator=g, dtype=t.dtype)
    tensors["mtp.fc.weight"] = 0.08 * torch.randn(hidden, 2 * hidden, generator=g)
    for name in ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"):
        tensors[name] = 0.1 * torch.randn(hidden, generator=g)
    save_file(tensors, path, metadata={"format": "pt"})


def _metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def _serve_and_check(reference, flags, tmp_path, prompts, max_tokens=16, second=None):
    """Run `prompts` concurrently, then `second` (prompts sharing a cached prefix); check each output
    against the reference; returns (results of the second round, accepted drafts, verified drafts)."""
    server = launch(flags, tmp_path)
    pids = server.actor_pids()
    try:
        first = asyncio.run(_complete_all(server.url, [_body(p, max_tokens) for p in prompts]))
        # drafts run in verify chunks but are no prompt tokens: the counter holds the prompts' uncached tokens
        # (less each prompt's last one, which the router counts with the sampled tokens)
        cached = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in first)
        prefilled = _metric(server.url, "hkv_engine_prefill_tokens_total")
        assert prefilled == sum(map(len, prompts)) - cached - len(prompts)
        again = asyncio.run(_complete_all(server.url, [_body(p, max_tokens) for p in second or []]))
        accepted = _metric(server.url, "hkv_spec_accepted_tokens_total")
        verified = _metric(server.url, "hkv_spec_draft_tokens_total")
    finally:
        assert server.stop(signal.SIGTERM) == 0, server.log()
    assert_clean(server, pids)
    for prompt, result in zip([*prompts, *(second or [])], [*first, *again]):
        tokens = result["choices"][0]["token_ids"]
        assert len(tokens) == max_tokens
        assert_greedy_parity(reference, prompt, tokens)
    return again, accepted, verified


def _prompts(seed, lengths, vocab):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def test_trained_tiny_hybrid_with_a_draft_window_matches_transformers(tmp_path, builtin_dir):
    """--spec-tokens 2 --draft-window 16: prompts of 5 and 12 tokens (inside the window) and of 40 and
    150 (past it); then prompts sharing the 150-token one's first 130 tokens hit its checkpoint."""
    from transformers import Qwen3_5ForCausalLM

    folder = builtin_folder("tiny-hybrid", builtin_dir)
    reference = Qwen3_5ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    text = ("def parse(line):\n    \"\"\"Split a line of key=value pairs into a dict.\"\"\"\n    result = {}\n"
            "    for item in line.split(','):\n        key, _, value = item.partition('=')\n")
    from hkv.models.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(folder)
    code = tok.encode(text * 4, add_special_tokens=False)
    prompts = [code[:5], code[:12], code[:40], code[:150]]
    second = [code[:130] + code[7:15], code[:140]]
    again, accepted, verified = _serve_and_check(
        reference, ["--spec-tokens", "2", "--draft-window", "16", *CACHE_FLAGS], tmp_path, prompts, 24, second)
    assert all(r["usage"]["prompt_tokens_details"]["cached_tokens"] >= 128 for r in again)
    assert 0 < accepted <= verified  # the trained head drafts tokens the target keeps


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_full_length_draft_kv_on_transformers_checkpoints_matches_transformers(kind, tmp_path, builtin_dir):
    """--spec-tokens 3 --draft-window 0 (the draft K/V paged like the target's) on random checkpoints
    with MTP weights: six concurrent prompts of 5 to 700 tokens, then two hitting a cached prefix."""
    from hkv.models.tiny import ensure_builtin

    folder = tmp_path / kind
    reference = _build(kind, folder, ensure_builtin("tiny-dense", builtin_dir))
    add_mtp_weights(folder, 3)
    prompts = _prompts(14, [5, 64, 150, 333, 512, 700], VOCAB)
    second = [prompts[4][:300] + [7, 8, 9], prompts[5][:450]]
    again, _, verified = _serve_and_check(
        reference, ["--model", str(folder), "--spec-tokens", "3", "--draft-window", "0", *CACHE_FLAGS], tmp_path,
        prompts, 12, second)
    assert all(r["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256 for r in again)
    assert verified > 0


@pytest.mark.parametrize("flags, message", [
    (["--spec-tokens", "2", "--draft-window", "2"], "--draft-window 2: must be 0 (full length) or at least"),
    (["--draft-window", "8"], "--draft-window needs --spec-tokens >= 1"),
    (["--spec-tokens", "9"], "--spec-tokens 9: at most 8"),
    (["--model", "tiny-dense", "--spec-tokens", "1"], "--spec-tokens: drafting uses a Qwen3.5 / Qwen3-Next MTP"),
])
def test_bad_speculative_flags_exit_2_with_one_line(flags, message, tmp_path):
    proc = subprocess.run([*LAUNCH, *flags, "--port", "8799"], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], proc.stderr


def test_a_checkpoint_without_mtp_weights_is_refused(tmp_path, builtin_dir):
    from hkv.models.tiny import ensure_builtin

    _build("qwen3_5", tmp_path / "plain", ensure_builtin("tiny-dense", builtin_dir))
    proc = subprocess.run([*LAUNCH, "--model", str(tmp_path / "plain"),
                           "--spec-tokens", "2", "--port", "8799"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "needs MTP weights (mtp.*)" in proc.stderr, proc.stderr


def test_the_openai_surface_is_unchanged_by_speculation(tmp_path):
    """Stop strings, logprobs per token and n > 1 behave as without --spec-tokens (greedy: the same text,
    finish reason and logprobs' length); seeded sampling repeats itself under speculation."""
    import json

    spec = launch(["--spec-tokens", "3", "--draft-window", "16"], tmp_path)
    plain = launch([], tmp_path)
    pids = [s.actor_pids() for s in (spec, plain)]

    def post(server, body):
        req = urllib.request.Request(server.url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(req, timeout=60).read())

    prompt = "def read_config(path):\n"
    greedy = {"prompt": prompt, "max_tokens": 60, "temperature": 0, "stop": ["file-like"], "logprobs": 1, "n": 2}
    seeded = {"prompt": prompt, "max_tokens": 40, "temperature": 0.8, "seed": 5, "logprobs": 2, "n": 2}
    try:
        got, want = post(spec, greedy), post(plain, greedy)
        first, again = post(spec, seeded), post(spec, seeded)
        accepted = _metric(spec.url, "hkv_spec_accepted_tokens_total")
    finally:
        for server, actors in zip((spec, plain), pids):
            assert server.stop(signal.SIGTERM) == 0, server.log()
            assert_clean(server, actors)
    for a, b in zip(got["choices"], want["choices"]):
        assert (a["text"], a["finish_reason"]) == (b["text"], b["finish_reason"])
        assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
        for x, y in zip(a["logprobs"]["token_logprobs"], b["logprobs"]["token_logprobs"]):
            assert abs(x - y) < 1e-3
    assert got["choices"][0]["finish_reason"] == "stop"
    assert [c["text"] for c in first["choices"]] == [c["text"] for c in again["choices"]]
    assert all(len(c["logprobs"]["tokens"]) == 40 for c in first["choices"])
    assert accepted > 0
