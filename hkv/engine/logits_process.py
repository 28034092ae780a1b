"""What a sequence's logits go through before sampling: logit_bias, repetition, frequency and
presence penalties, and the token mask of its grammar (structured output).

Only sequences whose SamplingParams are `processed` have state here, and only a step with such a
row does any of this: a step of plain rows costs one set lookup per row.

    bias            logits[t] += logit_bias[t]
    repetition r    tokens of the prompt or the output: logits / r where positive, logits * r elsewhere
    frequency f     logits[t] -= f * (times t is in the output)
    presence p      logits[t] -= p * (t is in the output)
    mask            tokens the grammar does not allow next -> -inf

Everything but the mask stays on the device: the output's token counts live in one pooled
[rows, vocab] tensor that each step's sampled ids are added into, with no host read. The mask
needs the matcher to have seen every token before it: on CUDA the rank plans a step before the
previous one's tokens are on the host, so a step with a grammar row samples late (`behind`, then
the runner's `complete`), once those tokens are in: the masks are computed on the host while the
step's forward runs, uploaded and applied in front of its sampling. With HKV_GRAMMAR_DEVICE_WAIT=1
(`apply_deferred`, hkv/engine/mask_wait.py) the step queues all of that at once, the upload behind a
device-side wait, and the masks are filled off the main thread.

A sequence's state is rebuilt from its NewSequence whenever it is (re)admitted: the router sends
the prompt (with a repetition penalty) and the tokens it generated before a preemption, so a
resumed sequence continues exactly where it was.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hkv.engine.grammar import Grammars, Matcher, fill_masks, mask_words
from hkv.ipc.messages import NewSequence, SamplingParams

log = logging.getLogger("hkv.rank")
LOGIT_BOUND = 1e30  # processed logits stay within +-this (float32's max is 3.4e38)


@dataclass
class SlotState:
    """One processed sequence on the rank."""

    req_id: int
    params: SamplingParams
    row: int | None  # its row of the count pools (penalties), None without penalties
    matcher: Matcher | None  # its grammar's place (a constraint), None without one
    behind: int = 0  # tokens sampled for it that the matcher has not consumed yet


@dataclass
class DeferredMasks:
    """A step's grammar rows whose masks the device waits for (hkv/engine/mask_wait.py): `fill` writes them into
    `masks`, the pinned buffer the step's queued copy reads once the wait passes."""

    matchers: list[Matcher]  # the rows' matchers, in the order of `masks`' rows
    masks: torch.Tensor  # [G, words] int32, pinned, owned by the step
    grammars: GrammarLoader | None

    def fill(self) -> tuple[float, int]:
        """Write the masks (the matchers must be current); (wall seconds, live matchers filled). A failure ends
        every row with an EOS-only mask rather than leaving the device to read stale bytes."""
        started = time.perf_counter()
        live = sum(not m.done for m in self.matchers)  # counted before: a fill that fails still reports them
        # the buffer was made under the launch's inference mode, which is per thread: writing it in place
        # (an EOS-only row) needs it on this one too
        with torch.inference_mode():
            try:
                _fill_rows(self.matchers, self.masks, self.grammars)
            except Exception as exc:
                log.error("the constrained sequences of a step end: their masks failed (%s: %s)",
                          type(exc).__name__, exc)
                for i, matcher in enumerate(self.matchers):
                    matcher.failed = True
                    matcher.fill(self.masks[i])
        return time.perf_counter() - started, live


def _fill_rows(matchers: list[Matcher], masks: torch.Tensor, grammars: GrammarLoader | None) -> int:
    """Row i of `masks` = matchers[i]'s next mask (llguidance's work on the grammar's mask threads, needed only
    when a matcher is live); returns the live matchers filled."""
    live = sum(not m.done for m in matchers)
    fill_masks(matchers, masks, grammars.get().executor if live and grammars else None)
    return live


def _penalised(params: SamplingParams) -> bool:
    return params.presence_penalty != 0.0 or params.frequency_penalty != 0.0 or params.repetition_penalty != 1.0


