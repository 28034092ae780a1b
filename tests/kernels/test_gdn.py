"""Gated DeltaNet kernels against the references: decode in place, prefill, speculative verification."""

import numpy as np
import pytest
import torch

from hkv_kernels.gdn.fla_chunk import fla_available, gated_delta_rule_chunked
from hkv_kernels.gdn.reference import gated_delta_rule_ref
from hkv_kernels.gdn.triton_recurrent import gated_delta_rule_recurrent
from hkv_kernels.meta import build_meta
from tests.kernels.helpers import HAS_CUDA, REL_TOL, assert_close, cases, nan_like, rel_err


def _inputs(device, dtype, num_tokens, dims, num_slots, seed):
    k_heads, v_heads, k_dim, v_dim = dims
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, k_heads, k_dim, generator=gen).to(device, dtype)
    k = torch.randn(num_tokens, k_heads, k_dim, generator=gen).to(device, dtype)
    v = torch.randn(num_tokens, v_heads, v_dim, generator=gen).to(device, dtype)
    g = (-torch.rand(num_tokens, v_heads, generator=gen) * 0.5).to(device)  # fp32 log decay
    beta = torch.rand(num_tokens, v_heads, generator=gen).to(device, dtype)
    state = (torch.randn(num_slots, v_heads, k_dim, v_dim, generator=gen) * 0.1).to(device)
    return q, k, v, g, beta, state


def _ref(q, k, v, g, beta, state, q_lens, slots, keep=None):
    ref_state = state.cpu().clone()
    ref = gated_delta_rule_ref(
        q.float().cpu(), k.float().cpu(), v.float().cpu(), g.cpu(), beta.float().cpu(), ref_state, q_lens, slots,
        keep_slots=None if keep is None else keep.cpu(),
    )
    return ref, ref_state


def _dims(device):
    return (2, 4, 16, 32) if device == "cpu" else (4, 8, 128, 128)


@pytest.mark.parametrize("device,dtype", cases())
@pytest.mark.parametrize("q_lens,slots", [([1, 1, 1], [0, 2, 4]), ([3, 0, 6, 1], [5, 0, 1, 2])], ids=["decode", "ragged"])
def test_recurrent_matches_reference(device, dtype, q_lens, slots):
    q, k, v, g, beta, state = _inputs(device, dtype, sum(q_lens), _dims(device), 6, seed=len(q_lens))
    ref, ref_state = _ref(q, k, v, g, beta, state, q_lens, slots)
    meta = build_meta(q_lens, q_lens, device, 1, 64, dtype)
    out = gated_delta_rule_recurrent(q, k, v, g, beta, state, torch.tensor(slots, device=device), meta, out=nan_like(v))
    assert_close(out, ref, dtype)
    assert_close(state, ref_state, dtype, "state")


