"""The fused small ops against their references: norms with the residual add, the gated GDN norm,
SiLU-and-mul, attention prep (q/k norm, rope, K/V write), the attention gate and the GDN gates."""

import pytest
import torch

from hkv_kernels.activation.reference import silu_mul_ref
from hkv_kernels.activation.triton_activation import silu_mul
from hkv_kernels.gdn.reference import gated_delta_rule_ref, gdn_gates_ref
from hkv_kernels.gdn.triton_recurrent import gated_delta_rule_recurrent
from hkv_kernels.meta import build_meta
from hkv_kernels.norm.reference import add_rms_norm_ref, gated_rms_norm_ref, rms_norm_ref
from hkv_kernels.norm.triton_norm import gated_rms_norm, rms_norm
from hkv_kernels.paged_attention.reference import paged_attention_ref
from hkv_kernels.paged_attention.triton_paged_attention import paged_attention
from hkv_kernels.rope.reference import attention_prep_ref
from hkv_kernels.rope.triton_rope import attention_prep
from tests.kernels.helpers import assert_close, cases


def _randn(*shape, device, dtype, gen):
    return torch.randn(*shape, generator=gen).to(device, dtype)


@pytest.mark.parametrize("device,dtype", cases())
@pytest.mark.parametrize("plus_one", [True, False], ids=["gemma", "qwen3"])
def test_rms_norm_with_and_without_residual(device, dtype, plus_one):
    gen = torch.Generator().manual_seed(1)
    x, res = _randn(7, 96, device=device, dtype=dtype, gen=gen), _randn(7, 96, device=device, dtype=dtype, gen=gen)
    w = _randn(96, device=device, dtype=dtype, gen=gen) * 0.1
    out, none = rms_norm(x, w, 1e-6, plus_one)
    assert none is None
    assert_close(out, rms_norm_ref(x.float().cpu(), w.float().cpu(), 1e-6, plus_one), dtype)
    want, want_res = add_rms_norm_ref(x.float().cpu(), res.float().cpu(), w.float().cpu(), 1e-6, plus_one)
    got, got_res = rms_norm(x, w, 1e-6, plus_one, residual=res)
    assert got_res is res  # the residual stream is updated in place
    assert_close(got, want, dtype)
    assert_close(got_res, want_res, dtype, "residual")


@pytest.mark.parametrize("device,dtype", cases())
def test_rms_norm_over_strided_head_rows(device, dtype):
    gen = torch.Generator().manual_seed(2)
    packed = _randn(5, 3, 2 * 16, device=device, dtype=dtype, gen=gen)  # query|gate per head
    q = packed[..., :16]
    w = _randn(16, device=device, dtype=dtype, gen=gen)
    out, _ = rms_norm(q, w, 1e-6, True)
    assert_close(out, rms_norm_ref(q.float().cpu(), w.float().cpu(), 1e-6, True), dtype)


@pytest.mark.parametrize("device,dtype", cases())
def test_gated_rms_norm_with_a_strided_gate(device, dtype):
    gen = torch.Generator().manual_seed(3)
    x = _randn(6, 4, 32, device=device, dtype=dtype, gen=gen)
    z = _randn(6, 200, device=device, dtype=dtype, gen=gen)[:, 40:168].view(6, 4, 32)  # a view of a wider GEMM
    w = _randn(32, device=device, dtype=dtype, gen=gen)
    out = gated_rms_norm(x, z, w, 1e-6)
    assert_close(out, gated_rms_norm_ref(x.float().cpu(), z.float().cpu(), w.float().cpu(), 1e-6), dtype)


@pytest.mark.parametrize("device,dtype", cases())
def test_silu_mul_over_the_halves_of_one_gemm(device, dtype):
    gen = torch.Generator().manual_seed(4)
    gate_up = _randn(9, 2 * 1100, device=device, dtype=dtype, gen=gen)
    gate, up = gate_up.split(1100, dim=-1)
    assert_close(silu_mul(gate, up), silu_mul_ref(gate.float().cpu(), up.float().cpu()), dtype)


def _caches(device, dtype, gen, pages=6, page_size=4, heads=2, dim=16):
    k = _randn(pages, page_size, heads, dim, device=device, dtype=dtype, gen=gen)
    return k, torch.zeros_like(k)


