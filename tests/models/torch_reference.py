"""transformers' logits from a child process on the CPU, on transformers' pure-torch paths.

Where fla-core is importable (the GPU machine), transformers' Qwen3.5 / Qwen3-Next
modules bind fla's Gated DeltaNet kernels when they are imported: on CUDA those
autotune for minutes, and they cannot run on CPU tensors. The child hides fla
before it imports transformers, so the reference is the torch fallback whatever
the calling process has imported already.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

_CHILD = r"""
import json, sys
sys.modules["fla"] = None  # find_spec / import of fla now fail: transformers keeps its torch functions
import torch, transformers
folder, dtype, inputs, output = sys.argv[1:5]
with open(f"{folder}/config.json") as f:
    cls = getattr(transformers, json.load(f)["architectures"][0])
with open(inputs) as f:
    sequences = json.load(f)
model = cls.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
with torch.inference_mode():
    logits = [model(input_ids=torch.tensor([s])).logits[0].float() for s in sequences]
torch.save(logits, output)
"""


def reference_logits(folder: Path, dtype: str, sequences: list[list[int]], work_dir: Path) -> list[torch.Tensor]:
    """fp32 logits [len(s), vocab] of each token sequence s under the checkpoint in `folder`.

    dtype: "float32" | "bfloat16", the dtype transformers loads the weights in (CPU).
    """
    inputs, output = work_dir / "reference_in.json", work_dir / "reference_out.pt"
    inputs.write_text(json.dumps(sequences))
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(folder), dtype, str(inputs), str(output)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"reference process failed:\n{proc.stderr[-4000:]}"
    return torch.load(output)
