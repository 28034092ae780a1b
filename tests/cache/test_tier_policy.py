"""TierPolicy without a worker, asyncio or files: a CpuTier and a dict standing in for the disk index.

`policy(state_units=0)` is a dense model's tier (pages only), the default a
hybrid one whose checkpoints take one unit. Keys listed together form one
chain, the first a prompt's first page. Disk reads are played by `lookup`: it
reports the first key in `bad` as the failed read, and forgets that file as
DiskTier does with a corrupt one.
"""

import pytest

from hkv.cache.cpu_tier import CpuTier
from hkv.cache.tier_policy import Committed, LookupHit, Reserved, TierPolicy

ROOT = bytes(16)


def key(i: int) -> bytes:
    return bytes([0x50 + i]) + i.to_bytes(15, "little")


class FakeDisk:
    """The disk tier's index: key -> whether its file carries a checkpoint."""

    def __init__(self):
        self.files: dict[bytes, bool] = {}
        self.links: dict[bytes, bytes] = {}  # what lookups told it: key -> parent

    def contains(self, k: bytes) -> bool:
        return k in self.files

    def has_state(self, k: bytes) -> bool:
        return self.files.get(k, False)

    def link(self, k: bytes, parent: bytes) -> None:
        self.links[k] = parent


def policy(units=6, state_units=1, disk=True) -> TierPolicy:
    """A CPU tier of `units` page units, a checkpoint taking `state_units` of them (0: dense)."""
    return TierPolicy(CpuTier(units, state_units, ROOT, lambda src, dst: None), FakeDisk() if disk else None)


def store(p: TierPolicy, offload_id: int, indexes: list[int], state=False, ok=True, room=16) -> Reserved:
    """An offload as the ranks run it: reserve, (copy), commit; the disk writes it leaves are done at once."""
    got = p.reserve(offload_id, [key(i) for i in indexes], state)
    p.cpu.check()
    for entry in p.commit(offload_id, ok, room).to_write:
        p.disk.files[entry.key] = entry.checkpoint is not None
        p.write_done(entry)
    p.cpu.check()
    return got


def lookup(p: TierPolicy, lookup_id: int, indexes: list[int], need_state=False, bad=(),
           parent: int | None = None) -> LookupHit | None:  # fmt: skip
    """begin_lookup, the disk reads (the first key in `bad` fails), finish_lookup."""
    plan = p.begin_lookup(lookup_id, [key(i) for i in indexes], need_state, None if parent is None else key(parent))
    p.cpu.check()
    failed_at = None
    for i, entry in plan.disk_reads:
        if entry.key in {key(b) for b in bad}:
            del p.disk.files[entry.key]
            failed_at = i
            break
    hit = p.finish_lookup(plan, failed_at)
    p.cpu.check()
    return hit


def pins(p: TierPolicy, indexes: list[int]) -> list[int]:
    return [p.cpu.entries[key(i)].pins for i in indexes]


def test_reserve_hands_out_entries_for_new_keys():
    p = policy(state_units=0, disk=False)
    assert p.reserve(1, [key(0), key(1), key(2)], False) == Reserved([0, 1, 2], None)
    p.cpu.check()
    assert [e.key for e in p.offloads[1].new] == [key(0), key(1), key(2)] and p.offloads[1].state_of is None
    assert [p.cpu.entries[key(i)].parent for i in range(3)] == [ROOT, key(0), key(1)]
    assert all(p.cpu.entries[key(i)].pins == 1 and not p.cpu.entries[key(i)].valid for i in range(3))


def test_reserve_skips_keys_held_or_in_flight():
    p = policy(state_units=0, disk=False)
    store(p, 1, [0, 1])  # valid
    assert p.reserve(2, [key(0), key(1), key(2)], False) == Reserved([None, None, 2], None)  # in flight
    assert p.reserve(3, [key(0), key(1), key(2), key(3)], False) == Reserved([None, None, None, 3], None)
    p.cpu.check()
    assert p.cpu.counters.store_skipped == 5 and [e.key for e in p.offloads[3].new] == [key(3)]


def test_reserve_stops_at_the_first_key_with_no_room():
    p = policy(units=2, state_units=0, disk=False)
    p.reserve(1, [key(0)], False)  # unit 0, pinned
    assert p.reserve(2, [key(5), key(6), key(7)], False) == Reserved([1, None, None], None)
    p.cpu.check()
    assert p.cpu.counters.store_refused == 1 and key(6) not in p.cpu.entries
    # nothing reserved at all: no offload is recorded
    assert p.reserve(3, [key(8)], False) == Reserved([None], None)
    assert 3 not in p.offloads
    p.cpu.check()


