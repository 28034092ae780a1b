"""The router's half of the CPU and disk tiers: lookups, offloads, and the copy ops they put in plans.

Pure logic, no sockets: messages for the cache worker collect in `outbox`
(the router sends them), answers come in through `found`/`reserved`, and
what must happen once a plan's copies ran is attached to that plan's step.

    arrival   lookup(keys past the device hit) ---------> worker pins the run (prefetching disk)
    admission match + extend(tier run) -> LoadPages/LoadState ops;  after the step: TierRelease
    publish   hold(prefix) -> TierReserve ----------------> worker reserves entries
              TierReserved -> StorePages/StoreState ops;  after the step: TierCommit(ok) + unhold

A page in flight is reserved at both ends (the coordinator's hold on the
device side, the worker's reservation or pin on the CPU side); a failed
step commits ok=False, which frees the CPU side, and the hold goes either way.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

from hkv.cache.coordinator import CacheCoordinator
from hkv.cache.transaction import Hold
from hkv.cache.keys import page_keys
from hkv.cache.types import CacheOp, StorePages, StoreState
from hkv.ipc.messages import (
    TierCommit, TierFound, TierInbound, TierLookup, TierRelease, TierReserve, TierReserved,
)  # fmt: skip

MAX_OFFLOADS = 64  # holds for copies out (waiting for the worker or their step); beyond it a publish is not copied


@dataclass(frozen=True)
class TierHit:
    """A lookup's answer, pinned by the worker until released: entries of pages [first, first + len(entries))."""

    lookup_id: int
    first: int
    entries: tuple[int, ...]
    from_disk: tuple[bool, ...]
    state_entry: int | None

    def usable(self, hit_tokens: int, page_size: int) -> int:
        """Entries past a device hit of `hit_tokens` that the run can serve (0: none).

            pages   [0 ...... hit/P) [hit/P ............ first + len)
            device   the hit          this tier's run serves these
        """
        start = hit_tokens // page_size - self.first
        return len(self.entries) - start if 0 <= start < len(self.entries) else 0


