"""Bookkeeping of the CPU tier (the cache worker's shm page pool): which key lives in which entry.

Pure Python: the cache worker's `TierPolicy` (hkv/cache/tier_policy.py) owns
one `CpuTier`; ranks copy contents into and out of the entries it hands out
(hkv/storage/host_pool.py). Keys are chained page keys (hkv/cache/keys.py),
so a key names a page *and* its whole prefix; every entry knows its parent
(the key of the page before it, the root key for a first page).

    key -> Entry(page entry = a unit of the slab, optional state entry = a block: the checkpoint at the page's end)

Pages and checkpoints share one byte budget (`Slab`, hkv/cache/slab.py). An
entry is in one of three states:

    reserved   allocated for a store or a disk read; contents not there yet; pinned
    valid      contents present; evictable when no pin holds it
    pinned     valid, and a lookup (a load in flight) or a disk write reads it

Eviction follows usable prefixes (`ChainIndex`, hkv/cache/chains.py): only
leaves go, least recently used first, so a chain is shortened from its deep
end and its first pages go last. On a hybrid model a leaf gives up its
checkpoint, and with it the pages back to the checkpoint before (or to a
page another chain shares): pages beyond the deepest checkpoint of their
chain serve no hit. Nothing of that kind is kept at rest either: when an
entry is unpinned or loses its checkpoint, the tier drops

- a reservation whose contents never came,
- on a hybrid model, a leaf without a checkpoint,
- an entry whose parent was held when it came and is gone now (its chain has
  a hole; an entry that came without its parent, a disk read past the
  device's hit, is kept: the device or the disk holds its prefix),

and then whatever that exposes, so no checkpoint is kept whose pages are gone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from hkv.cache.chains import ChainIndex
from hkv.cache.slab import Slab


class Entry:
    """One cached page (and maybe its checkpoint) in the CPU tier."""

    __slots__ = ("key", "parent", "page", "state", "state_valid", "pins", "valid", "anchored")

    def __init__(self, key: bytes, parent: bytes, page: int, anchored: bool):
        self.key: bytes = key
        self.parent: bytes = parent  # the previous page's key; the root key for a prompt's first page
        self.page: int = page  # page entry (slab unit) in the host pool; moves only while unpinned
        self.state: int | None = None  # state entry (slab block): the checkpoint after this page
        self.state_valid: bool = False  # the state entry's contents are present (not just reserved)
        self.pins: int = 0  # loads in flight, disk writes, reservations
        self.valid: bool = False  # contents present
        self.anchored: bool = anchored  # its parent was held (or was the root) when it came

    @property
    def checkpoint(self) -> int | None:
        """The state entry when its contents are present, else None (a lookup may use only these)."""
        return self.state if self.state_valid else None


@dataclass
class TierCounters:
    stores: int = 0  # page entries filled from the device
    state_stores: int = 0  # checkpoints filled from the device
    store_skipped: int = 0  # pages a store found cached already
    store_refused: int = 0  # stores cut short or refused: no room could be made
    evicted_pages: int = 0  # pages given up to make room (a chain's deep end)
    evicted_states: int = 0
    pruned_pages: int = 0  # pages dropped at rest: beyond their chain's deepest checkpoint, or behind a hole
    pruned_states: int = 0
    moved_pages: int = 0  # pages moved to free a block for a checkpoint (compaction)
    rolled_back: int = 0  # reservations undone (the copy failed)


class CpuTier:
    """Entries over a slab of `units` page units (`state_units` per checkpoint; 0: a dense model).

    `move(src, dst)` copies page entry src's bytes to page entry dst (the
    worker's shm; a recorder in tests): compaction moves unpinned pages only.
    Every method is O(1) or O(keys given) apart from a checkpoint change (its
    ancestors), compaction (one block) and `flush`/`check`.
    """

    def __init__(self, units: int, state_units: int, root: bytes, move: Callable[[int, int], None]):
        per_block = max(1, state_units)
        if units < 0 or state_units < 0 or units % per_block:
            raise ValueError(f"units ({units}) must be >= 0 and a multiple of state_units ({state_units})")
        self.checkpoints: bool = state_units > 0  # hybrid: the tier keeps checkpoints
        self.slab: Slab = Slab(units // per_block, per_block)
        self.chains: ChainIndex = ChainIndex(root, self.checkpoints)
        self.entries: dict[bytes, Entry] = {}
        self.counters: TierCounters = TierCounters()
        self._move: Callable[[int, int], None] = move
        self._owner: list[Entry | None] = [None] * units  # page unit -> the entry whose page it holds
        self._states: int = 0  # entries with a state entry
        self._valid: int = 0  # entries with their contents present
        self._pinned_pages: int = 0  # entries with pins
        self._pinned_states: int = 0  # entries with pins and a state entry

    @property
    def root(self) -> bytes:
        return self.chains.root

    @property
    def num_pages(self) -> int:
        return self.slab.units

    @property
    def num_states(self) -> int:
        return self.slab.blocks if self.checkpoints else 0

    @property
    def free_pages(self) -> int:
        return self.slab.free_units

    @property
    def free_states(self) -> int:
        return self.slab.free_blocks if self.checkpoints else 0

    def get(self, key: bytes) -> Entry | None:
        """The valid entry of `key`, or None (absent or still reserved)."""
        entry = self.entries.get(key)
        return entry if entry is not None and entry.valid else None

    def usage(self) -> dict:
        """{"pages": {total, free, cached, in_use}, "states": {...}}: cached = valid and unpinned.

        Pages and checkpoints share the slab: free pages are the free units,
        free states the free blocks, and each total is what its kind holds
        plus its free room, so totals move as the mix changes.
        """
        pages, free_states = len(self.entries), self.free_states
        return {
            "pages": {"total": self.slab.free_units + pages, "free": self.slab.free_units,
                      "cached": pages - self._pinned_pages, "in_use": self._pinned_pages},
            "states": {"total": free_states + self._states, "free": free_states,
                       "cached": self._states - self._pinned_states, "in_use": self._pinned_states},
        }  # fmt: skip

    def coverage(self) -> tuple[int, int]:
        """(pages held with their contents, pages a hit on this tier alone could reach)."""
        return self._valid, self.chains.reachable

    def pin(self, entry: Entry) -> None:
        """Keep `entry` (and its state) from eviction and from moving; pins nest."""
        if self.entries.get(entry.key) is not entry:
            raise ValueError(f"pin of an entry not held {entry.key.hex()}")
        if entry.pins == 0:
            self._pinned_pages += 1
            self._pinned_states += entry.state is not None
            self.chains.set_evictable(entry.key, False)
        entry.pins += 1

    def unpin(self, entry: Entry) -> None:
        """Drop one pin; an entry with none left is evictable, or dropped if it may not stay at rest."""
        if entry.pins <= 0:
            raise ValueError(f"unpin of an unpinned entry {entry.key.hex()}")
        entry.pins -= 1
        if entry.pins or self.entries.get(entry.key) is not entry:
            return
        self._pinned_pages -= 1
        self._pinned_states -= entry.state is not None
        if entry.valid:
            self.chains.set_evictable(entry.key, True)
        self._settle([entry], evicting=False)

    def touch(self, entry: Entry) -> None:
        """Mark `entry` used now (a hit); a pinned entry keeps the mark for when it is unpinned."""
        if self.entries.get(entry.key) is entry:
            self.chains.touch(entry.key)

    def reserve(self, key: bytes, parent: bytes) -> Entry | None:
        """A new reserved (pinned, invalid) entry for `key`, making room if needed.

        `key` must be absent; `parent` is the key of the page before it. None
        when no unit can be freed (everything left is pinned or reserved).
        """
        if key in self.entries:
            raise ValueError(f"key {key.hex()} is already in the CPU tier")
        if not self.make_room(1):
            return None
        unit = self.slab.take_unit()
        entry = Entry(key, parent, unit, parent == self.root or parent in self.entries)
        entry.pins = 1
        self.entries[key] = entry
        self._owner[unit] = entry
        self._pinned_pages += 1
        self.chains.add(key, parent, evictable=False, present=False)
        return entry

    def reserve_state(self, entry: Entry) -> int | None:
        """A state entry for `entry` (pinned by the caller), making room if needed; None if none can be had."""
        if entry.state is not None:
            raise ValueError(f"entry {entry.key.hex()} already has a state")
        if entry.pins == 0:
            raise ValueError("reserve_state needs the entry pinned")
        if not self.checkpoints or not self.make_room(0, 1):
            return None
        entry.state = self.slab.take_block()
        self._states += 1
        self._pinned_states += 1
        return entry.state

    def make_room(self, pages: int, checkpoints: int = 0) -> bool:
        """Free `pages` units and `checkpoints` blocks at once, beside each other; False if it cannot.

            free units  [ >= pages + checkpoints x k ]   of which >= checkpoints whole blocks

        Compacts when the units are free but scattered over page blocks, else
        evicts in usable-prefix order. Pinned and reserved entries never go or
        move. What it evicted stays evicted when it fails. Taking `pages`
        units (open page blocks first) then leaves the blocks for checkpoints.
        """
        need = pages + checkpoints * self.slab.units_per_block
        while True:
            if self.slab.free_units >= need:
                if self.slab.free_blocks >= checkpoints:
                    return True
                if self._compact():
                    continue
            if not self._evict_one():
                return False

    def fill(self, entry: Entry) -> None:
        """The reserved entry's contents (and its state's, if it has one) arrived: it is valid
        (still pinned by its reservation)."""
        entry.valid = True
        self._valid += 1
        self.chains.set_present(entry.key)
        if entry.state is not None:
            self.fill_state(entry)

    def fill_state(self, entry: Entry) -> None:
        """The state entry reserved for a valid page arrived."""
        if entry.state is None:
            raise ValueError(f"entry {entry.key.hex()} has no state entry to fill")
        entry.state_valid = True
        self.chains.set_checkpoint(entry.key, True)

    def drop(self, entry: Entry) -> None:
        """Forget an entry (a reservation whose contents never came, or a bad one); frees its ids."""
        if self.entries.get(entry.key) is not entry:
            return
        around = self._neighbours(entry)
        self._remove(entry)
        self._settle(around, evicting=False)

    def drop_state(self, entry: Entry) -> None:
        """Forget a state entry (whose contents never arrived); the page stays unless that leaves it useless."""
        if entry.state is not None and self.entries.get(entry.key) is entry:
            self._free_state(entry)
            self._settle([entry], evicting=False)

    def flush(self) -> tuple[int, int]:
        """Drop every entry no pin holds, itself or below it; returns (pages, states) freed."""
        pages = states = 0
        while (key := self.chains.victim()) is not None:
            entry = self.entries[key]
            pages += 1
            states += entry.state is not None
            self._remove(entry)
        return pages, states

    def _neighbours(self, entry: Entry) -> list[Entry]:
        """Its parent and children: what its removal may leave useless or behind a hole."""
        around = [self.entries[c] for c in self.chains.links[entry.key].children]
        parent = self.entries.get(entry.parent)
        return around + ([parent] if parent is not None else [])

    def _doomed(self, entry: Entry) -> bool:
        """An unpinned entry that may not stay at rest (see the module docstring)."""
        if not entry.valid:
            return True
        if entry.anchored and entry.parent != self.root and entry.parent not in self.entries:
            return True
        return self.checkpoints and entry.checkpoint is None and self.chains.is_leaf(entry.key)

    def _settle(self, stack: list[Entry], evicting: bool) -> None:
        """Drop the doomed unpinned entries of `stack` and, in turn, those their removal dooms."""
        while stack:
            entry = stack.pop()
            if entry.pins or self.entries.get(entry.key) is not entry or not self._doomed(entry):
                continue
            if entry.valid:
                counters = self.counters
                if evicting:
                    counters.evicted_pages += 1
                    counters.evicted_states += entry.state is not None
                else:
                    counters.pruned_pages += 1
                    counters.pruned_states += entry.state is not None
            stack += self._neighbours(entry)
            self._remove(entry)

    def _evict_one(self) -> bool:
        """Give up the first leaf in usable-prefix order; False when nothing is evictable."""
        key = self.chains.victim()
        if key is None:
            return False
        entry = self.entries[key]
        if self.checkpoints:
            # a chain's deep end: its checkpoint, then the pages back to the one before
            if entry.state is not None:
                self._free_state(entry)
                self.counters.evicted_states += 1
            self._settle([entry], evicting=True)
        else:
            self._remove(entry)
            self.counters.evicted_pages += 1
        return True

    def _compact(self) -> bool:
        """Empty the open page block with the fewest pages into the others' free units, if its pages may move."""
        for _, block in self.slab.open_blocks():
            owners = [self._owner[unit] for unit in self.slab.used_units(block)]
            if len(owners) > self.slab.room_outside(block):
                return False
            if all(owner.pins == 0 and owner.valid for owner in owners):
                for owner in owners:
                    self._relocate(owner, block)
                return True
        return False

    def _relocate(self, entry: Entry, block: int) -> None:
        unit = self.slab.take_unit(avoid=block)
        self._move(entry.page, unit)
        self._owner[entry.page] = None
        self.slab.give_unit(entry.page)
        self._owner[unit] = entry
        entry.page = unit
        self.counters.moved_pages += 1

    def _free_state(self, entry: Entry) -> None:
        self.slab.give_block(entry.state)
        self._states -= 1
        self._pinned_states -= entry.pins > 0
        if entry.state_valid:
            self.chains.set_checkpoint(entry.key, False)
        entry.state, entry.state_valid = None, False

    def _remove(self, entry: Entry) -> None:
        """Take `entry` out of every book; nothing else (the caller settles what it exposes)."""
        if entry.state is not None:
            self._free_state(entry)
        del self.entries[entry.key]
        self.chains.remove(entry.key)
        self._owner[entry.page] = None
        self.slab.give_unit(entry.page)
        self._pinned_pages -= entry.pins > 0
        self._valid -= entry.valid
        entry.valid = False

    def check(self) -> None:
        """Prove the books: slab ids, owners, chain links, counts, and that nothing doomed is at rest."""
        entries = self.entries.values()
        self.slab.check([e.page for e in entries], [e.state for e in entries if e.state is not None])
        assert all(self._owner[e.page] is e for e in entries), "a page unit's owner is not its entry"
        assert sum(o is not None for o in self._owner) == len(self.entries), "a free unit has an owner"
        self.chains.check()
        assert set(self.chains.links) == set(self.entries), "chain links differ from the entries"
        for key, e in self.entries.items():
            link = self.chains.links[key]
            assert link.parent == e.parent and link.present == e.valid, f"link of {key.hex()} is stale"
            assert link.evictable == (e.valid and not e.pins), f"{key.hex()}: evictable is stale"
            assert link.checkpoint == (e.checkpoint is not None), f"{key.hex()}: checkpoint flag is stale"
            assert e.pins or not self._doomed(e), f"{key.hex()} is at rest but may not be (useless or behind a hole)"
        assert self._states == sum(e.state is not None for e in entries), "state count is stale"
        assert self._valid == sum(e.valid for e in entries), "valid count is stale"
        assert self._pinned_pages == sum(e.pins > 0 for e in entries), "pinned page count is stale"
        assert self._pinned_states == sum(e.pins > 0 and e.state is not None for e in entries), "pinned states stale"
