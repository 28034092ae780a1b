"""In-chunk checkpoints (issue 12) at the kernel level: the state after every GDN chunk boundary
inside a prefill chunk, written into its own slot by the same forward.

On CPU (fp32) the references must give, bit for bit, the outputs and final states of the chunk
without checkpoints, and checkpoint states equal to those of the chunk cut there. The recurrent
Triton kernel (the interpreter on CPU, CUDA marked gpu) keeps them through its keep slots;
fla-core's path (CUDA, bf16/fp16) reads them from the chunk states its forward materializes.
"""

import numpy as np
import pytest
import torch

from hkv_kernels import dispatch
from hkv_kernels.conv1d.reference import causal_conv1d_ref, conv_checkpoints_ref
from hkv_kernels.gdn.fla_chunk import fla_available, gated_delta_rule_chunked
from hkv_kernels.gdn.reference import gated_delta_rule_ref, gdn_gates_ref
from hkv_kernels.gdn.triton_recurrent import gated_delta_rule_recurrent
from hkv_kernels.meta import StepArena, build_meta, checkpoint_arrays, checkpoint_meta
from tests.kernels.helpers import HAS_CUDA, assert_close, cases, nan_like

Q_LENS, SLOTS = [200, 1, 130], [0, 1, 2]
CHECKPOINTS = ((0, 64, 5), (0, 192, 6), (2, 128, 7))  # (sequence, tokens, slot)


def _inputs(num_tokens, device="cpu", dtype=torch.float32, dims=(2, 4, 16, 8), seed=0):
    k_heads, v_heads, k_dim, v_dim = dims
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, k_heads, k_dim, generator=gen).to(device, dtype)
    k = torch.randn(num_tokens, k_heads, k_dim, generator=gen).to(device, dtype)
    v = torch.randn(num_tokens, v_heads, v_dim, generator=gen).to(device, dtype)
    g = (-torch.rand(num_tokens, v_heads, generator=gen) * 0.5).to(device)
    beta = torch.rand(num_tokens, v_heads, generator=gen).to(device, dtype)
    state = (torch.randn(8, v_heads, k_dim, v_dim, generator=gen) * 0.1).to(device)
    return q, k, v, g, beta, state


def _checkpoints(q_lens, entries, device):
    arrays = checkpoint_arrays(entries, np.asarray(q_lens))
    return checkpoint_meta(StepArena(64, torch.device(device)).pack(arrays))


def _rows(b, lo, hi):
    start = sum(Q_LENS[:b])
    return slice(start + lo, start + hi)


def test_reference_checkpoints_equal_the_chunk_cut_there_and_change_nothing_else():
    q, k, v, g, beta, state = _inputs(sum(Q_LENS))
    plain, kept = state.clone(), state.clone()
    out = gated_delta_rule_ref(q, k, v, g, beta, plain, Q_LENS, SLOTS)
    out_kept = gated_delta_rule_ref(q, k, v, g, beta, kept, Q_LENS, SLOTS, checkpoints=CHECKPOINTS)
    assert torch.equal(out_kept, out) and torch.equal(kept[:5], plain[:5])  # outputs, live slots
    for b, tokens, slot in CHECKPOINTS:
        cut = state.clone()
        rows = _rows(b, 0, tokens)
        first = gated_delta_rule_ref(q[rows], k[rows], v[rows], g[rows], beta[rows], cut, [tokens], [SLOTS[b]])
        assert torch.equal(kept[slot], cut[SLOTS[b]]), f"checkpoint at {tokens} of sequence {b}"
        assert torch.equal(first, out[rows])
        rest = _rows(b, tokens, Q_LENS[b])
        second = gated_delta_rule_ref(q[rest], k[rest], v[rest], g[rest], beta[rest], cut,
                                      [Q_LENS[b] - tokens], [SLOTS[b]])
        assert torch.equal(second, out[rest]) and torch.equal(cut[SLOTS[b]], plain[SLOTS[b]])