@pytest.mark.parametrize("device,dtype", cases())
def test_recurrent_keeps_k_plus_1_states(device, dtype):
    # two sequences verifying 2 drafted tokens (3 positions) and 1 (2 positions, padded with -1)
    q_lens, slots = [3, 2], [1, 4]
    keep = torch.tensor([[0, 2, 3], [5, 6, -1]], device=device)
    q, k, v, g, beta, state = _inputs(device, dtype, 5, _dims(device), 8, seed=3)
    ref, ref_state = _ref(q, k, v, g, beta, state, q_lens, slots, keep)
    meta = build_meta(q_lens, q_lens, device, 1, 64, dtype)
    out = gated_delta_rule_recurrent(
        q, k, v, g, beta, state, torch.tensor(slots, device=device), meta, keep_slots=keep, out=nan_like(v)
    )
    assert_close(out, ref, dtype)
    assert_close(state, ref_state, dtype, "kept states (live slots untouched)")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.skipif(HAS_CUDA and not fla_available(), reason="fla-core not installed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_fla_chunk_matches_reference(dtype):
    q_lens, slots = [300, 1, 0, 64, 129], [3, 0, 1, 5, 2]
    q, k, v, g, beta, state = _inputs("cuda", dtype, sum(q_lens), (4, 8, 128, 128), 6, seed=5)
    ref, ref_state = _ref(q, k, v, g, beta, state, q_lens, slots)
    live = [b for b, n in enumerate(q_lens) if n > 0]  # fla takes sequences with new tokens only
    meta = build_meta([q_lens[b] for b in live], [q_lens[b] for b in live], "cuda", 1, 64, dtype)
    out = gated_delta_rule_chunked(q, k, v, g, beta, state, torch.tensor([slots[b] for b in live], device="cuda"), meta)
    # fla computes its chunk products in the input dtype and tf32 for fp32 inputs
    tol = max(REL_TOL[dtype], 2e-3)
    assert rel_err(out, ref) < tol and rel_err(state, ref_state) < tol


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.skipif(HAS_CUDA and not fla_available(), reason="fla-core not installed")
def test_fla_chunk_states_are_the_states_at_chunk_boundaries():
    """The per-chunk states fla's forward materializes are the recurrent states after 64, 128, ...
    tokens (issue 12's in-chunk checkpoints), and the kernel-by-kernel forward (chunk metadata
    from the step's KernelMeta) is fla's own."""
    from hkv_kernels.gdn.fla_chunk import _chunked_with_states
    from hkv_kernels.meta import checkpoint_arrays

    dtype = torch.bfloat16
    q_lens, slots = [200, 129], [3, 0]
    q, k, v, g, beta, state = _inputs("cuda", dtype, sum(q_lens), (4, 8, 128, 128), 6, seed=9)
    meta = build_meta(q_lens, q_lens, "cuda", 1, 64, dtype)
    initial = state.index_select(0, torch.tensor(slots, device="cuda"))
    out, final, h = _chunked_with_states(q.contiguous()[None], k.contiguous()[None], v.contiguous()[None],
                                         g.float().contiguous()[None], beta.contiguous()[None], initial,
                                         q.shape[-1] ** -0.5, meta)
    # fla's own entry point (autograd function, its chunk metadata derived from cu_seqlens)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    ref_out, ref_final = chunk_gated_delta_rule(
        q.contiguous()[None], k.contiguous()[None], v.contiguous()[None], g.float().contiguous()[None],
        beta.contiguous()[None], scale=q.shape[-1] ** -0.5, initial_state=initial.clone(), output_final_state=True,
        use_qk_l2norm_in_kernel=True, cu_seqlens=meta.cu_seqlens,
    )
    assert rel_err(out, ref_out) < 1e-3 and rel_err(final, ref_final) < 1e-3
    entries = [(0, 64, 0), (0, 128, 0), (0, 192, 0), (1, 64, 0), (1, 128, 0)]  # the h rows CheckpointMeta carries
    rows = checkpoint_arrays(entries, np.asarray(q_lens))["ckpt_hrows"]
    assert rows.tolist() == [1, 2, 3, 5, 6]  # the first sequence has 4 chunks (200 tokens)
    got = h[0, torch.from_numpy(rows).cuda()].float()
    for i, (b, t) in enumerate([(0, 64), (0, 128), (0, 192), (1, 64), (1, 128)]):
        start = sum(q_lens[:b])
        _, want = _ref(q[start : start + t], k[start : start + t], v[start : start + t], g[start : start + t],
                       beta[start : start + t], state, [t], [slots[b]])
        assert rel_err(got[i], want[slots[b]]) < 2e-2, (b, t)


def test_step_metadata_carries_flas_chunk_indices():
    """fla's varlen chunk metadata, made once per step on the host: (sequence, chunk) per 64-token
    chunk and each sequence's first chunk (fla's prepare_chunk_indices / prepare_chunk_offsets)."""
    meta = build_meta([3, 64, 130, 65], [3, 64, 130, 65], "cpu", 1, 64, torch.float32)
    assert meta.fla_chunk_indices.tolist() == [[0, 0], [1, 0], [2, 0], [2, 1], [2, 2], [3, 0], [3, 1]]
    assert meta.fla_chunk_offsets.tolist() == [0, 1, 2, 5, 7]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.skipif(HAS_CUDA and not fla_available(), reason="fla-core not installed")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fla_chunk_with_raw_gates_matches_the_torch_gates(dtype):
    """With (A_log, dt_bias) the chunked rule takes the raw a / b projections: the decay is made
    inside fla's chunk cumsum, beta by torch's sigmoid, as gdn_gates_ref makes them."""
    from hkv_kernels.gdn.reference import gdn_gates_ref

    q_lens, slots = [300, 1, 64, 129], [3, 0, 5, 2]
    q, k, v, _, _, state = _inputs("cuda", dtype, sum(q_lens), (4, 8, 128, 128), 6, seed=11)
    gen = torch.Generator().manual_seed(12)
    a = torch.randn(sum(q_lens), 8, generator=gen).to("cuda", dtype)
    b = torch.randn(sum(q_lens), 8, generator=gen).to("cuda", dtype)
    a_log = torch.log(torch.empty(8).uniform_(1, 16, generator=gen)).to("cuda", dtype)
    dt_bias = torch.randn(8, generator=gen).to("cuda", dtype)
    g, beta = gdn_gates_ref(a, b, a_log, dt_bias)
    meta = build_meta(q_lens, q_lens, "cuda", 1, 64, dtype)
    ref_state = state.clone()
    ref = gated_delta_rule_chunked(q, k, v, g, beta, ref_state, torch.tensor(slots, device="cuda"), meta)
    out = gated_delta_rule_chunked(q, k, v, a, b, state, torch.tensor(slots, device="cuda"), meta,
                                   gate_params=(a_log, dt_bias))
    assert rel_err(out, ref) < 1e-2 and rel_err(state, ref_state) < 1e-2
