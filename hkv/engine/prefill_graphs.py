"""Short prefill chunks of one sequence, replayed from CUDA graphs of exact token counts.

A step whose only chunk is one sequence's n new tokens, 1 < n < 2 * PREFILL_GRAPH_TOKENS (a chat
turn after a prefix hit, a tier hit's tail, a short prompt), runs as the graphs of the powers of two
that sum to n, largest first, back to back: n = 100 replays the 64-, 32- and 4-token graphs, each
over the next part of the chunk (an odd n ends with the 1-token graph). A mixed step of decode rows
and one such chunk (a prompt arriving while others decode) replays the rows' decode graph, then the
chunk's parts (ModelRunner._replay_mixed): the two forwards touch disjoint sequences.

    chunk      [ 64 tokens            | 32 tokens    | 4 ]   one sequence, start s
    replay     graph(64): kv s + 64     graph(32): s + 96    graph(4): s + 100, its last row sampled

Each part is a whole forward of exactly its bucket's tokens, so nothing is padded: the conv, the
GDN chunk kernels (fla-core's, one sequence) and the attention see one sequence of T tokens, and
their grids and chunk metadata are the same at every replay. What changes (tokens, positions, KV
slots, KV length, page-table row, state slot) lives in the bucket's own fields of one arena, so a
step packs every part with one host-to-device copy, then replays. The state a part leaves in the
slot is the next part's start, as between the chunks of a long prompt: the result equals the
unsplit chunk up to float rounding (the models' state contract, hkv/models/qwen3_5.py).

Each part reads every weight once (about 1 ms on an H200 for the 2 B benchmark model), so a chunk
of k parts costs k such forwards: still far below the host time of one eager forward there.

Why: an eager step costs host time per launch (an eager forward of the benchmark model issues
about 600 kernels; docs/benchmarks.md), so a 64-token step after a long hit was host-bound: on an
H200 the CPU-tier hit of issue 13 went from 50 ms to 21 ms of TTFT with these graphs. Steps with
in-chunk checkpoints, fed-in tokens or two prefill chunks stay eager. Off CUDA (tests) the same arena
and parts run eagerly, as DecodeGraphs does.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from hkv.engine.step_inputs import DevicePageTable, StepInputs
from hkv.models.batch import ForwardBatch
from hkv_kernels.meta import StepArena, attention_tile, kernel_meta, meta_arrays

log = logging.getLogger("hkv.rank")
PREFILL_GRAPH_TOKENS = 512  # the largest bucket; buckets are the powers of two from 1 up to it
_FIXED = ("q_start", "q_len", "cu_seqlens", "logits_indices", "attn_block_seq", "attn_block_tok",
          "conv_block_seq", "conv_block_tok", "fla_chunk_indices", "fla_chunk_offsets")
_VARYING = ("input_ids", "positions", "slot_mapping", "kv_len", "table_rows", "state_slots")


def buckets(largest: int = PREFILL_GRAPH_TOKENS) -> list[int]:
    """The token counts captured: the powers of two up to `largest`, 1 included (an odd chunk's last part)."""
    return [1 << b for b in range(largest.bit_length()) if 1 << b <= largest]


def parts_of(n: int, largest: int = PREFILL_GRAPH_TOKENS) -> list[int] | None:
    """The buckets a chunk of n tokens replays, largest first (n's binary digits), or None when
    n is 1 (a decode step's business) or needs a bucket above `largest`."""
    if n < 2 or n >= 2 * largest:
        return None
    return [1 << b for b in range(n.bit_length() - 1, -1, -1) if n >> b & 1]


class PrefillGraphs:
    """Captured one-sequence forwards by token count, their static batches and the arena."""

    def __init__(self, model, kv, state, pages: DevicePageTable, attn_dims: tuple[int, int],
                 scratch_slot: int | None, page_size: int, largest: int = PREFILL_GRAPH_TOKENS):
        self.model, self.kv, self.state, self.pages = model, kv, state, pages
        self.page_size: int = page_size
        self.scratch_slot: int | None = scratch_slot
        if largest < 1 or largest & (largest - 1):
            raise ValueError(f"the largest prefill graph bucket must be a power of two, got {largest}")
        # no bucket longer than a page-table row or the rope table reaches (the capture reads both)
        context = pages.max_pages * page_size
        positions = getattr(getattr(model, "rotary", None), "max_positions", 0)
        if positions:
            context = min(context, positions)
        while largest > max(1, context):
            largest //= 2
        self.largest: int = largest
        self.attn_dims = attn_dims
        self.sizes: list[int] = buckets(largest)
        self.fixed: dict[int, dict[str, np.ndarray]] = {t: self._fixed_arrays(t) for t in self.sizes}
        fields: dict[str, int] = {}
        for t in self.sizes:
            fields.update({f"{t}.{name}": len(a) for name, a in self.fixed[t].items()})
            fields.update({f"{t}.{name}": t if name in ("input_ids", "positions", "slot_mapping") else 1
                           for name in _VARYING})
        # a chunk of up to 2 * largest tokens adds at most that many pages / page_size + 1 (more after a
        # long hit: those go up in their own copy, DevicePageTable.upload)
        self.table_room: int = 2 * largest // page_size + 2
        fields.update(sample_rows=1, table_idx=self.table_room, table_val=self.table_room)
        self.layout: dict[str, tuple[int, int]] = StepArena.layout_of(fields)
        end = max(off + n for off, n in self.layout.values())
        self.arena: StepArena = StepArena(end, kv.k.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph | None] = {}
        self.batches: dict[int, ForwardBatch] = {}
        self.logits: torch.Tensor = torch.empty(1, model.cfg.vocab_size, dtype=torch.float32, device=kv.k.device)
        self.pool = None

    def _tile(self, t: int) -> tuple[tuple[int, int, int, int], int]:
        group, head_dim = self.attn_dims
        tile = attention_tile(t, group, head_dim, self.kv.k.dtype)
        return tile, max(1, tile[0] // group)

    def _fixed_arrays(self, t: int) -> dict[str, np.ndarray]:
        """What every replay of bucket t shares: one sequence of t new tokens, its last row's logits."""
        _, block_t = self._tile(t)
        arrays = meta_arrays(np.array([t]), np.array([t]), np.zeros(1, dtype=np.int64), block_t)
        arrays = {name: a for name, a in arrays.items() if name in _FIXED}
        arrays["logits_indices"] = np.array([t - 1], dtype=np.int64)
        return arrays

    def _varying(self, t: int, ids, positions, slots, kv_len: int, row: int, state_slot: int) -> dict[str, np.ndarray]:
        values = dict(input_ids=ids, positions=positions, slot_mapping=slots, kv_len=[kv_len], table_rows=[row],
                      state_slots=[state_slot])
        return {f"{t}.{name}": np.asarray(v, dtype=np.int64) for name, v in values.items()}

    def _static_batch(self, t: int, views: dict[str, torch.Tensor]) -> ForwardBatch:
        mine = {name.split(".", 1)[1]: view for name, view in views.items() if name.startswith(f"{t}.")}
        tile, block_t = self._tile(t)
        return ForwardBatch(
            input_ids=mine["input_ids"], positions=mine["positions"], slot_mapping=mine["slot_mapping"],
            logits_indices=mine["logits_indices"], page_table=self.pages.table,
            meta=kernel_meta(mine, np.array([t], dtype=np.int64), tile, block_t),
            state_slots=mine["state_slots"] if self.state is not None else None,
        )

    def capture_all(self) -> float:
        """Capture every bucket, largest first (its pool serves the smaller ones); returns seconds."""
        started = time.perf_counter()
        arrays: dict[str, np.ndarray] = {}
        scratch = self.pages.scratch_page * self.page_size
        for t in self.sizes:  # every bucket's fixed fields, and padding that writes only scratch memory
            arrays.update({f"{t}.{name}": a for name, a in self.fixed[t].items()})
            arrays.update(self._varying(t, np.zeros(t), np.arange(t), scratch + np.arange(t) % self.page_size, t,
                                        self.pages.scratch_row, self.scratch_slot or 0))
        views = self.arena.pack(arrays, self.layout)
        self.batches = {t: self._static_batch(t, views) for t in self.sizes}
        for i, t in enumerate(sorted(self.sizes, reverse=True), 1):
            self._capture(t)
            log.info("captured CUDA graph %d/%d (prefill of %d token%s)", i, len(self.sizes), t, "s" * (t > 1))
        return time.perf_counter() - started

    def _capture(self, t: int) -> None:
        batch = self.batches[t]
        if self.arena.device.type != "cuda":
            self.graphs[t] = None
            return
        with torch.inference_mode():
            self.model(batch, self.kv, self.state)  # compile and autotune outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.logits.copy_(self.model(batch, self.kv, self.state))
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[t] = graph

    def parts(self, inputs: StepInputs) -> list[int] | None:
        """The buckets this step replays, or None when it must run eagerly: anything but one chunk
        of 2 .. 2 * largest - 1 tokens without in-chunk checkpoints or fed-in tokens."""
        if len(inputs.q_lens) != 1 or inputs.checkpoints or len(inputs.follow_idx) or not self.graphs:
            return None
        return parts_of(int(inputs.q_lens[0]), self.largest)

    def replay(self, inputs: StepInputs, parts: list[int], idx: np.ndarray, vals: np.ndarray
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the chunk as `parts` (from `parts`); returns the logits [S, vocab] (S = 1 if it samples,
        else 0) and the sampling rows [S] on the device."""
        n = int(inputs.q_lens[0])
        start = int(inputs.kv_lens[0]) - n
        row = int(inputs.rows[0])
        state_slot = int(inputs.state_slots[0]) if inputs.state_slots is not None else 0
        arrays: dict[str, np.ndarray] = {"sample_rows": inputs.sample_rows}
        done = 0
        for t in parts:
            part = slice(done, done + t)
            done += t
            arrays.update(self._varying(t, inputs.input_ids[part], inputs.positions[part], inputs.slot_mapping[part],
                                        start + done, row, state_slot))
        views = self.pages.pack(self.arena, arrays, self.layout, idx, vals)
        for t in parts:
            graph = self.graphs[t]
            if graph is None:
                self.logits.copy_(self.model(self.batches[t], self.kv, self.state))
            else:
                graph.replay()
        sampled = len(inputs.logits_indices)
        return self.logits[:sampled], views["sample_rows"][:sampled]
