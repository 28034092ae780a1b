"""The tiny Qwen3.5 hybrid on CUDA against transformers, in-process (GPU only).

The model files call `hkv_kernels.dispatch`, so CUDA tensors take the Triton /
fla-core kernels. The run is tests/models' ragged SCHEDULE: chunked prefill
and decode in shared batches over shuffled pages and garbage-filled slots.
transformers runs on the CPU in a child process on its torch paths
(tests/models/torch_reference.py): on CUDA it would call fla-core and autotune
it again for its own shapes.
"""

from __future__ import annotations

import time

import pytest
import torch
import transformers as tf

from hkv.models.batch import ForwardBatch
from hkv.models.loader import load_model
from hkv.storage.kv_pool import KVPool
from hkv.storage.state_pool import StatePool
from tests.kernels.helpers import HAS_CUDA
from tests.models.test_qwen3_5 import PAGE, SCHEDULE, SLOTS, TEXT_CONFIG, PagedRun, build_hf
from tests.models.torch_reference import reference_logits
from tests.reference import MARGIN

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]

# fp32 serving is the parity mode: exact (ieee) dots and the recurrent GDN kernel
FP32_MAX_DIFF = 1e-3
# bf16, first token: relative L2 distance of hkv's logits to transformers' bf16 logits (H200:
# at most 3.1e-2; transformers' own bf16 first-token logits sit up to 6.8e-2 from its fp32 ones)
BF16_FIRST_REL = 5e-2
# bf16, every position: hkv's worst distance to the fp32 logits at most this many times
# transformers' bf16 worst distance to them (H200: 0.62-1.17; bf16 alone moves this tiny
# model's logits up to 14%, so a bound against transformers' bf16 alone would measure noise)
BF16_VS_FP32_RATIO = 2.0


class _OnCuda(torch.nn.Module):
    """Rebuilds PagedRun's CPU batch on the GPU (kernel metadata for this model's attention) and
    moves the logits back."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.inner = model

    def forward(self, batch, kv, state):
        cfg = self.inner.cfg
        dims = (cfg.num_attention_heads // cfg.num_key_value_heads, cfg.head_dim, kv.k.dtype)
        on_gpu = ForwardBatch.from_lists(
            batch.input_ids.tolist(), batch.positions.tolist(), batch.meta.q_len.tolist(), batch.meta.kv_len.tolist(),
            batch.page_table.cuda(), batch.slot_mapping.tolist(), batch.logits_indices.tolist(),
            state_slots=batch.state_slots.tolist(), attn_dims=dims,
        )
        return self.inner(on_gpu, kv, state).cpu()


def _run_schedule(model, dtype: str, tokens: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """SCHEDULE through `model` on CUDA; returns each sequence's logits [L, vocab] (fp32, CPU)."""
    run = PagedRun(model, seed=0)
    run.kv = KVPool(model.kv_layout(96, PAGE, dtype, "cuda"), model.layer_map)
    run.state = StatePool(model.state_layout(8, "cuda"))
    run.state.conv.normal_()
    run.state.recurrent.normal_()
    for name, slot in SLOTS.items():
        run.add(name, slot)
    run.model = _OnCuda(model)
    got: dict[str, list[torch.Tensor]] = {n: [] for n in SLOTS}
    for step in SCHEDULE:
        outs = run.step([(n, tokens[n][lo:hi]) for n, lo, hi in step])
        for (n, _, _), out in zip(step, outs):
            got[n].append(out)
    return {n: torch.cat(v) for n, v in got.items()}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_5_cuda")
    build_hf(tf.Qwen3_5ForCausalLM, tf.Qwen3_5TextConfig(**TEXT_CONFIG), folder, seed=1)
    gen = torch.Generator().manual_seed(0)
    ends = {n: max(hi for step in SCHEDULE for m, _, hi in step if m == n) for n in SLOTS}
    tokens = {n: torch.randint(0, TEXT_CONFIG["vocab_size"], (ends[n],), generator=gen).tolist() for n in SLOTS}
    return folder, tokens


def _reference(folder, dtype: str, tokens: dict[str, list[int]], work_dir) -> dict[str, torch.Tensor]:
    names = list(tokens)
    return dict(zip(names, reference_logits(folder, dtype, [tokens[n] for n in names], work_dir)))


def test_fp32_greedy_matches_transformers(ckpt, tmp_path):
    folder, tokens = ckpt
    start = time.perf_counter()
    ours = _run_schedule(load_model(folder, "float32", "cuda").model, "float32", tokens)
    ran = time.perf_counter() - start
    expected = _reference(folder, "float32", tokens, tmp_path)
    print(f"fp32: hkv on CUDA {ran:.1f} s (compiles included)")
    for name, expect in expected.items():
        diff = (ours[name] - expect).abs().max().item()
        print(f"fp32 {name}: max |logit diff| {diff:.2e}")
        top2 = expect.topk(2, dim=-1).values
        decided = (top2[:, 0] - top2[:, 1]) > MARGIN  # positions that are not float ties
        assert torch.equal(ours[name].argmax(-1)[decided], expect.argmax(-1)[decided]), name
        assert diff < FP32_MAX_DIFF, name


def _rel(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Relative L2 distance per position: [L, vocab] x2 -> [L]."""
    return (x - ref).norm(dim=-1) / ref.norm(dim=-1)


def test_bf16_logits_match_transformers_bf16(ckpt, tmp_path):
    folder, tokens = ckpt
    start = time.perf_counter()
    ours = _run_schedule(load_model(folder, "bfloat16", "cuda").model, "bfloat16", tokens)
    ran = time.perf_counter() - start
    expected = _reference(folder, "bfloat16", tokens, tmp_path)
    exact = _reference(folder, "float32", tokens, tmp_path)
    print(f"bf16: hkv on CUDA {ran:.1f} s (compiles and fla-core autotuning included)")
    first, ratio = {}, {}
    for name, expect in expected.items():
        rel = _rel(ours[name], expect)  # [L]
        ours_off, theirs_off = _rel(ours[name], exact[name]).max(), _rel(expect, exact[name]).max()
        first[name], ratio[name] = rel[0].item(), (ours_off / theirs_off).item()
        print(f"bf16 {name}: first-token rel L2 {rel[0]:.2e} (worst position {rel.max():.2e}); "
              f"worst distance to fp32: hkv {ours_off:.2e}, transformers bf16 {theirs_off:.2e}")
    assert max(first.values()) < BF16_FIRST_REL, first
    assert max(ratio.values()) < BF16_VS_FP32_RATIO, ratio
