"""Continuous batching with chunked prefill: which tokens of which sequences run next.

Pure logic, no sockets. The router feeds it requests and aborts, asks it for
the next `StepPlan`, and hands it each `StepResult`; it answers with the
`TokenDelta`s to stream. Every page and state slot comes from the
CacheCoordinator through a transaction, so a sequence that cannot get what
its step needs changes nothing and waits (or preempts a newer one).

A sequence's tokens are its prompt followed by its output. Each step runs one
chunk of the tokens whose K/V are not computed yet:

    all_ids:   [ p0 p1 ... p(P-1) | o0 o1 ... o(k-1) ]
                 <-- cached --><-- kv_len --><- chunk ->
    sample a new token iff the chunk reaches the end of all_ids

A new (or preempted) sequence starts at the longest cached prefix the
coordinator matches; at least one token is always recomputed. On a hybrid
model a chunk runs as far as the budget allows (rounded down to the GDN
chunk, so the next one starts on it) and the forward itself keeps the state
at every --checkpoint-interval boundary inside it, into slots the step's
transaction reserved; only the prompt's last page boundary cuts a chunk
(see `_chunk_end`). Those checkpoints, and the chunk's end when it is a
checkpoint boundary, are kept for good. Every other page boundary a
sequence reaches (decoding, or a chunk cut by the budget) saves its one
rolling checkpoint, which moves on to the next such boundary; on finish it
stays where it is, at the last page boundary of prompt + output, for the
conversation's next turn. A 36-token prompt and 200 output tokens, page 16,
interval 256:

    tokens  [0 ...... 32)[32 ... 48)[48 ... 64) ... [208 .. 224)[224 .. 236)
    ckpts             ^ kept      ^ rolling -> ^ ... ----------> ^ left on finish

A waiting sequence whose prompt shares a cacheable prefix (at least
`prefix_wait_min` tokens more than the cache has) with a prompt that a running
sequence is still prefilling waits for that prefix to be published,
rather than compute it again beside it (hkv/engine/prefix_wait.py): a burst of
requests for one long system prompt or document that reach the router in the
same tick costs one prefill of the prefix, and the others start from the hit
one step later. Other waiting sequences pass the held ones.
"""

from __future__ import annotations

import itertools
from collections import deque

from hkv.cache.coordinator import CacheCoordinator
from hkv.cache.errors import CapacityError
from hkv.cache.types import CacheOp, CheckpointRef, LoadPages, LoadState
from hkv.engine.pd_fetching import PdFetching
from hkv.engine.pd_pairing import PdPairing
from hkv.engine.prefix_wait import PREFIX_WAIT_SCAN, PrefixWaiting
from hkv.engine.publishing import Publishing
from hkv.engine.sequence import SchedulerLimits, Sequence
from hkv.engine.slot_book import SlotBook
from hkv.engine.speculating import Speculating
from hkv.engine.tier_client import TierClient
from hkv.ipc.messages import Chunk, GenerateRequest, NewSequence, StepPlan, StepResult, TierFound, TierReserved, TokenDelta
from hkv.ipc.request_table import RequestTable

__all__ = ["Scheduler", "SchedulerLimits", "Sequence"]