class GrammarLoader:
    """The rank's Grammars, built once in a thread at start-up (the tokenizer's byte trie takes most
    of a second for a 150k vocabulary) and waited for by the first constrained sequence."""

    def __init__(self, tokenizer_json: str | None, vocab_size: int, eos_ids: Sequence[int],
                 threads: int | None = None, mask_cache: str = "off"):
        self.eos_ids = sorted(eos_ids)
        self._threads = threads  # the mask threads (--grammar-threads); None: grammar.default_mask_threads()
        self._mask_cache = mask_cache  # HKV_GRAMMAR_MASK_CACHE's mode, grammar.MASK_CACHE_MODES
        self._grammars: Grammars | None = None
        self._error: str | None = None
        self._thread: threading.Thread | None = None
        self._reported = (0, 0)  # the mask cache's (hits, misses) at the last cache_fills()
        if tokenizer_json is None:
            self._error = "this checkpoint has no tokenizer.json"
            return
        self._thread = threading.Thread(target=self._load, args=(tokenizer_json, vocab_size, eos_ids), daemon=True,
                                        name="grammar-tokenizer")
        self._thread.start()

    def _load(self, path: str, vocab_size: int, eos_ids: Sequence[int]) -> None:
        try:
            self._grammars = Grammars(path, vocab_size, eos_ids, self._threads, self._mask_cache)
        except Exception as exc:  # structured output refuses its requests; the rest serves on
            self._error = f"{type(exc).__name__}: {exc}"
            log.warning("structured output is unavailable: %s", self._error)

    def cache_counts(self) -> tuple[int, int]:
        """The mask cache's keyed fills so far (hits, misses); (0, 0) before the load, on failure or without a cache."""
        cache = self._grammars.mask_cache if self._grammars is not None else None
        return (cache.hits, cache.misses) if cache is not None else (0, 0)

    def cache_fills(self) -> tuple[int, int]:
        """The mask cache's hits and misses since the last call (a step result's StepResult.grammar_cache_*; the
        counts are cumulative under the cache's lock, so fills still running land in a later result)."""
        hits, misses = self.cache_counts()
        last_hits, last_misses = self._reported
        self._reported = (hits, misses)
        return hits - last_hits, misses - last_misses

    def get(self) -> Grammars:
        if self._thread is not None:
            self._thread.join()
        if self._grammars is None:
            raise RuntimeError(f"structured output is unavailable: {self._error}")
        return self._grammars


