"""Verify steps of speculative decoding, and the drafter after them, replayed from CUDA graphs.

A verify step's sequences each bring [x_n, d_1 .. d_k] (k <= K drafts; a plain decode is k = 0).
The B of them that fit run two graphs of the smallest captured bucket b >= B:

    forward  every row has q = K + 1 token places. A chunk of n < q tokens fills the rest with
             padding: its K/V go to the scratch page and its states to the row's own spare keep
             slots, so they change nothing anyone reads; a padding token comes after every real
             token of its row, so the causal mask hides it from them. The logits, the final-norm
             hidden states and the argmax of all b * q rows land in static buffers.
    (host)   verification (hkv.engine.spec_verify): greedy rows from the argmaxes, in one copy;
             sampling rows with the rejection sampler on their logits rows
    post     adopt the accepted position's linear state, commit the kept tokens' MTP entries to
             the draft rings, store h_{L-1} and draft K tokens: ring windows only (W > 0); with a
             paged draft layer (W = 0) this part runs eagerly (hkv.engine.spec.SpecDecoder._draft)

Rows past B are padding too: they read and write the scratch page and the scratch state slot
(ModelRunner's graph scratch), never a sequence's. A row whose padded length would reach past its
page-table row (a sequence within K tokens of the context limit) runs eagerly instead.

Off CUDA (tests) the same buffers, padding and layouts are replayed eagerly, as DecodeGraphs does.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from hkv.engine.cuda_graphs import buckets_up_to
from hkv.engine.spec_verify import verify
from hkv.engine.step_inputs import StepInputs
from hkv.ipc.messages import Chunk
from hkv.models.batch import ForwardBatch
from hkv_kernels import dispatch
from hkv_kernels.meta import StepArena, attention_tile, kernel_meta, meta_arrays

log = logging.getLogger("hkv.rank")
MAX_VERIFY_TOKENS = 512  # b * (K + 1) of the largest bucket: its logits buffer is that many vocab rows

_SEQ_FIELDS = ("state_slots", "q_start", "q_len", "kv_len", "table_rows", "attn_block_seq", "attn_block_tok",
               "conv_block_seq", "conv_block_tok")
_POST_SEQ = ("live", "adopt_src", "hidden_idx", "draft_len", "next_token")
_POST_TOK = ("commit_tokens", "commit_pos", "commit_slots")


class VerifyGraphs:
    """Captured verify forwards and drafter passes by bucket, for one SpecDecoder."""

    def __init__(self, runner, spec, max_bs: int, scratch_slot: int) -> None:
        self.runner, self.spec = runner, spec
        self.q: int = spec.k + 1
        self.max_bs: int = max(1, min(max_bs, MAX_VERIFY_TOKENS // self.q))
        self.scratch_slot = scratch_slot
        self.ring: bool = bool(spec.drafter.store.spec.window)  # the drafter runs in the graph (W > 0)
        kv, pages = runner.kv, runner.pages
        group, head_dim = runner.attn_dims
        self.tile = attention_tile(self.q, group, head_dim, kv.k.dtype)
        self.block_t = max(1, self.tile[0] // group)
        if self.block_t < self.q:  # one attention block per row keeps the grid the graph captured
            raise ValueError(f"an attention block of {self.block_t} tokens is shorter than a verify row of {self.q}")
        self.capacity: int = pages.max_pages * runner.page_size  # positions a page-table row covers
        T, B = self.max_bs * self.q, self.max_bs
        fields = dict.fromkeys(("input_ids", "positions", "slot_mapping", "logits_indices", "keep_slots"), T)
        fields.update(dict.fromkeys(_SEQ_FIELDS, B))
        fields["cu_seqlens"] = B + 1
        self.table_room: int = 4 * B
        fields["table_idx"] = fields["table_val"] = self.table_room
        self.layout = StepArena.layout_of(fields)
        device = kv.k.device
        self.arena = StepArena(max(off + n for off, n in self.layout.values()), device)
        post = dict.fromkeys(_POST_SEQ, B) | dict.fromkeys(_POST_TOK, T)
        self.post_layout = StepArena.layout_of(post)
        self.post_arena = StepArena(max(off + n for off, n in self.post_layout.values()), device)
        model = runner.model
        self.logits = torch.empty(T, model.cfg.vocab_size, dtype=torch.float32, device=device)
        self.hidden = torch.empty(T, model.cfg.hidden_size, dtype=runner.state.mtp_hidden.dtype, device=device)
        self.targets = torch.zeros(T, dtype=torch.long, device=device)
        self.proposals = torch.zeros(B, spec.k, dtype=torch.long, device=device)
        # bucket -> (forward graph, post graph or None); both None off CUDA
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, torch.cuda.CUDAGraph | None]] = {}
        self.batches: dict[int, ForwardBatch] = {}
        self.pool = None
        self.rows_run: int = 0  # verify rows replayed so far (tests, logs)

    # -- which rows --------------------------------------------------------------------------------

    def take(self, chunks: list[Chunk]) -> list[Chunk]:
        """The chunks this step replays (verify or decode rows that fit); the rest run eagerly."""
        if not self.graphs:
            return []
        rows = [c for c in chunks if c.sample and len(c.token_ids) == c.drafts + 1 <= self.q and c.start_pos > 0
                and not c.checkpoints and not c.follows and c.start_pos + self.q <= self.capacity]
        return rows[: self.max_bs]

    def bucket(self, n: int) -> int:
        return next(b for b in sorted(self.graphs) if b >= n)

    # -- capture -----------------------------------------------------------------------------------

    def capture_all(self) -> float:
        """Capture every bucket, largest first (its pool serves the smaller ones); returns seconds."""
        started = time.perf_counter()
        sizes = sorted(buckets_up_to(self.max_bs), reverse=True)
        for i, b in enumerate(sizes, 1):
            self._capture(b)
            log.info("captured verify graph %d/%d (batch %d, %d tokens a row)", i, len(sizes), b, self.q)
        return time.perf_counter() - started

    def _capture(self, b: int) -> None:
        views = self.arena.pack(self._forward_arrays([], None, b), self.layout)
        batch = self._static_batch(b, views)
        post = self.post_arena.pack(self._post_arrays([], [], b), self.post_layout)
        self.batches[b] = batch
        if self.arena.device.type != "cuda":
            self.graphs[b] = (None, None)
            return
        with torch.inference_mode():
            self._forward(b, batch)  # compile and warm every kernel outside the capture
            if self.ring:
                self._post(b, post)
            torch.cuda.synchronize()
            forward = torch.cuda.CUDAGraph()
            with torch.cuda.graph(forward, pool=self.pool):
                self._forward(b, batch)
            if self.pool is None:
                self.pool = forward.pool()
            drafting = None
            if self.ring:
                drafting = torch.cuda.CUDAGraph()
                with torch.cuda.graph(drafting, pool=self.pool):
                    self._post(b, post)
        self.graphs[b] = (forward, drafting)

    # -- the captured work -------------------------------------------------------------------------

    def _forward(self, b: int, batch: ForwardBatch) -> None:
        T = b * self.q
        r = self.runner
        logits, hidden = r.model(batch, r.kv, r.state, hidden_out=True)
        self.logits[:T].copy_(logits)
        self.hidden[:T].copy_(hidden)
        self.targets[:T].copy_(logits.argmax(dim=-1))

    def _post(self, b: int, v: dict[str, torch.Tensor]) -> None:
        """Adopt, commit and draft for bucket b from the post arena's views (ring windows)."""
        q, T = self.q, b * self.q
        state, drafter = self.runner.state, self.spec.drafter
        mtp = drafter.mtp
        live = v["live"][:b]
        src = v["adopt_src"][:b]
        state.conv.index_copy_(1, live, state.conv.index_select(1, src))
        state.recurrent.index_copy_(1, live, state.recurrent.index_select(1, src))
        # entry j of row i pairs h at position start + j - 1 (the stored one for j = 0) with token j
        H = self.hidden.shape[1]
        h_prev = torch.cat([state.mtp_hidden.index_select(0, live)[:, None],
                            self.hidden[:T].view(b, q, H)[:, : q - 1]], dim=1).reshape(T, H)
        pos = v["commit_pos"][:T]
        x = mtp.entry_input(h_prev, drafter.embed(v["commit_tokens"][:T]))
        _, _, k, vals, _ = mtp.project(x, pos, drafter.model.rotary)
        slots = v["commit_slots"][:T]  # -1: not kept (padding, rejected drafts, position 0)
        dispatch.ring_write(state.draft_k, slots, pos, k.contiguous())
        dispatch.ring_write(state.draft_v, slots, pos, vals.contiguous())
        state.mtp_hidden.index_copy_(0, live, self.hidden.index_select(0, v["hidden_idx"][:b]))
        self.proposals[:b].copy_(drafter.draft_ring(v["draft_len"][:b], live, v["next_token"][:b], self.spec.k))

    # -- arrays ------------------------------------------------------------------------------------

    def _forward_arrays(self, rows: list[Chunk], inputs: StepInputs | None, b: int) -> dict[str, np.ndarray]:
        """The forward arena's arrays of `rows` padded to bucket b (rows empty: all padding)."""
        r, q, n = self.runner, self.q, len(rows)
        pages, P = r.pages, r.page_size
        T = b * q
        ids = np.zeros(T, dtype=np.int64)
        pos = np.zeros(T, dtype=np.int64)
        slot_mapping = np.full(T, pages.scratch_page * P, dtype=np.int64)
        keep = np.full((b, q), self.scratch_slot, dtype=np.int64)
        state_slots = np.full(b, self.scratch_slot, dtype=np.int64)
        kv_lens = np.full(b, q, dtype=np.int64)
        table_rows = np.full(b, pages.scratch_row, dtype=np.int64)
        if n:
            q_lens = inputs.q_lens
            starts = inputs.kv_lens - q_lens
            first = np.cumsum(q_lens) - q_lens
            seq = np.repeat(np.arange(n), q_lens)
            place = seq * q + (np.arange(len(seq)) - first[seq])  # each real token's padded index
            ids[place] = inputs.input_ids
            slot_mapping[place] = inputs.slot_mapping
            # padding tokens sit at their row's last real position (their rope never reaches the tables' end)
            pos[: n * q] = np.repeat(starts + q_lens - 1, q)
            pos[place] = inputs.positions
            keep[:n] = self.spec.keep_base + inputs.rows[:, None] * q + np.arange(q)[None]
            state_slots[:n] = inputs.state_slots
            kv_lens[:n] = starts + q
            table_rows[:n] = inputs.rows
        arrays = {"input_ids": ids, "positions": pos, "slot_mapping": slot_mapping,
                  "logits_indices": np.arange(T, dtype=np.int64), "keep_slots": keep.reshape(-1),
                  "state_slots": state_slots}
        arrays.update(meta_arrays(np.full(b, q, dtype=np.int64), kv_lens, table_rows, self.block_t, gdn_chunks=False))
        return arrays

    def _post_arrays(self, rows: list[Chunk], accepted: list[tuple[int, int]], b: int) -> dict[str, np.ndarray]:
        """The post arena's arrays: accepted[i] = (drafts kept, token emitted last) of rows[i]."""
        q, n = self.q, len(rows)
        s = self.scratch_slot
        live = np.full(b, s, dtype=np.int64)
        src = np.full(b, s, dtype=np.int64)
        hidden_idx = np.zeros(b, dtype=np.int64)
        draft_len = np.ones(b, dtype=np.int64)
        next_token = np.zeros(b, dtype=np.int64)
        tokens = np.zeros((b, q), dtype=np.int64)
        pos = np.ones((b, q), dtype=np.int64)
        slots = np.full((b, q), -1, dtype=np.int64)
        for i, (c, (a, token)) in enumerate(zip(rows, accepted)):
            live[i] = self.runner.state_slots[c.slot]
            src[i] = self.spec.keep_slot(c.slot, a)
            hidden_idx[i] = i * q + a
            draft_len[i] = c.start_pos + a + 1
            next_token[i] = token
            tokens[i, : a + 1] = c.token_ids[: a + 1]
            pos[i] = c.start_pos + np.arange(q)
            slots[i, : a + 1] = live[i]
        slots[pos < 1] = -1  # position 0 has no entry
        return {"live": live, "adopt_src": src, "hidden_idx": hidden_idx, "draft_len": draft_len,
                "next_token": next_token, "commit_tokens": tokens.reshape(-1), "commit_pos": pos.reshape(-1),
                "commit_slots": slots.reshape(-1)}

    def _static_batch(self, b: int, views: dict[str, torch.Tensor]) -> ForwardBatch:
        T = b * self.q
        sliced = {name: views[name][: b + 1] if name == "cu_seqlens" else views[name][:b]
                  for name in (*_SEQ_FIELDS, "cu_seqlens")}
        r = self.runner
        return ForwardBatch(
            input_ids=views["input_ids"][:T], positions=views["positions"][:T],
            slot_mapping=views["slot_mapping"][:T], logits_indices=views["logits_indices"][:T],
            page_table=r.pages.table, meta=kernel_meta(sliced, np.full(b, self.q, dtype=np.int64), self.tile,
                                                       self.block_t),
            state_slots=sliced["state_slots"], keep_slots=views["keep_slots"][:T].view(b, self.q),
        )

    # -- a step ------------------------------------------------------------------------------------

    def run(self, rows: list[Chunk]) -> tuple[dict[int, list[int]], dict[int, tuple]]:
        """Verify `rows` (from `take`) and draft after them.

        Returns (slot -> the drafter's K proposals, for ring windows) and (slot -> (outputs,
        committed tokens, hidden states of the committed positions)): with ring windows every row
        is drafted already; with a paged draft layer the second dict goes to the eager drafter.
        """
        r, q, n = self.runner, self.q, len(rows)
        b = self.bucket(n)
        self.rows_run += n
        inputs = StepInputs.of(rows, r.table, r.page_size, r.state_slots)
        idx, vals = r.pages.updates(inputs, r.table, r.page_size)
        arrays = self._forward_arrays(rows, inputs, b)
        fits = len(idx) <= self.table_room
        if fits:
            arrays["table_idx"], arrays["table_val"] = idx, vals
        else:
            r.pages.upload(idx, vals)
        views = self.arena.pack(arrays, self.layout)
        if fits:
            r.pages.apply(views["table_idx"][: len(idx)], views["table_val"][: len(vals)])
        forward, drafting = self.graphs[b]
        if forward is None:
            self._forward(b, self.batches[b])
        else:
            forward.replay()
        greedy = self.targets[: n * q].view(n, q).tolist()  # one copy, and the step's wait
        outcomes, accepted = {}, []
        for i, c in enumerate(rows):
            m = len(c.token_ids)
            v = verify(self.logits[i * q : i * q + m], c.token_ids[1:], self.spec.row(c), targets=greedy[i][:m])
            outcomes[c.slot] = (v.outputs, c.token_ids[: v.accepted + 1],
                                self.hidden[i * q : i * q + v.accepted + 1])
            accepted.append((v.accepted, v.outputs[-1].token_id))
        if not self.ring:
            self.spec.adopt_many([r.state_slots[c.slot] for c in rows],
                                 [self.spec.keep_slot(c.slot, a) for c, (a, _) in zip(rows, accepted)])
            return {}, outcomes
        post = self.post_arena.pack(self._post_arrays(rows, accepted, b), self.post_layout)
        if drafting is None:
            self._post(b, post)
        else:
            drafting.replay()
        proposals = self.proposals[:n].tolist()
        return {c.slot: p for c, p in zip(rows, proposals)}, outcomes
