"""Triton recurrent Gated DeltaNet: decode in place on state slots, and speculative verification.

One program owns one (sequence, value head, Dv block): the fp32 state tile
[Dk, BLOCK_V] stays in registers across the sequence's tokens, so a decode
step reads and writes each state once. With keep slots the state after every
token is stored to its own slot and the live slot is only read. With raw gates
the kernel also computes g = -exp(A_log) * softplus(a + dt_bias) and
beta = sigmoid(b) itself (the decode path: two fewer launches per layer).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hkv_kernels.meta import KernelMeta, next_pow2


@triton.jit
def _gates(g_ptr, beta_ptr, a_log_ptr, dt_bias_ptr, row, head, stride_gt, stride_bt, RAW: tl.constexpr):
    """(decay, beta) of one token and value head; RAW: g_ptr / beta_ptr hold the a / b projections."""
    g = tl.load(g_ptr + row * stride_gt + head).to(tl.float32)
    b = tl.load(beta_ptr + row * stride_bt + head)
    if RAW:
        x = g + tl.load(dt_bias_ptr + head).to(tl.float32)
        softplus = tl.where(x > 20.0, x, tl.maximum(x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x))))
        g = -tl.exp(tl.load(a_log_ptr + head).to(tl.float32)) * softplus
        # torch's b.sigmoid() rounds to the model dtype before the rule reads it in fp32
        b = tl.sigmoid(b.to(tl.float32)).to(beta_ptr.dtype.element_ty)
    return tl.exp(g), b.to(tl.float32)


@triton.jit
def _gdn_recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, a_log_ptr, dt_bias_ptr, o_ptr, state_ptr, q_start_ptr, q_len_ptr,
    slot_ptr, keep_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt, stride_ot, stride_oh,
    stride_ss, stride_sh, stride_sk, stride_keep, scale,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    L2NORM: tl.constexpr, KEEP: tl.constexpr, RAW_GATES: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    k_head = head // GROUP
    n = tl.load(q_len_ptr + seq)
    q_start = tl.load(q_start_ptr + seq)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    dk = tl.arange(0, BLOCK_K)
    dv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_mask = dk < DK
    v_mask = dv < DV
    tile_mask = (k_mask[:, None] & v_mask[None, :]) & (n > 0)
    tile = head * stride_sh + dk[:, None] * stride_sk + dv[None, :]
    state = tl.load(state_ptr + slot * stride_ss + tile, mask=tile_mask, other=0.0).to(tl.float32)  # [BK, BV]
    for t in range(0, n):
        row = (q_start + t).to(tl.int64)
        qv = tl.load(q_ptr + row * stride_qt + k_head * stride_qh + dk, mask=k_mask, other=0.0).to(tl.float32)
        kv = tl.load(k_ptr + row * stride_kt + k_head * stride_kh + dk, mask=k_mask, other=0.0).to(tl.float32)
        if L2NORM:
            qv = qv * tl.rsqrt(tl.sum(qv * qv) + 1e-6)
            kv = kv * tl.rsqrt(tl.sum(kv * kv) + 1e-6)
        qv = qv * scale
        vv = tl.load(v_ptr + row * stride_vt + head * stride_vh + dv, mask=v_mask, other=0.0).to(tl.float32)
        decay, beta = _gates(g_ptr, beta_ptr, a_log_ptr, dt_bias_ptr, row, head, stride_gt, stride_bt, RAW_GATES)
        state = state * decay
        delta = (vv - tl.sum(state * kv[:, None], 0)) * beta  # [BV]
        state = state + kv[:, None] * delta[None, :]
        out = tl.sum(state * qv[:, None], 0)  # [BV]
        tl.store(o_ptr + row * stride_ot + head * stride_oh + dv, out.to(o_ptr.dtype.element_ty), mask=v_mask)
        if KEEP:
            dst = tl.load(keep_ptr + seq * stride_keep + t).to(tl.int64)
            tl.store(state_ptr + dst * stride_ss + tile, state, mask=tile_mask & (dst >= 0))
    if not KEEP:
        tl.store(state_ptr + slot * stride_ss + tile, state, mask=tile_mask)


def gated_delta_rule_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    meta: KernelMeta,
    keep_slots: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    gate_params: tuple[torch.Tensor, torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
    tile: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Gated delta rule token by token for each sequence, from and to its state slot (Triton).

    q, k: [T, Hk, Dk] (Dk contiguous; may be views into the conv output);
    v: [T, Hv, Dv] (Dv contiguous); Hv a multiple of Hk, value head h reads key head h // (Hv // Hk);
    g (log decay), beta: [T, Hv] (head contiguous) or, with gate_params = (A_log, dt_bias) ([Hv]
        each), the raw a and b projections from which the kernel computes them;
    state: [S, Hv, Dk, Dv] fp32, one layer of the state pool, updated in place;
    slots: [B] int on the GPU; meta: the step's KernelMeta (q_start, q_len);
    keep_slots: None (final state overwrites slots[b]) or [B, max_n] int: the state after
        token t goes to keep_slots[b, t] (entries < 0 skipped), slots[b] only read;
    out: optional [T, Hv, Dv] to write into; tile: (BLOCK_V, num_warps) override (benchmark sweeps).
    Returns out: [T, Hv, Dv] in q's dtype.
    """
    num_tokens, num_k_heads, k_dim = q.shape
    num_v_heads, v_dim = v.shape[1], v.shape[2]
    if out is None:
        out = torch.empty(num_tokens, num_v_heads, v_dim, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1 and state.stride(3) == 1
    assert g.stride(1) == 1 and beta.stride(1) == 1 and state.dtype == torch.float32
    # (64, 2) won the H200 sweep at batch 64, 16 key / 32 value heads of 128: 75% of copy bandwidth
    block_v, num_warps = tile or (min(64, next_pow2(v_dim)), 2)
    keep = keep_slots is not None
    a_log, dt_bias = gate_params if gate_params is not None else (g, g)
    grid = (meta.num_seqs, num_v_heads, triton.cdiv(v_dim, block_v))
    _gdn_recurrent_kernel[grid](
        q, k, v, g, beta, a_log, dt_bias, out, state, meta.q_start, meta.q_len, slots, keep_slots if keep else slots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        out.stride(0), out.stride(1), state.stride(0), state.stride(1), state.stride(2),
        keep_slots.stride(0) if keep else 0, k_dim**-0.5,
        GROUP=num_v_heads // num_k_heads, DK=k_dim, DV=v_dim, BLOCK_K=next_pow2(k_dim), BLOCK_V=block_v,
        L2NORM=use_qk_l2norm, KEEP=keep, RAW_GATES=gate_params is not None, num_warps=num_warps,
    )
    return out
