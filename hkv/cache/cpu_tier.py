"""Bookkeeping of the CPU tier (the cache worker's shm page pool): which key lives in which entry.

Pure Python: the cache worker's `TierPolicy` (hkv/cache/tier_policy.py) owns
one `CpuTier`; ranks copy contents into and out of the entries it hands out
(hkv/storage/host_pool.py). Keys are chained page keys (hkv/cache/keys.py),
so a key names a page *and* its whole prefix.

    key -> Entry(page entry, optional state entry = the checkpoint at the page's end)

An entry is in one of three states:

    reserved   allocated for a store or a disk read; contents not there yet; pinned
    valid      contents present; evictable when no pin holds it
    pinned     valid, and a lookup (a load in flight) or a disk write reads it

Eviction is LRU over unpinned valid entries. Lookups touch a run deepest page
first, so a chain's first pages are the most recent and go last: losing an
early page would make every later page of the chain unreachable. State
entries are evicted separately (LRU), as they are the scarce resource.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


class Entry:
    """One cached page (and maybe its checkpoint) in the CPU tier."""

    __slots__ = ("key", "page", "state", "state_valid", "pins", "valid")

    def __init__(self, key: bytes, page: int):
        self.key: bytes = key
        self.page: int = page  # page entry index in the host pool
        self.state: int | None = None  # state entry index: the checkpoint after this page
        self.state_valid: bool = False  # the state entry's contents are present (not just reserved)
        self.pins: int = 0  # loads in flight, disk writes, reservations
        self.valid: bool = False  # contents present

    @property
    def checkpoint(self) -> int | None:
        """The state entry when its contents are present, else None (a lookup may use only these)."""
        return self.state if self.state_valid else None


@dataclass
class TierCounters:
    stores: int = 0  # page entries filled from the device
    state_stores: int = 0  # checkpoints filled from the device
    store_skipped: int = 0  # pages a store found cached already
    store_refused: int = 0  # stores cut short: no entry could be freed
    evicted_pages: int = 0
    evicted_states: int = 0
    rolled_back: int = 0  # reservations undone (the copy failed)


class CpuTier:
    """Page and state entries of the CPU tier, an index from keys, and LRU eviction.

    Every method is O(1) or O(keys given); nothing here touches the bytes.
    """

    def __init__(self, num_pages: int, num_states: int):
        if num_pages < 0 or num_states < 0:
            raise ValueError("entry counts must be >= 0")
        self.num_pages: int = num_pages
        self.num_states: int = num_states
        self.entries: dict[bytes, Entry] = {}
        self._free_pages: list[int] = list(range(num_pages))[::-1]
        self._free_states: list[int] = list(range(num_states))[::-1]
        self._page_lru: OrderedDict[bytes, None] = OrderedDict()  # valid, unpinned; oldest first
        self._state_lru: OrderedDict[bytes, None] = OrderedDict()  # valid, unpinned, with a state
        self.counters: TierCounters = TierCounters()

    def get(self, key: bytes) -> Entry | None:
        """The valid entry of `key`, or None (absent or still reserved)."""
        entry = self.entries.get(key)
        return entry if entry is not None and entry.valid else None

    @property
    def free_pages(self) -> int:
        return len(self._free_pages)

    @property
    def free_states(self) -> int:
        return len(self._free_states)

    def usage(self) -> dict:
        """{"pages": {total, free, cached, in_use}, "states": {...}}: cached = valid and unpinned."""
        pinned_pages = sum(1 for e in self.entries.values() if e.pins or not e.valid)
        pinned_states = sum(1 for e in self.entries.values() if e.state is not None and (e.pins or not e.valid))
        pages = {"total": self.num_pages, "free": self.free_pages, "cached": len(self._page_lru),
                 "in_use": pinned_pages}
        states = {"total": self.num_states, "free": self.free_states, "cached": len(self._state_lru),
                  "in_use": pinned_states}
        return {"pages": pages, "states": states}

    def pin(self, entry: Entry) -> None:
        """Keep `entry` (and its state) from eviction; pins nest."""
        if entry.pins == 0 and entry.valid:
            self._page_lru.pop(entry.key, None)
            self._state_lru.pop(entry.key, None)
        entry.pins += 1

    def unpin(self, entry: Entry) -> None:
        """Drop one pin; a valid entry with no pin left becomes evictable (most recent)."""
        if entry.pins <= 0:
            raise ValueError(f"unpin of an unpinned entry {entry.key.hex()}")
        entry.pins -= 1
        if entry.pins == 0 and entry.valid and self.entries.get(entry.key) is entry:
            self._make_evictable(entry)

    def _make_evictable(self, entry: Entry) -> None:
        self._page_lru[entry.key] = None
        self._page_lru.move_to_end(entry.key)
        if entry.state is not None:
            self._state_lru[entry.key] = None
            self._state_lru.move_to_end(entry.key)

    def touch(self, entry: Entry) -> None:
        """Mark `entry` most recently used (no effect while pinned: it is not in the LRU)."""
        if entry.key in self._page_lru:
            self._page_lru.move_to_end(entry.key)
        if entry.key in self._state_lru:
            self._state_lru.move_to_end(entry.key)

    def reserve(self, key: bytes) -> Entry | None:
        """A new reserved (pinned, invalid) entry for `key`, evicting the LRU page if needed.

        `key` must be absent. None when every page entry is pinned or reserved.
        """
        if key in self.entries:
            raise ValueError(f"key {key.hex()} is already in the CPU tier")
        if not self._free_pages and not self._evict_page():
            return None
        entry = Entry(key, self._free_pages.pop())
        entry.pins = 1
        self.entries[key] = entry
        return entry

    def reserve_state(self, entry: Entry) -> int | None:
        """A state entry for `entry` (pinned by the caller), evicting the LRU checkpoint; None if none can go."""
        if entry.state is not None:
            raise ValueError(f"entry {entry.key.hex()} already has a state")
        if entry.pins == 0:
            raise ValueError("reserve_state needs the entry pinned")
        if not self._free_states and not self._evict_state():
            return None
        entry.state = self._free_states.pop()
        return entry.state

    def fill(self, entry: Entry) -> None:
        """The reserved entry's contents (and its state's, if it has one) arrived: it is valid
        (still pinned by its reservation)."""
        entry.valid = True
        entry.state_valid = entry.state is not None

    def fill_state(self, entry: Entry) -> None:
        """The state entry reserved for a valid page arrived."""
        if entry.state is None:
            raise ValueError(f"entry {entry.key.hex()} has no state entry to fill")
        entry.state_valid = True

    def drop(self, entry: Entry) -> None:
        """Forget a reserved entry whose contents never arrived (or a bad one); frees its ids."""
        if self.entries.get(entry.key) is entry:
            del self.entries[entry.key]
        self._page_lru.pop(entry.key, None)
        self._state_lru.pop(entry.key, None)
        self._free_pages.append(entry.page)
        if entry.state is not None:
            self._free_states.append(entry.state)
        entry.state, entry.state_valid, entry.valid = None, False, False

    def drop_state(self, entry: Entry) -> None:
        """Forget a state entry whose contents never arrived; the page stays."""
        if entry.state is not None:
            self._state_lru.pop(entry.key, None)
            self._free_states.append(entry.state)
            entry.state, entry.state_valid = None, False

    def _evict_page(self) -> bool:
        if not self._page_lru:
            return False
        key, _ = self._page_lru.popitem(last=False)
        entry = self.entries.pop(key)
        self._state_lru.pop(key, None)
        self._free_pages.append(entry.page)
        if entry.state is not None:
            self._free_states.append(entry.state)
            self.counters.evicted_states += 1
        self.counters.evicted_pages += 1
        return True

    def _evict_state(self) -> bool:
        if not self._state_lru:
            return False
        key, _ = self._state_lru.popitem(last=False)
        entry = self.entries[key]
        self._free_states.append(entry.state)
        entry.state, entry.state_valid = None, False
        self.counters.evicted_states += 1
        return True

    def flush(self) -> tuple[int, int]:
        """Drop every valid unpinned entry; returns (pages, states) freed."""
        pages = states = 0
        for key in list(self._page_lru):
            entry = self.entries.pop(key)
            self._free_pages.append(entry.page)
            pages += 1
            if entry.state is not None:
                self._free_states.append(entry.state)
                states += 1
        self._page_lru.clear()
        self._state_lru.clear()
        return pages, states

    def check(self) -> None:
        """Prove free + entries == capacity for both kinds, ids disjoint, LRU == valid unpinned."""
        pages = list(self._free_pages) + [e.page for e in self.entries.values()]
        assert sorted(pages) == list(range(self.num_pages)), f"page entries unbalanced: {sorted(pages)}"
        states = list(self._free_states) + [e.state for e in self.entries.values() if e.state is not None]
        assert sorted(states) == list(range(self.num_states)), f"state entries unbalanced: {sorted(states)}"
        evictable = {k for k, e in self.entries.items() if e.valid and e.pins == 0}
        assert set(self._page_lru) == evictable, "page LRU differs from the valid unpinned entries"
        with_state = {k for k in evictable if self.entries[k].state is not None}
        assert set(self._state_lru) == with_state, "state LRU differs from the valid unpinned checkpoints"
