"""What a model forward consumes: a flat ragged batch over paged KV.

The model runner builds one `ForwardBatch` per step from a `StepPlan` and the
request table; model families only read it.

    sequence b owns new tokens input_ids[q_start[b] : q_start[b] + q_lens[b]]
    their positions are kv_lens[b] - q_lens[b] ... kv_lens[b] - 1
    its K/V for positions [0, kv_lens[b]) live in pages page_table[b, :ceil(kv_lens[b] / page_size)]
    token t writes its K/V at flat slot slot_mapping[t] = page * page_size + offset
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64, new tokens of all sequences, concatenated
    positions: torch.Tensor  # [T] int64, absolute position of each new token
    q_lens: list[int]  # [B] new tokens per sequence
    kv_lens: list[int]  # [B] tokens in KV per sequence after this step (cached + new)
    page_table: torch.Tensor  # [B, max_pages] int64, page ids per sequence (rows padded with 0)
    slot_mapping: torch.Tensor  # [T] int64, flat KV slot each new token writes
    logits_indices: torch.Tensor  # [S] int64, rows of the T tokens whose logits are returned
    state_slots: torch.Tensor | None = None  # [B] int64, live linear-state slot per sequence (hybrid)

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @property
    def q_starts(self) -> list[int]:
        """Offset of each sequence's first new token in input_ids."""
        starts, acc = [], 0
        for n in self.q_lens:
            starts.append(acc)
            acc += n
        return starts
