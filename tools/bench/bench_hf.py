"""`hkv-bench --baseline hf`: HF transformers `generate` on the same checkpoint, prompts and batch size.

transformers is a test/bench dependency, imported only here and only when the
baseline runs. Prompts are left-padded into batches of the benchmark's
concurrency and decoded greedily for exactly output_len tokens each
(min_new_tokens = max_new_tokens), the same work hkv did with ignore_eos.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm


def _left_pad(prompts: Sequence[Sequence[int]], pad_id: int):
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    return ids, mask


def _pad_id(config) -> int:
    for value in (getattr(config, "pad_token_id", None), getattr(config, "eos_token_id", None)):
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0


def _generate(model, prompts: Sequence[Sequence[int]], output_len: int, pad_id: int) -> list[list[int]]:
    import torch

    ids, mask = _left_pad(prompts, pad_id)
    device = model.device
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
            max_new_tokens=output_len, min_new_tokens=output_len, pad_token_id=pad_id,
        )
    return out[:, ids.shape[1]:].tolist()


def _sync(torch_module) -> None:
    if torch_module.cuda.is_available():
        torch_module.cuda.synchronize()


def run_hf_baseline(model_path: Path, prompts: Sequence[Sequence[int]], batch_size: int, output_len: int,
                    progress: bool = True) -> dict:
    """Time `generate` over prompts in batches of batch_size; returns throughput and every output's ids.

    Loads in bfloat16 on CUDA when there is one, float32 on CPU. One untimed
    2-token generate first takes CUDA context set-up and lazy inits out of the timing.
    """
    import torch
    from transformers import AutoModelForCausalLM

    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype)
    model = model.to("cuda" if cuda else "cpu").eval()
    pad_id = _pad_id(model.config)
    _generate(model, [prompts[0]], 2, pad_id)
    outputs: list[list[int]] = []
    seconds = 0.0
    batches = [prompts[i:i + batch_size] for i in range(0, len(prompts), batch_size)]
    for batch in tqdm(batches, desc="hf generate", unit="batch", disable=not progress):
        _sync(torch)
        started = time.perf_counter()
        outputs.extend(_generate(model, batch, output_len, pad_id))
        _sync(torch)
        seconds += time.perf_counter() - started
    output_tokens = sum(len(o) for o in outputs)
    return {
        "kind": "hf",
        "device": "cuda" if cuda else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "batch_size": batch_size,
        "prompts": len(prompts),
        "output_tokens": output_tokens,
        "seconds": seconds,
        "output_tokens_per_s": output_tokens / seconds if seconds else None,
        "outputs": outputs,
    }