def test_reserve_never_evicts_a_key_it_skipped_as_held():
    p = policy(units=2, state_units=0, disk=False)
    store(p, 1, [0])  # valid and evictable
    got = p.reserve(2, [key(0), key(1), key(2)], False)
    p.cpu.check()
    # key 0 was reported held (None), so the router does not copy it: it must still be there
    assert got == Reserved([None, 1, None], None)
    assert p.cpu.get(key(0)) is not None, f"key 0 was evicted for the same store: {got}"


def test_a_committed_chain_goes_from_its_deep_end():
    """The old commit unpinned a chain first page first, making page 0 the least recently used:
    the first eviction made the rest of the chain unreachable. Now only leaves go."""
    p = policy(units=4, state_units=0, disk=False)
    store(p, 1, [0, 1, 2])
    store(p, 2, [3])
    order = []
    for new in (10, 11, 12, 13):
        store(p, new, [new])
        order += [i for i in (0, 1, 2, 3) if key(i) not in p.cpu.entries and i not in order]
    assert order == [2, 1, 0, 3]


def test_reserve_with_a_state_for_a_fresh_last_page():
    p = policy(disk=False)
    assert p.reserve(1, [key(0), key(1)], True) == Reserved([0, 1], 2)
    p.cpu.check()
    assert p.cpu.entries[key(1)].state == 2 and p.offloads[1].state_of is None


def test_reserve_with_a_state_for_a_cached_interior_page():
    p = policy(disk=False)
    store(p, 1, [0, 1, 2], state=True)  # units 0-2, its checkpoint in unit 3
    assert p.reserve(2, [key(0), key(1)], True) == Reserved([None, None], 4)
    p.cpu.check()
    page = p.cpu.entries[key(1)]
    assert p.offloads[2].new == [] and p.offloads[2].state_of is page and page.pins == 1 and page.state == 4
    assert p.commit(2, True, 16) == Committed([], 0)
    p.cpu.check()
    assert page.pins == 0 and page.checkpoint == 4 and p.cpu.counters.state_stores == 2
    # the same again: it has a state now, nothing to reserve
    assert p.reserve(3, [key(0), key(1)], True) == Reserved([None, None], None)
    p.cpu.check()


def test_a_hybrid_reserve_is_all_or_nothing():
    """Pages past the deepest checkpoint serve no hit: without room for the checkpoint, nothing."""
    p = policy(units=4, disk=False)
    store(p, 1, [0, 1], state=True)
    assert lookup(p, 2, [0, 1], need_state=True) == LookupHit([0, 1], [False, False], 2)  # pinned now
    assert p.reserve(3, [key(5), key(6)], True) == Reserved([None, None], None)
    p.cpu.check()
    assert 3 not in p.offloads and sorted(p.cpu.entries) == [key(0), key(1)] and p.cpu.counters.store_refused == 1
    p.release(2)
    assert p.reserve(4, [key(5), key(6)], True) == Reserved([0, 1], 2)  # chain 0-1 gave up its units
    p.cpu.check()
    assert p.cpu.counters.evicted_states == 1 and p.cpu.counters.evicted_pages == 2


def test_a_failed_state_only_offload_drops_the_state():
    p = policy(disk=False)
    store(p, 1, [0, 1], state=True)
    p.reserve(2, [key(0)], True)
    p.commit(2, False, 16)
    p.cpu.check()
    assert p.cpu.get(key(0)).state is None and p.cpu.free_states == 3 and p.cpu.get(key(0)).pins == 0


def test_reserve_gives_no_state_for_a_page_another_store_is_filling():
    p = policy(disk=False)
    p.reserve(1, [key(0)], True)
    assert p.reserve(2, [key(0)], True) == Reserved([None], None)
    assert 2 not in p.offloads
    p.cpu.check()


def test_reserve_gives_nothing_when_the_room_is_pinned():
    p = policy(units=3, disk=False)
    p.reserve(1, [key(0)], True)  # a page and its checkpoint, in flight
    assert p.reserve(2, [key(1)], True) == Reserved([None], None)
    assert 2 not in p.offloads and p.cpu.free_pages == 1
    p.cpu.check()


