"""Prefill chunks replayed from CUDA graphs of exact shapes: b sequences of t new tokens each.

A bucket (b, t) is one forward of b sequences that each bring exactly t new tokens: t is a power
of two up to `largest` (2,048) for one sequence, and b a power of two up to MULTI_MAX_SEQS with
b * t <= MULTI_BUCKET_TOKENS for several. A step's prefill chunks are cut into parts (as many
largest buckets as fit, then the binary digits of the rest), and the parts are replayed in rounds:
each round takes the longest next part t of any chunk, and every chunk whose next part is t
goes into that round's bucket, b padded up to a power of two (padding rows write only the scratch
page and state slot). A chunk's parts run in order, so the state a part leaves in its slot is the
next part's start, as between the chunks of a long prompt: the result equals the unsplit chunk up
to float rounding (the models' state contract, hkv/models/qwen3_5.py).

    chunks     A: 2,176 tokens (parts 2,048 + 128)   B..D: 128 tokens each (after a prefix hit)
    rounds     (1, 2048): A's first part             (4, 128): A's last part, B, C, D, all sampled

Each replay is a whole forward of its bucket, so nothing is padded inside a sequence: the conv,
the GDN chunk kernels (fla-core's) and the attention see b sequences of t tokens, and their grids
and chunk metadata are the same at every replay. What changes (tokens, positions, KV slots, KV
lengths, page-table rows, state slots, in-chunk checkpoints) lives in the bucket's own fields of
one arena, so a step packs every round with one host-to-device copy, then replays. A bucket used
twice in a step (a chunk of two largest parts) takes its later rounds' fields from a staging field
of the same arena, copied device to device before that replay.

In-chunk checkpoints (a hybrid prompt keeps its state every --checkpoint-interval tokens) that fall
inside a part are kept by the captured forward itself: a bucket of t >= 128 tokens has room for
ceil((t - 1) / interval) of them a sequence (fla-core's chunk states hold them; unused entries
repeat a used one, or write the scratch slot). One that falls on a part's end is the live state,
copied to its slot after that round. A chunk with more than its parts have room for is cut at
every checkpoint instead (each piece then replays its own parts).

Why: an eager step costs host time per launch (about 600 kernels a forward of the benchmark model,
45-70 us each on the H200's host: docs/benchmarks.md), so every step with a prompt in it was
host-bound. A lone chunk of 2 to 1,023 tokens always replays (a turn after a hit, a tier hit's
tail). Other steps replay when that is cheaper than the eager step, measured, not guessed: at
capture each bucket's replay is timed on the device, and eager forwards on the host of two tokens,
of the smallest bucket that keeps a checkpoint and of the widest two-token bucket (launch-bound: the
floors of an eager step's wall time without and with in-chunk checkpoints, and what each sequence
adds to them); a step replays its rounds when their summed device time, times PART_COST_MARGIN, plus
the decode graph's for decode rows beside them, is below what its eager step would take: the floor
for its sequences (chunks and decode rows), or its tokens at the best measured device cost per token
when that is more (eager_estimate_s). Steps with fed-in tokens
stay eager. Off CUDA (tests) the same arena and rounds run eagerly, as DecodeGraphs does, and steps other
than a lone short chunk replay only when a test sets `budget_s`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from hkv.engine.cuda_graphs import replay_seconds
from hkv.engine.step_inputs import DevicePageTable, StepInputs, checkpoints_of
from hkv.ipc.messages import Chunk
from hkv.models.batch import ForwardBatch
from hkv_kernels.gdn import GDN_CHUNK
from hkv_kernels.meta import CheckpointMeta, StepArena, attention_tile, kernel_meta, meta_arrays, next_pow2

log = logging.getLogger("hkv.rank")
PREFILL_GRAPH_TOKENS = 2048  # the largest one-sequence bucket; buckets are powers of two from 1 up to it
SHORT_CHUNK_TOKENS = 1024  # a lone chunk below this (and below twice the largest bucket) always replays
MULTI_BUCKET_TOKENS = 2048  # b * t of the buckets of several sequences
MULTI_MAX_SEQS = 32  # sequences of the widest bucket
MULTI_MAX_CHUNKS = 64  # chunks of one step that replay parts (more: eager)
# rounds cost more on the device than their capture-time replays (deeper KV than captured, checkpoint copies,
# staging): on an H200 (tools/bench/bench_prefill.py, 2026-12-04) 1.06x for a 2,176-token prompt with 8 checkpoints,
# 1.19x for 31 prompts of 128 after 2,048 cached, 1.23x for one chunk of 8,192
PART_COST_MARGIN = 1.2
MULTI_STAGE_TOKENS = 4096  # tokens of one step's repeated buckets that can be staged (the runner's: its step budget)
CHECKPOINT_EVERY = 256  # the default --checkpoint-interval: what a bucket's checkpoint room is cut for
_FIXED = ("q_start", "q_len", "cu_seqlens", "logits_indices", "attn_block_seq", "attn_block_tok",
          "conv_block_seq", "conv_block_tok", "fla_chunk_indices", "fla_chunk_offsets")
_VARYING = ("input_ids", "positions", "slot_mapping", "kv_len", "table_rows", "state_slots")
_CKPT = ("ckpt_seq", "ckpt_tokens", "ckpt_slots", "ckpt_rows", "ckpt_hrows")

Bucket = tuple[int, int]  # (sequences, new tokens each)


@dataclass(frozen=True)
class ChunkParts:
    """How one chunk of a step replays: its parts' token counts in order, the state slot that receives
    the live state after part i (a checkpoint on its end), and the checkpoints inside part i as
    (tokens into the part, state slot), kept by the part's forward."""

    parts: list[int]
    saves: dict[int, int] = field(default_factory=dict)
    inside: dict[int, list[tuple[int, int]]] = field(default_factory=dict)


