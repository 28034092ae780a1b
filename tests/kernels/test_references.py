"""The per-sequence references in hkv_kernels equal transformers' pure-torch GDN fallbacks (fp32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from hkv_kernels.conv1d.reference import causal_conv1d
from hkv_kernels.gdn.reference import chunk_gated_delta_rule, recurrent_gated_delta_rule

TOL = 1e-5


def _rule_inputs(num_tokens: int, k_heads: int = 2, v_heads: int = 4, k_dim: int = 16, v_dim: int = 8, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, k_heads, k_dim, generator=gen)
    k = torch.randn(num_tokens, k_heads, k_dim, generator=gen)
    v = torch.randn(num_tokens, v_heads, v_dim, generator=gen)
    a = torch.randn(num_tokens, v_heads, generator=gen)
    b = torch.randn(num_tokens, v_heads, generator=gen)
    A_log = torch.empty(v_heads).uniform_(0.01, 16, generator=gen).log()
    dt_bias = torch.rand(v_heads, generator=gen)
    # decay and write strength as the model's gates make them (a spread of realistic decays)
    g, beta = -A_log.exp() * F.softplus(a + dt_bias), b.sigmoid()  # [T, Hv] each
    state = torch.randn(v_heads, k_dim, v_dim, generator=gen) * 0.1
    return q, k, v, g, beta, state


def _hf_rule(fn, q, k, v, g, beta, state, **kw):
    out, final = fn(
        q[None], k[None], v[None], g=g[None], beta=beta[None],
        initial_state=None if state is None else state[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True, **kw,
    )
    return out[0], final[0]


@pytest.mark.parametrize("num_tokens", [1, 3, 11])
def test_causal_conv1d_matches_fn_and_update(num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    channels, kernel = 12, 4
    x = torch.randn(num_tokens, channels, generator=gen)  # [T, C]
    weight = torch.randn(channels, kernel, generator=gen)
    zero = torch.zeros(channels, kernel - 1)
    out, state = causal_conv1d(x, zero, weight, activation="silu")
    ref = hf.causal_conv1d_fn(x.t()[None], weight, None, activation="silu")[0].t()
    assert (out - ref).abs().max() < TOL
    # decode one more token from the carried state == transformers' in-place update
    nxt = torch.randn(1, channels, generator=gen)
    hf_state = torch.cat([zero, x.t()], dim=-1)[:, -(kernel - 1):].clone()[None]
    ref_next = hf.causal_conv1d_update(nxt.t()[None], hf_state, weight, None, "silu")[0].t()
    out_next, state_next = causal_conv1d(nxt, state, weight, activation="silu")
    assert (out_next - ref_next).abs().max() < TOL
    assert torch.equal(state_next, hf_state[0])


def test_causal_conv1d_split_equals_whole():
    gen = torch.Generator().manual_seed(3)
    x, weight = torch.randn(9, 6, generator=gen), torch.randn(6, 4, generator=gen)
    bias = torch.randn(6, generator=gen)
    whole, whole_state = causal_conv1d(x, torch.zeros(6, 3), weight, bias)
    first, state = causal_conv1d(x[:2], torch.zeros(6, 3), weight, bias)
    second, state = causal_conv1d(x[2:], state, weight, bias)
    assert (torch.cat([first, second]) - whole).abs().max() < TOL
    assert torch.equal(state, whole_state)


@pytest.mark.parametrize("num_tokens,chunk_size,with_state", [(1, 64, True), (37, 16, True), (70, 64, False), (64, 64, True)])
def test_chunk_rule_matches_transformers(num_tokens, chunk_size, with_state):
    q, k, v, g, beta, state = _rule_inputs(num_tokens, seed=num_tokens)
    state = state if with_state else None
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size=chunk_size)
    ref_out, ref_final = _hf_rule(hf.torch_chunk_gated_delta_rule, q, k, v, g, beta, state, chunk_size=chunk_size)
    assert out.shape == (num_tokens, 4, 8) and final.shape == (4, 16, 8)
    assert (out - ref_out).abs().max() < TOL
    assert (final - ref_final).abs().max() < TOL


@pytest.mark.parametrize("num_tokens", [1, 9])
def test_recurrent_rule_matches_transformers(num_tokens):
    q, k, v, g, beta, state = _rule_inputs(num_tokens, seed=10 + num_tokens)
    out, final = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    ref_out, ref_final = _hf_rule(hf.torch_recurrent_gated_delta_rule, q, k, v, g, beta, state)
    assert (out - ref_out).abs().max() < TOL
    assert (final - ref_final).abs().max() < TOL


def test_chunk_split_anywhere_equals_recurrent():
    q, k, v, g, beta, state = _rule_inputs(45, seed=7)
    ref_out, ref_final = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    outs, carried = [], state
    for lo, hi in [(0, 5), (5, 6), (6, 30), (30, 45)]:
        out, carried = chunk_gated_delta_rule(
            q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], carried, chunk_size=8
        )
        outs.append(out)
    assert (torch.cat(outs) - ref_out).abs().max() < TOL
    assert (carried - ref_final).abs().max() < TOL
