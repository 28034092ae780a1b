"""What a model forward consumes: a flat ragged batch over paged KV, tensors only.

The model runner builds one `ForwardBatch` per step from a `StepPlan` and the
request table; model families only read it.

    sequence b owns new tokens input_ids[q_start[b] : q_start[b] + q_len[b]]
    their positions are kv_len[b] - q_len[b] ... kv_len[b] - 1
    its K/V for positions [0, kv_len[b]) live in pages page_table[table_rows[b], :ceil(kv_len[b] / page_size)]
    token t writes its K/V at flat slot slot_mapping[t] = page * page_size + offset

The per-sequence arrays and every kernel's block grid are in `meta`
(hkv_kernels.meta.KernelMeta), built once per step; on CUDA they are views of
one device buffer filled by one copy, and a decode batch keeps fixed addresses
so the forward can be replayed from a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hkv_kernels.meta import (
    CheckpointMeta, KernelMeta, StepArena, attention_tile, checkpoint_arrays, checkpoint_meta, kernel_meta, meta_arrays,
)  # fmt: skip


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64, new tokens of all sequences, concatenated
    positions: torch.Tensor  # [T] int64, absolute position of each new token
    slot_mapping: torch.Tensor  # [T] int64, flat KV slot each new token writes
    logits_indices: torch.Tensor  # [S] int64, rows of the T tokens whose logits are returned
    page_table: torch.Tensor  # [R, max_pages] page ids; sequence b reads row meta.table_rows[b]
    meta: KernelMeta  # per-sequence lengths and offsets, kernel grids (hkv_kernels/meta.py)
    state_slots: torch.Tensor | None = None  # [B] int64, live linear-state slot per sequence (hybrid)
    checkpoints: CheckpointMeta | None = None  # prefill: states kept inside chunks (in-chunk checkpoints)
    # speculative verify: [B, max q_len] state slot to write the linear state after each token into (-1: none);
    # the live slots are then left as they were (the runner adopts the accepted position's)
    keep_slots: torch.Tensor | None = None

    @classmethod
    def from_lists(
        cls, input_ids, positions, q_lens, kv_lens, page_table, slot_mapping, logits_indices,
        state_slots=None, attn_dims: tuple[int, int, torch.dtype] | None = None, checkpoints=(),
    ) -> "ForwardBatch":
        """A batch from python lists (tests, tools): page_table rows are per sequence, in batch
        order, and every tensor lands on page_table's device. attn_dims = (query heads per KV
        head, head dim, dtype) picks the attention kernel's tile; CPU references ignore it.
        checkpoints: (sequence, tokens, state slot) triples, see CheckpointMeta."""
        device = torch.as_tensor(page_table).device
        q = np.asarray(q_lens, dtype=np.int64)
        group, head_dim, dtype = attn_dims or (1, 64, torch.float32)
        tile = attention_tile(int(q.max(initial=1)), group, head_dim, dtype)
        block_t = max(1, tile[0] // group)
        arrays = meta_arrays(q, np.asarray(kv_lens, dtype=np.int64), np.arange(len(q)), block_t)
        arrays.update(input_ids=np.asarray(input_ids, dtype=np.int64), positions=np.asarray(positions, dtype=np.int64),
                      slot_mapping=np.asarray(slot_mapping, dtype=np.int64),
                      logits_indices=np.asarray(logits_indices, dtype=np.int64))
        if state_slots is not None:
            arrays["state_slots"] = np.asarray(state_slots, dtype=np.int64)
        checkpoints = tuple(tuple(int(x) for x in entry) for entry in checkpoints)
        if checkpoints:
            arrays.update(checkpoint_arrays(checkpoints, q))
        arena = StepArena(sum(len(a) + 2 for a in arrays.values()) + 2, device)
        views = arena.pack(arrays)
        return cls(
            input_ids=views["input_ids"], positions=views["positions"], slot_mapping=views["slot_mapping"],
            logits_indices=views["logits_indices"], page_table=torch.as_tensor(page_table),
            meta=kernel_meta(views, q, tile, block_t), state_slots=views.get("state_slots"),
            checkpoints=checkpoint_meta(views),
        )
