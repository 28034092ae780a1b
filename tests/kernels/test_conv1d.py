"""Causal conv1d kernel against the reference: ragged prefill, decode, carried state, kept intermediates."""

import pytest
import torch

from hkv_kernels.conv1d.reference import causal_conv1d_ref
from hkv_kernels.conv1d.triton_conv1d import causal_conv1d
from hkv_kernels.meta import build_meta
from tests.kernels.helpers import assert_close, cases, nan_like

CASES = [
    ([1, 1, 1], [0, 2, 5]),  # decode
    ([3, 0, 7, 1, 2], [5, 0, 1, 2, 3]),  # ragged, an empty sequence, lengths below K-1
    ([19], [4]),  # more than one token block
]


def _inputs(device, dtype, num_tokens, channels, ksize, slots, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, channels, generator=gen).to(device, dtype)
    weight = torch.randn(channels, ksize, generator=gen).to(device, dtype)
    state = torch.randn(slots, channels, ksize - 1, generator=gen).to(device)  # the pool is fp32
    return x, weight, state


@pytest.mark.parametrize("device,dtype", cases())
@pytest.mark.parametrize("ksize", [4, 2])
def test_conv1d_matches_reference(device, dtype, ksize):
    channels = 40 if device == "cpu" else 1000
    for i, (q_lens, slots) in enumerate(CASES):
        x, weight, state = _inputs(device, dtype, sum(q_lens), channels, ksize, 6, seed=i)
        ref_state = state.cpu().clone()
        meta = build_meta(q_lens, q_lens, device, 1, 64, dtype)
        out = causal_conv1d(x, state, weight, torch.tensor(slots, device=device), meta, out=nan_like(x))
        ref = causal_conv1d_ref(x.float().cpu(), ref_state, weight.float().cpu(), q_lens, slots)
        assert_close(out, ref, dtype, f"case {i} out")
        assert_close(state, ref_state, dtype, f"case {i} state")


@pytest.mark.parametrize("device,dtype", cases())
def test_conv1d_keeps_state_after_every_token(device, dtype):
    q_lens, slots = [3, 2], [1, 4]
    keep = torch.tensor([[0, 2, 3], [5, -1, -1]], device=device)
    x, weight, state = _inputs(device, dtype, 5, 24, 4, 6, seed=7)
    ref_state = state.cpu().clone()
    meta = build_meta(q_lens, q_lens, device, 1, 64, dtype)
    out = causal_conv1d(x, state, weight, torch.tensor(slots, device=device), meta, keep_slots=keep, out=nan_like(x))
    ref = causal_conv1d_ref(x.float().cpu(), ref_state, weight.float().cpu(), q_lens, slots, keep_slots=keep.cpu())
    assert_close(out, ref, dtype)
    assert_close(state, ref_state, dtype, "kept states")