def test_malformed_reserves_are_counted_and_change_nothing():
    p = policy(disk=False)
    p.reserve(1, [key(0)], False)
    assert p.reserve(1, [key(1)], False) == Reserved([None], None)  # duplicate id
    assert p.reserve(2, [b"short", key(2)], False) == Reserved([None, None], None)
    assert p.counters.malformed == 2 and sorted(p.cpu.entries) == [key(0)]
    p.cpu.check()


def test_commit_ok_fills_and_keeps_what_the_disk_lacks_pinned_for_writing():
    p = policy()
    p.disk.files[key(0)] = False  # on disk already (the CPU entry was evicted, the file stayed)
    p.reserve(1, [key(0), key(1), key(2)], True)
    committed = p.commit(1, True, 16)
    p.cpu.check()
    entries = [p.cpu.get(key(i)) for i in range(3)]
    assert committed == Committed(entries[1:], 0) and all(e.valid for e in entries)
    assert pins(p, [0, 1, 2]) == [0, 1, 1] and entries[2].checkpoint == 3
    assert p.cpu.counters.stores == 3 and p.cpu.counters.state_stores == 1 and p.offloads == {}
    for entry in committed.to_write:
        p.write_done(entry)
    assert pins(p, [0, 1, 2]) == [0, 0, 0]
    p.cpu.check()


def test_commit_keeps_only_write_room_entries_and_counts_the_rest():
    p = policy(state_units=0)
    p.reserve(1, [key(0), key(1), key(2)], False)
    assert p.commit(1, True, 1) == Committed([p.cpu.get(key(0))], 2)
    assert pins(p, [0, 1, 2]) == [1, 0, 0]
    p.cpu.check()


def test_commit_not_ok_frees_the_reservations():
    p = policy()
    p.reserve(1, [key(0), key(1)], True)
    assert p.commit(1, False, 16) == Committed([], 0)
    p.cpu.check()
    assert p.cpu.entries == {} and (p.cpu.free_pages, p.cpu.free_states) == (6, 6)
    assert p.cpu.counters.rolled_back == 2 and p.cpu.counters.stores == 0


def test_commit_of_an_unknown_offload_is_malformed():
    p = policy()
    assert p.commit(5, True, 16) == Committed([], 0)
    store(p, 1, [0], state=True)
    p.commit(1, True, 16)  # twice
    assert p.counters.malformed == 2
    p.cpu.check()


def test_a_hybrid_store_without_its_checkpoint_is_pruned_at_commit():
    p = policy(disk=False)
    store(p, 1, [0, 1], state=True)
    store(p, 2, [0, 1, 2, 3])  # pages past page 1's checkpoint, none of their own
    assert sorted(p.cpu.entries) == [key(0), key(1)] and p.cpu.counters.pruned_pages == 2
    assert p.cpu.counters.stores == 4


def test_needs_write_skips_what_the_disk_has():
    p = policy()
    store(p, 1, [0, 1], state=True)
    entry = p.cpu.get(key(0))
    assert p.disk.files == {key(0): False, key(1): True} and not p.needs_write(entry)
    # a state still being stored does not count
    p.cpu.pin(entry)
    p.cpu.reserve_state(entry)
    assert not p.needs_write(entry)
    # once it arrived, the disk copy is worse than the entry: written again
    p.cpu.fill_state(entry)
    assert p.needs_write(entry)
    p.disk.files[key(0)] = True
    assert not p.needs_write(entry)
    p.cpu.unpin(entry)
    p.cpu.check()


def test_no_disk_no_writes():
    p = policy(state_units=0, disk=False)
    p.reserve(1, [key(0)], False)
    assert p.commit(1, True, 16) == Committed([], 0) and p.cpu.get(key(0)).pins == 0
    assert not p.needs_write(p.cpu.get(key(0)))