class LogitsProcessor:
    """Per-slot processing state of one rank, and its application to a step's logits."""

    def __init__(self, vocab_size: int, device: torch.device, grammars: GrammarLoader | None):
        self.vocab_size = vocab_size
        self.device = device
        self.grammars = grammars
        self.slots: dict[int, SlotState] = {}  # request-table row -> its processed sequence
        self._free_rows: list[int] = []
        self.counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)  # [rows, V] output token counts
        self.prompt = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)  # [rows, V] prompt tokens
        self._masks: torch.Tensor | None = None  # [R, words] int32 host buffer (pinned on CUDA)

    # membership

    def admit(self, seq: NewSequence) -> None:
        """Take a (re)admitted sequence in; plain ones leave no state."""
        self.drop(seq.slot)
        params = seq.sampling
        if not params.processed:
            return
        row = self._take_row(seq.prompt_ids, seq.output_ids) if _penalised(params) else None
        matcher = self._matcher(seq) if params.constraint is not None else None
        self.slots[seq.slot] = SlotState(seq.req_id, params, row, matcher)

    def _matcher(self, seq: NewSequence) -> Matcher:
        """The sequence's matcher, past its output so far. The api compiled the grammar already; one that
        fails here (no tokenizer for llguidance, say) may only end the sequence, with the reason logged."""
        try:
            if self.grammars is None:
                raise RuntimeError("structured output is unavailable on this rank")
            return self.grammars.get().matcher(seq.sampling.constraint, seq.output_ids)
        except Exception as exc:
            log.error("request %d: its grammar failed on the rank (%s: %s); it ends at once", seq.req_id,
                      type(exc).__name__, exc)
            return Matcher.ended(self.grammars.eos_ids if self.grammars is not None else [])

    def drop(self, slot: int) -> None:
        state = self.slots.pop(slot, None)
        if state is not None and state.row is not None:
            self._free_rows.append(state.row)

    def _take_row(self, prompt_ids: list[int], output_ids: list[int]) -> int:
        if not self._free_rows:
            self._grow()
        row = self._free_rows.pop()
        self.counts[row].zero_()
        self.prompt[row].zero_()
        if prompt_ids:
            self.prompt[row, self._ids(prompt_ids)] = True
        if output_ids:
            self.counts[row].index_add_(0, self._ids(output_ids), torch.ones(len(output_ids), dtype=torch.int32,
                                                                             device=self.device))
        return row

    def _grow(self) -> None:
        """Double the count pools (8 rows first): a rank pays for the penalised sequences it has had at once."""
        old = self.counts.shape[0]
        new = max(8, 2 * old)
        self.counts = torch.cat([self.counts, self.counts.new_zeros(new - old, self.vocab_size)])
        self.prompt = torch.cat([self.prompt, self.prompt.new_zeros(new - old, self.vocab_size)])
        self._free_rows.extend(range(new - 1, old - 1, -1))

    def _ids(self, ids: list[int]) -> torch.Tensor:
        return self._upload([t for t in ids if 0 <= t < self.vocab_size], torch.long)

    # a step

    def rows(self, slots: Sequence[int]) -> list[int]:
        """Indexes into `slots` (a step's sampling rows, in order) of the processed sequences."""
        if not self.slots:
            return []
        return [i for i, s in enumerate(slots) if s in self.slots]

    def matched(self, slots: Sequence[int]) -> dict[int, int] | None:
        """slot -> req_id of the grammar rows among `slots` (whose matchers take the step's tokens), or None."""
        if not self.slots:
            return None
        return {s: st.req_id for s in slots if (st := self.slots.get(s)) is not None and st.matcher is not None} or None

    def cache_fills(self) -> dict[str, int]:
        """StepResult's grammar_cache_hits / misses: the mask cache's fills since the last call (0 without grammars)."""
        hits, misses = self.grammars.cache_fills() if self.grammars is not None else (0, 0)
        return {"grammar_cache_hits": hits, "grammar_cache_misses": misses}

    def behind(self, slots: Sequence[int]) -> bool:
        """Some grammar row's matcher still waits for a token a running step samples."""
        return any(self.slots[s].behind for s in slots if s in self.slots and self.slots[s].matcher is not None)

    def apply(self, logits: torch.Tensor, slots: Sequence[int], rows: list[int]) -> tuple[float, int]:
        """Process `logits` ([S, V] fp32, row i sampling for slots[i]) in place at `rows`; every grammar
        row's matcher must be current (not `behind`). Returns (wall seconds filling the grammar rows' masks,
        live matchers filled): (0.0, 0) without grammar rows (StepResult.grammar_mask_s, grammar_rows)."""
        states = [self.slots[slots[i]] for i in rows]
        started = time.perf_counter()
        masks, live = self._fill_masks(states)  # the host's share first: it overlaps the forward the device runs
        mask_s = time.perf_counter() - started if masks is not None else 0.0
        self._process(logits, rows, states, masks)
        return mask_s, live

    def apply_deferred(self, logits: torch.Tensor, slots: Sequence[int], rows: list[int],
                       wait: Callable[[], None]) -> DeferredMasks:
        """`apply` with the grammar rows' masks left to fill later: bias and penalties are queued, then `wait` (which
        queues the device-side wait for the masks), then the masks' copy from a fresh pinned buffer and their apply.
        The rows must include a grammar row; the caller fills the returned masks once their matchers are current."""
        states = [self.slots[slots[i]] for i in rows]
        matchers = [(r, s.matcher) for r, s in enumerate(states) if s.matcher is not None]
        if not matchers:
            raise ValueError("a deferred mask apply without grammar rows")
        masks = self._mask_buffer(len(matchers), mask_words(self.vocab_size))
        self._process(logits, rows, states, ([r for r, _ in matchers], masks), before_mask=wait)
        return DeferredMasks([m for _, m in matchers], masks, self.grammars)

    def _process(self, logits: torch.Tensor, rows: list[int], states: list[SlotState],
                 masks: tuple[list[int], torch.Tensor] | None, before_mask: Callable[[], None] | None = None) -> None:
        """Bias, penalties and (with `masks`: the grammar rows among `states` and their [G, words] host masks)
        the masks' apply, queued on `logits` at `rows`; `before_mask` is queued first when there are masks."""
        index = self._upload(rows, torch.long)
        sub = logits.index_select(0, index)  # [R, V]
        self._bias(sub, states)
        self._penalties(sub, states)
        if masks is not None:
            at = self._upload(masks[0], torch.long)  # before the wait: nothing behind it allocates pinned memory
            if before_mask is not None:
                before_mask()
            self._mask(sub, at, masks[1])
        logits.index_copy_(0, index, sub)

    def _upload(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """A small host list on the device without waiting: from pinned memory, queued behind the step's work (a
        copy from pageable memory first waits for the stream, which still runs this step's forward)."""
        host = torch.tensor(values, dtype=dtype)
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def _bias(self, sub: torch.Tensor, states: list[SlotState]) -> None:
        entries = [(r, t, b) for r, s in enumerate(states) for t, b in s.params.logit_bias.items()
                   if 0 <= t < self.vocab_size]
        if not entries:
            return
        r, t, b = zip(*entries)
        where = (self._upload(list(r), torch.long), self._upload(list(t), torch.long))
        sub.index_put_(where, self._upload(list(b), sub.dtype), accumulate=True)

    def _penalties(self, sub: torch.Tensor, states: list[SlotState]) -> None:
        picked = [(r, s) for r, s in enumerate(states) if s.row is not None]
        if not picked:
            return
        at = self._upload([r for r, _ in picked], torch.long)
        pool = self._upload([s.row for _, s in picked], torch.long)
        knobs = self._upload([[s.params.repetition_penalty, s.params.frequency_penalty, s.params.presence_penalty]
                              for _, s in picked], sub.dtype)  # [P, 3]
        counts = self.counts.index_select(0, pool).to(sub.dtype)  # [P, V]
        rows = sub.index_select(0, at)
        seen = (counts > 0) | self.prompt.index_select(0, pool)
        rep = knobs[:, 0:1]
        rows = torch.where(seen, torch.where(rows > 0, rows / rep, rows * rep), rows)
        rows -= knobs[:, 1:2] * counts + knobs[:, 2:3] * (counts > 0).to(sub.dtype)
        # a tiny repetition penalty overflows the division: keep every logit finite, and small enough that
        # the sampler's division by a temperature (>= 1e-5) stays finite too
        sub.index_copy_(0, at, rows.clamp_(-LOGIT_BOUND, LOGIT_BOUND))

    def _fill_masks(self, states: list[SlotState]) -> tuple[tuple[list[int], torch.Tensor] | None, int]:
        """The grammar rows' masks on the host (llguidance's threads): ((their rows in `states`, [G, words]
        int32) or None without grammar rows, the live matchers among them: those llguidance computed)."""
        picked = [(r, s.matcher) for r, s in enumerate(states) if s.matcher is not None]
        if not picked:
            return None, 0
        masks = self._mask_buffer(len(picked), mask_words(self.vocab_size))
        live = _fill_rows([m for _, m in picked], masks, self.grammars)
        return ([r for r, _ in picked], masks), live

    def _mask(self, sub: torch.Tensor, at: torch.Tensor, masks: torch.Tensor) -> None:
        """-inf where the grammar rows' masks ([G, words] host) leave a bit clear; `at`: their rows of `sub` ([G],
        on the device). Queues device work only: a device-side wait may sit in front of it (hkv/engine/mask_wait.py)."""
        bits = masks.to(self.device, non_blocking=True)  # [G, words], from pinned memory
        shifts = torch.arange(32, dtype=torch.int32, device=self.device)
        allowed = ((bits.unsqueeze(-1) >> shifts) & 1).view(masks.shape[0], -1)[:, : self.vocab_size]
        sub.index_copy_(0, at, sub.index_select(0, at).masked_fill(allowed == 0, float("-inf")))

    def _mask_buffer(self, rows: int, words: int) -> torch.Tensor:
        """A host buffer of `rows` masks; a fresh one per step, since the last step's upload may still read
        the old one."""
        return torch.empty(rows, words, dtype=torch.int32, pin_memory=self.device.type == "cuda")

    def sampled(self, slots: Sequence[int], rows: list[int], ids: torch.Tensor,
                counted: tuple[torch.Tensor, ...] | None = None) -> None:
        """The step's sampled ids ([S] on the device) are in: add the processed rows' to their counts, and
        mark their matchers one token behind until `consume` gives them the token. `counted`: count_rows'
        answer taken before (then this queues device work only); None: taken here."""
        if counted is None:
            counted = self.count_rows(slots, rows)
        if counted:
            at, pool = counted
            self.counts.index_put_((pool, ids.index_select(0, at)), torch.ones(at.shape[0], dtype=torch.int32,
                                                                               device=self.device), accumulate=True)
        for i in rows:
            state = self.slots[slots[i]]
            if state.matcher is not None:
                state.behind += 1

    def count_rows(self, slots: Sequence[int], rows: list[int]) -> tuple[torch.Tensor, ...]:
        """(the step rows, their count rows) on the device of the processed rows whose tokens count toward
        penalties, () if none: what `sampled` uploads, for a caller that must upload before a device-side wait."""
        counted = [(i, self.slots[slots[i]].row) for i in rows if self.slots[slots[i]].row is not None]
        if not counted:
            return ()
        return self._upload([i for i, _ in counted], torch.long), self._upload([r for _, r in counted], torch.long)

    def consume(self, slot: int, req_id: int, tokens: Sequence[int]) -> None:
        """A step's tokens for `slot` reached the host: its matcher advances (a slot since handed to
        another sequence, or freed, is left alone)."""
        state = self.slots.get(slot)
        if state is None or state.req_id != req_id or state.matcher is None:
            return
        for token in tokens:
            state.matcher.consume(token)
        state.behind = max(0, state.behind - 1)
