"""Decode steps replayed from CUDA graphs, one per batch-size bucket, captured at start-up.

A decode step of B sequences runs the graph of the smallest bucket >= B. Every
input lives at a fixed address in one arena (hkv_kernels/meta.py); a step packs
its arrays there with one host-to-device copy and replays the graph. Rows past B
are padding: they read and write a scratch KV page and a scratch state slot that
the router never hands out, so they compute garbage no one reads.

    arena   [ input_ids(max_bs) | positions | slot_mapping | ... ]   fixed layout
    bucket b reads the first b entries of every field; logits[:B] are the step's

A step of one short prefill chunk replays graphs of its own (hkv.engine.prefill_graphs); other
prefill and mixed steps run eagerly. Speculative verify steps (k + 1 tokens per
sequence) have their own graphs in the same scheme: hkv.engine.spec_graphs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from hkv.engine.step_inputs import DevicePageTable, StepInputs
from hkv.models.batch import ForwardBatch
from hkv_kernels.meta import StepArena, attention_tile, kernel_meta, meta_arrays

log = logging.getLogger("hkv.rank")
_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def buckets_up_to(max_bs: int) -> list[int]:
    """Batch sizes to capture: powers of two, then steps of 8 to 64, 16 to 128, 32 to 256, 64 beyond."""
    out = [b for b in _BUCKETS if b < max_bs]
    return out + [max_bs]


def replay_seconds(graph: torch.cuda.CUDAGraph, repeats: int, stat: Callable[[list[float]], float] = min) -> float:
    """A captured graph's replay time on the device: CUDA events, `stat` (the best by default) of `repeats`."""
    times = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / 1e3)
    return stat(times)


