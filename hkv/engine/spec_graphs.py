"""Verify steps of speculative decoding, and the drafter after them, replayed from CUDA graphs.

A verify step's sequences each bring [x_n, d_1 .. d_k] (k <= K drafts; a plain decode is k = 0).
The B of them that fit run two graphs of the smallest captured bucket b >= B:

    forward  every row has q = K + 1 token places. A chunk of n < q tokens fills the rest with
             padding: its K/V go to the scratch page and its states to the row's own spare keep
             slots, so they change nothing anyone reads; a padding token comes after every real
             token of its row, so the causal mask hides it from them. The logits, the final-norm
             hidden states and the argmax of all b * q rows land in static buffers.
             It also verifies greedily on the device: each row's accepted count (the drafts that
             equal the argmax before them) and the token after them.
    (host)   only when a row samples at temperature > 0 or asks for logprobs: the rejection
             sampler (hkv.engine.spec_verify) on its logits rows; its accepted counts and tokens
             overwrite the device's
    post     adopt the accepted position's linear state, commit the kept tokens' MTP entries to
             the draft rings, store h_{L-1} and draft K tokens, all from the accepted counts on
             the device: ring windows only (W > 0); with a paged draft layer (W = 0) this part
             runs eagerly (hkv.engine.spec.SpecDecoder._draft)

A greedy step therefore replays both graphs back to back and waits on the device once, for one
[B, K + 1 + 1 + K] copy: the argmaxes, the accepted count and the next drafts of every row.

Rows past B are padding too: they read and write the scratch page and the scratch state slot
(ModelRunner's graph scratch), never a sequence's. A row whose padded length would reach past its
page-table row (a sequence within K tokens of the context limit) runs eagerly instead.

Off CUDA (tests) the same buffers, padding and layouts are replayed eagerly, as DecodeGraphs does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from hkv.engine.cuda_graphs import buckets_up_to
from hkv.engine.sampler import GREEDY_BELOW, SampleOutput
from hkv.engine.spec_verify import verify
from hkv.engine.step_inputs import StepInputs
from hkv.ipc.messages import Chunk
from hkv.models.batch import ForwardBatch
from hkv_kernels import dispatch
from hkv_kernels.meta import StepArena, attention_tile, kernel_meta, meta_arrays

log = logging.getLogger("hkv.rank")
MAX_VERIFY_TOKENS = 512  # b * (K + 1) of the largest bucket: its logits buffer is that many vocab rows


def verify_max_bs(graph_max_bs: int, spec_tokens: int) -> int:
    """The largest verify bucket for --cuda-graph-max-bs and K: its b (K + 1) tokens within MAX_VERIFY_TOKENS."""
    return max(1, min(graph_max_bs, MAX_VERIFY_TOKENS // (spec_tokens + 1)))

_SEQ_FIELDS = ("state_slots", "q_start", "q_len", "kv_len", "table_rows", "attn_block_seq", "attn_block_tok",
               "conv_block_seq", "conv_block_tok")


class VerifyGraphs:
    """Captured verify forwards and drafter passes by bucket, for one SpecDecoder."""

    def __init__(self, runner, spec, max_bs: int, scratch_slot: int) -> None:
        self.runner, self.spec = runner, spec
        self.q: int = spec.k + 1
        self.max_bs: int = verify_max_bs(max_bs, spec.k)
        self.scratch_slot = scratch_slot
        self.ring: bool = bool(spec.drafter.store.spec.window)  # the drafter runs in the graph (W > 0)
        kv, pages = runner.kv, runner.pages
        group, head_dim = runner.attn_dims
        self.tile = attention_tile(self.q, group, head_dim, kv.attn_dtype)
        self.block_t = max(1, self.tile[0] // group)
        if self.block_t < self.q:  # rows of several attention blocks never ran in a graph on a GPU: such K stay eager
            raise ValueError(f"an attention block of {self.block_t} tokens is shorter than a verify row of {self.q}")
        self.capacity: int = pages.max_pages * runner.page_size  # positions a page-table row covers
        T, B = self.max_bs * self.q, self.max_bs
        fields = dict.fromkeys(("input_ids", "positions", "slot_mapping", "logits_indices", "keep_slots"), T)
        fields.update(dict.fromkeys((*_SEQ_FIELDS, "row_len"), B))  # row_len: real tokens a row, 0 = padding
        fields["cu_seqlens"] = B + 1
        self.table_room: int = 4 * B
        fields["table_idx"] = fields["table_val"] = self.table_room
        self.layout = StepArena.layout_of(fields)
        device = kv.k.device
        self.arena = StepArena(max(off + n for off, n in self.layout.values()), device)
        self.views: dict[str, torch.Tensor] = {}  # the arena's fixed views (every pack returns the same)
        model = runner.model
        self.logits = torch.empty(T, model.cfg.vocab_size, dtype=torch.float32, device=device)
        self.hidden = torch.empty(T, model.cfg.hidden_size, dtype=runner.state.mtp_hidden.dtype, device=device)
        self.targets = torch.zeros(T, dtype=torch.long, device=device)
        # per row: drafts kept and the token after them (the device's greedy verdict, or the host's)
        self.accepted = torch.zeros(B, dtype=torch.long, device=device)
        self.next_token = torch.zeros(B, dtype=torch.long, device=device)
        # per row, one copy to the host: argmaxes [q], accepted count, proposals [K]
        self.result = torch.zeros(B, 2 * self.q, dtype=torch.long, device=device)
        # bucket -> (forward graph, post graph or None); both None off CUDA
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, torch.cuda.CUDAGraph | None]] = {}
        self.batches: dict[int, ForwardBatch] = {}
        self.pool = None
        self.rows_run: int = 0  # verify rows replayed so far (tests, logs)
        self.host_rows: int = 0  # ... of which the host verified (sampling or logprobs in their step)

    def take(self, chunks: list[Chunk]) -> list[Chunk]:
        """The chunks this step replays (verify or decode rows that fit); the rest run eagerly."""
        if not self.graphs:
            return []
        rows = [c for c in chunks if c.sample and len(c.token_ids) == c.drafts + 1 <= self.q and c.start_pos > 0
                and not c.checkpoints and not c.follows and c.start_pos + self.q <= self.capacity]
        return rows[: self.max_bs]

    def bucket(self, n: int) -> int:
        return next(b for b in sorted(self.graphs) if b >= n)

    def capture_all(self, progress: Callable[[], None] | None = None) -> float:
        """Capture every bucket, largest first (its pool serves the smaller ones), `progress()` after
        each; returns seconds."""
        started = time.perf_counter()
        sizes = sorted(buckets_up_to(self.max_bs), reverse=True)
        for i, b in enumerate(sizes, 1):
            self._capture(b)
            log.debug("captured verify graph %d/%d (batch %d, %d tokens a row)", i, len(sizes), b, self.q)
            if progress is not None:
                progress()
        return time.perf_counter() - started

    def _capture(self, b: int) -> None:
        self.views = self.arena.pack(self._forward_arrays([], None, b), self.layout)
        batch = self._static_batch(b, self.views)
        self.batches[b] = batch
        if self.arena.device.type != "cuda":
            self.graphs[b] = (None, None)
            return
        with torch.inference_mode():
            self._forward(b, batch)  # compile and warm every kernel outside the capture
            if self.ring:
                self._post(b)
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
                    self._post(b)
        self.graphs[b] = (forward, drafting)

    def _forward(self, b: int, batch: ForwardBatch) -> None:
        q, T = self.q, b * self.q
        r = self.runner
        logits, hidden = r.model(batch, r.kv, r.state, hidden_out=True)
        self.logits[:T].copy_(logits)
        self.hidden[:T].copy_(hidden)
        targets = logits.argmax(dim=-1)  # [T]
        self.targets[:T].copy_(targets)
        # greedy verification: draft j (token j + 1 of the row) is kept while it equals the argmax of the
        # position before it, and only among the row's real drafts
        rows = targets.view(b, q)
        drafts = batch.input_ids.view(b, q)[:, 1:]
        real = torch.arange(q - 1, device=rows.device)[None] < (self.views["row_len"][:b, None] - 1)
        accepted = torch.cumprod(((drafts == rows[:, :-1]) & real).long(), dim=1).sum(dim=1)  # [b]
        self.accepted[:b].copy_(accepted)
        self.next_token[:b].copy_(rows.gather(1, accepted[:, None])[:, 0])

    def _post(self, b: int) -> None:
        """Adopt, commit and draft for bucket b (ring windows), from the accepted counts on the device and
        the forward arena's views."""
        q, T = self.q, b * self.q
        state, drafter, v = self.runner.state, self.spec.drafter, self.views
        mtp = drafter.mtp
        accepted = self.accepted[:b]
        real = v["row_len"][:b] > 0
        live = v["state_slots"][:b]
        kept = v["keep_slots"][:T].view(b, q).gather(1, accepted[:, None])[:, 0]
        adopt_to = torch.where(real, live, torch.full_like(live, -1))  # padding rows copy nothing
        dispatch.copy_blocks(state.conv, state.conv, kept, adopt_to)
        dispatch.copy_blocks(state.recurrent, state.recurrent, kept, adopt_to)
        # entry j of row i pairs h at position start + j - 1 (the stored one for j = 0) with token j
        H = self.hidden.shape[1]
        h_prev = torch.cat([state.mtp_hidden.index_select(0, live)[:, None],
                            self.hidden[:T].view(b, q, H)[:, : q - 1]], dim=1).reshape(T, H)
        offsets = torch.arange(q, device=live.device)[None]  # [1, q]
        start = v["positions"][:T].view(b, q)[:, :1]  # [b, 1] a row's first position (padding: 0)
        pos = start + offsets  # [b, q]
        x = mtp.entry_input(h_prev, drafter.embed(v["input_ids"][:T]))
        _, _, k, vals, _ = mtp.project(x, pos.reshape(T), drafter.model.rotary)
        # kept entries only: the row's token and its accepted drafts (position 0 has no entry)
        write = (offsets <= accepted[:, None]) & real[:, None] & (pos >= 1)
        slots = torch.where(write, live[:, None], torch.full_like(pos, -1)).reshape(T)
        dispatch.ring_write(state.draft_k, slots, pos.reshape(T), k.contiguous())
        dispatch.ring_write(state.draft_v, slots, pos.reshape(T), vals.contiguous())
        last = torch.arange(b, device=live.device) * q + accepted  # each row's last kept token
        state.mtp_hidden.index_copy_(0, live, self.hidden.index_select(0, last))
        proposals = drafter.draft_ring(start[:, 0] + accepted + 1, live, self.next_token[:b], self.spec.k)
        self.result[:b, :q].copy_(self.targets[:T].view(b, q))
        self.result[:b, q].copy_(accepted)
        self.result[:b, q + 1 :].copy_(proposals)

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
        row_len = np.zeros(b, dtype=np.int64)
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
            row_len[:n] = q_lens
        arrays = {"input_ids": ids, "positions": pos, "slot_mapping": slot_mapping,
                  "logits_indices": np.arange(T, dtype=np.int64), "keep_slots": keep.reshape(-1),
                  "state_slots": state_slots, "row_len": row_len}
        arrays.update(meta_arrays(np.full(b, q, dtype=np.int64), kv_lens, table_rows, self.block_t, gdn_chunks=False))
        return arrays

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

    def run(self, rows: list[Chunk]) -> tuple[dict[int, list[int]], dict[int, tuple]]:
        """Verify `rows` (from `take`) and draft after them.

        Returns (slot -> the drafter's K proposals, for ring windows) and (slot -> (outputs,
        committed tokens, hidden states of the committed positions or None)): with ring windows
        every row is drafted already; with a paged draft layer the second dict goes to the eager
        drafter.
        """
        r, q, n = self.runner, self.q, len(rows)
        b = self.bucket(n)
        self.rows_run += n
        inputs = StepInputs.of(rows, r.table, r.page_size, r.state_slots)
        idx, vals = r.pages.updates(inputs, r.table, r.page_size)
        arrays = self._forward_arrays(rows, inputs, b)
        r.pages.pack(self.arena, arrays, self.layout, idx, vals)
        forward, drafting = self.graphs[b]
        self._replay(forward, lambda: self._forward(b, self.batches[b]))
        if self.ring and all(self._plain_greedy(c) for c in rows):
            self._replay(drafting, lambda: self._post(b))
            return self._greedy_outcomes(rows, self.result[:n].tolist())
        self.host_rows += n
        targets = self.targets[: n * q].view(n, q).tolist()  # one copy, and the step's wait
        outcomes, accepted, tokens = {}, [], []
        for i, c in enumerate(rows):
            m = len(c.token_ids)
            v = verify(self.logits[i * q : i * q + m], c.token_ids[1:], self.spec.row(c), targets=targets[i][:m])
            outcomes[c.slot] = (v.outputs, c.token_ids[: v.accepted + 1],
                                self.hidden[i * q : i * q + v.accepted + 1])
            accepted.append(v.accepted)
            tokens.append(v.outputs[-1].token_id)
        if not self.ring:
            self.spec.adopt_many([r.state_slots[c.slot] for c in rows],
                                 [self.spec.keep_slot(c.slot, a) for c, a in zip(rows, accepted)])
            return {}, outcomes
        verdict = torch.tensor([accepted, tokens], dtype=torch.long).to(self.accepted.device)
        self.accepted[:n].copy_(verdict[0])
        self.next_token[:n].copy_(verdict[1])
        self._replay(drafting, lambda: self._post(b))
        proposals = self.result[:n, q + 1 :].tolist()
        return {c.slot: p for c, p in zip(rows, proposals)}, outcomes

    def _replay(self, graph: torch.cuda.CUDAGraph | None, eager) -> None:
        if graph is None:
            eager()
        else:
            graph.replay()

    def _plain_greedy(self, c: Chunk) -> bool:
        """Greedy without logprobs: the device's verdict is the whole answer."""
        params = self.runner.sampling[c.slot]
        return params.temperature < GREEDY_BELOW and params.logprobs is None

    def _greedy_outcomes(self, rows: list[Chunk], result: list[list[int]]) -> tuple[dict, dict]:
        """(proposals, outcomes) of a greedy step from its result rows [argmaxes (q), accepted, proposals (K)]:
        the accepted drafts equal the argmaxes before them, so the emitted tokens are argmaxes 0 .. a."""
        q, drafted, outcomes = self.q, {}, {}
        for c, row in zip(rows, result):
            a = row[q]
            outcomes[c.slot] = ([SampleOutput(t, None, None) for t in row[: a + 1]], c.token_ids[: a + 1], None)
            drafted[c.slot] = row[q + 1 :]
        return drafted, outcomes
