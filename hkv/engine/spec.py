"""Speculative decoding on a rank: verify the router's drafts in one target forward, keep what agrees, draft again.

A plan's chunks split in two forwards:

    plain   prefill chunks and decodes without drafts (Chunk.drafts == 0): the usual forward
    verify  [x_n, d_1 .. d_k] at positions n .. n + k: logits at every row, and the linear state
            after every token kept in scratch slots (keep_slots), the live slots left as they were

Verification (hkv.engine.spec_verify) accepts a drafts and emits them plus the
target's own next token. The state after token n + a (scratch slot a of the
row) becomes the live state; the K/V written at rejected positions lie past
the sequence's new length, where the router's cursor moved back to, and are
overwritten later. Then the drafter (hkv.models.mtp) commits the accepted
tokens' MTP entries and proposes the next drafts, which travel back in the
result (Sampled.proposals); the router sends them in the next verify chunk.

Scratch slots: the rank allocates rows * (k + 1) state slots past the
router's (and the graph scratch slot): row r's token t keeps its state in
`keep_base + r * (k + 1) + t`. They are never a checkpoint's and never leave
the rank.

Everything waits for the step's tokens on the host before drafting (the next
plan depends on them anyway: the router does not plan a drafting sequence
ahead of its result).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch

from hkv.engine.sampler import SampleRow, sample
from hkv.engine.spec_verify import verify
from hkv.engine.step_inputs import StepInputs
from hkv.ipc.messages import STEP_EAGER, STEP_VERIFY_GRAPHS, Chunk, Emitted, Sampled, StepPlan
from hkv.models.batch import ForwardBatch
from hkv.models.mtp import DraftRow, Drafter, DraftSpec, DraftStore
from hkv_kernels.dispatch import copy_blocks

log = logging.getLogger("hkv.rank")
# tests: (request-table row, position of the first proposal, the drafter's proposals) -> the proposals to send
Proposer = Callable[[int, int, list[int]], list[int]]
ORACLE_KEY = 32  # prompt tokens that identify a sequence to the oracle


class OracleProposer:
    """Benchmarks only (`HKV_SPEC_ORACLE=file`, read by hkv.config; docs/spec.md): propose a sequence's known continuation,
    to measure the speedup the verify machinery allows when every draft is right.

    The file is JSON, [{"prompt": [ids], "output": [ids]}, ...] (hkv-bench --save-outputs writes it).
    A sequence is recognised by its first ORACLE_KEY prompt tokens, seen when its first chunk starts
    at position 0; sequences it does not know (or that start from a cache hit) get the MTP module's
    own proposals. The file may appear or change while serving: it is read again when its
    modification time changes, so one server can record its own greedy outputs (a first hkv-bench
    run with --save-outputs) and then replay them as the oracle (a second run): the same
    configuration computes the same tokens, so an oracle taken from it is right at every draft.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.stamp: tuple[int, int] | None = None  # (mtime_ns, size) of the file as last read
        self.known: dict[tuple[int, ...], list[int]] = {}
        self.rows: dict[int, list[int]] = {}

    def _refresh(self) -> None:
        try:
            st = os.stat(self.path)
        except OSError:
            return  # not written yet: the MTP module proposes
        if (st.st_mtime_ns, st.st_size) == self.stamp:
            return
        try:
            entries = json.loads(open(self.path, encoding="utf-8").read())
            known = {tuple(e["prompt"][:ORACLE_KEY]): [*e["prompt"], *e["output"]] for e in entries}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("oracle file %s unreadable (%s); keeping the previous one", self.path, exc)
            return
        self.known, self.stamp = known, (st.st_mtime_ns, st.st_size)
        log.info("oracle: %d known continuations from %s", len(known), self.path)

    def observe(self, plan: StepPlan) -> None:
        if plan.new:
            self._refresh()
        for seq in plan.new:
            self.rows.pop(seq.slot, None)
        for c in plan.chunks:
            if c.start_pos == 0:
                sequence = self.known.get(tuple(c.token_ids[:ORACLE_KEY]))
                if sequence is not None:
                    self.rows[c.slot] = sequence
                else:
                    self.rows.pop(c.slot, None)

    def __call__(self, row: int, first: int, got: list[int]) -> list[int]:
        sequence = self.rows.get(row)
        if sequence is None or first + len(got) > len(sequence):
            return got
        return sequence[first : first + len(got)]


