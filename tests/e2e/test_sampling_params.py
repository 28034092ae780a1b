"""Issue 37's sampling parameters on a live CPU server, against transformers.

Greedy output with a logit bias and repetition, frequency and presence penalties equals transformers'
logits put through the documented processing token by token (repetition as transformers'
RepetitionPenaltyLogitsProcessor applies it to prompt and output; frequency and presence on the
output, as OpenAI defines them), with and without a prefix hit. `n = 4` equals four requests
seeded seed, seed + 1, ..., and its prompt is prefilled once.
"""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch

pytestmark = pytest.mark.e2e


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _complete(server, prompt: list[int], **params) -> dict:
    return _post(f"{server.url}/v1/completions", {"prompt": prompt, "return_token_ids": True, **params})


@torch.inference_mode()
def reference_tokens(model, prompt: list[int], steps: int, bias: dict[int, float], repetition: float,
                     frequency: float, presence: float) -> list[int]:
    """Greedy decoding from transformers' logits through hkv's documented processing order."""
    out: list[int] = []
    for _ in range(steps):
        logits = model(torch.tensor([prompt + out])).logits[0, -1].double()
        for token, b in bias.items():
            logits[token] += b
        for token in set(prompt) | set(out):
            logits[token] = logits[token] / repetition if logits[token] > 0 else logits[token] * repetition
        for token in set(out):
            logits[token] -= frequency * out.count(token) + presence
        out.append(int(logits.argmax()))
    return out


PROMPT = [(17 * i + 5) % 1500 + 3 for i in range(40)]


@pytest.mark.parametrize("knobs", [
    dict(repetition_penalty=1.8),
    dict(frequency_penalty=1.5, presence_penalty=0.5),
    dict(logit_bias={"77": 9.0, "1200": -100}, repetition_penalty=0.7, frequency_penalty=-0.3, presence_penalty=1.0),
], ids=["repetition", "frequency-presence", "all"])
def test_penalties_and_bias_equal_transformers_logits_processed_as_documented(qwen3_server, qwen3_reference, knobs):
    steps = 24
    bias = {int(t): float(b) for t, b in knobs.get("logit_bias", {}).items()}
    want = reference_tokens(qwen3_reference, PROMPT, steps, bias, knobs.get("repetition_penalty", 1.0),
                            knobs.get("frequency_penalty", 0.0), knobs.get("presence_penalty", 0.0))
    plain = _complete(qwen3_server, PROMPT, max_tokens=steps, temperature=0, ignore_eos=True)
    assert plain["choices"][0]["token_ids"] != want  # the knobs change the answer
    for _ in range(2):  # the second one hits the cached prompt
        got = _complete(qwen3_server, PROMPT, max_tokens=steps, temperature=0, ignore_eos=True, **knobs)
        assert got["choices"][0]["token_ids"] == want
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_n_choices_equal_separately_seeded_requests_and_share_one_prefill(qwen3_server):
    # two chunks of --chunked-prefill-size 256: the other choices wait for the first one's 256 (its whole pages)
    prompt = [(31 * i + 7) % 1500 + 3 for i in range(270)]
    params = dict(max_tokens=12, temperature=1.0, top_p=0.9, min_p=0.05, seed=41, ignore_eos=True)
    together = _complete(qwen3_server, prompt, n=4, **params)
    apart = [_complete(qwen3_server, prompt, **{**params, "seed": 41 + i})["choices"][0]["token_ids"]
             for i in range(4)]
    assert [c["token_ids"] for c in sorted(together["choices"], key=lambda c: c["index"])] == apart
    assert len({tuple(t) for t in apart}) > 1  # the seeds differ, so do the samples
    usage = together["usage"]
    assert usage["prompt_tokens"] == 270
    # the first choice prefilled the prompt; the three others read its whole pages (the partial one is recomputed)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert usage["choices_cached_tokens"] == [0, 256, 256, 256]