class Scheduler(Publishing, PrefixWaiting, Speculating, PdFetching, PdPairing):
    """Owns waiting and running sequences and their request-table rows."""

    def __init__(self, limits: SchedulerLimits, coord: CacheCoordinator, table: RequestTable,
                 tiers: TierClient | None = None):
        if limits.hybrid and limits.checkpoint_interval and limits.checkpoint_interval % limits.chunk_align:
            raise ValueError(f"checkpoint_interval {limits.checkpoint_interval} is not a multiple of the "
                             f"chunk alignment {limits.chunk_align}")
        self.limits = limits
        self.coord = coord
        self.table = table
        self.tiers = tiers  # the CPU/disk tiers' router half; None without --cpu-cache-gb
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}  # req_id -> sequence, in admission order
        self.slots: SlotBook = SlotBook(table, min(limits.max_running, table.layout.slots))
        self.by_slot: dict[int, Sequence] = {}
        self.preemptions = 0  # sequences preempted for pages, ever
        self.prefix_waits = 0  # sequences held for a prefix another was prefilling, ever (once each)
        self.spec_verified = 0  # draft tokens verified, ever (speculative decoding)
        self.spec_accepted = 0  # ... of them accepted
        self.spec_histogram = [0] * (limits.spec_tokens + 1)  # verify chunks by drafts accepted
        self._step = itertools.count(1)
        self._admit_counter = itertools.count(1)
        self._ops: list[CacheOp] = []  # cache ops for the next plan, in emission order
        self._finished: list[TokenDelta] = []  # deltas produced outside a step (aborts)
        self._sent: dict[int, dict[int, Sequence]] = {}  # step -> {slot: sequence} of plans without a result
        self._unpublished: dict[int, StepPlan] = {}  # sent plans whose computed prefixes are not published yet
        self._pd_init()
        self._pair_init()

    def add(self, req: GenerateRequest) -> None:
        seq = Sequence(req.req_id, list(req.prompt_ids), req.sampling)
        self._note_no_drafts(seq)
        self._note_for_peer(req)
        fetching = (req.peer is not None and not self._peer_device_usable(seq, req)
                    and self._start_fetch(seq, req.peer))  # then the lookup: on_pd_fetched
        if self.tiers is not None and not fetching:
            hit = self.coord.peek(seq.prompt_ids)
            seq.lookup_pending = self.tiers.lookup(seq.req_id, seq.keys, seq.prompt_ids, hit)
        self.waiting.append(seq)

    def on_tier_found(self, msg: TierFound) -> None:
        """A lookup came back: the sequence may be admitted (with the run, if any)."""
        answer = self.tiers.found(msg)
        if answer is None:
            return
        req_id, hit = answer
        seq = next((s for s in self.waiting if s.req_id == req_id), None)
        if seq is None:
            if hit is not None:
                self.tiers.release(hit.lookup_id)
            return
        seq.lookup_pending, seq.tier = False, hit

    def on_tier_reserved(self, msg: TierReserved) -> None:
        """CPU entries are reserved for an offload: its copies go into the next plan."""
        self._ops.extend(self.tiers.reserved(msg))

    def abort(self, req_id: int) -> None:
        """Drop a sequence wherever it is; unknown or finished ids are ignored."""
        for seq in self.waiting:
            if seq.req_id == req_id:
                self._drop_waiting(seq)
                self._finished.append(_delta(seq, [], "abort"))
                return
        seq = self.running.get(req_id)
        if seq is not None and not seq.doomed:
            if not self._abort_arriving(seq):  # (an arriving one leaves once its transfer ended)
                self._leave(seq, publish=False)
            self._finished.append(_delta(seq, [], "abort"))

    def flush(self) -> tuple[int, int]:
        """Drop every unreferenced cache entry; returns (pages, checkpoints) freed."""
        evicted = self.coord.flush()
        return evicted.pages, evicted.checkpoints

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def free_slots(self) -> list[int]:
        return self.slots.free

    @property
    def in_flight(self) -> int:
        """Sent plans whose results are not in yet."""
        return len(self._sent)

    def _drop_waiting(self, seq: Sequence) -> None:
        """Take a waiting sequence out for good: its tier run goes, and a preempted one's
        paused record in the coordinator is released (it would otherwise stay forever)."""
        self.waiting.remove(seq)
        self._drop_tier(seq)
        self._drop_peer(seq)
        if seq.req_id in self.coord.requests:
            self.coord.release(seq.req_id)

    def _drop_tier(self, seq: Sequence) -> None:
        """Let go of the tier run a waiting sequence will not load."""
        if self.tiers is None:
            return
        if seq.lookup_pending:
            self.tiers.forget_lookup(seq.req_id)
            seq.lookup_pending = False
        if seq.tier is not None:
            self.tiers.release(seq.tier.lookup_id)
            seq.tier = None

    def take_finished(self) -> list[TokenDelta]:
        out, self._finished = self._finished, []
        return self._hold_for_peer(out)

    def schedule(self) -> StepPlan | None:
        """The next step's plan, or None when nothing can run.

        Mutates: coordinator holdings, slots and the request-table rows of
        scheduled sequences. The plan carries the cache ops emitted since the
        last plan; ranks run them, in order, before the forward.
        """
        self._publish_sent()
        self._expire_arriving()
        budget = self.limits.token_budget
        chunks: list[Chunk] = []
        new: list[NewSequence] = []
        feeders = self._prefix_feeders()  # before their chunks move kv_len on
        held: set[int] = set()
        for seq in list(self.running.values()):
            if seq.req_id not in self.running or budget <= 0 or seq.arriving is not None:
                continue
            chunk = self._plan_running(seq, budget)
            if chunk is not None:
                if not seq.announced:  # its pages arrived over a pair group: the ranks meet it now
                    seq.announced = True
                    new.append(seq.announcement())
                chunks.append(chunk)
                budget -= len(chunk.token_ids)
        while self.free_slots and budget > 0:
            seq = self._next_ready(feeders, held)
            if seq is None:
                break
            chunk = self._admit(seq, budget)
            if chunk is None and seq.arriving is None:
                break
            self.waiting.remove(seq)
            if chunk is None:  # admitted, its pages on their way (hkv/engine/pd_pairing.py)
                continue
            seq.announced = True  # (one arrived, then preempted before its first chunk, is admitted again here)
            new.append(seq.announcement())
            chunks.append(chunk)
            budget -= len(chunk.token_ids)
            if feeders is not None and chunk.start_pos < len(seq.prompt_ids):
                feeders.append((seq, chunk.start_pos))  # those behind it may wait for its prompt
        if not chunks:
            self._reject_unfittable()
            if not self._ops and not self._pair_poll_due():  # (a copies-only plan asks about transfers)
                return None
        # a plan with ops and no chunks only copies (tier stores waiting on an idle engine)
        return self._plan(new, chunks)

    def probe_plan(self) -> StepPlan:
        """A plan with nothing to run, to ask idle ranks for a sign of life (hkv/engine/rank_probe.py);
        only when `schedule` just returned None, so no cache op waits for a plan. Numbered and booked
        like any plan: it carries the slots freed since the last one, and its result goes to
        `on_result` (aborts and ended transfers come back with it)."""
        return self._plan([], [])

    def _plan(self, new: list[NewSequence], chunks: list[Chunk]) -> StepPlan:
        """Number the plan, hand it the queued cache ops and freed slots, and book what it uses."""
        ops, self._ops = self._ops, []
        step = next(self._step)
        plan = StepPlan(step=step, new=new, chunks=chunks, freed=self.slots.take_freed(), ops=ops)
        self._sent[step] = {c.slot: self.by_slot[c.slot] for c in chunks}
        for c in chunks:
            self.slots.used_by(c.slot, step)
        if chunks:
            self._unpublished[step] = plan
        if self.tiers is not None:
            self.tiers.plan_built(step)
        self._peer_plan_built(step)
        self._pair_plan_built()
        return plan

    def _next_ready(self, feeders: list[tuple[Sequence, int]] | None = None,
                    held: set[int] | None = None) -> Sequence | None:
        """The first waiting sequence not waiting for its tier lookup, nor (given the step's
        `feeders`) for a prefix another sequence is prefilling. `held` collects this step's held
        req_ids, so a scan skips them without asking again; past PREFIX_WAIT_SCAN of them nothing
        more is admitted this step (a burst of thousands costs a bounded scan)."""
        for seq in self.waiting:
            if seq.lookup_pending:
                continue
            if feeders and held is not None:
                if seq.req_id in held:
                    continue
                if self._waits_for_prefix(seq, feeders):
                    held.add(seq.req_id)
                    if len(held) >= PREFIX_WAIT_SCAN:
                        return None
                    continue
            return seq
        return None

    def _chunk_end(self, seq: Sequence, start: int, budget: int) -> tuple[int, tuple[int, ...]]:
        """Where a chunk starting at `start` ends, and the checkpoint depths the forward keeps inside it.

        Dense: the budget or the sequence's end. Hybrid, A = limits.chunk_align (the GDN chunk):

            start % A == 0  [start ..... i1 ....... i2 ....... end)  end: the budget, the sequence's end or
                                         ^ kept     ^ kept           the prompt's last page boundary; every
                                                                     interval multiple inside is kept
            start % A != 0  [start ....... b)                        cut at the first checkpoint boundary b
                                                                     (next interval multiple, prompt's last page)

        An end the budget sets is rounded down to a multiple of A when that keeps a token, so
        the next chunk starts aligned and a hit at any interval boundary resumes on a GDN chunk
        boundary of the cold run's chunk (docs/cache.md). Prefix cache off: no cut, nothing kept.
        """
        end = min(seq.total_len, start + budget)
        if not self.limits.hybrid:
            return end, ()
        keep, align = self.coord.spec.prefix_cache, self.limits.chunk_align
        if keep and start % align:
            cut = next((b for b in self._boundaries(seq, start) if start < b < end), None)
            if cut is not None:
                return cut, ()
        last_page = len(seq.prompt_ids) // self.limits.page_size * self.limits.page_size
        if keep and start < last_page < end:
            end = last_page  # its checkpoint is kept for the next turn, saved from the live state
        elif end < seq.total_len and end // align * align > start:
            end = end // align * align
        interval = self.limits.checkpoint_interval
        if not keep or start % align or interval is None:
            return end, ()
        return end, tuple(range((start // interval + 1) * interval, end, interval))

    def _boundaries(self, seq: Sequence, start: int) -> list[int]:
        """Hybrid chunk boundaries after `start`: the next interval multiple, the prompt's last page boundary."""
        ps, interval = self.limits.page_size, self.limits.checkpoint_interval
        out = [len(seq.prompt_ids) // ps * ps]
        if interval is not None:
            out.append((start // interval + 1) * interval)
        return sorted(out)

    def _plan_running(self, seq: Sequence, budget: int) -> Chunk | None:
        """Reserve this step's tokens for a running sequence, preempting newer ones if needed.

        A sequence whose last sent chunk samples a token not yet returned decodes that token
        next (the rank feeds it in: `Chunk.follows`), unless that token will surely finish it.
        """
        follows = seq.pending_samples > 0
        drafts = 0
        if follows:
            # a drafting sequence waits for its result: the next chunk carries the drafts that come with it
            if self.limits.spec_tokens or seq.pending_samples > 1 or self._ends_with_pending(seq):
                return None
            end, depths = seq.kv_len + 1, ()
        elif seq.proposals and seq.kv_len == seq.total_len - 1:
            drafts = self._drafts(seq, budget)
            end, depths = seq.kv_len + 1 + drafts, ()
        else:
            end, depths = self._chunk_end(seq, seq.kv_len, budget)
        while True:
            txn = self.coord.begin(seq.req_id)
            try:
                txn.reserve(tokens=end - seq.kv_len)
                self._reserve_checkpoints(txn, depths)
                grant = txn.commit()
                break
            except CapacityError:
                txn.rollback()
            victim = self._newest_running()
            self._preempt(victim)
            if victim is seq:
                return None
        seq.pages = list(grant.pages)
        self._ops.extend(grant.ops)
        return self._chunk(seq, seq.kv_len, end, grant.checkpoints, follows, drafts)

    def _ends_with_pending(self, seq: Sequence) -> bool:
        """The token in flight is its last by length (an EOS is only known when it returns)."""
        return len(seq.output_ids) + 1 >= seq.sampling.max_tokens or seq.total_len + 1 >= self.limits.max_context

    def _admit(self, seq: Sequence, budget: int) -> Chunk | None:
        """Admit the head of the queue at its longest cached prefix, or change nothing."""
        txn = self.coord.begin(seq.req_id)
        try:
            hit = txn.match(seq.all_ids())
            loaded, load_pages = self._extend_from_tier(txn, seq, hit.length)
            copied, copy_pages = self._extend_from_peer(txn, seq, hit.length + loaded)
            start = hit.length + loaded + copied
            arriving = bool(copy_pages) and seq.peer_pair  # no chunk until they arrived
            end, depths = (start, ()) if arriving else self._chunk_end(seq, start, budget)
            txn.reserve(tokens=end - start, state_slots=1 if self.limits.hybrid else 0)
            # Leave a page per running sequence so admitting does not force preemption next step.
            if self._spare_pages() < len(self.running):
                raise CapacityError("gpu_pages", len(self.running), self._spare_pages(), 0)
            self._reserve_checkpoints(txn, depths)
            grant = txn.commit()
        except CapacityError:
            txn.rollback()
            return None
        seq.slot = self.slots.take()
        seq.state_slot = grant.state_slots[0] if self.limits.hybrid else None
        seq.admit_order = next(self._admit_counter)
        seq.pages = list(grant.pages)
        seq.kv_len = start
        if seq.cached_tokens is None:
            seq.cached_tokens = min(start, len(seq.prompt_ids))
            seq.cache_tiers = self._tier_counts(seq, hit.length, loaded)
            seq.cache_tiers["peer"] += copied
        self.running[seq.req_id] = seq
        self.by_slot[seq.slot] = seq
        self._ops.extend(grant.ops)
        if loaded:
            self._ops.extend(self._load_ops(seq, load_pages))
        self._ops.extend(self._peer_copy_ops(seq, hit.length + loaded, copy_pages))
        if (loaded or copied) and not arriving:  # (an arriving prefix is published once it is there)
            if self.limits.hybrid:  # the loaded prefix becomes a device prefix, its checkpoint kept on the device
                self._ops.extend(self.coord.publish(seq.req_id, seq.all_ids(), start, checkpoint=True).ops)
        if seq.tier is not None:  # loaded or not, the run is not needed after this plan
            self.tiers.release(seq.tier.lookup_id, after_plan=True)
            seq.tier = None
        return None if arriving else self._chunk(seq, start, end, grant.checkpoints)

    def _extend_from_tier(self, txn, seq: Sequence, hit_tokens: int) -> tuple[int, tuple[int, ...]]:
        """Grow the device hit with the sequence's tier run: (tokens loaded, their fresh pages)."""
        run = seq.tier
        if run is None:
            return 0, ()
        usable = run.usable(hit_tokens, self.limits.page_size)
        if usable == 0:
            return 0, ()
        tokens = usable * self.limits.page_size
        return tokens, txn.extend(tokens)

    def _load_ops(self, seq: Sequence, pages: tuple[int, ...]) -> list[CacheOp]:
        run = seq.tier
        entries = list(run.entries[len(run.entries) - len(pages) :])
        ops: list[CacheOp] = [LoadPages(entries, list(pages))]
        if self.limits.hybrid:
            ops.append(LoadState(run.state_entry, seq.state_slot))
        return ops

    def _tier_counts(self, seq: Sequence, hit_tokens: int, loaded: int) -> dict[str, int]:
        """Cached prompt tokens per tier for usage.cache: the device hit, then the run's CPU and disk pages."""
        counts = {"gpu": min(hit_tokens, len(seq.prompt_ids)), "cpu": 0, "disk": 0, "peer": 0}
        if loaded:
            P = self.limits.page_size
            used = seq.tier.from_disk[len(seq.tier.entries) - loaded // P :]
            counts["disk"] = sum(used) * P
            counts["peer"] = self._peer_tokens(seq, hit_tokens // P, loaded // P)
            counts["cpu"] = loaded - counts["disk"] - counts["peer"]
        return counts

    def _spare_pages(self) -> int:
        return self.coord.pages.free_count + self.coord.tree.evictable_pages

    def _reserve_checkpoints(self, txn, depths: tuple[int, ...]) -> None:
        """Slots for the in-chunk checkpoints at `depths`, all or nothing; when slots are short,
        fewer: the deepest ones, down to none (a step never waits for its checkpoints)."""
        for first in range(len(depths)):
            try:
                txn.reserve(checkpoints=depths[first:])
                return
            except CapacityError:
                continue

    def _chunk(self, seq: Sequence, start: int, end: int, checkpoints: tuple[CheckpointRef, ...],
               follows: bool = False, drafts: int = 0) -> Chunk:
        """The chunk [start, end) of the sequence; its K/V count as computed from now on (a verify
        chunk's drafts until its result says how many held: `_apply_verified`)."""
        self._write_row(seq, end)
        kept = [[ckpt.length - start, ckpt.slot] for ckpt in checkpoints]
        seq.kv_len = end
        if drafts:  # its last token, then the drafts for the positions after it
            tokens = [seq.output_ids[-1], *seq.proposals[:drafts]]
            seq.pending_samples += 1
            return Chunk(seq.slot, tokens, start, True, kept, False, drafts)
        # a following chunk's one token is the one its previous chunk samples: the rank feeds it in
        tokens = [0] if follows else seq.token_slice(start, end)
        sample = follows or end == seq.total_len
        seq.pending_samples += sample
        return Chunk(seq.slot, tokens, start, sample, kept, follows)

    def _reject_unfittable(self) -> None:
        """With nothing running or held for a tier copy, every page is free (or evictable):
        a head that still cannot start never will."""
        if self.running or not self.free_slots or self.coord.holds or self._sent:
            return
        seq = self._next_ready()
        if seq is None:
            return
        self._drop_waiting(seq)
        reason = f"request needs more KV pages than the pool's {self.coord.spec.num_pages}"
        self._finished.append(_delta(seq, [], "error", reason))

    def _newest_running(self) -> Sequence:
        """Preemption's victim (never an arriving sequence: a receive may be writing its pages)."""
        return max((s for s in self.running.values() if s.arriving is None), key=lambda s: s.admit_order)

    def _preempt(self, seq: Sequence) -> None:
        """Give back all but its published prefix; it resumes from a cache hit later."""
        self.coord.pause(seq.req_id)
        self._free_slot(seq)
        seq.kv_len = seq.done_len = 0
        seq.pending_samples = 0  # the results of its sent chunks are dropped
        seq.proposals = []
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def _write_row(self, seq: Sequence, kv_end: int) -> None:
        """Fill the slot's row; after admission only what a step changes (pages only grow)."""
        seq.table_pages = self.slots.write_row(seq.slot, seq.pages, seq.table_pages, seq.req_id, len(seq.prompt_ids),
                                               seq.cached_tokens or 0, len(seq.output_ids), kv_end)

    def on_result(self, result: StepResult, plan: StepPlan) -> list[TokenDelta]:
        """Apply a rank's result to the plan it answers (plans are answered in sending order);
        returns deltas to stream.

        A plan still unpublished (nothing was planned after it before its result) publishes
        now, first: its checkpoint saves then ride the next plan, ahead of any forward that
        moves the live states on.
        """
        sent = self._sent.pop(plan.step, {})
        self.on_transfers(result.transfers)  # (a failed transfer's error delta goes out with this result's)
        deltas, self._finished = self._finished, []  # held for a peer (or not) once, at the end
        if self.tiers is not None:
            self.tiers.step_done(plan.step, result.error is None)
        self._peer_step_done(plan.step)
        unpublished = self._unpublished.pop(plan.step, None)
        if result.error is not None:
            self._fail(sent, result.error, deltas, published=unpublished is None)
        else:
            if unpublished is not None:
                self._publish_plan(unpublished, sent)
            sampled = iter(result.sampled)
            for chunk in plan.chunks:
                seq = sent[chunk.slot]
                token = next(sampled) if chunk.sample else None
                if seq.req_id not in self.running or seq.slot != chunk.slot:
                    continue  # aborted or preempted while the step ran: drop its token
                if chunk.drafts:
                    deltas.append(self._apply_verified(seq, chunk, token))
                    continue
                seq.done_len = chunk.start_pos + len(chunk.token_ids)
                if token is not None:
                    seq.proposals = list(token.proposals)
                    deltas.append(self._append_token(seq, token))
        self.slots.step_done(plan.step)
        return self._hold_for_peer(deltas)

    def _fail(self, sent: dict[int, Sequence], error: str, deltas: list[TokenDelta], published: bool) -> None:
        """A step failed: its sequences fail. When its prefixes were published ahead of the result,
        the device cache and the copies out cannot be trusted: both are dropped."""
        for seq in sent.values():
            if seq.req_id in self.running:
                self._leave(seq, publish=False)
                deltas.append(_delta(seq, [], "error", error))
        if published and sent:
            self.coord.flush()
            if self.tiers is not None:
                self.tiers.poison()

    def _append_token(self, seq: Sequence, sampled) -> TokenDelta:
        seq.pending_samples -= 1
        tokens, reason = self._append(seq, [sampled])
        return self._token_delta(seq, tokens, reason)

    def _append(self, seq: Sequence, emitted: list) -> tuple[list, str | None]:
        """Append the emitted tokens (Sampled / Emitted) up to the first that finishes the sequence:
        (the ones appended, the finish reason or None)."""
        for i, tok in enumerate(emitted):
            seq.output_ids.append(tok.token_id)
            reason = self._finish_reason(seq, tok.token_id)
            if reason is not None:
                return emitted[: i + 1], reason
        return emitted, None

    def _token_delta(self, seq: Sequence, tokens: list, reason: str | None) -> TokenDelta:
        """The delta of tokens just appended; a finished sequence leaves (its prefix stays cached)."""
        lp = None if tokens[0].logprob is None else [t.logprob for t in tokens]
        top = None if tokens[0].top_logprobs is None else [t.top_logprobs for t in tokens]
        tiers = None
        if reason is not None:
            self._leave(seq, publish=True)
            tiers = _tiers_of(seq)
        return TokenDelta(seq.req_id, [t.token_id for t in tokens], lp, top, reason, len(seq.prompt_ids),
                          seq.cached_tokens or 0, tiers)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        if token in self.limits.eos_ids and not seq.sampling.ignore_eos:
            return "stop"
        if len(seq.output_ids) >= seq.sampling.max_tokens or seq.total_len >= self.limits.max_context:
            return "length"
        return None

    def _leave(self, seq: Sequence, publish: bool) -> None:
        """Finish or abort: a dense sequence's computed prefix stays cached for later turns.

        A hybrid one published as it went; its rolling checkpoint (its last page
        boundary) stays in the tree, and a finish copies it out with the prefix.
        """
        if publish and not self.limits.hybrid and self.coord.spec.prefix_cache and seq.done_len:
            # what finished steps computed (a step still in flight may yet fail)
            self.coord.publish(seq.req_id, seq.all_ids(), seq.done_len)
        if publish:
            self._offload(seq)
        self.coord.release(seq.req_id)
        self._free_slot(seq)
        self.running.pop(seq.req_id, None)

    def _free_slot(self, seq: Sequence) -> None:
        seq.pages = []
        seq.table_pages = 0
        seq.state_slot = None
        if seq.slot is not None:
            self.by_slot.pop(seq.slot, None)
            self.slots.release(seq.slot)  # at once, or when the sent plans using it are done
            seq.slot = None
        self.running.pop(seq.req_id, None)


def _tiers_of(seq: Sequence) -> dict[str, int]:
    """usage.cache: cached prompt tokens per tier (all from the device unless a tier run was loaded)."""
    if seq.cache_tiers is not None:
        return seq.cache_tiers
    return {"gpu": seq.cached_tokens or 0, "cpu": 0, "disk": 0, "peer": 0}


def _delta(seq: Sequence, tokens: list[int], reason: str | None, error: str | None = None) -> TokenDelta:
    cached = seq.cached_tokens or 0
    tiers = _tiers_of(seq) if reason is not None else None
    return TokenDelta(seq.req_id, tokens, None, None, reason, len(seq.prompt_ids), cached, tiers, error)
