"""What the CPU tier pins, reserves and fills for the cache worker's lookups and offloads.

Pure Python over a `CpuTier` and the disk tier's index: the cache worker calls
these steps from its message handlers and does the I/O between them.

    lookup   begin_lookup    pin the CPU run, reserve entries for its disk-only pages
             (worker)        read plan.disk_reads' files into those entries, in a thread
             finish_lookup   fill what was read, unpin from the first failed read on,
                             hybrid: cut back to the deepest checkpoint -> LookupHit
             release         unpin the hit once its loads ran

    offload  reserve         entries for the keys not held, and the last page's state
                             (hybrid: all of them or none)
             (ranks)         copy the device pages into them
             commit          fill (ok) or free them -> entries to write to disk, pinned
             (worker)        write each one, in a thread
             write_done      unpin it

The CPU tier evicts by usable prefix and drops what may not stay at rest
(hkv/cache/cpu_tier.py); hits count as uses for its order. Every step runs
on the worker's event loop, so steps of different messages
interleave only between calls: while a lookup's disk read is in flight,
other messages' reserve/commit/release run, and the lookup's pins keep its
entries from them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

from hkv.cache.cpu_tier import CpuTier, Entry
from hkv.cache.keys import KEY_BYTES


class DiskIndex(Protocol):
    """The disk tier's in-memory index (`DiskTier` in hkv/cache/disk.py); neither call reads a file."""

    def contains(self, key: bytes) -> bool: ...

    def has_state(self, key: bytes) -> bool: ...

    def link(self, key: bytes, parent: bytes) -> None: ...  # a lookup saw `key` follow `parent`


@dataclass
class PolicyCounters:
    lookups: int = 0
    hit_pages_cpu: int = 0  # pages lookups found in the CPU tier
    hit_pages_disk: int = 0  # pages lookups read from the disk tier
    disk_read_failed: int = 0  # lookups whose run ended at a missing or corrupt disk entry
    malformed: int = 0  # messages that broke the contract (bad key sizes, unknown or reused ids)


@dataclass
class Offload:
    """Entries reserved for one TierReserve, until its TierCommit."""

    new: list[Entry]  # entries created for it (reserved, pinned)
    state_of: Entry | None  # an existing entry that got a new state entry (pinned by us)


@dataclass
class LookupPlan:
    """One lookup between begin_lookup and finish_lookup: its run, every entry pinned."""

    lookup_id: int
    need_state: bool  # hybrid: the run must end at a checkpoint
    entries: list[Entry]  # the run in sequence order; disk ones reserved, contents not there yet
    from_disk: list[bool]  # per entry: its contents come from the disk tier

    @property
    def disk_reads(self) -> list[tuple[int, Entry]]:
        """(index in the run, reserved entry) of each page to read from disk, in run order."""
        return [(i, entry) for i, (entry, disk) in enumerate(zip(self.entries, self.from_disk)) if disk]


class LookupHit(NamedTuple):
    """A lookup's usable run (the fields of TierFound), pinned until `release`."""

    pages: list[int]  # CPU-tier page entries, in sequence order
    from_disk: list[bool]  # per page: read from the disk tier for this lookup
    state_entry: int | None  # hybrid: the checkpoint after the last page


class Reserved(NamedTuple):
    """Where the ranks copy an offload (the fields of TierReserved)."""

    entries: list[int | None]  # one per key: a page entry, or None (held already, or no room)
    state_entry: int | None  # the last page's checkpoint, if asked and granted


class Committed(NamedTuple):
    """What a commit leaves for the disk: entries to write (each pinned until write_done)."""

    to_write: list[Entry]
    skipped: int  # entries the disk lacks that found no room in the write queue