def test_lookup_pins_the_cpu_run_until_release():
    p = policy(units=4, state_units=0, disk=False)
    store(p, 1, [0, 1, 2])
    assert lookup(p, 7, [0, 1, 2, 3, 1]) == LookupHit([0, 1, 2], [False, False, False], None)
    assert pins(p, [0, 1, 2]) == [1, 1, 1]
    assert p.counters.lookups == 1 and p.counters.hit_pages_cpu == 3
    # pinned: a flush and a full tier leave them alone
    assert p.cpu.flush() == (0, 0)
    p.cpu.check()
    assert p.reserve(2, [key(5)], False) == Reserved([3], None)
    assert p.reserve(3, [key(6)], False) == Reserved([None], None)
    p.commit(2, True, 16)
    p.release(7)
    p.cpu.check()
    assert pins(p, [0, 1, 2]) == [0, 0, 0]
    # key 5 came after the hit, but was never hit itself: it goes first, then the chain from its deep end
    order = []
    for new in (10, 11, 12, 13):
        p.reserve(new, [key(new)], False)
        order += [i for i in (5, 2, 1, 0) if key(i) not in p.cpu.entries and i not in order]
    assert order == [5, 2, 1, 0]


def test_lookup_with_nothing_found_pins_nothing():
    p = policy()
    assert lookup(p, 1, [0]) is None
    assert p.lookup_pins == {} and p.counters.lookups == 1
    p.release(1)  # nothing was pinned: malformed
    assert p.counters.malformed == 1


def test_lookup_plans_disk_reads_into_fresh_entries_after_pinning_the_cpu_ones():
    p = policy(state_units=0)
    store(p, 1, [0])
    p.disk.files.update({key(1): False, key(2): False})
    plan = p.begin_lookup(4, [key(0), key(1), key(2)], False)
    assert [e.key for e in plan.entries] == [key(0), key(1), key(2)] and plan.from_disk == [False, True, True]
    assert [(i, e.key, e.page, e.parent, e.valid, e.pins) for i, e in plan.disk_reads] == [
        (1, key(1), 1, key(0), False, 1), (2, key(2), 2, key(1), False, 1)]
    assert p.disk.links == {key(1): key(0), key(2): key(1)}  # the disk learns its chains from lookups
    assert p.finish_lookup(plan, None) == LookupHit([0, 1, 2], [False, True, True], None)
    p.cpu.check()
    assert all(p.cpu.get(key(i)).pins == 1 for i in range(3))
    assert (p.counters.hit_pages_cpu, p.counters.hit_pages_disk) == (1, 2)
    p.release(4)
    # now all three are CPU hits
    assert lookup(p, 5, [0, 1, 2]).from_disk == [False, False, False]
    p.release(5)
    p.cpu.check()


def test_a_run_past_the_device_hit_hangs_under_its_parent():
    p = policy(state_units=0)
    store(p, 1, [0])
    p.disk.files.update({key(1): False, key(2): False})
    assert lookup(p, 2, [2], parent=1) == LookupHit([1], [True], None)  # page 1 is on the device only
    assert (p.cpu.entries[key(2)].parent, p.cpu.entries[key(2)].anchored) == (key(1), False)
    p.release(2)
    assert lookup(p, 3, [1], parent=0) == LookupHit([2], [True], None)
    assert p.cpu.entries[key(1)].anchored and p.cpu.coverage() == (3, 3)  # the chain is whole again
    p.release(3)
    p.cpu.check()


def test_lookup_reserves_a_state_for_a_checkpoint_on_disk():
    p = policy()
    p.disk.files.update({key(0): False, key(1): True})
    plan = p.begin_lookup(1, [key(0), key(1)], True)
    assert [(i, e.state) for i, e in plan.disk_reads] == [(0, None), (1, 2)]
    assert p.finish_lookup(plan, None) == LookupHit([0, 1], [True, True], 2)
    assert p.cpu.get(key(1)).checkpoint == 2 and p.cpu.get(key(0)).state is None
    p.release(1)
    p.cpu.check()


def test_hybrid_lookup_cuts_back_to_the_deepest_checkpoint():
    p = policy()
    store(p, 1, [0, 1, 2], state=True)
    p.disk.files.update({key(3): False, key(4): False})  # on disk, no checkpoint after them
    assert lookup(p, 3, [0, 1, 2, 3, 4], need_state=True) == LookupHit([0, 1, 2], [False] * 3, 3)
    assert key(3) not in p.cpu.entries and p.cpu.free_pages == 2
    # no checkpoint anywhere: nothing
    assert lookup(p, 4, [3, 4], need_state=True) is None
    p.release(3)
    p.cpu.check()


def test_a_checkpoint_being_stored_is_not_served():
    p = policy(disk=False)
    store(p, 1, [0, 1, 2], state=True)
    assert p.reserve(2, [key(0), key(1)], True) == Reserved([None, None], 4)  # a state for the cached page 1
    assert lookup(p, 3, [0, 1], need_state=True) is None
    p.commit(2, True, 16)
    p.cpu.check()
    assert lookup(p, 4, [0, 1], need_state=True) == LookupHit([0, 1], [False, False], 4)
    p.release(4)
    p.cpu.check()


