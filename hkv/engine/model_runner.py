"""Executes one StepPlan on a rank: batch tensors, forward, sampling.

The runner owns the device pools and the per-slot sampling params. It reads
page ids from the request table (written by the router before the plan was
sent) and never decides anything.
"""

from __future__ import annotations

import time
from itertools import chain

import numpy as np
import torch

from hkv.cache.types import LoadPages, LoadState, RestoreCheckpoint, SaveCheckpoint, StorePages, StoreState
from hkv.engine.sampler import SampleRow, sample
from hkv.ipc.messages import Sampled, SamplingParams, StepPlan, StepResult
from hkv.ipc.request_table import RequestTable
from hkv.models.batch import ForwardBatch
from hkv_kernels.dispatch import copy_blocks  # imports no kernel until a CUDA tensor asks


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv, state, table: RequestTable, page_size: int, device: str,
                 host=None):
        self.model = model
        self.host = host  # HostPool: the CPU tier's shm entries (pinned on CUDA), None without tiers
        self.kv = kv  # KVPool: K/V pages of the full-attention layers
        self.state = state  # StatePool of the linear-attention layers, None for dense models
        self.table = table
        self.page_size = page_size
        self.device = torch.device(device)
        self.sampling: dict[int, SamplingParams] = {}  # slot -> params of the sequence in it
        self.state_slots: dict[int, int] = {}  # slot -> live linear-state slot of its sequence

    def execute(self, plan: StepPlan) -> StepResult:
        """Run the plan; failures become a StepResult with `error` set."""
        for slot in plan.freed:
            self.sampling.pop(slot, None)
            self.state_slots.pop(slot, None)
        for seq in plan.new:
            self.sampling[seq.slot] = seq.sampling
            if seq.state_slot is not None:
                self.state_slots[seq.slot] = seq.state_slot
        forward_s = 0.0
        if not plan.chunks:  # a copies-only plan (tier stores while nothing runs)
            try:
                with torch.inference_mode():
                    self._run_cache_ops(plan)
                    self._sync()
            except Exception as exc:
                return StepResult(plan.step, [], 0.0, f"{type(exc).__name__}: {exc}")
            return StepResult(plan.step, [], 0.0)
        try:
            with torch.inference_mode():
                batch = self.build_batch(plan)
                self._run_cache_ops(plan)
                self._reset_fresh_states(plan)
                start = time.perf_counter()
                logits = self.model(batch, self.kv, self.state)  # [S, vocab]
                forward_s = time.perf_counter() - start
                rows = [
                    SampleRow(self.sampling[c.slot], c.start_pos + len(c.token_ids))
                    for c in plan.chunks
                    if c.sample
                ]
                outs = sample(logits, rows)
        except Exception as exc:  # a failed step fails its requests, not the rank
            return StepResult(plan.step, [], forward_s, f"{type(exc).__name__}: {exc}")
        slots = [c.slot for c in plan.chunks if c.sample]
        sampled = [Sampled(s, o.token_id, o.logprob, o.top_logprobs) for s, o in zip(slots, outs)]
        return StepResult(plan.step, sampled, forward_s)

    def _run_cache_ops(self, plan: StepPlan) -> None:
        """Checkpoint saves and restores and tier copies, in the order the router emitted them."""
        for op in plan.ops:
            if isinstance(op, (SaveCheckpoint, RestoreCheckpoint)):
                if op.src_window is not None or op.dst_window is not None:
                    raise NotImplementedError("draft-window checkpoints arrive with speculative decoding")
                self.state.copy_slot(op.src_slot, op.dst_slot)
            elif isinstance(op, StorePages):
                self._copy_pages(to_host=True, pages=op.src_pages, entries=op.dst_entries)
            elif isinstance(op, LoadPages):
                self._copy_pages(to_host=False, pages=op.dst_pages, entries=op.src_entries)
            elif isinstance(op, StoreState):
                self._copy_state(to_host=True, slot=op.src_slot, entry=op.dst_entry)
            elif isinstance(op, LoadState):
                self._copy_state(to_host=False, slot=op.dst_slot, entry=op.src_entry)

    def _indexes(self, *lists: list[int]) -> torch.Tensor:
        """The index lists as one [n, M] int64 tensor on the device: one host-to-device transfer."""
        idx = torch.tensor(lists, dtype=torch.long)
        if self.device.type == "cuda":
            return idx.pin_memory().to(self.device, non_blocking=True)
        return idx

    def _copy_pages(self, to_host: bool, pages: list[int], entries: list[int]) -> None:
        """Pages between the device pool and the CPU tier: K and V of every layer in one copy.
        Out-of-range pairs are skipped by the copy."""
        if self.host is None or len(pages) != len(entries):
            raise ValueError("a tier copy without a CPU tier, or with unequal index lists")
        if not pages:
            return
        idx = self._indexes(pages, entries)
        device_side, host_side = self.kv.layers_view(), self.host.kv_layers
        if to_host:
            copy_blocks(device_side, host_side, idx[0], idx[1])
        else:
            copy_blocks(host_side, device_side, idx[1], idx[0])

    def _copy_state(self, to_host: bool, slot: int, entry: int) -> None:
        """One checkpoint between a state slot and a CPU-tier state entry."""
        if self.host is None or self.state is None or self.host.conv is None:
            raise ValueError("a state copy without a CPU tier or a state pool")
        if not (0 <= slot < self.state.num_slots and 0 <= entry < self.host.layout.num_states):
            raise IndexError(f"state copy slot {slot} / entry {entry} out of range")
        idx = self._indexes([slot], [entry])
        for dev, host in ((self.state.conv, self.host.conv), (self.state.recurrent, self.host.recurrent)):
            if to_host:
                copy_blocks(dev, host, idx[0], idx[1])
            else:
                copy_blocks(host, dev, idx[1], idx[0])

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _reset_fresh_states(self, plan: StepPlan) -> None:
        """A sequence computing from position 0 starts from zero linear state (after the ops)."""
        if self.state is None:
            return
        for chunk in plan.chunks:
            if chunk.start_pos == 0:
                self.state.zero_slot(self.state_slots[chunk.slot])

    def _state_slot_tensor(self, slots: np.ndarray) -> torch.Tensor:
        return torch.tensor([self.state_slots[s] for s in slots.tolist()], dtype=torch.long, device=self.device)

    def build_batch(self, plan: StepPlan) -> ForwardBatch:
        """Flatten the plan's chunks into one ragged batch (see hkv/models/batch.py)."""
        ps = self.page_size
        chunks = plan.chunks
        q_lens = np.array([len(c.token_ids) for c in chunks], dtype=np.int64)  # [B]
        starts = np.array([c.start_pos for c in chunks], dtype=np.int64)  # [B]
        kv_lens = starts + q_lens  # [B]
        slots = np.array([c.slot for c in chunks], dtype=np.int64)
        max_pages = int((kv_lens.max() + ps - 1) // ps)
        page_table = self.table.page_ids[slots, :max_pages].astype(np.int64)  # [B, max_pages]
        seq_of_token = np.repeat(np.arange(len(chunks)), q_lens)  # [T]
        first_token = np.cumsum(q_lens) - q_lens  # [B]
        positions = starts[seq_of_token] + (np.arange(int(q_lens.sum())) - first_token[seq_of_token])  # [T]
        slot_mapping = page_table[seq_of_token, positions // ps] * ps + positions % ps  # [T]
        sample_rows = np.array([c.sample for c in chunks], dtype=bool)
        logits_indices = (first_token + q_lens - 1)[sample_rows]  # [S]
        dev = self.device
        return ForwardBatch(
            input_ids=torch.tensor(list(chain.from_iterable(c.token_ids for c in chunks)), dtype=torch.long, device=dev),
            positions=torch.from_numpy(positions).to(dev),
            q_lens=q_lens.tolist(),
            kv_lens=kv_lens.tolist(),
            page_table=torch.from_numpy(page_table).to(dev),
            slot_mapping=torch.from_numpy(slot_mapping).to(dev),
            logits_indices=torch.from_numpy(logits_indices).to(dev),
            state_slots=None if self.state is None else self._state_slot_tensor(slots),
        )
