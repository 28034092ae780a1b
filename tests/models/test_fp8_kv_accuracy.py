"""FP8 KV pages against fp32 KV pages on the built-in tiny models (issue 39 acceptance 2): the
teacher-forced logprob error and greedy agreement, within the bounds docs/sizing.md reports.

The same model, weights and kernels (CPU references, fp32 compute) run one sequence in chunks
over paged KV, once with fp32 pages and once with FP8 pages (scale 1.0): only the KV storage
differs. Run with -s to print the measured numbers.
"""

from __future__ import annotations

import pytest
import torch

from hkv.models.batch import ForwardBatch
from hkv.models.loader import load_model
from hkv.models.tiny import builtin_folder
from hkv.models.tokenizer import Tokenizer
from hkv.storage.kv_pool import KVPool
from hkv.storage.state_pool import StatePool

PAGE = 16
CHUNK = 24  # prompt chunks cross pages, so later chunks read earlier chunks' pages
# docs/sizing.md "FP8 KV pages": the measured max errors were 0.184 (tiny-hybrid, mean 0.029) and 0.0106
# (tiny-dense, mean 0.0027); the documented tolerance
MAX_LOGPROB_ERROR = 0.25
GREEDY_TOKENS = 48
TEXT = '''import os
import sys


def read_lines(path, encoding="utf-8"):
    """Return the lines of the file at path, without their line endings."""
    with open(path, encoding=encoding) as f:
        return [line.rstrip("\\n") for line in f]


class Counter(dict):
    def __missing__(self, key):
        return 0

    def most_common(self, n=None):
        items = sorted(self.items(), key=lambda kv: kv[1], reverse=True)
        return items if n is None else items[:n]
'''


class Sequence:
    """One sequence over a KV pool of `kv_dtype` pages and a state slot, fed chunk by chunk."""

    def __init__(self, model, kv_dtype: str, pages: int = 64) -> None:
        self.model = model
        self.kv = KVPool(model.kv_layout(pages, PAGE, kv_dtype, "cpu"), model.layer_map, attn_dtype=torch.float32)
        layout = model.state_layout(2, device="cpu")
        self.state = StatePool(layout) if layout is not None else None
        self.page_row = torch.randperm(pages, generator=torch.Generator().manual_seed(0))  # shuffled pages
        self.done = 0

    def feed(self, tokens: list[int]) -> torch.Tensor:
        """fp32 logits [len(tokens), vocab] of the next chunk."""
        start, end = self.done, self.done + len(tokens)
        slots = [int(self.page_row[p // PAGE]) * PAGE + p % PAGE for p in range(start, end)]
        batch = ForwardBatch.from_lists(
            input_ids=tokens, positions=range(start, end), q_lens=[len(tokens)], kv_lens=[end],
            page_table=self.page_row[None], slot_mapping=slots, logits_indices=range(len(tokens)),
            state_slots=[0] if self.state is not None else None,
        )
        with torch.inference_mode():
            logits = self.model(batch, self.kv, self.state)
        self.done = end
        return logits


def teacher_forced(model, kv_dtype: str, tokens: list[int]) -> torch.Tensor:
    """log-probabilities [len(tokens), vocab] after each token, the prompt fed in CHUNK-token chunks."""
    seq = Sequence(model, kv_dtype)
    logits = torch.cat([seq.feed(tokens[i:i + CHUNK]) for i in range(0, len(tokens), CHUNK)])
    return torch.log_softmax(logits, dim=-1)


def greedy(model, kv_dtype: str, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """n greedy tokens after the prompt (decode steps read the pages one token at a time) and the
    top-2 logit gap at each."""
    seq = Sequence(model, kv_dtype)
    logits = torch.cat([seq.feed(prompt[i:i + CHUNK]) for i in range(0, len(prompt), CHUNK)])[-1]
    out, gaps = [], []
    for _ in range(n):
        top = logits.topk(2)
        gaps.append(float(top.values[0] - top.values[1]))
        out.append(int(top.indices[0]))
        logits = seq.feed([out[-1]])[-1]
    return out, gaps


@pytest.fixture(scope="module", params=["tiny-hybrid", "tiny-dense"])
def tiny(request, tmp_path_factory):
    folder = builtin_folder(request.param, tmp_path_factory.mktemp("builtin"))
    return request.param, load_model(folder, "float32", "cpu").model, Tokenizer.from_folder(folder)


def test_fp8_kv_logprob_error_is_small(tiny):
    name, model, tokenizer = tiny
    tokens = tokenizer.encode(TEXT)
    assert len(tokens) > 4 * PAGE
    ref = teacher_forced(model, "float32", tokens)
    fp8 = teacher_forced(model, "float8_e4m3fn", tokens)
    forced = torch.tensor(tokens[1:])[:, None]
    error = (fp8[:-1].gather(1, forced) - ref[:-1].gather(1, forced)).abs()
    print(f"\n{name}: {len(tokens) - 1} teacher-forced tokens, max |logprob error| {error.max():.4f}, "
          f"mean {error.mean():.5f}; over the whole vocabulary max {(fp8 - ref).abs().max():.4f}")
    assert error.max() < MAX_LOGPROB_ERROR
    assert (error > 0).any(), "FP8 pages changed nothing: are they FP8?"


def test_fp8_kv_greedy_matches_fp32_kv(tiny):
    """Greedy tokens equal, except where the fp32-KV run's top-2 gap is within the logprob error bound
    (a near tie FP8 rounding may flip; the test then stops at the flip)."""
    name, model, tokenizer = tiny
    prompt = tokenizer.encode(TEXT)[:70]
    ref, gaps = greedy(model, "float32", prompt, GREEDY_TOKENS)
    fp8, _ = greedy(model, "float8_e4m3fn", prompt, GREEDY_TOKENS)
    first = next((i for i, (a, b) in enumerate(zip(ref, fp8)) if a != b), None)
    print(f"\n{name}: greedy {GREEDY_TOKENS} tokens, first difference at {first}")
    if first is not None:
        assert gaps[first] < 2 * MAX_LOGPROB_ERROR, f"{name}: token {first} differs with a top-2 gap {gaps[first]:.3f}"


def test_fp8_pool_is_half_a_bf16_pool(tiny):
    _, model, _ = tiny
    bf16 = model.kv_layout(8, PAGE, "bfloat16", "cpu").bytes_per_page()
    assert model.kv_layout(8, PAGE, "float8_e4m3fn", "cpu").bytes_per_page() * 2 == bf16