def test_a_failed_state_store_leaves_the_pages_served_without_it():
    p = policy(disk=False)
    store(p, 1, [0, 1, 2], state=True)
    p.reserve(2, [key(0), key(1)], True)
    p.commit(2, False, 16)
    p.cpu.check()
    assert lookup(p, 3, [0, 1]) == LookupHit([0, 1], [False, False], None)
    assert lookup(p, 4, [0, 1], need_state=True) is None
    p.release(3)
    p.cpu.check()


def test_a_failed_read_ends_the_run_before_it_and_frees_what_was_reserved_after():
    p = policy(state_units=0)
    store(p, 1, [0])
    p.disk.files.update({key(1): False, key(2): False})
    assert lookup(p, 3, [0, 1, 2], bad=[1]) == LookupHit([0], [False], None)
    assert p.counters.disk_read_failed == 1 and p.counters.hit_pages_disk == 0
    assert key(1) not in p.cpu.entries and key(2) not in p.cpu.entries and p.cpu.free_pages == 5
    p.release(3)
    p.cpu.check()


def test_hybrid_lookup_cuts_back_when_the_checkpoint_read_fails():
    p = policy()
    store(p, 1, [0], state=True)
    p.disk.files[key(1)] = True
    assert lookup(p, 2, [0, 1], need_state=True, bad=[1]) == LookupHit([0], [False], 1)
    assert p.counters.disk_read_failed == 1 and key(1) not in p.cpu.entries
    assert (p.cpu.free_pages, p.cpu.free_states) == (4, 4)
    p.release(2)
    p.cpu.check()


def test_finish_lookup_refuses_a_failure_that_was_no_disk_read():
    p = policy(state_units=0)
    store(p, 1, [0])
    plan = p.begin_lookup(1, [key(0)], False)
    with pytest.raises(AssertionError, match="only a disk read"):
        p.finish_lookup(plan, 0)


def test_lookup_stops_where_no_entry_can_be_had_for_a_disk_page():
    p = policy(units=1, state_units=0)
    store(p, 1, [0])
    p.disk.files[key(1)] = False
    assert lookup(p, 1, [0, 1]) == LookupHit([0], [False], None) and key(1) not in p.cpu.entries
    p.release(1)
    p.cpu.check()


def test_lookup_stops_at_a_page_another_store_is_filling():
    p = policy(state_units=0)
    store(p, 1, [0])
    p.reserve(2, [key(0), key(1)], False)
    p.disk.files[key(1)] = False
    assert lookup(p, 3, [0, 1]).pages == [0]
    p.release(3)
    p.cpu.check()


def test_a_disk_prefetch_never_evicts_a_cpu_page_of_its_own_run():
    p = policy(units=3, state_units=0)
    store(p, 1, [0, 1])  # the least recently used leaf: page 1
    store(p, 2, [6])
    p.disk.files[key(2)] = False
    hit = lookup(p, 3, [0, 1, 2])  # page 2 from disk: its entry may take page 6's unit, never page 1's
    assert hit == LookupHit([0, 1, 2], [False, False, True], None) and key(6) not in p.cpu.entries
    for i, entry in enumerate(hit.pages):
        held = p.cpu.entries.get(key(i))
        assert held is not None and held.page == entry, f"page {i}: entry {entry} is not key {i}'s ({hit})"
    assert len(set(hit.pages)) == len(hit.pages), f"one entry serves two pages: {hit}"


def test_malformed_lookups_are_counted():
    p = policy(state_units=0, disk=False)
    store(p, 1, [0])
    lookup(p, 1, [0])
    assert lookup(p, 1, [0]) is None  # id pinned already
    assert p.finish_lookup(p.begin_lookup(2, [b"\x01" * 8], False), None) is None
    assert p.finish_lookup(p.begin_lookup(3, [key(0)], False, b"\x02" * 4), None) is None  # a bad parent key
    p.release(9)
    assert p.counters.malformed == 4 and p.cpu.get(key(0)).pins == 1
    p.release(1)
    p.release(1)
    assert p.counters.malformed == 5 and p.cpu.get(key(0)).pins == 0
    p.cpu.check()
