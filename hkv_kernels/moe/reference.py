"""Pure-torch MoE: the CPU path and the Triton kernels' reference.

`moe_route_ref` and `moe_experts_ref` compute what transformers' Qwen3-Next / Qwen3.5-MoE sparse
block computes, op for op (fp32 softmax, top-k, renormalisation cast to the model dtype; a loop over
the hit experts in ascending order with index_add_), so CPU serving equals transformers exactly.
`moe_align_ref` is the sort the Triton path runs on the device, as plain Python over a list.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def moe_route_ref(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [T, E] router logits -> (weights [T, k] in logits' dtype, expert ids [T, k] int64), the
    k most probable experts of each token in descending order of probability."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def moe_experts_ref(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
    shared: torch.Tensor | None = None, shared_gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) (+ sigmoid(shared_gate[t]) * shared[t]).

    x: [T, H]; w13: [E, 2I, H] (each expert's gate rows, then its up rows); w2: [E, H, I];
    weights, ids: [T, k] from the router; shared: [T, H] the shared expert's output and
    shared_gate: [T, 1] its gate logit, or both None. Returns [T, H] in x's dtype.
    """
    out = torch.zeros_like(x)
    for expert in torch.unique(ids).tolist():  # ascending, as transformers sums
        rank, tokens = torch.where(ids.T == expert)  # transformers' order: by rank, then token
        gate, up = F.linear(x[tokens], w13[expert]).chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, w2[expert]) * weights[tokens, rank, None]
        out.index_add_(0, tokens, h.to(out.dtype))
    if shared is None:
        return out
    return out + torch.sigmoid(shared_gate) * shared


def padded_pairs(num_pairs: int, num_experts: int, block: int) -> int:
    """Rows of the sorted layout, worst case: every hit expert's rows rounded up to whole blocks.

    At most min(E, pairs) experts are hit, each wasting at most block - 1 rows; the total is a whole
    number of blocks. Depends on shapes only, so a CUDA graph's buffers can be sized at capture.
    """
    rows = num_pairs + min(num_experts, num_pairs) * (block - 1)
    return -(-rows // block) * block


def moe_align_ref(ids: torch.Tensor, num_experts: int, block: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The (token, rank) pairs sorted by expert, each expert's run padded to whole blocks.

    ids: [N] the flat top-k ids (pair p = token p // k, rank p % k). Returns
    sorted_pairs [padded_pairs(N, E, block)] int32 (pair indices; padding rows hold N),
    block_expert [that / block] int32 (the expert of each block; blocks past the used ones
    are never read) and used (the rows in use, a multiple of block):

        ids            [2, 0, 2, 2]          E 3, block 2
        sorted_pairs   [1, 4 | 0, 2 | 3, 4]  (expert 0: pair 1, pad; expert 2: pairs 0, 2, 3, pad)
        block_expert   [0, 2, 2]             used 6
    """
    num_pairs = ids.numel()
    rows = padded_pairs(num_pairs, num_experts, block)
    sorted_pairs = torch.full((rows,), num_pairs, dtype=torch.int32)
    block_expert = torch.zeros(rows // block, dtype=torch.int32)
    flat = ids.reshape(-1).tolist()
    used = 0
    for expert in range(num_experts):
        pairs = [p for p, e in enumerate(flat) if e == expert]
        if not pairs:
            continue
        sorted_pairs[used:used + len(pairs)] = torch.tensor(pairs, dtype=torch.int32)
        blocks = -(-len(pairs) // block)
        block_expert[used // block:used // block + blocks] = expert
        used += blocks * block
    return sorted_pairs, block_expert, used


def dequantize_experts(w13: torch.Tensor, w2: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor],
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 stacked experts -> (w13 [E, 2I, H], w2 [E, H, I]) in `dtype` (hkv_kernels/fp8_gemm/reference.py).

    scales: s13 [E, 2 * ceil(I/128), ceil(H/128)] (the gate half's blocks, then the up half's: each half
    is tiled on its own, so I need not be a multiple of 128) and s2 [E, ceil(H/128), ceil(I/128)].
    """
    from hkv_kernels.fp8_gemm.reference import dequantize

    s13, s2 = scales
    inter, half = w13.shape[1] // 2, s13.shape[1] // 2
    gate = dequantize(w13[:, :inter], s13[:, :half], dtype)
    up = dequantize(w13[:, inter:], s13[:, half:], dtype)
    return torch.cat([gate, up], dim=1), dequantize(w2, s2, dtype)
