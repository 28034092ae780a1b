"""Small host-side helpers shared by the Triton launchers."""

from __future__ import annotations

import torch


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (and >= 1)."""
    return 1 << max(0, (n - 1).bit_length())


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: exact fp32 for fp32 operands (parity runs), the fast default otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"


# int32 elements per 16 bytes: every view below starts 16-byte aligned
_ALIGN = 4


def to_device_ints(rows: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """Several int32 host lists as views of one device tensor: one host-to-device copy, not one per list.

    Each view starts on a 16-byte boundary: Triton specializes pointer arguments on
    alignment, so unpadded views would compile a new kernel variant per batch size mod 4.
    """
    flat, starts = [], []
    for r in rows:
        starts.append(len(flat))
        flat += r
        flat += [0] * (-len(flat) % _ALIGN)
    flat_t = torch.tensor(flat, dtype=torch.int32).to(device, non_blocking=True)
    return [flat_t[start : start + len(r)] for start, r in zip(starts, rows)]


def ragged_metadata(q_lens: list[int], extra: list[list[int]], block_t: int, device: torch.device):
    """(q_start, q_len, *extra, block_seq, block_tok) as int32 device tensors from one copy.

    block i of (block_seq, block_tok) covers tokens block_tok[i] .. + block_t - 1 of sequence
    block_seq[i]; sequences with no new tokens get no block.
    """
    starts, acc, seqs, toks = [], 0, [], []
    for b, n in enumerate(q_lens):
        starts.append(acc)
        acc += n
        for t in range(0, n, block_t):
            seqs.append(b)
            toks.append(t)
    return to_device_ints([starts, list(q_lens), *extra, seqs, toks], device)