@pytest.mark.parametrize("device,dtype", cases())
@pytest.mark.parametrize("rot", [8, 16], ids=["partial", "full"])
@pytest.mark.parametrize("plus_one", [True, False], ids=["gemma", "qwen3"])
def test_attention_prep_norms_rotates_and_writes(device, dtype, rot, plus_one):
    gen = torch.Generator().manual_seed(5)
    tokens, dim = 5, 16
    q = _randn(tokens, 4, 2 * dim, device=device, dtype=dtype, gen=gen)[..., :dim]
    k, v = (_randn(tokens, 2, dim, device=device, dtype=dtype, gen=gen) for _ in range(2))
    qw, kw = (_randn(dim, device=device, dtype=dtype, gen=gen) * 0.2 for _ in range(2))
    positions = torch.tensor([0, 3, 7, 100, 31], device=device)
    slots = torch.tensor([2, 9, 13, 0, 22], device=device)
    cos_table = torch.randn(128, rot, generator=gen).to(device, dtype)
    sin_table = torch.randn(128, rot, generator=gen).to(device, dtype)
    k_cache, v_cache = _caches(device, dtype, gen)
    ref_k, ref_v = k_cache.float().cpu(), v_cache.float().cpu()
    want = attention_prep_ref(q.float().cpu(), k.float().cpu(), v.float().cpu(), cos_table.float().cpu()[positions.cpu()],
                              sin_table.float().cpu()[positions.cpu()], qw.float().cpu(), kw.float().cpu(), 1e-6,
                              plus_one, ref_k, ref_v, slots.cpu())
    got = attention_prep(q, k, v, cos_table, sin_table, positions, qw, kw, 1e-6, plus_one, k_cache, v_cache, slots)
    assert_close(got, want, dtype)
    assert_close(k_cache, ref_k, dtype, "k cache")
    assert_close(v_cache, ref_v, dtype, "v cache")


@pytest.mark.parametrize("device,dtype", cases())
def test_paged_attention_gate_and_table_rows(device, dtype):
    gen = torch.Generator().manual_seed(6)
    q_lens, kv_lens, rows = [1, 3], [6, 9], [2, 0]
    k, v = (_randn(8, 4, 2, 16, device=device, dtype=dtype, gen=gen) for _ in range(2))
    table = torch.tensor([[5, 1, 7], [0, 0, 0], [3, 6, 0]], device=device)
    q = _randn(4, 4, 16, device=device, dtype=dtype, gen=gen)
    gate = _randn(4, 4, 32, device=device, dtype=dtype, gen=gen)[..., 16:]
    meta = build_meta(q_lens, kv_lens, device, 2, 16, dtype, table_rows=rows)
    got = paged_attention(q, k, v, table, meta, 0.25, gate=gate)
    ref = paged_attention_ref(q.float().cpu(), k.float().cpu(), v.float().cpu(), table.cpu()[rows], q_lens, kv_lens, 0.25)
    assert_close(got, ref * torch.sigmoid(gate.float().cpu()), dtype)


@pytest.mark.parametrize("device,dtype", cases())
def test_recurrent_with_raw_gates(device, dtype):
    gen = torch.Generator().manual_seed(7)
    q_lens, slots = [1, 2, 1], [3, 0, 1]
    q, k = (_randn(4, 2, 16, device=device, dtype=dtype, gen=gen) for _ in range(2))
    v = _randn(4, 4, 16, device=device, dtype=dtype, gen=gen)
    ab = _randn(4, 40, device=device, dtype=dtype, gen=gen) * 4  # a and b as views of one projection
    a, b = ab[:, 30:34], ab[:, 34:38]
    a_log, dt_bias = (torch.randn(4, generator=gen).to(device, dtype) for _ in range(2))
    state = (torch.randn(4, 4, 16, 16, generator=gen) * 0.1).to(device)
    ref_state = state.cpu().clone()
    g, beta = gdn_gates_ref(a.float().cpu(), b.float().cpu(), a_log.float().cpu(), dt_bias.float().cpu())
    ref = gated_delta_rule_ref(q.float().cpu(), k.float().cpu(), v.float().cpu(), g, beta, ref_state, q_lens, slots)
    meta = build_meta(q_lens, q_lens, device, 1, 64, dtype)
    got = gated_delta_rule_recurrent(q, k, v, a, b, state, torch.tensor(slots, device=device), meta,
                                     gate_params=(a_log, dt_bias))
    assert_close(got, ref, dtype)
    assert_close(state, ref_state, dtype, "state")


@pytest.mark.parametrize("device,dtype", cases())
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_split_decode_attention(device, dtype, gated):
    """Decode steps split every sequence's keys across programs and reduce: short, long, page-crossing."""
    gen = torch.Generator().manual_seed(8)
    kv_lens = [1, 5, 17, 64, 130, 300]
    page_size, pages = 16, 128
    k, v = (_randn(pages, page_size, 2, 16, device=device, dtype=dtype, gen=gen) for _ in range(2))
    table = torch.randperm(pages, generator=gen)[: 6 * 20].view(6, 20).to(device)
    rows = [5, 0, 3, 1, 4, 2]
    q = _randn(6, 8, 16, device=device, dtype=dtype, gen=gen)
    gate = _randn(6, 8, 16, device=device, dtype=dtype, gen=gen) if gated else None
    meta = build_meta([1] * 6, kv_lens, device, 4, 16, dtype, table_rows=rows)
    got = paged_attention(q, k, v, table, meta, 0.25, gate=gate)
    ref = paged_attention_ref(q.float().cpu(), k.float().cpu(), v.float().cpu(), table.cpu()[rows], [1] * 6,
                              kv_lens, 0.25)
    if gated:
        ref = ref * torch.sigmoid(gate.float().cpu())
    assert_close(got, ref, dtype)
