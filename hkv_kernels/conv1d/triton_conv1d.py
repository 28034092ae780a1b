"""Triton causal depthwise conv1d over a ragged batch with the conv state in state-pool slots.

Two launches on one stream: the first computes every output (reading the old
states), the second writes the new states, so no program overwrites a state
another program still reads. Prefill, decode (one token) and speculative
verification (keep the state after every token) share both kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hkv_kernels.meta import CONV_BLOCK_T, KernelMeta, next_pow2


@triton.jit
def _conv_out_kernel(
    x_ptr, state_ptr, w_ptr, bias_ptr, o_ptr, q_start_ptr, q_len_ptr, slot_ptr, block_seq_ptr, block_tok_ptr,
    num_channels, stride_xt, stride_ot, stride_ss, stride_sc, stride_wc,
    KSIZE: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    blk = tl.program_id(0)
    seq = tl.load(block_seq_ptr + blk)
    t0 = tl.load(block_tok_ptr + blk)
    n = tl.load(q_len_ptr + seq)
    q_start = tl.load(q_start_ptr + seq)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    i = t0 + tl.arange(0, BLOCK_T)  # [BT] token index within the sequence
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BC]
    t_mask = i < n
    c_mask = c < num_channels
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    for j in tl.static_range(KSIZE):
        p = i - (KSIZE - 1) + j  # input index; p < 0 reads the carried state
        mask = t_mask[:, None] & c_mask[None, :]
        from_x = (p >= 0)[:, None]
        xv = tl.load(x_ptr + (q_start + p).to(tl.int64)[:, None] * stride_xt + c[None, :], mask=mask & from_x, other=0.0)
        sv = tl.load(
            state_ptr + slot * stride_ss + c[None, :] * stride_sc + (KSIZE - 1 + p)[:, None], mask=mask & ~from_x, other=0.0
        )
        w = tl.load(w_ptr + c * stride_wc + j, mask=c_mask, other=0.0).to(tl.float32)
        acc += (xv.to(tl.float32) + sv.to(tl.float32)) * w[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    rows = (q_start + i).to(tl.int64)[:, None] * stride_ot + c[None, :]
    tl.store(o_ptr + rows, acc.to(o_ptr.dtype.element_ty), mask=t_mask[:, None] & c_mask[None, :])


@triton.jit
def _conv_state_kernel(
    x_ptr, state_ptr, q_start_ptr, q_len_ptr, slot_ptr, keep_ptr, num_channels, stride_xt, stride_ss, stride_sc,
    stride_keep, KSIZE: tl.constexpr, KEEP: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
):
    seq = tl.program_id(0)
    out_idx = tl.program_id(2)
    n = tl.load(q_len_ptr + seq)
    q_start = tl.load(q_start_ptr + seq)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    if KEEP:
        # state after token out_idx, into its own slot; the live slot is only read
        after = out_idx + 1
        dst = tl.load(keep_ptr + seq * stride_keep + out_idx, mask=out_idx < n, other=-1).to(tl.int64)
        active = (out_idx < n) & (dst >= 0)
    else:
        after = n
        dst = slot
        active = n > 0
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = tl.arange(0, BLOCK_K)
    p = after - (KSIZE - 1) + m  # input index of state column m; p < 0 is an older state column
    mask = active & (c < num_channels)[:, None] & (m < KSIZE - 1)[None, :]
    xv = tl.load(x_ptr + (q_start + p).to(tl.int64)[None, :] * stride_xt + c[:, None], mask=mask & (p >= 0)[None, :], other=0.0)
    sv = tl.load(state_ptr + slot * stride_ss + c[:, None] * stride_sc + (after + m)[None, :], mask=mask & (p < 0)[None, :], other=0.0)
    val = xv.to(tl.float32) + sv.to(tl.float32)
    tl.store(state_ptr + dst * stride_ss + c[:, None] * stride_sc + m[None, :], val.to(state_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _conv_decode_kernel(
    x_ptr, state_ptr, w_ptr, bias_ptr, o_ptr, q_start_ptr, slot_ptr, num_channels, stride_xt, stride_ot,
    stride_ss, stride_sc, stride_wc,
    KSIZE: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One new token per sequence: output and state shift in one pass (each program its own channels)."""
    seq = tl.program_id(0)
    row = tl.load(q_start_ptr + seq).to(tl.int64)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BC]
    m = tl.arange(0, BLOCK_K)  # [BK] state columns, oldest first
    c_mask = c < num_channels
    s_mask = c_mask[:, None] & (m < KSIZE - 1)[None, :]
    s_ptrs = state_ptr + slot * stride_ss + c[:, None] * stride_sc + m[None, :]
    old = tl.load(s_ptrs, mask=s_mask, other=0.0).to(tl.float32)  # [BC, BK]
    xv = tl.load(x_ptr + row * stride_xt + c, mask=c_mask, other=0.0).to(tl.float32)  # [BC]
    w_old = tl.load(w_ptr + c[:, None] * stride_wc + m[None, :], mask=s_mask, other=0.0).to(tl.float32)
    w_new = tl.load(w_ptr + c * stride_wc + (KSIZE - 1), mask=c_mask, other=0.0).to(tl.float32)
    acc = tl.sum(old * w_old, 1) + xv * w_new  # [BC]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + c, mask=c_mask, other=0.0).to(tl.float32)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(o_ptr + row * stride_ot + c, acc.to(o_ptr.dtype.element_ty), mask=c_mask)
    # shift left by one and append the new input: column m takes old column m + 1, the last takes x
    nxt = tl.load(s_ptrs + 1, mask=c_mask[:, None] & (m < KSIZE - 2)[None, :], other=0.0).to(tl.float32)
    new = tl.where((m == KSIZE - 2)[None, :], xv[:, None], nxt)
    tl.debug_barrier()  # every load of the old state precedes the first store
    tl.store(s_ptrs, new.to(state_ptr.dtype.element_ty), mask=s_mask)