@dataclass(frozen=True)
class Piece:
    """One chunk's part in a round: the chunk (its index among the step's prefill chunks), where the
    part starts in it, and the part's checkpoints (ChunkParts)."""

    chunk: int
    start: int
    inside: tuple[tuple[int, int], ...]
    save: int | None
    last: bool  # the chunk's last part (its logits row, if the chunk samples)


@dataclass(frozen=True)
class Round:
    """One replay: a bucket and the parts it runs, one a sequence row, the rest padding."""

    bucket: Bucket
    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class StepParts:
    """A step's prefill chunks as parts (`plans`, one per chunk) and the rounds that replay them."""

    plans: list[ChunkParts]
    rounds: list[Round]

    @property
    def parts(self) -> list[list[int]]:
        return [p.parts for p in self.plans]


def long_parts(n: int, largest: int = PREFILL_GRAPH_TOKENS) -> list[int]:
    """Parts of a piece of n >= 1 tokens: as many `largest` buckets as fit, then the rest's binary digits."""
    rest = n % largest
    return [largest] * (n // largest) + [1 << b for b in range(rest.bit_length() - 1, -1, -1) if rest >> b & 1]


def checkpoint_room(t: int, every: int = CHECKPOINT_EVERY) -> int:
    """In-chunk checkpoints a t-token part of one sequence can keep inside it: interval boundaries
    strictly inside (at most ceil((t - 1) / every)), on a GDN chunk boundary (so none below 128 tokens)."""
    if t < 2 * GDN_CHUNK:
        return 0
    return min(t // GDN_CHUNK - 1, -(-(t - 1) // max(every, GDN_CHUNK)))


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


def place_chunk(n: int, checkpoints: list[tuple[int, int]], largest: int = PREFILL_GRAPH_TOKENS,
                every: int = CHECKPOINT_EVERY) -> ChunkParts:
    """A chunk of n tokens as long_parts, its checkpoints inside the parts they fall in (or saved after
    the part they end), or, where a part would hold more than checkpoint_room, cut at every one."""
    parts = long_parts(n, largest)
    ends = np.cumsum(parts)
    saves: dict[int, int] = {}
    inside: dict[int, list[tuple[int, int]]] = {}
    for tokens, slot in sorted(checkpoints):
        i = int(np.searchsorted(ends, tokens))  # the part whose end is at or after it
        start = int(ends[i]) - parts[i]
        if tokens == ends[i]:
            saves[i] = slot
        else:
            inside.setdefault(i, []).append((tokens - start, slot))
    if any(len(kept) > checkpoint_room(parts[i], every) or any(t % GDN_CHUNK for t, _ in kept)
           for i, kept in inside.items()):
        return split_chunk(n, checkpoints, largest)
    return ChunkParts(parts, saves, inside)


def buckets(largest: int = PREFILL_GRAPH_TOKENS) -> list[int]:
    """The token counts captured for one sequence: the powers of two up to `largest`, 1 included."""
    return [1 << b for b in range(largest.bit_length()) if 1 << b <= largest]


def bucket_set(largest: int = PREFILL_GRAPH_TOKENS, max_seqs: int = MULTI_MAX_SEQS,
               multi_tokens: int = MULTI_BUCKET_TOKENS) -> list[Bucket]:
    """Every bucket captured: (1, t) for each of `buckets(largest)`, and (b, t) for b = 2, 4, .. up to
    max_seqs with b * t <= multi_tokens (and t <= largest); sorted by tokens, largest first."""
    sizes = buckets(largest)
    out = [(1, t) for t in sizes]
    out += [(1 << k, t) for t in sizes for k in range(1, max_seqs.bit_length())
            if 1 << k <= max_seqs and (1 << k) * t <= multi_tokens]
    return sorted(out, key=lambda bt: (-bt[0] * bt[1], -bt[1]))


def parts_of(n: int, largest: int = PREFILL_GRAPH_TOKENS) -> list[int] | None:
    """The parts a lone chunk of n tokens always replays, largest first (n's binary digits), or None
    when n is 1 (a decode step's business) or not below min(SHORT_CHUNK_TOKENS, 2 * largest)."""
    if n < 2 or n >= min(SHORT_CHUNK_TOKENS, 2 * largest):
        return None
    return [1 << b for b in range(n.bit_length() - 1, -1, -1) if n >> b & 1]


def rounds_of(plans: list[ChunkParts], widest: dict[int, int]) -> list[Round]:
    """The rounds that replay `plans`: each takes the longest next part t of any chunk and every chunk
    whose next part is t, at most widest[t] to a replay (b the next power of two of the count)."""
    at, done = [0] * len(plans), [0] * len(plans)
    rounds: list[Round] = []
    while True:
        pending = [i for i, p in enumerate(plans) if at[i] < len(p.parts)]
        if not pending:
            return rounds
        t = max(plans[i].parts[at[i]] for i in pending)
        group = [i for i in pending if plans[i].parts[at[i]] == t]
        pieces = []
        for i in group:
            j = at[i]
            pieces.append(Piece(i, done[i], tuple(plans[i].inside.get(j, ())), plans[i].saves.get(j),
                                j == len(plans[i].parts) - 1))
            at[i], done[i] = j + 1, done[i] + t
        for lo in range(0, len(pieces), widest[t]):
            some = tuple(pieces[lo : lo + widest[t]])
            rounds.append(Round((next_pow2(len(some)), t), some))


class PrefillGraphs:
    """Captured prefill forwards by bucket, their static batches and the arena."""

    def __init__(self, model, kv, state, pages: DevicePageTable, attn_dims: tuple[int, int],
                 scratch_slot: int | None, page_size: int, largest: int = PREFILL_GRAPH_TOKENS,
                 max_chunks: int = MULTI_MAX_CHUNKS, stage_tokens: int = MULTI_STAGE_TOKENS,
                 max_seqs: int = MULTI_MAX_SEQS, multi_tokens: int = MULTI_BUCKET_TOKENS,
                 checkpoint_every: int | None = None):
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
        self.every: int = checkpoint_every or CHECKPOINT_EVERY
        self.sizes: list[Bucket] = bucket_set(largest, max(1, max_seqs), min(multi_tokens, largest))
        self.widest: dict[int, int] = {}  # t -> the widest bucket of t tokens a sequence
        for b, t in self.sizes:
            self.widest[t] = max(self.widest.get(t, 1), b)
        self.room: dict[Bucket, int] = {(b, t): b * checkpoint_room(t, self.every) if state is not None else 0
                                        for b, t in self.sizes}
        self.fixed: dict[Bucket, dict[str, np.ndarray]] = {bt: self._fixed_arrays(*bt) for bt in self.sizes}
        fields: dict[str, int] = {}
        for bt in self.sizes:  # a bucket's varying fields last and together: one block a staged round copies
            b, t = bt
            key = _key(bt)
            fields.update({f"{key}.{name}": len(a) for name, a in self.fixed[bt].items()})
            fields.update({f"{key}.{name}": b * t if name in ("input_ids", "positions", "slot_mapping") else b
                           for name in _VARYING})
            if self.room[bt]:
                fields.update({f"{key}.{name}": self.room[bt] for name in _CKPT})
        # a step's page-table pairs up to what two largest parts add (more after a long hit, or in a step
        # of several chunks: those go up in their own copy, DevicePageTable.upload)
        self.table_room: int = 2 * largest // page_size + 2
        self.max_chunks: int = max(1, max_chunks)
        self.varying: tuple[str, ...] = _VARYING + (_CKPT if any(self.room.values()) else ())
        self.blocks: dict[Bucket, tuple[int, int]] = {}  # bucket -> (offset, length) of its varying block
        self.block_fields: dict[Bucket, dict[str, tuple[int, int]]] = {}
        layout = StepArena.layout_of(fields)
        for bt in self.sizes:
            names = [f"{_key(bt)}.{name}" for name in self.varying if f"{_key(bt)}.{name}" in layout]
            first, last = layout[names[0]], layout[names[-1]]
            self.blocks[bt] = (first[0], last[0] + last[1] - first[0])
            self.block_fields[bt] = {name: (layout[name][0] - first[0], layout[name][1]) for name in names}
        # staged rounds: a block each; padding at most doubles a round's rows, so twice the step's tokens'
        # fields and per-sequence fields (with checkpoints and alignment) for twice the chunks
        self.stage_room: int = 6 * stage_tokens + (16 + 5 * max(self.room.values())) * 2 * self.max_chunks
        fields.update(sample_rows=self.max_chunks, table_idx=self.table_room, table_val=self.table_room,
                      stage=self.stage_room)
        self.layout: dict[str, tuple[int, int]] = StepArena.layout_of(fields)
        # the cost model (capture_all measures both on CUDA): a replay's device seconds by bucket, and
        # the host seconds an eager step takes at least
        self.costs: dict[Bucket, float] = {}
        self.budget_s: float = 0.0
        self.budget_checkpoints_s: float = 0.0  # the eager floor of a step that keeps in-chunk checkpoints (0: budget_s)
        self.seq_s: float = 0.0  # what each sequence after the first adds to an eager step's floor
        end = max(off + n for off, n in self.layout.values())
        self.arena: StepArena = StepArena(end, kv.k.device)
        self.graphs: dict[Bucket, torch.cuda.CUDAGraph | None] = {}
        self.batches: dict[Bucket, ForwardBatch] = {}
        widest = max(b for b, _ in self.sizes)
        self.logits: torch.Tensor = torch.empty(widest, model.cfg.vocab_size, dtype=torch.float32, device=kv.k.device)
        self.pool = None

    def _tile(self, t: int) -> tuple[tuple[int, int, int, int], int]:
        group, head_dim = self.attn_dims
        tile = attention_tile(t, group, head_dim, self.kv.attn_dtype)
        return tile, max(1, tile[0] // group)

    def _fixed_arrays(self, b: int, t: int) -> dict[str, np.ndarray]:
        """What every replay of bucket (b, t) shares: b sequences of t new tokens, each last row's logits."""
        _, block_t = self._tile(t)
        q = np.full(b, t, dtype=np.int64)
        arrays = meta_arrays(q, q, np.zeros(b, dtype=np.int64), block_t)
        arrays = {name: a for name, a in arrays.items() if name in _FIXED}
        arrays["logits_indices"] = np.arange(1, b + 1, dtype=np.int64) * t - 1
        return arrays

    def _padding(self, bt: Bucket) -> dict[str, np.ndarray]:
        """A bucket's varying fields as padding rows: every sequence writes only the scratch page and slot."""
        b, t = bt
        key, scratch = _key(bt), self.pages.scratch_page * self.page_size
        arrays = {f"{key}.input_ids": np.zeros(b * t, dtype=np.int64),
                  f"{key}.positions": np.tile(np.arange(t), b),
                  f"{key}.slot_mapping": scratch + np.tile(np.arange(t), b) % self.page_size,
                  f"{key}.kv_len": np.full(b, t), f"{key}.table_rows": np.full(b, self.pages.scratch_row),
                  f"{key}.state_slots": np.full(b, self.scratch_slot or 0)}
        if self.room[bt]:
            arrays.update(self._checkpoints(bt, []))
        return {name: np.asarray(a, dtype=np.int64) for name, a in arrays.items()}

    def _checkpoints(self, bt: Bucket, entries: list[tuple[int, int, int]]) -> dict[str, np.ndarray]:
        """A bucket's checkpoint fields for (sequence row, tokens into its part, slot) entries, padded to
        its room with copies of the first (or, with none, the state after 64 tokens of row 0 to scratch)."""
        b, t = bt
        room = self.room[bt]
        pad = entries[0] if entries else (0, GDN_CHUNK, self.scratch_slot or 0)
        table = np.array(entries + [pad] * (room - len(entries)), dtype=np.int64).reshape(-1, 3)
        key = _key(bt)
        return {f"{key}.ckpt_seq": table[:, 0], f"{key}.ckpt_tokens": table[:, 1], f"{key}.ckpt_slots": table[:, 2],
                f"{key}.ckpt_rows": table[:, 0] * t + table[:, 1],
                f"{key}.ckpt_hrows": table[:, 0] * (t // GDN_CHUNK) + table[:, 1] // GDN_CHUNK}

    def _static_batch(self, bt: Bucket, views: dict[str, torch.Tensor]) -> ForwardBatch:
        b, t = bt
        mine = {name.split(".", 1)[1]: view for name, view in views.items() if name.startswith(f"{_key(bt)}.")}
        tile, block_t = self._tile(t)
        checkpoints = None
        if self.room[bt]:
            checkpoints = CheckpointMeta(mine["ckpt_seq"], mine["ckpt_tokens"], mine["ckpt_slots"], mine["ckpt_rows"],
                                         mine["ckpt_hrows"])
        return ForwardBatch(
            input_ids=mine["input_ids"], positions=mine["positions"], slot_mapping=mine["slot_mapping"],
            logits_indices=mine["logits_indices"], page_table=self.pages.table,
            meta=kernel_meta(mine, np.full(b, t, dtype=np.int64), tile, block_t),
            state_slots=mine["state_slots"] if self.state is not None else None, checkpoints=checkpoints,
        )

    def capture_all(self, progress: Callable[[], None] | None = None) -> float:
        """Capture every bucket, most tokens first (its pool serves the smaller ones), `progress()` after
        each; returns seconds."""
        started = time.perf_counter()
        arrays: dict[str, np.ndarray] = {}
        for bt in self.sizes:  # every bucket's fixed fields, and padding that writes only scratch memory
            arrays.update({f"{_key(bt)}.{name}": a for name, a in self.fixed[bt].items()})
            arrays.update(self._padding(bt))
        views = self.arena.pack(arrays, self.layout)
        self.batches = {bt: self._static_batch(bt, views) for bt in self.sizes}
        for i, bt in enumerate(self.sizes, 1):
            self._capture(bt)
            log.debug("captured CUDA graph %d/%d (prefill of %d x %d token%s)", i, len(self.sizes), *bt,
                      "s" * (bt[1] > 1))
            if progress is not None:
                progress()
        if self.arena.device.type == "cuda":
            self.measure()
        return time.perf_counter() - started

    def measure(self, repeats: int = 3) -> None:
        """The cost model: each bucket's replay on the device (CUDA events, the best of `repeats`) and the
        host time of eager forwards of the 2-token bucket's batch, of the smallest bucket's that keeps
        a checkpoint and of the widest 2-token bucket's (synchronized, the best of `repeats`: launches,
        not the GPU, set them; the last gives `seq_s`, what a sequence adds to an eager step: on an H200
        an eager step of 63 decode rows and one 128-token prompt took 53-62 ms, about twice the one-prompt
        floor). Replays and forwards write only the scratch page and slot."""
        with torch.inference_mode():
            self.costs = {bt: replay_seconds(self.graphs[bt], repeats) for bt in self.sizes}
            floor = self._host_floor(self.batches[(1, min(2, self.largest))], repeats)
            keeps = [bt for bt in self.sizes if bt[0] == 1 and self.room[bt]]
            if keeps:
                self.budget_checkpoints_s = self._host_floor(self.batches[min(keeps)], repeats)
            two = min(2, self.largest)
            many = max(b for b, t in self.sizes if t == two)
            if many > 1:
                self.seq_s = max(0.0, (self._host_floor(self.batches[(many, two)], repeats) - floor) / (many - 1))
        self.budget_s = floor
        wide = max(self.sizes, key=lambda bt: (bt[0], bt[1]))
        log.info("prefill graphs: a replay takes %.2f ms (1 token) to %.2f ms (%d tokens; %d x %d: %.2f ms) on the "
                 "device, an eager prefill step at least %.1f ms on the host (%.1f ms keeping checkpoints; %.2f ms "
                 "more a sequence): steps replay parts below that", self.costs[(1, 1)] * 1e3,
                 self.costs[(1, self.largest)] * 1e3, self.largest, *wide, self.costs[wide] * 1e3, floor * 1e3,
                 self.budget_checkpoints_s * 1e3, self.seq_s * 1e3)

    def _host_floor(self, batch: ForwardBatch, repeats: int) -> float:
        best = math.inf
        for _ in range(repeats):
            torch.cuda.synchronize()
            begin_s = time.perf_counter()
            self.model(batch, self.kv, self.state)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - begin_s)
        return best

    def _capture(self, bt: Bucket) -> None:
        batch, b = self.batches[bt], bt[0]
        if self.arena.device.type != "cuda":
            self.graphs[bt] = None
            return
        with torch.inference_mode():
            self.model(batch, self.kv, self.state)  # compile and autotune outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.logits[:b].copy_(self.model(batch, self.kv, self.state))
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[bt] = graph

    def plan_chunks(self, chunks: list[Chunk], rows: int = 0, rows_s: float = 0.0) -> StepParts | None:
        """How a step of these prefill chunks replays, or None when it runs eagerly. A lone chunk of
        2 .. SHORT_CHUNK_TOKENS - 1 tokens without checkpoints always replays its binary digits; other
        steps replay unless a chunk has a fed-in token or a checkpoint the eager path would refuse (it
        says why), there are more than `max_chunks` chunks or more repeated buckets than the staging
        field holds, or the rounds' measured device time (times PART_COST_MARGIN) plus `rows_s` exceeds
        what the eager step would cost (`eager_estimate_s`). rows: decode rows beside the chunks, which
        replay their decode graph (rows_s: its measured device time) or are sequences of the eager step.
        Decided from the plan alone, before any array is built."""
        if not self.graphs or not chunks or len(chunks) > self.max_chunks:
            return None
        if len(chunks) == 1 and not chunks[0].checkpoints and not chunks[0].follows:
            short = parts_of(len(chunks[0].token_ids), self.largest)
            if short is not None:
                plans = [ChunkParts(short)]
                return StepParts(plans, rounds_of(plans, self.widest))
        plans = []
        for c in chunks:
            try:  # the eager path's rule for checkpoints (it raises the error a bad one deserves)
                marks = sorted((tokens, slot) for _, tokens, slot in checkpoints_of([c]))
            except ValueError:
                return None
            if c.follows or not c.token_ids or len({m[0] for m in marks}) != len(marks):
                return None
            plans.append(place_chunk(len(c.token_ids), marks, self.largest, self.every))
        rounds = rounds_of(plans, self.widest)
        seen: set[Bucket] = set()
        staged = cost = 0
        for r in rounds:
            cost += self.costs.get(r.bucket, math.inf)
            if r.bucket in seen:
                staged += self.blocks[r.bucket][1]
            seen.add(r.bucket)
        if staged > self.stage_room or cost * PART_COST_MARGIN + rows_s > self.eager_estimate_s(chunks, rows):
            return None
        return StepParts(plans, rounds)

    def eager_estimate_s(self, chunks: list[Chunk], rows: int = 0) -> float:
        """What an eager step of these chunks and `rows` decode rows costs at least: the host's launch
        floor (`budget_s`, or `budget_checkpoints_s` when a chunk keeps in-chunk checkpoints: their copies
        are more launches) plus `seq_s` for each sequence after the first, or, when more, its tokens at
        the measured device cost per token of the most efficient bucket (an eager step runs the same
        kernels, so a large step is device-bound, not host-bound). 0 before anything is measured."""
        if self.budget_s <= 0:
            return 0.0
        floor = self.budget_s
        if any(c.checkpoints for c in chunks):
            floor = max(floor, self.budget_checkpoints_s)
        floor += self.seq_s * max(0, len(chunks) + rows - 1)
        per_token = min((c / (b * t) for (b, t), c in self.costs.items()), default=0.0)
        return max(floor, per_token * (sum(len(c.token_ids) for c in chunks) + rows))

    def _round_fields(self, r: Round, chunks: list[StepInputs]) -> dict[str, np.ndarray]:
        """A round's varying fields: its parts' rows, then padding rows."""
        b, t = r.bucket
        key = _key(r.bucket)
        out = self._padding(r.bucket)
        entries = []
        for j, p in enumerate(r.pieces):
            c = chunks[p.chunk]
            n = int(c.q_lens[0])
            start = int(c.kv_lens[0]) - n + p.start
            part = slice(p.start, p.start + t)
            rows = slice(j * t, (j + 1) * t)
            out[f"{key}.input_ids"][rows] = c.input_ids[part]
            out[f"{key}.positions"][rows] = c.positions[part]
            out[f"{key}.slot_mapping"][rows] = c.slot_mapping[part]
            out[f"{key}.kv_len"][j] = start + t
            out[f"{key}.table_rows"][j] = int(c.rows[0])
            out[f"{key}.state_slots"][j] = int(c.state_slots[0]) if c.state_slots is not None else 0
            entries += [(j, tokens, slot) for tokens, slot in p.inside]
        if entries:
            out.update(self._checkpoints(r.bucket, entries))
        return out

    def replay_chunks(self, chunks: list[StepInputs], plan: StepParts, idx: np.ndarray, vals: np.ndarray
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the chunks (`StepInputs.of([chunk])` each) as `plan` (from `plan_chunks`); returns the
        logits [S, vocab] of those that sample, in chunk order, and their sampling rows [S] on the device."""
        samples = [bool(len(c.logits_indices)) for c in chunks]
        out_row = np.cumsum(samples) - 1  # chunk -> its logits row
        arrays: dict[str, np.ndarray] = {
            "sample_rows": np.array([int(c.sample_rows[0]) for c in chunks if len(c.logits_indices)])}
        staged: list[np.ndarray] = []
        stage_at = 0
        runs = []  # per round: (bucket, staging offset or None, [(state slot, checkpoint slot)], [(row, out row)])
        seen: set[Bucket] = set()
        for r in plan.rounds:
            fields = self._round_fields(r, chunks)
            if r.bucket in seen:  # the bucket's own fields are taken: stage this round's
                block = np.zeros(self.blocks[r.bucket][1], dtype=np.int64)
                for name, (off, _) in self.block_fields[r.bucket].items():
                    block[off : off + len(fields[name])] = fields[name]
                staged.append(block)
                where, stage_at = stage_at, stage_at + len(block)
            else:
                arrays.update(fields)
                where = None
            seen.add(r.bucket)
            saves = [(int(chunks[p.chunk].state_slots[0]), p.save) for p in r.pieces if p.save is not None]
            rows = [(j, int(out_row[p.chunk])) for j, p in enumerate(r.pieces) if p.last and samples[p.chunk]]
            runs.append((r.bucket, where, saves, rows))
        if staged:
            arrays["stage"] = np.concatenate(staged)
        views = self.pages.pack(self.arena, arrays, self.layout, idx, vals)
        logits = torch.empty(len(arrays["sample_rows"]), self.logits.shape[1], dtype=self.logits.dtype,
                             device=self.logits.device)
        for bt, where, saves, rows in runs:
            if where is not None:
                off, span = self.blocks[bt]
                self.arena.dev[off : off + span].copy_(views["stage"][where : where + span])
            graph = self.graphs[bt]
            if graph is None:
                self.logits[: bt[0]].copy_(self.model(self.batches[bt], self.kv, self.state))
            else:
                graph.replay()
            for live, keep in saves:  # a checkpoint on the part's end: the live state is what it keeps
                self.state.copy_slot(live, keep)
            for j, dst, n in _runs(rows):
                logits[dst : dst + n].copy_(self.logits[j : j + n])
        return logits, views["sample_rows"][: len(arrays["sample_rows"])]


def _key(bt: Bucket) -> str:
    return f"{bt[0]}x{bt[1]}"


def _runs(rows: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(source row, destination row) pairs as runs (source, destination, length) where both go up by one."""
    out: list[list[int]] = []
    for j, dst in rows:
        if out and out[-1][0] + out[-1][2] == j and out[-1][1] + out[-1][2] == dst:
            out[-1][2] += 1
        else:
            out.append([j, dst, 1])
    return [tuple(r) for r in out]