class SpecDecoder:
    """The speculative half of a ModelRunner (which owns the pools, the table and the sampling params)."""

    def __init__(self, runner, spec_tokens: int, drafter: Drafter, keep_base: int, oracle: str | None = None) -> None:
        self.runner = runner
        self.k = spec_tokens
        self.drafter = drafter
        self.keep_base = keep_base
        self.propose: Proposer | None = OracleProposer(oracle) if oracle else None
        self.graphs = None  # hkv.engine.spec_graphs.VerifyGraphs: verify steps replayed from CUDA graphs

    def keep_slot(self, row: int, t: int) -> int:
        return self.keep_base + row * (self.k + 1) + t

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> tuple[list[Sampled], int]:
        """Forward, verify, adopt, commit and draft; the Sampled of every sampling chunk, in plan order, and
        how the step ran (StepResult.graph: STEP_VERIFY_GRAPHS when every row replayed)."""
        chunks = plan.chunks
        if isinstance(self.propose, OracleProposer):
            self.propose.observe(plan)
        if any(c.follows for c in chunks):
            raise ValueError("a drafting rank got a chunk planned ahead of its result (Chunk.follows)")
        # rows with bias, penalties or a grammar run eagerly: their logits are processed on the way to sampling
        sampling = [c.slot for c in chunks if c.sample]
        processed = {sampling[i] for i in self.runner.processor.rows(sampling)}
        graphed = self.graphs.take([c for c in chunks if c.slot not in processed]) if self.graphs is not None else []
        drafted: dict[int, list[int]] = {}  # slot -> proposals drafted in a graph
        out: dict[int, tuple[list, list[int], torch.Tensor]] = {}  # slot -> (emitted, committed tokens, hidden)
        if graphed:
            drafted, out = self.graphs.run(graphed)
        eager = [c for c in chunks if c.slot not in out]  # out holds every graph row (drafted or not)
        plain = [c for c in eager if c.drafts == 0]
        checking = [c for c in eager if c.drafts > 0]
        if plain:
            logits, hidden = self._forward(plain, verify_rows=False)
            rows = [c for c in plain if c.sample]
            outs = self._sample(logits, rows) if rows else []
            emitted = dict(zip((c.slot for c in rows), outs))
            start = 0
            for c in plain:
                n = len(c.token_ids)
                out[c.slot] = ([emitted[c.slot]] if c.sample else [], c.token_ids, hidden[start:start + n])
                start += n
        if checking:
            logits, hidden = self._forward(checking, verify_rows=True)
            start, live, kept = 0, [], []
            for c in checking:
                n = len(c.token_ids)
                v = verify(logits[start:start + n], c.token_ids[1:], self.row(c))
                live.append(self.runner.state_slots[c.slot])
                kept.append(self.keep_slot(c.slot, v.accepted))
                out[c.slot] = (v.outputs, c.token_ids[:v.accepted + 1], hidden[start:start + v.accepted + 1])
                start += n
            self.adopt_many(live, kept)
        by_slot = self._draft([c for c in chunks if c.slot in out and c.slot not in drafted], out)
        for c in graphed:
            if c.slot in drafted:
                by_slot[c.slot] = self._sampled(c, out[c.slot], drafted[c.slot])
        graph = STEP_VERIFY_GRAPHS if graphed and not eager else STEP_EAGER
        return [by_slot[c.slot] for c in chunks if c.sample], graph

    def _sample(self, logits: torch.Tensor, rows: list[Chunk]) -> list:
        """The plain rows' tokens, their logits processed first where they ask for it (their drafts are off:
        hkv/engine/speculating.py)."""
        processor, slots = self.runner.processor, [c.slot for c in rows]
        processed = processor.rows(slots)
        if processed:
            processor.apply(logits, slots, processed)
        outs = sample(logits, [self.row(c, c.start_pos + len(c.token_ids)) for c in rows])
        if processed:
            ids = torch.tensor([o.token_id for o in outs], dtype=torch.long).to(logits.device)
            processor.sampled(slots, processed, ids)
        return outs

    def row(self, c: Chunk, position: int | None = None) -> SampleRow:
        """The sampling row of a chunk's first emitted token (or of `position`)."""
        return SampleRow(self.runner.sampling[c.slot], c.start_pos + 1 if position is None else position)

    def _forward(self, chunks: list[Chunk], verify_rows: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """One target forward over `chunks`: (logits of the sampled rows, or of every row when verifying;
        every token's final-norm hidden state)."""
        r = self.runner
        inputs = StepInputs.of(chunks, r.table, r.page_size, r.state_slots)
        device = r.device
        page_rows = torch.from_numpy(inputs.page_rows(r.table)).to(device)
        logits_idx = np.arange(len(inputs.input_ids)) if verify_rows else inputs.logits_indices
        batch = ForwardBatch.from_lists(
            inputs.input_ids, inputs.positions, inputs.q_lens, inputs.kv_lens, page_rows, inputs.slot_mapping,
            logits_idx, state_slots=inputs.state_slots, checkpoints=inputs.checkpoints,
            attn_dims=(*r.attn_dims, r.kv.attn_dtype),
        )
        if verify_rows:
            width = int(inputs.q_lens.max())
            keep = np.full((len(chunks), width), -1, dtype=np.int64)
            for b, c in enumerate(chunks):
                keep[b, : len(c.token_ids)] = [self.keep_slot(c.slot, t) for t in range(len(c.token_ids))]
            batch = replace(batch, keep_slots=torch.from_numpy(keep).to(device))
        return r.model(batch, r.kv, r.state, hidden_out=True)

    def adopt_many(self, live: list[int], kept: list[int]) -> None:
        """The linear state after each sequence's last accepted token (its keep slot) becomes its live
        state (conv and recurrent only: the drafter's part of the live slot moves on in commit)."""
        if not live:
            return
        state = self.runner.state
        pairs = torch.tensor([kept, live], dtype=torch.long).to(state.conv.device)
        copy_blocks(state.conv, state.conv, pairs[0], pairs[1])  # one pass over the bytes, no temporary
        copy_blocks(state.recurrent, state.recurrent, pairs[0], pairs[1])

    def _draft(self, chunks: list[Chunk], out: dict) -> dict[int, Sampled]:
        """Commit every chunk's kept tokens, then draft after every sampling chunk's last emitted token;
        slot -> the Sampled of every sampling chunk."""
        r, drafter = self.runner, self.drafter
        paged = not drafter.store.spec.window
        rows = []
        for c in chunks:
            emitted, committed, hidden = out[c.slot]
            end = c.start_pos + len(committed)
            flat = self._flat(c.slot, end) if paged else None
            ckpts = tuple((c.start_pos + tokens, slot) for tokens, slot in c.checkpoints
                          if 0 < tokens < len(committed))
            rows.append(DraftRow(r.state_slots[c.slot], list(committed), c.start_pos, hidden,
                                 emitted[-1].token_id if c.sample else None, flat, ckpts))
        drafter.commit(rows)
        drafting = [row for row in rows if row.next_token is not None]
        proposals = iter(drafter.draft(drafting, self.k))
        return {c.slot: self._sampled(c, out[c.slot], next(proposals)) for c in chunks if c.sample}

    def _sampled(self, c: Chunk, outcome: tuple, guess: list[int]) -> Sampled:
        """A sampling chunk's result from its (emitted, committed, hidden): the emitted tokens and the
        next drafts (the proposer's, when set)."""
        emitted, committed, _ = outcome
        if self.propose is not None:
            first = c.start_pos + len(committed) + 1  # the position of the first draft
            guess = list(self.propose(c.slot, first, guess))[: self.k]
        head, rest = emitted[0], emitted[1:]
        return Sampled(c.slot, head.token_id, head.logprob, head.top_logprobs,
                       [Emitted(o.token_id, o.logprob, o.top_logprobs) for o in rest], guess)

    def _flat(self, row: int, n: int) -> torch.Tensor:
        """Flat KV slots of positions 0 .. n - 1 of a request-table row, from its page ids."""
        P = self.runner.page_size
        positions = np.arange(n)
        page = self.runner.table.page_ids[row, positions // P].astype(np.int64)
        return torch.from_numpy(page * P + positions % P)


def draft_spec(model, window: int) -> DraftSpec:
    """The drafter's state shapes for `model` with draft window `window` (0 = paged, full length)."""
    c = model.cfg
    return DraftSpec(window, c.hidden_size, c.num_key_value_heads, c.head_dim)


def keep_slots_needed(rows: int, spec_tokens: int) -> int:
    """Scratch state slots a rank adds past the router's for the verify states of `rows` table rows."""
    return rows * (spec_tokens + 1) if spec_tokens else 0


def with_paged_draft(model, layout, draft: DraftSpec | None):
    """(layout, layer_map) of the model's KV pool, one storage layer longer when the draft K/V are paged
    (W = 0); the draft layer is model layer cfg.num_hidden_layers."""
    layer_map = dict(model.layer_map)
    if draft is not None and not draft.window:
        layer_map[model.cfg.num_hidden_layers] = layout.num_layers
        layout = replace(layout, num_layers=layout.num_layers + 1)
    return layout, layer_map


def attach(runner, draft: DraftSpec, spec_tokens: int, keep_base: int, oracle: str | None = None,
           graph_max_bs: int = 0) -> SpecDecoder:
    """Make `runner` (its model loaded with the MTP module, its pools built with `draft`) speculate;
    `oracle`: a file of known continuations to propose instead (benchmarks, OracleProposer);
    graph_max_bs > 0 on a runner with device metadata: verify steps of up to that many sequences
    replay CUDA graphs (captured by ModelRunner.capture_graphs)."""
    from hkv.engine.spec_graphs import VerifyGraphs

    model, kv = runner.model, runner.kv
    store = DraftStore(draft, runner.state, kv, kv.layer_map.get(model.cfg.num_hidden_layers))
    runner.spec = SpecDecoder(runner, spec_tokens, Drafter(model, store), keep_base, oracle)
    if graph_max_bs > 0 and runner.pages is not None and getattr(model, "graph_safe", True):
        try:
            runner.spec.graphs = VerifyGraphs(runner, runner.spec, min(graph_max_bs, runner.table.layout.slots),
                                              runner.scratch[1])
        except ValueError as exc:  # a shape the graphs do not cover: verify steps run eagerly
            log.warning("verify steps run eagerly: %s", exc)
    return runner.spec
