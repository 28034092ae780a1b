"""Transformers as the correctness reference (DESIGN.md section 8).

Greedy parity is checked teacher-forced and margin-aware: feed the prompt and
hkv's output to the reference in one forward; at every output position hkv's
token must be the reference argmax, unless the reference's top-2 logit gap
there is under MARGIN (a genuine float tie).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

MARGIN = 1e-4


@dataclass(frozen=True)
class Divergence:
    position: int  # index into the output tokens
    got: int
    expected: int
    gap: float  # reference logit of expected minus that of got


def copy_tokenizer(src: Path, dst: Path) -> None:
    """Give a transformers-saved model folder the tiny tokenizer and chat template."""
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        if (src / name).exists():
            shutil.copy(src / name, dst / name)


@torch.inference_mode()
def teacher_forced_divergences(model, prompt: list[int], output: list[int]) -> list[Divergence]:
    """Positions where `output` is not the reference's greedy choice beyond a float tie."""
    if not output:
        return []
    ids = torch.tensor([prompt + output[:-1]])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 :].float()  # [len(output), V]
    bad = []
    for i, token in enumerate(output):
        row = logits[i]
        best = int(row.argmax())
        gap = float(row[best] - row[token])
        if best != token and gap >= MARGIN:
            bad.append(Divergence(i, token, best, gap))
    return bad


def assert_greedy_parity(model, prompt: list[int], output: list[int]) -> None:
    bad = teacher_forced_divergences(model, prompt, output)
    assert not bad, f"output diverges from the reference (prompt of {len(prompt)} tokens): {bad[:3]}"
