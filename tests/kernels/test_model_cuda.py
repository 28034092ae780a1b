"""The tiny Qwen3.5 hybrid on CUDA through hkv_kernels.dispatch against transformers (GPU only).

The model files still call the references; this test swaps in the dispatch
ops exactly as the recommended call-site edits do, then runs ragged chunked
prefill and decode over shuffled pages and slots.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
import transformers as tf

from hkv.models import gdn, qwen3_5
from hkv.models.loader import load_model
from hkv.storage.kv_pool import KVPool
from hkv.storage.state_pool import StatePool
from hkv_kernels import dispatch
from tests.kernels.helpers import HAS_CUDA
from tests.models.test_qwen3_5 import PAGE, SCHEDULE, SLOTS, TEXT_CONFIG, build_hf

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]


def _fast_gdn_forward(self, x, batch, state):
    """GatedDeltaNet.forward with the per-sequence loop replaced by dispatch.gated_delta_net."""
    qkv, z, b, a = self.project(x)
    g, beta = gdn.gdn_gates(a, b, self.A_log, self.dt_bias)  # [T, Hv] each
    heads = (self.k_heads, self.k_dim, self.v_heads, self.v_dim)
    core = dispatch.gated_delta_net(qkv, g, beta, self.conv1d.weight[:, 0], state, self.layer_idx, batch, heads)
    return self.out_proj(self.norm(core, z).reshape(x.shape[0], -1))


@pytest.fixture
def kernels_on(monkeypatch):
    monkeypatch.setattr(qwen3_5, "paged_attention", dispatch.paged_attention)
    monkeypatch.setattr(qwen3_5.GatedDeltaNet, "forward", _fast_gdn_forward)


def _run_schedule(model, dtype: str, tokens: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """SCHEDULE through `model` on CUDA; returns each sequence's logits [L, vocab] (fp32, CPU)."""
    from tests.models.test_qwen3_5 import PagedRun

    run = PagedRun(model, seed=0)
    run.kv = KVPool(model.kv_layout(96, PAGE, dtype, "cuda"), model.layer_map)
    run.state = StatePool(model.state_layout(8, "cuda"))
    run.state.conv.normal_()
    run.state.recurrent.normal_()
    for name, slot in SLOTS.items():
        run.add(name, slot)
    inner = model

    class OnCuda(torch.nn.Module):
        def forward(self, batch, kv, state):
            moved = {f: getattr(batch, f).cuda() for f in
                     ("input_ids", "positions", "page_table", "slot_mapping", "logits_indices", "state_slots")}
            return inner(replace(batch, **moved), kv, state).cpu()

    run.model = OnCuda()
    got: dict[str, list[torch.Tensor]] = {n: [] for n in SLOTS}
    for step in SCHEDULE:
        outs = run.step([(n, tokens[n][lo:hi]) for n, lo, hi in step])
        for (n, _, _), out in zip(step, outs):
            got[n].append(out)
    return {n: torch.cat(v) for n, v in got.items()}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_5_cuda")
    ref = build_hf(tf.Qwen3_5ForCausalLM, tf.Qwen3_5TextConfig(**TEXT_CONFIG), folder, seed=1)
    gen = torch.Generator().manual_seed(0)
    ends = {n: max(hi for step in SCHEDULE for m, _, hi in step if m == n) for n in SLOTS}
    tokens = {n: torch.randint(0, TEXT_CONFIG["vocab_size"], (ends[n],), generator=gen).tolist() for n in SLOTS}
    return folder, ref, tokens


def _hf_logits(ref, tokens, dtype):
    # transformers runs on the CPU: on CUDA it would pick up fla-core and autotune it for minutes
    model = copy.deepcopy(ref).to("cpu", dtype)
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits[0].float()


def test_fp32_greedy_matches_transformers(ckpt, kernels_on):
    folder, ref, tokens = ckpt
    ours = _run_schedule(load_model(folder, "float32", "cuda").model, "float32", tokens)
    for name, toks in tokens.items():
        expect = _hf_logits(ref, toks, torch.float32)
        diff = (ours[name] - expect).abs().max().item()
        print(f"fp32 {name}: max |logit diff| {diff:.2e}")
        top2 = expect.topk(2, dim=-1).values
        decided = (top2[:, 0] - top2[:, 1]) > 1e-4  # positions that are not float ties
        assert torch.equal(ours[name].argmax(-1)[decided], expect.argmax(-1)[decided]), name
        assert diff < 1e-3, name


def test_bf16_first_token_logits_match_transformers_bf16(ckpt, kernels_on):
    folder, ref, tokens = ckpt
    ours = _run_schedule(load_model(folder, "bfloat16", "cuda").model, "bfloat16", tokens)
    for name, toks in tokens.items():
        expect = _hf_logits(ref, toks, torch.bfloat16)
        first = ours[name][0]
        rel = ((first - expect[0]).norm() / expect[0].norm()).item()
        worst = ((ours[name] - expect).norm(dim=-1) / expect.norm(dim=-1)).max().item()
        print(f"bf16 {name}: first-token rel L2 {rel:.2e}, worst position {worst:.2e}")
        assert rel < 2e-2 and worst < 5e-2, name
