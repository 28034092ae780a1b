"""Short prefill chunks of one sequence, replayed from CUDA graphs of exact token counts.

A step whose only chunk is one sequence's n new tokens, 1 < n < 2 * PREFILL_GRAPH_TOKENS (a chat
turn after a prefix hit, a tier hit's tail, a short prompt), runs as the graphs of the powers of two
that sum to n, largest first, back to back: n = 100 replays the 64-, 32- and 4-token graphs, each
over the next part of the chunk (an odd n ends with the 1-token graph). A mixed step of decode rows
and one such chunk (a prompt arriving while others decode) replays the rows' decode graph, then the
chunk's parts (ModelRunner._replay_parts): the two forwards touch disjoint sequences.

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
H200 the CPU-tier hit of issue 13 went from 50 ms to 21 ms of TTFT with these graphs.

Steps of several chunks (a wave of prompts after a shared-prefix hit, prompts beside decode rows),
chunks of any length and chunks with in-chunk checkpoints replay parts too when that is cheaper than
the eager step (`plan_chunks`): each chunk is cut at its checkpoints, each piece into parts (as many
largest buckets as fit, then the binary digits of the rest), and the live state is copied to the
checkpoint's slot between the parts, which is what the in-chunk checkpoint would hold. A bucket used
twice in a step gets its second part's fields from a staging field of the same arena, copied device
to device before that replay. Cheaper is measured, not guessed: at capture each bucket's replay is
timed on the device and an eager forward of two tokens on the host (its time is launch-bound: the
floor of any eager step's wall time); a step replays parts when their summed device time is below
that floor (times PART_COST_MARGIN, what served parts cost beyond their capture-time replays), so on a
host that launches fast the batched eager step keeps its larger steps. Steps with
fed-in tokens stay eager. Off CUDA (tests) the same arena and parts run eagerly, as DecodeGraphs
does, and several chunks replay parts only when a test sets `budget_s`.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from hkv.engine.step_inputs import DevicePageTable, StepInputs, checkpoints_of
from hkv.ipc.messages import Chunk
from hkv.models.batch import ForwardBatch
from hkv_kernels.meta import StepArena, attention_tile, kernel_meta, meta_arrays

log = logging.getLogger("hkv.rank")
PREFILL_GRAPH_TOKENS = 512  # the largest bucket; buckets are the powers of two from 1 up to it
_FIXED = ("q_start", "q_len", "cu_seqlens", "logits_indices", "attn_block_seq", "attn_block_tok",
          "conv_block_seq", "conv_block_tok", "fla_chunk_indices", "fla_chunk_offsets")
_VARYING = ("input_ids", "positions", "slot_mapping", "kv_len", "table_rows", "state_slots")


MULTI_MAX_CHUNKS = 64  # chunks of one step that replay parts (more: eager)
# served parts cost more than their capture-time replays (deeper KV, checkpoint copies, staging): on an H200 a
# 2,176-token prompt with 8 checkpoints took 39.1 ms against 31.7 predicted, 31 prompts of 128 129 against 97.5
PART_COST_MARGIN = 1.35
MULTI_STAGE_TOKENS = 4096  # tokens of one step's repeated buckets that can be staged (the runner's: its step budget)


@dataclass(frozen=True)
class ChunkParts:
    """How one chunk of a step of several replays: its buckets in order, and the state slot that
    receives the live state after part i (an in-chunk checkpoint ends there)."""

    parts: list[int]
    saves: dict[int, int] = field(default_factory=dict)


def long_parts(n: int, largest: int = PREFILL_GRAPH_TOKENS) -> list[int]:
    """Parts of a piece of n >= 1 tokens: as many `largest` buckets as fit, then the rest's binary digits."""
    rest = n % largest
    return [largest] * (n // largest) + [1 << b for b in range(rest.bit_length() - 1, -1, -1) if rest >> b & 1]


def split_chunk(n: int, checkpoints: list[tuple[int, int]], largest: int = PREFILL_GRAPH_TOKENS) -> ChunkParts:
    """A chunk of n tokens with in-chunk checkpoints (tokens, state slot), each strictly inside it, as
    the parts of its pieces between them; the checkpoint after `tokens` is saved after that piece."""
    parts: list[int] = []
    saves: dict[int, int] = {}
    done = 0
    for tokens, slot in sorted(checkpoints):
        parts += long_parts(tokens - done, largest)
        saves[len(parts) - 1] = slot
        done = tokens
    return ChunkParts(parts + long_parts(n - done, largest), saves)


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
                 scratch_slot: int | None, page_size: int, largest: int = PREFILL_GRAPH_TOKENS,
                 max_chunks: int = MULTI_MAX_CHUNKS, stage_tokens: int = MULTI_STAGE_TOKENS):
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
        for t in self.sizes:  # a bucket's varying fields last and together: one block a staged part copies
            fields.update({f"{t}.{name}": len(a) for name, a in self.fixed[t].items()})
            fields.update({f"{t}.{name}": t if name in ("input_ids", "positions", "slot_mapping") else 1
                           for name in _VARYING})
        # a chunk of up to 2 * largest tokens adds at most that many pages / page_size + 1 (more after a
        # long hit, or in a step of several chunks: those go up in their own copy, DevicePageTable.upload)
        self.table_room: int = 2 * largest // page_size + 2
        self.max_chunks: int = max(1, max_chunks)
        # staged parts: a block per part, each at most 3 t + 3 fields rounded up to the alignment
        self.stage_room: int = 3 * stage_tokens + 12 * self.max_chunks * len(self.sizes)
        fields.update(sample_rows=self.max_chunks, table_idx=self.table_room, table_val=self.table_room,
                      stage=self.stage_room)
        self.layout: dict[str, tuple[int, int]] = StepArena.layout_of(fields)
        # bucket -> (offset, length) of its varying block in the arena, and each field's place in it
        self.blocks: dict[int, tuple[int, int]] = {}
        self.block_fields: dict[int, dict[str, tuple[int, int]]] = {}
        for t in self.sizes:
            first, last = self.layout[f"{t}.{_VARYING[0]}"], self.layout[f"{t}.{_VARYING[-1]}"]
            self.blocks[t] = (first[0], last[0] + last[1] - first[0])
            self.block_fields[t] = {f"{t}.{name}": (self.layout[f"{t}.{name}"][0] - first[0],
                                                    self.layout[f"{t}.{name}"][1]) for name in _VARYING}
        # the cost model of steps of several chunks (capture_all measures both on CUDA): a replay's
        # device seconds by bucket, and the host seconds an eager step takes at least
        self.costs: dict[int, float] = {}
        self.budget_s: float = 0.0
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
        if self.arena.device.type == "cuda":
            self.measure()
        return time.perf_counter() - started

    def measure(self, repeats: int = 3) -> None:
        """The cost model of steps of several chunks: each bucket's replay on the device (CUDA events,
        the best of `repeats`) and the host time of an eager forward of the 2-token bucket's batch
        (synchronized, the best of `repeats`: launches, not the GPU, set it). Replays write only the
        scratch page and slot."""
        with torch.inference_mode():
            for t in self.sizes:
                best = math.inf
                for _ in range(repeats):
                    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    begin.record()
                    self.graphs[t].replay()
                    end.record()
                    end.synchronize()
                    best = min(best, begin.elapsed_time(end) / 1e3)
                self.costs[t] = best
            floor = math.inf
            for _ in range(repeats):
                torch.cuda.synchronize()
                begin_s = time.perf_counter()
                self.model(self.batches[min(2, self.largest)], self.kv, self.state)
                torch.cuda.synchronize()
                floor = min(floor, time.perf_counter() - begin_s)
        self.budget_s = floor
        log.info("prefill graphs: a replay takes %.2f ms (1 token) to %.2f ms (%d tokens) on the device, an eager "
                 "prefill step at least %.1f ms on the host: steps of several chunks replay parts below that",
                 self.costs[1] * 1e3, self.costs[self.largest] * 1e3, self.largest, floor * 1e3)

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

    def plan_chunks(self, chunks: list[Chunk]) -> list[ChunkParts] | None:
        """How a step of these prefill chunks (any length) replays, or None when it runs eagerly: a fed-in
        token, a checkpoint the eager path would refuse (it says why), more than `max_chunks` chunks,
        repeated buckets beyond the staging field, or replays whose measured device time (times
        PART_COST_MARGIN) exceeds `budget_s`. Decided from the plan alone, before any array is built."""
        if not self.graphs or not chunks or len(chunks) > self.max_chunks:
            return None
        plans = []
        for c in chunks:
            try:  # the eager path's rule for checkpoints (it raises the error a bad one deserves)
                marks = sorted((tokens, slot) for _, tokens, slot in checkpoints_of([c]))
            except ValueError:
                return None
            if c.follows or not c.token_ids or len({m[0] for m in marks}) != len(marks):
                return None
            plans.append(split_chunk(len(c.token_ids), marks, self.largest))
        seen: set[int] = set()
        staged = cost = 0
        for t in (t for p in plans for t in p.parts):
            cost += self.costs.get(t, math.inf)
            if t in seen:
                staged += self.blocks[t][1]
            seen.add(t)
        return plans if staged <= self.stage_room and cost * PART_COST_MARGIN <= self.budget_s else None

    def replay_chunks(self, chunks: list[StepInputs], plans: list[ChunkParts], idx: np.ndarray, vals: np.ndarray
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the chunks (`StepInputs.of([chunk])` each) as `plans` (from `plan_chunks`), one after the
        other; returns the logits [S, vocab] of those that sample, in order, and their sampling rows [S]
        on the device."""
        sampling = [c for c in chunks if len(c.logits_indices)]
        arrays: dict[str, np.ndarray] = {"sample_rows": np.array([int(c.sample_rows[0]) for c in sampling])}
        staged: list[np.ndarray] = []
        stage_at = 0
        runs = []  # per part: (bucket, staging offset or None, checkpoint slot or None, state slot, logits row)
        out_row = 0
        for c, plan in zip(chunks, plans):
            n, row = int(c.q_lens[0]), int(c.rows[0])
            start = int(c.kv_lens[0]) - n
            state_slot = int(c.state_slots[0]) if c.state_slots is not None else 0
            done = 0
            for i, t in enumerate(plan.parts):
                part = slice(done, done + t)
                done += t
                fields = self._varying(t, c.input_ids[part], c.positions[part], c.slot_mapping[part], start + done,
                                       row, state_slot)
                if f"{t}.input_ids" in arrays:  # the bucket's own fields are taken: stage this part's
                    block = np.zeros(self.blocks[t][1], dtype=np.int64)
                    for name, (off, _) in self.block_fields[t].items():
                        block[off : off + len(fields[name])] = fields[name]
                    staged.append(block)
                    where, stage_at = stage_at, stage_at + len(block)
                else:
                    arrays.update(fields)
                    where = None
                last = i == len(plan.parts) - 1 and len(c.logits_indices)
                runs.append((t, where, plan.saves.get(i), state_slot, out_row if last else None))
            out_row += 1 if len(c.logits_indices) else 0
        if staged:
            arrays["stage"] = np.concatenate(staged)
        views = self.pages.pack(self.arena, arrays, self.layout, idx, vals)
        logits = torch.empty(len(sampling), self.logits.shape[1], dtype=self.logits.dtype, device=self.logits.device)
        for t, where, save, state_slot, logits_row in runs:
            if where is not None:
                off, span = self.blocks[t]
                self.arena.dev[off : off + span].copy_(views["stage"][where : where + span])
            graph = self.graphs[t]
            if graph is None:
                self.logits.copy_(self.model(self.batches[t], self.kv, self.state))
            else:
                graph.replay()
            if save is not None:  # an in-chunk checkpoint ends here: the live state is what it keeps
                self.state.copy_slot(state_slot, save)
            if logits_row is not None:
                logits[logits_row].copy_(self.logits[0])
        return logits, views["sample_rows"][: len(sampling)]

    def replay(self, inputs: StepInputs, parts: list[int], idx: np.ndarray, vals: np.ndarray
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the one chunk as `parts` (from `parts`); returns the logits [S, vocab] (S = 1 if it samples,
        else 0) and the sampling rows [S] on the device."""
        return self.replay_chunks([inputs], [ChunkParts(parts)], idx, vals)
