"""Speculative decoding with the CPU and disk tiers: a checkpoint that comes back from a tier carries the
drafter's state (mtp_hidden, and with --draft-window W > 0 the draft K/V ring; with W = 0 the paged draft
K/V come back in the pages).

On the trained built-in tiny-hybrid (its MTP head drafts well): a fresh server runs prompt A cold, then
other prompts that push A off the device, then A again, whose prefix comes back from the CPU tier. Its
output equals transformers' and the cold run's, and so do the drafts accepted for it (a drafter state lost
on the way drafts worse: with W = 16 a zeroed ring showed here as one draft fewer). With W = 16 a restart
on the disk directory then serves A from disk, with the same output and accepted drafts. (The copies
themselves are checked value by value in tests/engine/test_spec_tier_copy.py.)
"""

from __future__ import annotations

import random
import signal
import urllib.request

import pytest
import torch

from hkv.models.tiny import builtin_folder
from tests.e2e.harness import assert_clean, launch
from tests.e2e.test_prefix_cache import _body, _complete
from tests.reference import assert_greedy_parity

pytestmark = pytest.mark.e2e
OUT_TOKENS = 16
# a small device pool (24 pages of 16) that the other prompts overrun, so A's pages leave the device
FLAGS = ["--spec-tokens", "2", "--page-size", "16", "--checkpoint-interval", "64", "--max-total-tokens", "384",
         "--cpu-cache-gb", "0.05"]
TEXT = ("def parse(line):\n    \"\"\"Split a line of key=value pairs into a dict.\"\"\"\n    result = {}\n"
        "    for item in line.split(','):\n        key, _, value = item.partition('=')\n"
        "        result[key.strip()] = value.strip()\n    return result\n\n\n")


@pytest.fixture(scope="module")
def folder(builtin_dir):
    return builtin_folder("tiny-hybrid", builtin_dir)


@pytest.fixture(scope="module")
def reference(folder):
    from transformers import Qwen3_5ForCausalLM

    return Qwen3_5ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(folder):
    """A: 161 tokens of code (drafts mostly held; a tier hit at 160 recomputes one); three others of
    160 random tokens."""
    from hkv.models.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(folder)
    code = tok.encode(TEXT * 4, add_special_tokens=False)
    assert len(code) >= 161
    rng = random.Random(60)
    vocab = tok.vocab_size
    return code[:161], [[rng.randrange(3, vocab) for _ in range(160)] for _ in range(3)]


def _accepted(url: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("hkv_spec_accepted_tokens_total "))


def _run(server, prompt) -> tuple[list[int], dict, float]:
    """(tokens, usage, drafts accepted) of one request."""
    before = _accepted(server.url)
    result = _complete(server.url, _body(prompt, OUT_TOKENS))
    return result["choices"][0]["token_ids"], result["usage"], _accepted(server.url) - before


def _serve(flags, tmp_path, requests):
    """Launch, run `requests` (prompts) one at a time, drain; their (tokens, usage, drafts accepted)."""
    server = launch(flags, tmp_path)
    pids = server.actor_pids()
    try:
        results = [_run(server, p) for p in requests]
    finally:
        assert server.stop(signal.SIGTERM) == 0, server.log()  # drained: the CPU tier's entries go to disk
    assert_clean(server, pids)
    return results


def _check_cpu_round_trip(results, reference, prompt, others):
    """The cold run and the run from the CPU tier of `prompt` agree (output, accepted drafts)."""
    (cold, cold_usage, cold_accepted), *rest, (cpu, cpu_usage, cpu_accepted) = results
    assert cold_usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert cpu_usage["cache"]["cpu"] == len(prompt) - 1 and cpu_usage["cache"]["gpu"] == 0, cpu_usage
    assert_greedy_parity(reference, prompt, cold)
    for other, (tokens, _, _) in zip(others, rest):
        assert_greedy_parity(reference, other, tokens)
    assert cpu == cold
    assert 0 < cold_accepted and cpu_accepted == cold_accepted, (cold_accepted, cpu_accepted)
    return cold, cold_accepted


def test_a_draft_window_comes_back_from_the_cpu_and_the_disk_tier(folder, reference, prompts, tmp_path):
    prompt, others = prompts
    flags = ["--model", str(folder), *FLAGS, "--draft-window", "16", "--disk-cache-dir", str(tmp_path / "d")]
    cold, accepted = _check_cpu_round_trip(_serve(flags, tmp_path, [prompt, *others, prompt]), reference, prompt,
                                           others)
    [(disk, usage, disk_accepted)] = _serve(flags, tmp_path, [prompt])
    assert usage["cache"]["disk"] == len(prompt) - 1 and usage["cache"]["gpu"] == 0, usage
    assert disk == cold and disk_accepted == accepted, (accepted, disk_accepted)


def test_paged_draft_kv_come_back_from_the_cpu_tier(folder, reference, prompts, tmp_path):
    prompt, others = prompts
    flags = ["--model", str(folder), *FLAGS, "--draft-window", "0"]
    _check_cpu_round_trip(_serve(flags, tmp_path, [prompt, *others, prompt]), reference, prompt, others)
