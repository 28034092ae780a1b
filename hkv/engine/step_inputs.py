"""A StepPlan's chunks as the arrays of one forward: tokens, positions, slots, lengths, page tables.

    chunks  (slot 3: 5 prompt tokens from 0) (slot 1: 1 decode token at 9)
    tokens  [ t t t t t | t ]              q_lens [5, 1]   kv_lens [5, 10]
    slots   page_ids[row, pos // P] * P + pos % P  for every new token

`StepInputs` is pure numpy, built from the plan and the shared request table.
`DevicePageTable` keeps the request table's page ids on the GPU, uploading only
the pages a step adds (a decode crosses a page every `page_size` tokens), so
kernels read page ids by request-table row and a step copies a few integers,
not a [batch, max_pages] table.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from hkv.ipc.messages import Chunk
from hkv.ipc.request_table import RequestTable
from hkv_kernels.gdn import GDN_CHUNK
from hkv_kernels.meta import StepArena


@dataclass(frozen=True)
class StepInputs:
    """The int64 arrays of one step's forward (T tokens, B sequences, S sampled rows)."""

    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T] flat KV slot of each new token
    logits_indices: np.ndarray  # [S] the last token of every chunk that samples
    q_lens: np.ndarray  # [B]
    kv_lens: np.ndarray  # [B] cached + new tokens
    rows: np.ndarray  # [B] request-table row (slot) of each sequence
    max_pages: int  # pages the longest sequence's KV spans
    state_slots: np.ndarray | None  # [B] live linear-state slot of each sequence (hybrid models)
    sample_rows: np.ndarray  # [S] request-table row of each sampling chunk, in logits order
    follow_idx: np.ndarray  # [F] token index of each fed-in token (Chunk.follows), into input_ids
    follow_rows: np.ndarray  # [F] the row whose last sampled token it is
    checkpoints: tuple[tuple[int, int, int], ...] = ()  # (sequence, tokens, state slot): see CheckpointMeta

    @classmethod
    def of(cls, chunks: list[Chunk], table: RequestTable, page_size: int,
           state_of: dict[int, int] | None = None) -> "StepInputs":
        """state_of: request-table row -> live state slot (hybrid models), else None."""
        q_lens = np.array([len(c.token_ids) for c in chunks], dtype=np.int64)  # [B]
        starts = np.array([c.start_pos for c in chunks], dtype=np.int64)  # [B]
        kv_lens = starts + q_lens  # [B]
        rows = np.array([c.slot for c in chunks], dtype=np.int64)
        max_pages = int((kv_lens.max() + page_size - 1) // page_size)
        seq_of_token = np.repeat(np.arange(len(chunks)), q_lens)  # [T]
        first_token = np.cumsum(q_lens) - q_lens  # [B]
        positions = starts[seq_of_token] + (np.arange(int(q_lens.sum())) - first_token[seq_of_token])  # [T]
        pages = table.page_ids[rows[seq_of_token], positions // page_size].astype(np.int64)  # [T]
        sample_rows = np.array([c.sample for c in chunks], dtype=bool)
        follows = np.array([c.follows for c in chunks], dtype=bool)
        return cls(
            input_ids=np.fromiter(chain.from_iterable(c.token_ids for c in chunks), dtype=np.int64,
                                  count=int(q_lens.sum())),
            positions=positions,
            slot_mapping=pages * page_size + positions % page_size,
            logits_indices=(first_token + q_lens - 1)[sample_rows],
            q_lens=q_lens,
            kv_lens=kv_lens,
            rows=rows,
            max_pages=max_pages,
            state_slots=None if state_of is None else np.array([state_of[c.slot] for c in chunks], dtype=np.int64),
            sample_rows=rows[sample_rows],
            follow_idx=first_token[follows],
            follow_rows=rows[follows],
            checkpoints=checkpoints_of(chunks),
        )

    def page_rows(self, table: RequestTable) -> np.ndarray:
        """[B, max_pages] page ids per sequence (the CPU path's page table; unused entries stale)."""
        return table.page_ids[self.rows, : self.max_pages].astype(np.int64)


def checkpoints_of(chunks: list[Chunk]) -> tuple[tuple[int, int, int], ...]:
    """The chunks' in-chunk checkpoints as (sequence, tokens, state slot); ValueError for one not
    strictly inside its chunk on a GDN chunk boundary (the forward could not keep it)."""
    out = []
    for b, chunk in enumerate(chunks):
        for tokens, slot in chunk.checkpoints:
            if not 0 < tokens < len(chunk.token_ids) or tokens % GDN_CHUNK:
                raise ValueError(f"a checkpoint after {tokens} of a chunk's {len(chunk.token_ids)} tokens: "
                                 f"it must lie inside the chunk on a multiple of {GDN_CHUNK}")
            out.append((b, tokens, slot))
    return tuple(out)


class DevicePageTable:
    """The request table's page ids mirrored on the device: [rows + 1, max_pages] int64.

    The last row is the scratch row (padded graph rows read it). `updates` lists the
    (flat index, page id) pairs a step adds; `apply` writes them after the step's arena
    copy, so the table is current before the forward reads it. A row is re-uploaded from
    its first page when a new sequence takes the slot.
    """

    def __init__(self, rows: int, max_pages: int, device: torch.device, scratch_page: int):
        self.max_pages: int = max_pages
        self.scratch_row: int = rows
        self.scratch_page: int = scratch_page
        self.table: torch.Tensor = torch.zeros(rows + 1, max_pages, dtype=torch.int64, device=device)
        self.table[rows, 0] = scratch_page
        self._uploaded: np.ndarray = np.zeros(rows, dtype=np.int64)  # pages of each row on the device

    def reset(self, row: int) -> None:
        """A new sequence took `row`: nothing of it is on the device yet."""
        self._uploaded[row] = 0

    def updates(self, inputs: StepInputs, host: RequestTable, page_size: int) -> tuple[np.ndarray, np.ndarray]:
        """(flat indexes, page ids) of the pages this step's sequences reach beyond what is uploaded."""
        need = (inputs.kv_lens + page_size - 1) // page_size  # [B]
        have = self._uploaded[inputs.rows]
        idx, vals = [], []
        for row, lo, hi in zip(inputs.rows.tolist(), have.tolist(), need.tolist()):
            if hi > lo:
                idx.append(row * self.max_pages + np.arange(lo, hi))
                vals.append(host.page_ids[row, lo:hi].astype(np.int64))
                self._uploaded[row] = hi
        if not idx:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        return np.concatenate(idx), np.concatenate(vals)

    def apply(self, idx: torch.Tensor, vals: torch.Tensor) -> None:
        """Write the pairs `updates` returned (device tensors from the step's arena)."""
        if idx.numel():
            self.table.view(-1).index_copy_(0, idx, vals)

    def pack(self, arena: StepArena, arrays: dict[str, np.ndarray], layout: dict[str, tuple[int, int]],
             idx: np.ndarray, vals: np.ndarray) -> dict[str, torch.Tensor]:
        """A graph step's arena pack with the step's page-table pairs: in the arena's `table_idx` /
        `table_val` fields when they fit (one copy for both), else through `upload`; applied either way."""
        room = layout["table_idx"][1]
        fits = len(idx) <= room
        if fits:
            arrays = {**arrays, "table_idx": idx, "table_val": vals}
        else:
            self.upload(idx, vals)
        views = arena.pack(arrays, layout)
        if fits:
            self.apply(views["table_idx"][: len(idx)], views["table_val"][: len(vals)])
        return views

    def upload(self, idx: np.ndarray, vals: np.ndarray) -> None:
        """Write pairs that did not fit a step's arena, with their own copy (from pinned memory on CUDA,
        queued on the stream: a pageable copy would wait for everything queued before it, such as a
        tier hit's page loads)."""
        pairs = torch.from_numpy(np.stack((idx, vals)))
        if self.table.is_cuda:
            pairs = pairs.pin_memory()
        pairs = pairs.to(self.table.device, non_blocking=True)
        self.apply(pairs[0], pairs[1])