class TierClient:
    """Lookups and offloads for one router; every outgoing message lands in `outbox`."""

    def __init__(self, coord: CacheCoordinator, root_key: bytes, page_size: int, hybrid: bool,
                 num_entries: int, num_states: int):
        self.coord = coord
        self.num_entries = num_entries  # CPU-tier page entries: answers naming others are refused
        self.num_states = num_states
        self.root_key = root_key
        self.page_size = page_size
        self.hybrid = hybrid
        self.outbox: list[TierInbound] = []
        self.waiting_lookups: dict[int, int | None] = {}  # lookup id -> req id (None: it left), until TierFound
        self.offloads: dict[int, Hold] = {}  # offload id -> the hold on its pages, until TierReserved
        self.offloading: dict[int, int] = {}  # req id -> its copies out not settled yet (prefill mode waits)
        self._offload_req: dict[int, int] = {}  # offload id -> its request, until settled
        self.skipped_offloads = 0  # publishes not copied out (too many in flight)
        self.malformed = 0  # answers naming an unknown id or an index out of range (dropped)
        self._ids = itertools.count(1)
        self._next_plan: list[Callable[[bool], None]] = []  # run once the next plan's ops ran
        self._by_step: dict[int, list[Callable[[bool], None]]] = {}
        self._poisoned: set[int] = set()  # offloads whose reservation, when it comes, commits ok=False

    def keys(self, known: list[bytes], token_ids: list[int], pages: int) -> list[bytes]:
        """Chained keys of pages [0, pages), extending the cached list `known` in place."""
        if len(known) < pages:
            P = self.page_size
            parent = known[-1] if known else self.root_key
            known += page_keys(parent, token_ids[len(known) * P : pages * P], P)
        return known[:pages]

    def lookup(self, req_id: int, known: list[bytes], prompt_ids: list[int], device_hit: int) -> bool:
        """Ask for the run past the device hit; False when the prompt has no page left to look up."""
        P = self.page_size
        pages = (len(prompt_ids) - 1) // P  # a hit leaves at least one prompt token to compute
        first = device_hit // P
        if pages <= first:
            return False
        keys = self.keys(known, prompt_ids, pages)
        lookup_id = next(self._ids)
        self.waiting_lookups[lookup_id] = req_id
        parent = keys[first - 1] if first else None
        self.outbox.append(TierLookup(lookup_id, first, keys[first:], self.hybrid, parent))
        return True

    def found(self, msg: TierFound) -> tuple[int, TierHit | None] | None:
        """(req id, hit or None when empty) for a lookup still wanted; None for an unknown id."""
        if msg.lookup_id not in self.waiting_lookups:
            self.malformed += 1
            return None
        req_id = self.waiting_lookups.pop(msg.lookup_id)
        if req_id is None:  # the request left meanwhile
            if msg.entries:
                self.release(msg.lookup_id)
            return None
        if not msg.entries or not self._valid_found(msg):
            if msg.entries:  # entries that fail the check: drop them, release the worker's pins
                self.malformed += 1
                self.release(msg.lookup_id)
            return req_id, None
        hit = TierHit(msg.lookup_id, msg.first, tuple(msg.entries), tuple(msg.from_disk), msg.state_entry)
        return req_id, hit

    def _valid_found(self, msg: TierFound) -> bool:
        """Every index in range and the shapes consistent: a bad answer is never used as an index."""
        return (len(msg.from_disk) == len(msg.entries) and msg.first >= 0
                and all(0 <= e < self.num_entries for e in msg.entries)
                and ((msg.state_entry is not None and 0 <= msg.state_entry < self.num_states)
                     if self.hybrid else msg.state_entry is None))

    def release(self, lookup_id: int, after_plan: bool = False) -> None:
        """Unpin a lookup's entries now, or once the next plan (which loads them) ran."""
        if after_plan:
            self._next_plan.append(lambda ok: self.outbox.append(TierRelease(lookup_id)))
        else:
            self.outbox.append(TierRelease(lookup_id))

    def forget_lookup(self, req_id: int) -> None:
        """The request left before its lookup was answered: release the answer when it comes."""
        for lookup_id, waiting in list(self.waiting_lookups.items()):
            if waiting == req_id:
                self.waiting_lookups[lookup_id] = None

    def offload(self, req_id: int, known: list[bytes], token_ids: list[int]) -> bool:
        """Copy the request's published prefix out to the CPU tier (hybrid: it must end at a checkpoint)."""
        if len(self.coord.holds) >= MAX_OFFLOADS:
            self.skipped_offloads += 1
            return False
        hold = self.coord.hold(req_id)
        if hold is None:
            return False
        if self.hybrid and hold.checkpoint is None:
            self.coord.unhold(hold)
            return False
        keys = self.keys(known, token_ids, hold.length // self.page_size)
        offload_id = next(self._ids)
        self.offloads[offload_id] = hold
        self._offload_req[offload_id] = req_id
        self.offloading[req_id] = self.offloading.get(req_id, 0) + 1
        self.outbox.append(TierReserve(offload_id, keys, hold.checkpoint is not None))
        return True

    def _settled(self, offload_id: int) -> None:
        """An offload committed, failed or copied nothing: its request waits for one fewer."""
        req_id = self._offload_req.pop(offload_id, None)
        if req_id is not None:
            left = self.offloading.pop(req_id) - 1
            if left:
                self.offloading[req_id] = left

    def reserved(self, msg: TierReserved) -> list[CacheOp]:
        """The copy ops for a reservation (for the next plan); the commit and unhold follow that plan."""
        hold = self.offloads.pop(msg.offload_id, None)
        if hold is None:
            self.malformed += 1
            return []
        if msg.offload_id in self._poisoned:
            self._poisoned.discard(msg.offload_id)
            self.coord.unhold(hold)
            self._settled(msg.offload_id)
            if msg.state_entry is not None or any(e is not None for e in msg.entries):
                self.outbox.append(TierCommit(msg.offload_id, False))
            return []
        pairs = [(page, entry) for page, entry in zip(hold.pages, msg.entries) if entry is not None]
        ops: list[CacheOp] = []
        ckpt = hold.checkpoint
        valid = (len(msg.entries) == len(hold.pages) and all(0 <= e < self.num_entries for _, e in pairs)
                 and (msg.state_entry is None or (ckpt is not None and 0 <= msg.state_entry < self.num_states)))
        self.malformed += not valid
        if valid and pairs:
            ops.append(StorePages([p for p, _ in pairs], [e for _, e in pairs]))
        if valid and msg.state_entry is not None:
            ops.append(StoreState(ckpt.slot, msg.state_entry))
        if not ops:
            self.coord.unhold(hold)
            self._settled(msg.offload_id)
            if msg.state_entry is not None or any(e is not None for e in msg.entries):
                self.outbox.append(TierCommit(msg.offload_id, False))
            return []

        def done(ok: bool) -> None:
            self.outbox.append(TierCommit(msg.offload_id, ok))
            self.coord.unhold(hold)
            self._settled(msg.offload_id)

        self._next_plan.append(done)
        return ops

    def poison(self) -> None:
        """A step failed after prefixes were published ahead of its result: no copy out started so
        far may commit (its pages may hold that step's garbage). Each commits ok=False when its
        plan is done, or at once when its reservation comes back."""
        self._poisoned.update(self.offloads)
        for actions in (self._next_plan, *self._by_step.values()):
            actions[:] = [lambda ok, act=act: act(False) for act in actions]

    def has_pending(self) -> bool:
        """Actions wait for a plan to carry their ops."""
        return bool(self._next_plan)

    def plan_built(self, step: int) -> None:
        """The plan `step` carries the ops queued so far; their follow-ups run after its result."""
        if self._next_plan:
            self._by_step[step], self._next_plan = self._next_plan, []

    def step_done(self, step: int, ok: bool) -> None:
        for action in self._by_step.pop(step, ()):
            action(ok)

    def take_outbox(self) -> list[TierInbound]:
        out, self.outbox = self.outbox, []
        return out