class TierPolicy:
    """The CPU tier's pins, reservations and commits for the cache worker's messages.

    Owns `cpu` (the index) and the records of lookups and offloads in flight.
    `disk` is None without a disk tier; the policy only asks it what it holds.
    """

    def __init__(self, cpu: CpuTier, disk: DiskIndex | None):
        self.cpu: CpuTier = cpu
        self.disk: DiskIndex | None = disk
        self.counters: PolicyCounters = PolicyCounters()
        self.lookup_pins: dict[int, list[Entry]] = {}  # lookup id -> entries it pinned, until release
        self.offloads: dict[int, Offload] = {}  # offload id -> its reservations, until commit

    def begin_lookup(self, lookup_id: int, keys: list[bytes], need_state: bool,
                     parent: bytes | None = None) -> LookupPlan:  # fmt: skip
        """Pin the longest run of `keys` held by a tier; reserve entries for its disk-only pages.

            parent  keys   [ cpu | cpu | disk | cpu | disk | (absent) ...
                    run    [ pinned ........................ ]            hybrid: ends at a page with a checkpoint

        `parent` is the key of the page before keys[0] (None: keys[0] is a
        prompt's first page). The run stops early where no entry can be had
        for a disk page. A malformed lookup (reused id, bad key size) is
        counted and plans nothing. Mutates `cpu`; the plan must be passed to
        finish_lookup.
        """
        self.counters.lookups += 1
        bad_key = any(len(k) != KEY_BYTES for k in keys) or (parent is not None and len(parent) != KEY_BYTES)
        if lookup_id in self.lookup_pins or bad_key:
            self.counters.malformed += 1
            return LookupPlan(lookup_id, need_state, [], [])
        parent = self.cpu.root if parent is None else parent
        entries, from_disk = self._pin_run(self._held_run(keys, need_state, parent), need_state, parent)
        return LookupPlan(lookup_id, need_state, entries, from_disk)

    def finish_lookup(self, plan: LookupPlan, failed_at: int | None) -> LookupHit | None:
        """The disk reads ran: `failed_at` is the run index of the first read that failed, or None.

            run    [ 0 ........ failed_at-1 | failed_at ....... ]
                     filled, kept             unpinned (reserved ones dropped)

        A hybrid run is then cut back to its deepest checkpoint. Returns the
        hit, pinned under `plan.lookup_id` until release, or None (nothing pinned).
        """
        assert failed_at is None or plan.from_disk[failed_at], "only a disk read can fail"
        entries, from_disk = plan.entries, plan.from_disk
        end = len(entries) if failed_at is None else failed_at
        for entry in entries[:end]:
            if not entry.valid:
                self.cpu.fill(entry)
        if failed_at is not None:
            self.counters.disk_read_failed += 1
            self._unpin_all(entries[failed_at:])
        entries, from_disk = entries[:end], from_disk[:end]
        if plan.need_state:
            entries, from_disk = self._cut_to_state(entries, from_disk)
        if not entries:
            return None
        for entry in entries:
            self.cpu.touch(entry)
        self.lookup_pins[plan.lookup_id] = entries
        self.counters.hit_pages_cpu += sum(1 for d in from_disk if not d)
        self.counters.hit_pages_disk += sum(from_disk)
        state = entries[-1].checkpoint if plan.need_state else None
        return LookupHit([e.page for e in entries], from_disk, state)

    def release(self, lookup_id: int) -> None:
        """Unpin a hit's entries (deepest first); an id with no hit is counted malformed."""
        entries = self.lookup_pins.pop(lookup_id, None)
        if entries is None:
            self.counters.malformed += 1
            return
        self._unpin_all(entries)

    def _held_run(self, keys: list[bytes], need_state: bool, parent: bytes) -> list[tuple[bytes, Entry | None]]:
        """The leading keys held by a tier: (key, CPU entry) or (key, None) for disk-only ones.

        Tells the disk index each disk-only key's parent (it forgets them across restarts).
        """
        run: list[tuple[bytes, Entry | None]] = []
        last_state = -1
        for key in keys:
            entry = self.cpu.get(key)
            if entry is not None:
                has_state = entry.checkpoint is not None
            elif key not in self.cpu.entries and self.disk is not None and self.disk.contains(key):
                has_state = self.disk.has_state(key)
                self.disk.link(key, parent)
            else:
                break
            run.append((key, entry))
            parent = key
            if has_state:
                last_state = len(run) - 1
        return run[: last_state + 1] if need_state else run

    def _pin_run(self, run: list[tuple[bytes, Entry | None]], need_state: bool,
                 parent: bytes) -> tuple[list[Entry], list[bool]]:  # fmt: skip
        """Pin the run's CPU entries, then reserve entries for its disk ones; stops where none can be had.

        Pinning first keeps a disk page's reservation from evicting a CPU page
        of the same run (a leaf of the run's chain may be the likeliest victim).
        """
        for _, entry in run:
            if entry is not None:
                self.cpu.pin(entry)
        entries: list[Entry] = []
        for i, (key, entry) in enumerate(run):
            if entry is None:
                entry = self.cpu.reserve(key, run[i - 1][0] if i else parent)
                if entry is not None and need_state and i == len(run) - 1 and self.cpu.reserve_state(entry) is None:
                    self.cpu.drop(entry)
                    entry = None
                if entry is None:
                    self._unpin_all([e for _, e in run[i:] if e is not None])
                    break
            entries.append(entry)
        return entries, [not entry.valid for entry in entries]

    def _cut_to_state(self, entries: list[Entry], from_disk: list[bool]) -> tuple[list[Entry], list[bool]]:
        """A hybrid run must end at a checkpoint: cut back to the deepest entry with a state."""
        keep = len(entries)
        while keep and entries[keep - 1].checkpoint is None:
            keep -= 1
        self._unpin_all(entries[keep:])
        return entries[:keep], from_disk[:keep]

    def reserve(self, offload_id: int, keys: list[bytes], state: bool) -> Reserved:
        """Reserve entries for the keys not held yet, keys[0] being a prompt's first page.

            keys     [ held | new | held | new | (no room) ... ]
            entries  [ None | e1  | None | e2  | None ...      ]

        `state`: also a state entry for the last key's checkpoint. On a hybrid
        tier that is all or nothing: pages past the deepest checkpoint serve
        no hit, so without room for every new page and the checkpoint nothing
        is reserved (and nothing the chain holds is evicted). Without `state`
        it stops at the first key no entry can take. Mutates `cpu` and records
        the offload until commit; a malformed reserve (reused id, bad key size)
        is counted and reserves nothing.
        """
        if offload_id in self.offloads or any(len(k) != KEY_BYTES for k in keys):
            self.counters.malformed += 1
            return Reserved([None] * len(keys), None)
        held = [self.cpu.entries.get(key) for key in keys]
        skipped = [entry for entry in held if entry is not None]
        for entry in skipped:  # pinned while reserving, so making room never evicts the chain's own pages
            self.cpu.pin(entry)
        if state and self.cpu.checkpoints and not self._room_for(held):
            self.cpu.counters.store_refused += 1
            self._unpin_all(skipped)
            return Reserved([None] * len(keys), None)
        out, new = self._reserve_pages(keys, held)
        state_of, state_entry = self._reserve_state(keys, state, out)
        self._unpin_all(skipped)
        if new or state_of is not None:
            self.offloads[offload_id] = Offload(new, state_of)
        return Reserved(out, state_entry)

    def _room_for(self, held: list[Entry | None]) -> bool:
        """Make room for a hybrid offload's new pages and the last page's checkpoint, if it lacks one."""
        last = held[-1] if held else None
        needs_state = bool(held) and (last is None or (last.valid and last.state is None))
        return self.cpu.make_room(sum(entry is None for entry in held), int(needs_state))

    def _reserve_pages(self, keys: list[bytes], held: list[Entry | None]) -> tuple[list[int | None], list[Entry]]:
        """Page entries for the keys not held, in chain order, until one finds no room."""
        out: list[int | None] = []
        new: list[Entry] = []
        parent = self.cpu.root
        for key, entry in zip(keys, held):
            if entry is not None:
                self.cpu.counters.store_skipped += 1
                out.append(None)
            else:
                entry = self.cpu.reserve(key, parent)
                if entry is None:
                    self.cpu.counters.store_refused += 1
                    break
                out.append(entry.page)
                new.append(entry)
            parent = key
        return out + [None] * (len(keys) - len(out)), new

    def _reserve_state(self, keys: list[bytes], state: bool, out: list[int | None]) -> tuple[Entry | None, int | None]:
        """A state entry for the last key's checkpoint, when asked and the page is (being) stored.

        Returns (the existing entry that got it and is now pinned by the offload, or
        None when the page entry is the offload's own; the state entry, or None).
        """
        if not state or not keys:
            return None, None
        last = self.cpu.entries.get(keys[-1])
        if last is None or last.state is not None:
            return None, None
        fresh = out[-1] is not None  # reserved by this very message (pinned already)
        if not fresh:
            if not last.valid:
                return None, None  # another store is filling it; its own checkpoint comes with it
            self.cpu.pin(last)
        state_entry = self.cpu.reserve_state(last)
        if state_entry is None:
            if not fresh:
                self.cpu.unpin(last)
            return None, None
        return (None if fresh else last), state_entry

    def commit(self, offload_id: int, ok: bool, write_room: int) -> Committed:
        """The ranks copied (ok) or failed: make the offload's entries valid, or free them.

        Of the entries made valid that the disk lacks, the first `write_room`
        stay pinned for their disk write (call write_done after each); the rest
        are skipped. An unknown id is counted malformed and commits nothing.
        """
        offload = self.offloads.pop(offload_id, None)
        if offload is None:
            self.counters.malformed += 1
            return Committed([], 0)
        for entry in offload.new:
            if ok:
                self.cpu.fill(entry)
                self.cpu.counters.stores += 1
                self.cpu.counters.state_stores += entry.state is not None
            else:
                self.cpu.counters.rolled_back += 1
        if offload.state_of is not None:
            if ok:
                self.cpu.fill_state(offload.state_of)
                self.cpu.counters.state_stores += 1
            else:
                self.cpu.drop_state(offload.state_of)
        committed = offload.new + ([offload.state_of] if offload.state_of is not None else [])
        wanted = [entry for entry in committed if ok and self.needs_write(entry)]
        to_write = wanted[: max(0, write_room)]
        for entry in to_write:
            self.cpu.pin(entry)  # the write reads the entry's bytes; it must not be reused or moved meanwhile
        self._unpin_all(committed)
        return Committed(to_write, len(wanted) - len(to_write))

    def needs_write(self, entry: Entry) -> bool:
        """Whether the disk tier lacks `entry` (or the checkpoint it carries now). Mutates nothing."""
        if self.disk is None:
            return False
        # the disk has it: a prefetched entry, or written before; a state still being stored does not count
        return not (self.disk.contains(entry.key) and (entry.checkpoint is None or self.disk.has_state(entry.key)))

    def write_done(self, entry: Entry) -> None:
        """An entry commit kept for the disk was written (or the write failed): drop its pin."""
        self._unpin_all([entry])

    def _unpin_all(self, entries: list[Entry]) -> None:
        """Unpin deepest first: a reservation left empty is dropped as a leaf, before its parent."""
        for entry in reversed(entries):
            self.cpu.unpin(entry)
