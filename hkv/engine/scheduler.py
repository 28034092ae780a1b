"""Continuous batching with chunked prefill: which tokens of which sequences run next.

Pure logic, no sockets. The router feeds it requests and aborts, asks it for
the next `StepPlan`, and hands it each `StepResult`; it answers with the
`TokenDelta`s to stream. It writes each scheduled slot's page ids into the
request table before the plan leaves.

A sequence's tokens are its prompt followed by its output. Each step runs one
chunk of the tokens whose K/V are not computed yet:

    all_ids:   [ p0 p1 ... p(P-1) | o0 o1 ... o(k-1) ]
                 <---- kv_len ---->< chunk ->
    sample a new token iff the chunk reaches the end of all_ids

so a prompt's last chunk and every decode step (a chunk of one token, the
last output) sample, and a preempted sequence resumes by recomputing.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from hkv.engine.pages import PageAllocator
from hkv.ipc.messages import (
    Chunk,
    GenerateRequest,
    NewSequence,
    SamplingParams,
    StepPlan,
    StepResult,
    TokenDelta,
)
from hkv.ipc.request_table import RequestTable, SlotPhase


@dataclass(frozen=True)
class SchedulerLimits:
    page_size: int
    max_running: int  # sequences holding a slot at once (<= request-table slots)
    token_budget: int  # tokens per step, decode and prefill together
    max_context: int  # the model's context length
    eos_ids: frozenset[int]


@dataclass
class Sequence:
    req_id: int
    prompt_ids: list[int]
    sampling: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    slot: int | None = None  # request-table row while admitted
    pages: list[int] = field(default_factory=list)  # page ids, in order
    kv_len: int = 0  # tokens of all_ids whose K/V are computed
    admit_order: int = 0  # larger = admitted later = preempted first

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_slice(self, start: int, stop: int) -> list[int]:
        prompt_len = len(self.prompt_ids)
        if stop <= prompt_len:
            return self.prompt_ids[start:stop]
        if start >= prompt_len:
            return self.output_ids[start - prompt_len : stop - prompt_len]
        return self.prompt_ids[start:] + self.output_ids[: stop - prompt_len]


class Scheduler:
    """Owns waiting and running sequences, their slots and pages."""

    def __init__(self, limits: SchedulerLimits, pages: PageAllocator, table: RequestTable):
        self.limits = limits
        self.pages = pages
        self.table = table
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}  # req_id -> sequence, in admission order
        self.free_slots: list[int] = list(range(min(limits.max_running, table.layout.slots)))[::-1]
        self.by_slot: dict[int, Sequence] = {}
        self._step = itertools.count(1)
        self._admit = itertools.count(1)
        self._freed_slots: list[int] = []  # slots released since the last plan
        self._finished: list[TokenDelta] = []  # deltas produced outside a step (aborts)
        self._in_flight: dict[int, Sequence] | None = None  # slot -> sequence of the plan in flight
        self.preemptions = 0  # sequences preempted for pages, ever

    # ---- inputs -----------------------------------------------------------------

    def add(self, req: GenerateRequest) -> None:
        self.waiting.append(Sequence(req.req_id, list(req.prompt_ids), req.sampling))

    def abort(self, req_id: int) -> None:
        for seq in self.waiting:
            if seq.req_id == req_id:
                self.waiting.remove(seq)
                self._finished.append(_delta(seq, [], "abort"))
                return
        seq = self.running.get(req_id)
        if seq is not None:
            self._finish(seq)
            self._finished.append(_delta(seq, [], "abort"))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def take_finished(self) -> list[TokenDelta]:
        out, self._finished = self._finished, []
        return out

    # ---- planning ---------------------------------------------------------------

    def schedule(self) -> StepPlan | None:
        """The next step's plan, or None when nothing can run.

        Mutates: slots, pages and the request table rows of scheduled sequences.
        """
        budget = self.limits.token_budget
        chunks: list[Chunk] = []
        new: list[NewSequence] = []
        for seq in list(self.running.values()):
            if seq.req_id not in self.running or budget <= 0:
                continue
            chunk = self._plan_chunk(seq, budget, may_preempt=True)
            if chunk is not None:
                chunks.append(chunk)
                budget -= len(chunk.token_ids)
        while self.waiting and self.free_slots and budget > 0:
            seq = self.waiting[0]
            chunk = self._admit_and_plan(seq, budget)
            if chunk is None:
                break
            self.waiting.popleft()
            new.append(NewSequence(seq.slot, seq.req_id, seq.sampling))
            chunks.append(chunk)
            budget -= len(chunk.token_ids)
        freed, self._freed_slots = self._freed_slots, []
        if not chunks:
            self._freed_slots = freed
            self._reject_unfittable()
            return None
        self._in_flight = {c.slot: self.by_slot[c.slot] for c in chunks}
        return StepPlan(step=next(self._step), new=new, chunks=chunks, freed=freed)

    def _plan_chunk(self, seq: Sequence, budget: int, may_preempt: bool) -> Chunk | None:
        n = min(seq.total_len - seq.kv_len, budget)
        need = _pages_for(seq.kv_len + n, self.limits.page_size) - len(seq.pages)
        while need > 0 and not self.pages.can_allocate(need):
            victim = self._newest_running()
            if not may_preempt or victim is None:
                return None
            self._preempt(victim)
            if victim is seq:
                return None
        if need > 0:
            seq.pages.extend(self.pages.allocate(need))
        end = seq.kv_len + n
        self._write_row(seq, end)
        return Chunk(seq.slot, seq.token_slice(seq.kv_len, end), seq.kv_len, end == seq.total_len)

    def _admit_and_plan(self, seq: Sequence, budget: int) -> Chunk | None:
        n = min(seq.total_len, budget)
        need = _pages_for(n, self.limits.page_size)
        # Leave one page per running sequence so admission does not force preemption next step.
        if not self.pages.can_allocate(need + len(self.running)):
            return None
        seq.slot = self.free_slots.pop()
        seq.admit_order = next(self._admit)
        seq.pages = self.pages.allocate(need)
        seq.kv_len = 0
        self.running[seq.req_id] = seq
        self.by_slot[seq.slot] = seq
        self._write_row(seq, n)
        return Chunk(seq.slot, seq.token_slice(0, n), 0, n == seq.total_len)

    def _reject_unfittable(self) -> None:
        """With nothing running every page is free: a head that still cannot start never will."""
        if self.running or not self.waiting or not self.free_slots:
            return
        seq = self.waiting.popleft()
        reason = f"request needs more KV pages than the pool's {self.pages.num_pages}"
        self._finished.append(_delta(seq, [], "error", reason))

    def _newest_running(self) -> Sequence | None:
        if not self.running:
            return None
        return max(self.running.values(), key=lambda s: s.admit_order)

    def _preempt(self, seq: Sequence) -> None:
        """Give back everything the sequence holds; it recomputes from scratch later."""
        self._release_resources(seq)
        seq.kv_len = 0
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def _write_row(self, seq: Sequence, kv_end: int) -> None:
        t, slot = self.table, seq.slot
        t.write_pages(slot, seq.pages)
        t.req_id[slot] = seq.req_id
        t.prompt_len[slot] = len(seq.prompt_ids)
        t.output_len[slot] = len(seq.output_ids)
        t.kv_len[slot] = kv_end
        t.cached_len[slot] = 0
        t.phase[slot] = SlotPhase.DECODE if seq.output_ids else SlotPhase.PREFILL

    # ---- results ----------------------------------------------------------------

    def on_result(self, result: StepResult, plan: StepPlan) -> list[TokenDelta]:
        """Apply a rank's result to the plan it answers; returns deltas to stream."""
        in_flight, self._in_flight = self._in_flight or {}, None
        deltas = self.take_finished()
        if result.error is not None:
            for seq in in_flight.values():
                if seq.req_id in self.running:
                    self._finish(seq)
                    deltas.append(_delta(seq, [], "error", result.error))
            return deltas
        sampled = iter(result.sampled)
        for chunk in plan.chunks:
            seq = in_flight[chunk.slot]
            if seq.req_id not in self.running or seq.slot != chunk.slot:
                if chunk.sample:
                    next(sampled)  # aborted or preempted mid-step: drop its token
                continue
            seq.kv_len = chunk.start_pos + len(chunk.token_ids)
            if chunk.sample:
                deltas.append(self._append_token(seq, next(sampled)))
        return deltas

    def _append_token(self, seq: Sequence, sampled) -> TokenDelta:
        seq.output_ids.append(sampled.token_id)
        reason = self._finish_reason(seq, sampled.token_id)
        lp = None if sampled.logprob is None else [sampled.logprob]
        top = None if sampled.top_logprobs is None else [sampled.top_logprobs]
        if reason is not None:
            self._finish(seq)
        return TokenDelta(seq.req_id, [sampled.token_id], lp, top, reason, len(seq.prompt_ids), 0)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        if token in self.limits.eos_ids and not seq.sampling.ignore_eos:
            return "stop"
        if len(seq.output_ids) >= seq.sampling.max_tokens or seq.total_len >= self.limits.max_context:
            return "length"
        return None

    def _finish(self, seq: Sequence) -> None:
        self._release_resources(seq)

    def _release_resources(self, seq: Sequence) -> None:
        self.pages.free(seq.pages)
        seq.pages = []
        if seq.slot is not None:
            self.table.clear(seq.slot)
            self.by_slot.pop(seq.slot, None)
            self.free_slots.append(seq.slot)
            self._freed_slots.append(seq.slot)
            seq.slot = None
        self.running.pop(seq.req_id, None)


def _pages_for(tokens: int, page_size: int) -> int:
    return (tokens + page_size - 1) // page_size


def _delta(seq: Sequence, tokens: list[int], reason: str | None, error: str | None = None) -> TokenDelta:
    return TokenDelta(seq.req_id, tokens, None, None, reason, len(seq.prompt_ids), 0, None, error)