class DecodeGraphs:
    """Captured decode forwards by bucket, their static batches and the fixed-layout arena."""

    def __init__(self, model, kv, state, pages: DevicePageTable, max_bs: int, attn_dims: tuple[int, int],
                 scratch_slot: int | None, page_size: int):
        self.model, self.kv, self.state, self.pages = model, kv, state, pages
        self.max_bs: int = max_bs
        self.page_size: int = page_size
        self.scratch_slot: int | None = scratch_slot  # padded rows' state slot (hybrid models)
        group, head_dim = attn_dims
        self.tile: tuple[int, int, int, int] = attention_tile(1, group, head_dim, kv.attn_dtype)
        self.block_t: int = max(1, self.tile[0] // group)
        fields = dict.fromkeys(("input_ids", "positions", "slot_mapping", "logits_indices", "state_slots",
                                "q_start", "q_len", "kv_len", "table_rows", "attn_block_seq", "attn_block_tok",
                                "conv_block_seq", "conv_block_tok", "sample_rows", "follow_idx", "follow_rows"),
                               max_bs)
        fields["cu_seqlens"] = max_bs + 1
        # a decode step adds at most one page per sequence; a 1-token first chunk after a long hit
        # adds more, and then the pages go up in their own copy (DevicePageTable.upload)
        self.table_room: int = 4 * max_bs
        fields["table_idx"] = fields["table_val"] = self.table_room
        self.layout: dict[str, tuple[int, int]] = StepArena.layout_of(fields)
        end = max(off + n for off, n in self.layout.values())
        self.arena: StepArena = StepArena(end, kv.k.device)
        # bucket -> its graph; None off CUDA (tests: the same buffers and padding, replayed eagerly)
        self.graphs: dict[int, torch.cuda.CUDAGraph | None] = {}
        self.batches: dict[int, ForwardBatch] = {}
        # every bucket's graph copies its logits here: one buffer, not one per bucket
        self.logits: torch.Tensor = torch.empty(max_bs, model.cfg.vocab_size, dtype=torch.float32, device=kv.k.device)
        self.pool = None  # one memory pool shared by every bucket's graph
        self.costs: dict[int, float] = {}  # bucket -> a replay's device seconds (measured at capture on CUDA)

    def bucket(self, batch_size: int) -> int | None:
        """The captured bucket a decode batch of this size replays, or None (too large)."""
        return next((b for b in sorted(self.graphs) if b >= batch_size), None)

    def capture_all(self, progress: Callable[[], None] | None = None) -> float:
        """Capture every bucket, largest first (its pool serves the smaller ones), `progress()` after
        each; returns seconds."""
        started = time.perf_counter()
        sizes = sorted(buckets_up_to(self.max_bs), reverse=True)
        for i, b in enumerate(sizes, 1):
            self._capture(b)
            log.debug("captured CUDA graph %d/%d (batch %d)", i, len(sizes), b)
            if progress is not None:
                progress()
        if self.arena.device.type == "cuda":
            self.measure()
        return time.perf_counter() - started

    def measure(self, repeats: int = 3) -> None:
        """Each bucket's replay on the device (`replay_seconds`): what decode rows add to a step whose
        prefill chunks replay beside them (PrefillGraphs.plan_chunks). The replays run the padding
        batch, which writes only the scratch page and slot."""
        with torch.inference_mode():
            self.costs = {b: replay_seconds(graph, repeats) for b, graph in self.graphs.items()}

    def _padded(self, inputs: StepInputs | None, b: int) -> dict[str, np.ndarray]:
        """The arena arrays of a decode batch padded to bucket b (inputs None: all padding)."""
        n = 0 if inputs is None else len(inputs.q_lens)
        pad = b - n
        scratch_slot_mapping = self.pages.scratch_page * self.page_size
        arrays = {
            "input_ids": np.zeros(pad, dtype=np.int64), "positions": np.zeros(pad, dtype=np.int64),
            "slot_mapping": np.full(pad, scratch_slot_mapping, dtype=np.int64),
            "state_slots": np.full(pad, self.scratch_slot or 0, dtype=np.int64),
        }
        q_lens = np.ones(b, dtype=np.int64)
        kv_lens = np.concatenate((inputs.kv_lens if n else np.zeros(0, np.int64), np.ones(pad, dtype=np.int64)))
        rows = np.concatenate((inputs.rows if n else np.zeros(0, np.int64),
                               np.full(pad, self.pages.scratch_row, dtype=np.int64)))
        if n:
            for name in ("input_ids", "positions", "slot_mapping"):
                arrays[name] = np.concatenate((getattr(inputs, name), arrays[name]))
            if inputs.state_slots is not None:
                arrays["state_slots"] = np.concatenate((inputs.state_slots, arrays["state_slots"]))
        arrays["logits_indices"] = np.arange(b, dtype=np.int64)
        arrays.update(meta_arrays(q_lens, kv_lens, rows, self.block_t, gdn_chunks=False))
        return arrays

    def _static_batch(self, b: int, views: dict[str, torch.Tensor]) -> ForwardBatch:
        sliced = {name: view[: b + 1] if name == "cu_seqlens" else view[:b] for name, view in views.items()
                  if name not in ("table_idx", "table_val", "sample_rows", "follow_idx", "follow_rows")}
        return ForwardBatch(
            input_ids=sliced["input_ids"], positions=sliced["positions"], slot_mapping=sliced["slot_mapping"],
            logits_indices=sliced["logits_indices"], page_table=self.pages.table,
            meta=kernel_meta(sliced, np.ones(b, dtype=np.int64), self.tile, self.block_t),
            state_slots=sliced["state_slots"] if self.state is not None else None,
        )

    def _capture(self, b: int) -> None:
        views = self.arena.pack(self._padded(None, b), self.layout)
        batch = self._static_batch(b, views)
        if self.arena.device.type != "cuda":
            self.graphs[b], self.batches[b] = None, batch
            return
        with torch.inference_mode():
            self.model(batch, self.kv, self.state)  # compile and warm every kernel outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.logits[:b].copy_(self.model(batch, self.kv, self.state))
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[b], self.batches[b] = graph, batch

    def replay(self, inputs: StepInputs, idx: np.ndarray, vals: np.ndarray, feed) -> tuple[torch.Tensor, torch.Tensor]:
        """Run a decode step (every q_len is 1) from its bucket's graph; returns logits [B, vocab]
        and the sampling rows [B] on the device.

        idx, vals: the device page table's new entries for this step (DevicePageTable.updates);
        feed(input_ids, follow_idx, follow_rows): writes fed-in tokens (ModelRunner.feed).
        """
        n = len(inputs.q_lens)
        b = self.bucket(n)
        arrays = self._padded(inputs, b)
        arrays.update(sample_rows=inputs.sample_rows, follow_idx=inputs.follow_idx, follow_rows=inputs.follow_rows)
        views = self.pages.pack(self.arena, arrays, self.layout, idx, vals)
        follows = len(inputs.follow_idx)
        feed(self.batches[b].input_ids, views["follow_idx"][:follows], views["follow_rows"][:follows])
        graph = self.graphs[b]
        if graph is None:
            self.logits[:b].copy_(self.model(self.batches[b], self.kv, self.state))
        else:
            graph.replay()
        return self.logits[:n], views["sample_rows"][:n]