def causal_conv1d(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    slots: torch.Tensor,
    meta: KernelMeta,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    keep_slots: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal depthwise conv of each sequence's new tokens from its slot's state (Triton).

    x: [T, C] new tokens of all B sequences in order (channels contiguous, rows may be strided);
    conv_state: [S, C, K-1] one layer of the state pool (oldest input first), updated in place;
    weight: [C, K]; bias: [C] or None; slots: [B] int on x's device;
    meta: the step's KernelMeta (q_start, q_len and the conv block grid);
    keep_slots: None (final state overwrites slots[b]) or [B, max_n] int: state after
        token t goes to keep_slots[b, t] (entries < 0 skipped) and slots[b] is left as it was;
    out: optional [T, C] to write into.
    Returns out: [T, C] in x's dtype, silu applied when activation == "silu".
    """
    if activation not in ("silu", None):
        raise ValueError(f"unsupported conv activation {activation!r}")
    num_tokens, num_channels = x.shape
    ksize = weight.shape[-1]
    assert x.stride(1) == 1 and conv_state.stride(2) == 1 and weight.stride(1) == 1
    out = torch.empty(num_tokens, num_channels, dtype=x.dtype, device=x.device) if out is None else out
    num_blocks = meta.conv_block_seq.numel()
    if num_tokens == 0 or num_blocks == 0:
        return out
    if meta.max_q_len == 1 and keep_slots is None and num_tokens == meta.num_seqs:
        # decode: one fused pass instead of a 16-token block per sequence and a second launch
        block_c = 256
        _conv_decode_kernel[(meta.num_seqs, triton.cdiv(num_channels, block_c))](
            x, conv_state, weight, bias if bias is not None else weight, out, meta.q_start, slots, num_channels,
            x.stride(0), out.stride(0), conv_state.stride(0), conv_state.stride(1), weight.stride(0),
            KSIZE=ksize, HAS_BIAS=bias is not None, SILU=activation == "silu", BLOCK_C=block_c,
            BLOCK_K=next_pow2(ksize - 1), num_warps=4,
        )
        return out
    block_c = 128
    _conv_out_kernel[(num_blocks, triton.cdiv(num_channels, block_c))](
        x, conv_state, weight, bias if bias is not None else weight, out, meta.q_start, meta.q_len, slots,
        meta.conv_block_seq, meta.conv_block_tok,
        num_channels, x.stride(0), out.stride(0), conv_state.stride(0), conv_state.stride(1), weight.stride(0),
        KSIZE=ksize, HAS_BIAS=bias is not None, SILU=activation == "silu", BLOCK_T=CONV_BLOCK_T, BLOCK_C=block_c,
        num_warps=4,
    )
    keep = keep_slots is not None
    num_out = keep_slots.shape[1] if keep else 1
    _conv_state_kernel[(meta.num_seqs, triton.cdiv(num_channels, block_c), num_out)](
        x, conv_state, meta.q_start, meta.q_len, slots, keep_slots if keep else slots, num_channels, x.stride(0),
        conv_state.stride(0), conv_state.stride(1), keep_slots.stride(0) if keep else 0,
        KSIZE=ksize, KEEP=keep, BLOCK_C=block_c, BLOCK_K=next_pow2(ksize - 1), num_warps=4,
    )
    return out