def test_conv_checkpoints_are_the_last_inputs_before_the_boundary():
    gen = torch.Generator().manual_seed(4)
    x, weight = torch.randn(sum(Q_LENS), 12, generator=gen), torch.randn(12, 4, generator=gen)
    conv_state = torch.randn(8, 12, 3, generator=gen)
    initial = conv_state.clone()
    meta = _checkpoints(Q_LENS, CHECKPOINTS, "cpu")
    conv_checkpoints_ref(x, conv_state, meta.rows, meta.slots)
    for b, tokens, slot in CHECKPOINTS:
        cut = initial.clone()
        causal_conv1d_ref(x[_rows(b, 0, tokens)], cut, weight, [tokens], [SLOTS[b]])
        assert torch.equal(conv_state[slot], cut[SLOTS[b]]), f"conv checkpoint at {tokens} of sequence {b}"
    untouched = [s for s in range(8) if s not in (5, 6, 7)]
    assert torch.equal(conv_state[untouched], initial[untouched])


def test_dispatch_on_cpu_is_the_reference_with_checkpoints():
    q, k, v, g, beta, state = _inputs(sum(Q_LENS))
    gen = torch.Generator().manual_seed(9)
    a, b = torch.randn(sum(Q_LENS), 4, generator=gen), torch.randn(sum(Q_LENS), 4, generator=gen)
    gates = (torch.randn(4, generator=gen), torch.rand(4, generator=gen))
    meta = build_meta(Q_LENS, Q_LENS, "cpu", 1, 64, torch.float32)
    ours, ref = state.clone(), state.clone()
    out = dispatch.gated_delta_rule(q, k, v, a, b, gates, ours, torch.tensor(SLOTS), meta,
                                    checkpoints=_checkpoints(Q_LENS, CHECKPOINTS, "cpu"))
    g, beta = gdn_gates_ref(a, b, *gates)
    assert torch.equal(out, gated_delta_rule_ref(q, k, v, g, beta, ref, Q_LENS, SLOTS, checkpoints=CHECKPOINTS))
    assert torch.equal(ours, ref)
    with pytest.raises(ValueError, match="keep_slots"):
        dispatch.gated_delta_rule(q, k, v, a, b, gates, ours, torch.tensor(SLOTS), meta,
                                  keep_slots=torch.zeros(3, 200, dtype=torch.long),
                                  checkpoints=_checkpoints(Q_LENS, CHECKPOINTS, "cpu"))


def _reference(q, k, v, g, beta, state, checkpoints):
    ref_state = state.cpu().clone()
    out = gated_delta_rule_ref(q.float().cpu(), k.float().cpu(), v.float().cpu(), g.cpu(), beta.float().cpu(),
                               ref_state, Q_LENS, SLOTS, checkpoints=checkpoints)
    return out, ref_state


@pytest.mark.parametrize("device,dtype", cases())
def test_recurrent_kernel_keeps_the_checkpoints_through_keep_slots(device, dtype):
    dims = (2, 4, 16, 32) if device == "cpu" else (4, 8, 128, 128)
    q, k, v, g, beta, state = _inputs(sum(Q_LENS), device, dtype, dims, seed=2)
    ref, ref_state = _reference(q, k, v, g, beta, state, CHECKPOINTS)
    meta = build_meta(Q_LENS, Q_LENS, device, 1, 64, dtype)
    slots = torch.tensor(SLOTS, device=device)
    keep = dispatch._checkpoint_keep_slots(slots, meta, _checkpoints(Q_LENS, CHECKPOINTS, device))
    assert keep[0, 63] == 5 and keep[0, 191] == 6 and keep[0, 199] == 0 and keep[1, 0] == 1 and keep[2, 127] == 7
    assert int((keep >= 0).sum()) == 6
    out = gated_delta_rule_recurrent(q, k, v, g, beta, state, slots, meta, keep_slots=keep, out=nan_like(v))
    assert_close(out, ref, dtype)
    assert_close(state, ref_state, dtype, "live and checkpoint states")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or not fla_available(), reason="needs CUDA and fla-core")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fla_chunk_keeps_the_checkpoints(dtype):
    q, k, v, g, beta, state = _inputs(sum(Q_LENS), "cuda", dtype, (4, 8, 128, 128), seed=6)
    ref, ref_state = _reference(q, k, v, g, beta, state, CHECKPOINTS)
    meta = build_meta(Q_LENS, Q_LENS, "cuda", 1, 64, dtype)
    out = gated_delta_rule_chunked(q, k, v, g, beta, state, torch.tensor(SLOTS, device="cuda"), meta,
                                   checkpoints=_checkpoints(Q_LENS, CHECKPOINTS, "cuda"))
    assert_close(out, ref, dtype)
    assert_close(state, ref_state, dtype, "live and checkpoint states")
