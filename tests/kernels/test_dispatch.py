"""On CPU the model path through `hkv_kernels.dispatch` is exactly the pure-torch references.

The GDN layer must equal, bit for bit, the per-sequence composition of the
references (conv, then the chunked or recurrent rule) that the model ran
before the dispatch ops; paged attention on a pool layer's raw tensors must
equal the KVPool-gather loop the models ran before; and a CPU forward must not
import Triton at all.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hkv.models.batch import ForwardBatch
from hkv.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForCausalLM
from hkv.storage.kv_pool import KVLayout, KVPool
from hkv.storage.state_pool import StatePool
from hkv_kernels import dispatch
from hkv_kernels.conv1d.reference import causal_conv1d
from hkv_kernels.gdn.reference import chunk_gated_delta_rule, gdn_gates_ref, recurrent_gated_delta_rule
from hkv_kernels.paged_attention.reference import attend
from tests.models.test_qwen3_5 import TEXT_CONFIG, PagedRun

REPO = Path(__file__).resolve().parents[2]


def _per_sequence_gdn(layer, x, batch, state):
    """GatedDeltaNet.forward as a loop of the per-sequence references (the pre-dispatch code)."""
    qkv, z, b, a = layer.project(x)
    g, beta = gdn_gates_ref(a, b, layer.A_log, layer.dt_bias)
    s = state.layer_map[layer.layer_idx]
    core = x.new_empty(x.shape[0], layer.v_heads, layer.v_dim)  # [T, Hv, Dv]
    meta = batch.meta
    for start, n, slot in zip(meta.q_start.tolist(), meta.q_len.tolist(), batch.state_slots.tolist()):
        rows = slice(start, start + n)
        conv_out, conv_state = causal_conv1d(qkv[rows], state.conv[s, slot], layer.conv1d.weight[:, 0])
        q, k, v = torch.split(conv_out, [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
        rule = recurrent_gated_delta_rule if n == 1 else chunk_gated_delta_rule
        core[rows], recurrent = rule(
            q.reshape(n, layer.k_heads, layer.k_dim), k.reshape(n, layer.k_heads, layer.k_dim),
            v.reshape(n, layer.v_heads, layer.v_dim), g[rows], beta[rows], state.recurrent[s, slot],
        )
        state.conv[s, slot].copy_(conv_state)
        state.recurrent[s, slot].copy_(recurrent)
    return layer.out_proj(layer.norm(core, z).reshape(x.shape[0], -1))


def _copy(state: StatePool) -> StatePool:
    out = StatePool(state.layout)
    out.conv.copy_(state.conv)
    out.recurrent.copy_(state.recurrent)
    return out


def test_cpu_gdn_layer_is_the_per_sequence_reference():
    torch.manual_seed(0)
    cfg = Qwen3_5Config.from_hf({**TEXT_CONFIG, "model_type": "qwen3_5_text"})
    model = Qwen3_5ForCausalLM(cfg).eval()
    run = PagedRun(model, seed=0)
    for name, slot in (("a", 5), ("b", 2), ("c", 0)):
        run.add(name, slot)
    run.step([("a", list(range(70))), ("b", [3]), ("c", list(range(9)))])  # states to continue from
    # a decode, a prefill chunk crossing the 64-token GDN chunk, and a decode, in one batch
    q_lens, slots = [1, 66, 1], [5, 2, 0]
    num_tokens = sum(q_lens)
    x = torch.randn(num_tokens, cfg.hidden_size)
    batch = ForwardBatch.from_lists(
        input_ids=[0] * num_tokens, positions=[0] * num_tokens, q_lens=q_lens, kv_lens=[71, 67, 10],
        page_table=torch.zeros(3, 18, dtype=torch.long), slot_mapping=[0] * num_tokens,
        logits_indices=range(num_tokens), state_slots=slots,
    )
    layer = model.model.layers[0].linear_attn
    ours, expected = _copy(run.state), _copy(run.state)
    with torch.inference_mode():
        got = layer(x, batch, ours)
        want = _per_sequence_gdn(layer, x, batch, expected)
    assert torch.equal(got, want)
    assert torch.equal(ours.conv, expected.conv) and torch.equal(ours.recurrent, expected.recurrent)


def _gather_attention(q, kv, layer, batch, scale):
    """The models' paged attention before dispatch took raw tensors: KVPool.gather, then attend."""
    out = torch.empty_like(q)
    meta = batch.meta
    for b, start in enumerate(meta.q_start.tolist()):
        n, kv_len = meta.q_len[b].item(), meta.kv_len[b].item()
        if n == 0:
            continue
        k, v = kv.gather(layer, batch.page_table[b], kv_len)  # [L, Hkv, D]
        out[start : start + n] = attend(q[start : start + n], k, v, scale)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_paged_attention_is_the_gather_loop(dtype):
    gen = torch.Generator().manual_seed(4)
    layout = KVLayout(num_layers=2, num_pages=12, page_size=4, kv_heads=2, head_dim=16,
                      dtype=str(dtype).removeprefix("torch."), device="cpu", layer_ids=(1, 3))
    kv = KVPool(layout)
    kv.kv.copy_(torch.randn(kv.kv.shape, generator=gen))
    # a decode over a page-crossing prefix, an empty sequence, and a prefill chunk after a prefix
    q_lens, kv_lens = [1, 0, 6], [9, 3, 11]
    page_table = torch.tensor([[7, 2, 10, 0], [5, 0, 0, 0], [3, 11, 1, 0]])
    batch = ForwardBatch.from_lists(
        input_ids=[0] * 7, positions=[0] * 7, q_lens=q_lens, kv_lens=kv_lens, page_table=page_table,
        slot_mapping=[0] * 7, logits_indices=range(7),
    )
    q = torch.randn(7, 4, 16, generator=gen).to(dtype)  # [T, Hq, D]
    s = kv.layer_map[3]
    got = dispatch.paged_attention(q, kv.k[s], kv.v[s], page_table, batch.meta, 0.25)
    assert torch.equal(got, _gather_attention(q, kv, 3, batch, 0.25))


def test_cpu_forward_never_imports_triton():
    code = (
        "import sys, torch\n"
        "from hkv.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForCausalLM\n"
        "from tests.models.test_qwen3_5 import TEXT_CONFIG, PagedRun\n"
        "cfg = Qwen3_5Config.from_hf({**TEXT_CONFIG, 'model_type': 'qwen3_5_text'})\n"
        "run = PagedRun(Qwen3_5ForCausalLM(cfg).eval())\n"
        "run.add('a', 1)\n"
        "run.step([('a', [1, 2, 3])])\n"
        "run.step([('a', [4])])\n"
        "assert 'triton' not in sys.modules, 'a CPU forward imported triton'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
