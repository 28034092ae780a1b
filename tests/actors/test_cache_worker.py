"""CacheWorker's handlers without processes or sockets: a real HostPool over a bytearray and a real DiskTier."""

import asyncio
import os

import pytest

from hkv.actors.cache_worker import CacheWorker, Counters
from hkv.cache.cpu_tier import CpuTier
from hkv.cache.disk import DiskTier
from hkv.ipc import json_block
from hkv.ipc.messages import TierFlushed, TierFound, TierLookup, TierReserve, TierReserved
from hkv.storage.host_pool import HostLayout, HostPool

FP = bytes(range(16))


def key(i: int) -> bytes:
    return bytes([0x50 + i]) + i.to_bytes(15, "little")


def layout(pages: int, states: int) -> HostLayout:
    """Page entry: [2, 1 layer, 2 tokens, 1 head, 4] fp32 = 64 bytes; state entry: 2 + 4 floats = 24 bytes."""
    return HostLayout(num_pages=pages, num_states=states, kv_layers=1, page_size=2, kv_heads=1, head_dim=4,
                      kv_dtype="float32", lin_layers=1, conv_dim=2, conv_width=1, v_heads=1, k_dim=2, v_dim=2)


def make_worker(tmp_path, pages=4, states=2, disk=True) -> CacheWorker:
    """What CacheWorker.__init__ builds, minus the sockets."""
    lay = layout(pages, states)
    worker = CacheWorker.__new__(CacheWorker)
    worker.layout = lay
    worker.host = HostPool(lay, memoryview(bytearray(lay.nbytes)))
    worker.cpu = CpuTier(lay.num_pages, lay.num_states)
    worker.disk = None
    if disk:
        worker.disk = DiskTier(tmp_path / "disk", 10**6, FP, lay.descriptor, lay.page_bytes, lay.state_bytes)
        worker.disk.open()
    worker.stats_block = memoryview(bytearray(64 * 1024))
    worker.counters = Counters()
    worker.lookup_pins = {}
    worker.offloads = {}
    worker.lookups = asyncio.Queue(maxsize=1024)
    worker.writes = asyncio.Queue(maxsize=16)
    worker.changed = asyncio.Event()
    return worker


@pytest.fixture
def worker(tmp_path):
    made = []

    def build(**kw) -> CacheWorker:
        made.append(make_worker(tmp_path / str(len(made)), **kw))
        return made[-1]

    yield build
    for w in made:
        if w.disk is not None:
            w.disk.close()


def page_bytes(i: int) -> bytes:
    return bytes((i * 31 + j) % 251 for j in range(64))


def state_bytes(i: int) -> bytes:
    return bytes((i * 17 + j + 1) % 251 for j in range(24))


def store(w: CacheWorker, offload_id: int, indexes: list[int], state=False, ok=True) -> TierReserved:
    """An offload as the ranks run it: reserve, write the entries' bytes, commit."""
    got = w.reserve(TierReserve(offload_id, [key(i) for i in indexes], state))
    w.cpu.check()
    for i, entry in zip(indexes, got.entries):
        if entry is not None:
            w.host.page_view(entry)[:] = page_bytes(i)
    if got.state_entry is not None:
        w.host.state_view(got.state_entry)[:] = state_bytes(indexes[-1])
    w.commit(offload_id, ok)
    w.cpu.check()
    return got


async def drain_writes(w: CacheWorker) -> None:
    while not w.writes.empty():
        await w._write(w.writes.get_nowait())
        w.cpu.check()


def entry_file(w: CacheWorker, k: bytes, has_state: bool) -> str:
    return w.disk._path(k, has_state)


# ---- reserve and commit ------------------------------------------------------------------------


def test_reserve_hands_out_entries_for_new_keys(worker):
    w = worker(disk=False)
    got = w.reserve(TierReserve(1, [key(0), key(1), key(2)], False))
    w.cpu.check()
    assert got == TierReserved(1, [0, 1, 2], None)
    assert [e.key for e in w.offloads[1].new] == [key(0), key(1), key(2)] and w.offloads[1].state_of is None
    assert all(w.cpu.entries[key(i)].pins == 1 and not w.cpu.entries[key(i)].valid for i in range(3))


def test_reserve_skips_keys_held_or_in_flight(worker):
    w = worker(disk=False)
    store(w, 1, [1])  # valid
    w.reserve(TierReserve(2, [key(2)], False))  # reserved by another offload, not filled yet
    got = w.reserve(TierReserve(3, [key(0), key(1), key(2), key(3)], False))
    w.cpu.check()
    assert got == TierReserved(3, [2, None, None, 3], None)
    assert w.cpu.counters.store_skipped == 2
    assert [e.key for e in w.offloads[3].new] == [key(0), key(3)]


def test_reserve_stops_at_the_first_key_with_no_room(worker):
    w = worker(pages=2, disk=False)
    w.reserve(TierReserve(1, [key(0)], False))  # page 0, pinned
    got = w.reserve(TierReserve(2, [key(1), key(2), key(0)], False))
    w.cpu.check()
    assert got == TierReserved(2, [1, None, None], None)
    assert w.cpu.counters.store_refused == 1 and key(2) not in w.cpu.entries
    # nothing reserved at all: no offload is recorded
    assert w.reserve(TierReserve(3, [key(3)], False)) == TierReserved(3, [None], None)
    assert 3 not in w.offloads
    w.cpu.check()


def test_reserve_never_evicts_a_key_it_skipped_as_held(worker):
    w = worker(pages=2, disk=False)
    store(w, 1, [0])  # valid and evictable
    got = w.reserve(TierReserve(2, [key(0), key(1), key(2)], False))
    w.cpu.check()
    # key 0 was reported held (None), so the router does not copy it: it must still be there
    assert got.entries[0] is None
    assert w.cpu.get(key(0)) is not None, f"key 0 was evicted for the same store: {got}"


def test_reserve_with_a_state_for_a_fresh_last_page(worker):
    w = worker(disk=False)
    got = w.reserve(TierReserve(1, [key(0), key(1)], True))
    w.cpu.check()
    assert got == TierReserved(1, [0, 1], 0)
    assert w.cpu.entries[key(1)].state == 0 and w.offloads[1].state_of is None


def test_reserve_with_a_state_for_a_cached_last_page(worker):
    w = worker(disk=False)
    store(w, 1, [0, 1])  # no state
    got = w.reserve(TierReserve(2, [key(0), key(1)], True))
    w.cpu.check()
    last = w.cpu.entries[key(1)]
    assert got == TierReserved(2, [None, None], 0)
    assert w.offloads[2].new == [] and w.offloads[2].state_of is last and last.pins == 1 and last.state == 0
    w.commit(2, True)
    w.cpu.check()
    assert last.pins == 0 and last.state == 0 and w.cpu.counters.state_stores == 1
    # the same again: it has a state now, nothing to reserve
    assert w.reserve(TierReserve(3, [key(0), key(1)], True)) == TierReserved(3, [None, None], None)
    w.cpu.check()


def test_a_failed_state_only_offload_drops_the_state(worker):
    w = worker(disk=False)
    store(w, 1, [0])
    w.reserve(TierReserve(2, [key(0)], True))
    w.commit(2, False)
    w.cpu.check()
    assert w.cpu.get(key(0)).state is None and w.cpu.free_states == 2 and w.cpu.get(key(0)).pins == 0


def test_reserve_gives_no_state_for_a_page_another_store_is_filling(worker):
    w = worker(disk=False)
    w.reserve(TierReserve(1, [key(0)], False))
    assert w.reserve(TierReserve(2, [key(0)], True)) == TierReserved(2, [None], None)
    assert 2 not in w.offloads
    w.cpu.check()


def test_reserve_gives_no_state_when_every_state_is_pinned(worker):
    w = worker(states=1, disk=False)
    w.reserve(TierReserve(1, [key(0)], True))  # takes the only state
    store(w, 2, [1])
    got = w.reserve(TierReserve(3, [key(1)], True))
    w.cpu.check()
    assert got == TierReserved(3, [None], None) and w.cpu.get(key(1)).pins == 0


def test_malformed_reserves_are_counted_and_change_nothing(worker):
    w = worker(disk=False)
    w.reserve(TierReserve(1, [key(0)], False))
    assert w.reserve(TierReserve(1, [key(1)], False)) == TierReserved(1, [None], None)  # duplicate id
    assert w.reserve(TierReserve(2, [b"short", key(2)], False)) == TierReserved(2, [None, None], None)
    assert w.counters.malformed == 2 and sorted(w.cpu.entries) == [key(0)]
    w.cpu.check()


def test_commit_ok_fills_and_queues_disk_writes(worker):
    w = worker()
    got = store(w, 1, [0, 1], state=True)
    assert got == TierReserved(1, [0, 1], 0)
    entries = [w.cpu.get(key(i)) for i in range(2)]
    assert all(e is not None and e.valid for e in entries)
    assert [e.pins for e in entries] == [1, 1]  # the queued writes read them
    assert w.cpu.counters.stores == 2 and w.cpu.counters.state_stores == 1
    assert w.counters.writes_queued == 2 and w.writes.qsize() == 2 and w.offloads == {}
    asyncio.run(drain_writes(w))
    assert [e.pins for e in entries] == [0, 0]
    assert w.disk.contains(key(0)) and not w.disk.has_state(key(0)) and w.disk.has_state(key(1))
    kv, st = bytearray(64), bytearray(24)
    assert w.disk.read_into(key(1), kv, st) is True and (bytes(kv), bytes(st)) == (page_bytes(1), state_bytes(1))
    w.disk.check_integrity()


def test_commit_not_ok_frees_the_reservations(worker):
    w = worker()
    store(w, 1, [0, 1], state=True, ok=False)
    assert w.cpu.entries == {} and (w.cpu.free_pages, w.cpu.free_states) == (4, 2)
    assert w.cpu.counters.rolled_back == 2 and w.cpu.counters.stores == 0 and w.writes.empty()


def test_commit_of_an_unknown_offload_is_malformed(worker):
    w = worker()
    w.commit(5, True)
    store(w, 1, [0])
    w.commit(1, True)  # twice
    assert w.counters.malformed == 2
    w.cpu.check()


def test_queue_write_skips_what_the_disk_has(worker):
    async def body():
        w = worker()
        store(w, 1, [0])
        await drain_writes(w)
        entry = w.cpu.get(key(0))
        w._queue_write(entry)  # on disk already
        assert w.writes.empty() and entry.pins == 0 and w.counters.writes_queued == 1
        # a state still being stored does not count
        w.cpu.pin(entry)
        w.cpu.reserve_state(entry)
        w._queue_write(entry)
        assert w.writes.empty() and entry.pins == 1
        # once it arrived, the disk copy is worse than the entry: written again
        w.cpu.fill_state(entry)
        w._queue_write(entry)
        assert w.writes.qsize() == 1 and entry.pins == 2
        await drain_writes(w)
        w.cpu.unpin(entry)
        w.cpu.check()
        assert w.disk.has_state(key(0)) and entry.pins == 0

    asyncio.run(body())


def test_queue_write_skips_when_the_queue_is_full(worker):
    w = worker()
    w.writes = asyncio.Queue(maxsize=1)
    store(w, 1, [0, 1])
    assert w.counters.writes_queued == 1 and w.counters.writes_skipped == 1
    assert [w.cpu.get(key(i)).pins for i in range(2)] == [1, 0]
    w.cpu.check()


def test_no_disk_no_writes(worker):
    w = worker(disk=False)
    store(w, 1, [0])
    assert w.writes.empty() and w.cpu.get(key(0)).pins == 0


# ---- lookups ------------------------------------------------------------------------------------


async def test_lookup_pins_the_cpu_run_until_release(worker):
    w = worker(disk=False)
    store(w, 1, [0, 1, 2])
    found = await w.lookup(TierLookup(7, 3, [key(0), key(1), key(2), key(3), key(1)], False))
    w.cpu.check()
    assert found == TierFound(7, 3, [0, 1, 2], [False, False, False], None)
    assert [w.cpu.get(key(i)).pins for i in range(3)] == [1, 1, 1]
    assert w.counters.lookups == 1 and w.counters.hit_pages_cpu == 3
    # pinned: a flush and a full tier leave them alone
    assert await w.flush(1) == TierFlushed(1, 0, 0, 0)
    w.cpu.check()
    assert w.reserve(TierReserve(2, [key(5)], False)) == TierReserved(2, [3], None)
    assert w.reserve(TierReserve(3, [key(6)], False)) == TierReserved(3, [None], None)
    w.commit(2, True)
    w.release(7)
    w.cpu.check()
    assert [w.cpu.get(key(i)).pins for i in range(3)] == [0, 0, 0]
    # unpinned deepest first: key 5 (stored before the release) goes first, then 2, 1, 0
    order = []
    for new in (10, 11, 12, 13):
        w.reserve(TierReserve(new, [key(new)], False))
        order += [i for i in (5, 2, 1, 0) if key(i) not in w.cpu.entries and i not in order]
    assert order == [5, 2, 1, 0]


async def test_lookup_with_nothing_found_pins_nothing(worker):
    w = worker()
    assert await w.lookup(TierLookup(1, 0, [key(0)], False)) == TierFound(1, 0, [], [], None)
    assert w.lookup_pins == {} and w.counters.lookups == 1
    w.release(1)  # nothing was pinned: malformed
    assert w.counters.malformed == 1


async def test_lookup_prefetches_disk_entries_into_fresh_cpu_entries(worker):
    w = worker()
    store(w, 1, [0])
    await drain_writes(w)
    for i in (1, 2):
        assert w.disk.write(key(i), page_bytes(i), None)
    found = await w.lookup(TierLookup(4, 0, [key(0), key(1), key(2)], False))
    w.cpu.check()
    assert found == TierFound(4, 0, [0, 1, 2], [False, True, True], None)
    for i, entry in enumerate(found.entries):
        assert bytes(w.host.page_view(entry)) == page_bytes(i)
        assert w.cpu.get(key(i)).pins == 1 and w.cpu.get(key(i)).page == entry
    assert (w.counters.hit_pages_cpu, w.counters.hit_pages_disk) == (1, 2)
    w.release(4)
    w.cpu.check()
    # now all three are CPU hits
    found = await w.lookup(TierLookup(5, 0, [key(0), key(1), key(2)], False))
    assert found.from_disk == [False, False, False]
    w.release(5)
    w.cpu.check()


async def test_lookup_prefetches_a_checkpoint_from_disk(worker):
    w = worker()
    assert w.disk.write(key(0), page_bytes(0), None)
    assert w.disk.write(key(1), page_bytes(1), state_bytes(1))
    found = await w.lookup(TierLookup(1, 0, [key(0), key(1)], True))
    w.cpu.check()
    assert found == TierFound(1, 0, [0, 1], [True, True], 0)
    assert bytes(w.host.state_view(0)) == state_bytes(1) and bytes(w.host.page_view(1)) == page_bytes(1)
    assert w.cpu.get(key(1)).state == 0 and w.cpu.get(key(0)).state is None
    w.release(1)
    w.cpu.check()


async def test_hybrid_lookup_cuts_back_to_the_deepest_checkpoint(worker):
    w = worker(disk=False)
    store(w, 1, [0, 1], state=True)  # checkpoint after page 1
    store(w, 2, [0, 1, 2, 3])  # pages 2 and 3, no checkpoint
    found = await w.lookup(TierLookup(3, 0, [key(i) for i in range(4)], True))
    w.cpu.check()
    assert found == TierFound(3, 0, [0, 1], [False, False], 0)
    assert w.cpu.get(key(2)).pins == 0 and w.cpu.get(key(3)).pins == 0
    # no checkpoint anywhere: nothing
    assert await w.lookup(TierLookup(4, 0, [key(2), key(3)], True)) == TierFound(4, 0, [], [], None)
    w.release(3)
    w.cpu.check()


async def test_a_checkpoint_being_stored_is_not_served(worker):
    w = worker(disk=False)
    store(w, 1, [0, 1])
    got = w.reserve(TierReserve(2, [key(0), key(1)], True))  # a state for the cached page 1
    assert got == TierReserved(2, [None, None], 0)
    assert await w.lookup(TierLookup(3, 0, [key(0), key(1)], True)) == TierFound(3, 0, [], [], None)
    w.cpu.check()
    w.commit(2, True)
    w.cpu.check()
    assert await w.lookup(TierLookup(4, 0, [key(0), key(1)], True)) == TierFound(4, 0, [0, 1], [False, False], 0)
    w.release(4)
    w.cpu.check()


async def test_a_failed_state_store_leaves_the_pages_served_without_it(worker):
    w = worker(disk=False)
    store(w, 1, [0, 1])
    w.reserve(TierReserve(2, [key(0), key(1)], True))
    w.commit(2, False)
    w.cpu.check()
    assert await w.lookup(TierLookup(3, 0, [key(0), key(1)], False)) == TierFound(3, 0, [0, 1], [False, False], None)
    assert await w.lookup(TierLookup(4, 0, [key(0), key(1)], True)) == TierFound(4, 0, [], [], None)
    w.release(3)
    w.cpu.check()


async def test_hybrid_lookup_cuts_back_when_the_checkpoint_read_fails(worker):
    w = worker()
    store(w, 1, [0], state=True)
    await drain_writes(w)
    assert w.disk.write(key(1), page_bytes(1), state_bytes(1))
    path = entry_file(w, key(1), True)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 10)
        f.write(b"\xff")
    found = await w.lookup(TierLookup(2, 0, [key(0), key(1)], True))
    w.cpu.check()
    assert found == TierFound(2, 0, [0], [False], 0)
    assert w.counters.disk_read_failed == 1 and key(1) not in w.cpu.entries and not w.disk.contains(key(1))
    assert (w.cpu.free_pages, w.cpu.free_states) == (3, 1)
    w.release(2)
    w.cpu.check()


async def test_lookup_stops_at_a_corrupt_disk_file(worker):
    w = worker()
    store(w, 1, [0])
    await drain_writes(w)
    for i in (1, 2):
        assert w.disk.write(key(i), page_bytes(i), None)
    path = entry_file(w, key(1), False)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 20)
        f.write(b"\x00\x00")
    found = await w.lookup(TierLookup(3, 0, [key(0), key(1), key(2)], False))
    w.cpu.check()
    assert found == TierFound(3, 0, [0], [False], None)
    assert w.counters.disk_read_failed == 1 and w.counters.hit_pages_disk == 0
    assert key(1) not in w.cpu.entries and key(2) not in w.cpu.entries and w.cpu.free_pages == 3
    assert not w.disk.contains(key(1)) and w.disk.contains(key(2)) and w.disk.stats()["corrupt"] == 1
    w.release(3)
    w.cpu.check()
    w.disk.check_integrity()


async def test_lookup_stops_where_no_entry_can_be_had_for_a_disk_page(worker):
    w = worker(pages=1)
    store(w, 1, [0])
    await drain_writes(w)
    assert w.disk.write(key(1), page_bytes(1), None)
    found = await w.lookup(TierLookup(1, 0, [key(0), key(1)], False))
    w.cpu.check()
    assert found == TierFound(1, 0, [0], [False], None) and key(1) not in w.cpu.entries
    w.release(1)
    w.cpu.check()


async def test_lookup_stops_at_a_page_another_store_is_filling(worker):
    w = worker()
    store(w, 1, [0])
    w.reserve(TierReserve(2, [key(1)], False))
    assert w.disk.write(key(1), page_bytes(1), None)
    found = await w.lookup(TierLookup(3, 0, [key(0), key(1)], False))
    assert found.entries == [0]
    w.release(3)
    w.cpu.check()


async def test_a_disk_prefetch_never_evicts_a_cpu_page_of_its_own_run(worker):
    w = worker(pages=2)
    store(w, 1, [0, 2])  # chain 0, 1, 2: pages 0 and 2 in the CPU tier, page 1 only on disk
    await drain_writes(w)
    assert w.disk.write(key(1), page_bytes(1), None)
    found = await w.lookup(TierLookup(1, 0, [key(0), key(1), key(2)], False))
    w.cpu.check()
    for i, entry in enumerate(found.entries):
        held = w.cpu.entries.get(key(i))
        assert held is not None and held.page == entry, f"page {i}: entry {entry} is not key {i}'s ({found})"
    assert len(set(found.entries)) == len(found.entries), f"one entry serves two pages: {found}"


async def test_malformed_lookups_are_counted(worker):
    w = worker(disk=False)
    store(w, 1, [0])
    await w.lookup(TierLookup(1, 0, [key(0)], False))
    assert await w.lookup(TierLookup(1, 0, [key(0)], False)) == TierFound(1, 0, [], [], None)  # id pinned already
    assert await w.lookup(TierLookup(2, 0, [b"\x01" * 8], False)) == TierFound(2, 0, [], [], None)
    w.release(9)
    assert w.counters.malformed == 3 and w.cpu.get(key(0)).pins == 1
    w.release(1)
    w.release(1)
    assert w.counters.malformed == 4 and w.cpu.get(key(0)).pins == 0
    w.cpu.check()


# ---- flush and stats -----------------------------------------------------------------------------


async def test_flush_drops_unpinned_cpu_entries_and_disk_files(worker):
    w = worker()
    store(w, 1, [0, 1], state=True)
    await drain_writes(w)
    w.reserve(TierReserve(2, [key(5)], False))  # reserved: stays
    assert await w.flush(8) == TierFlushed(8, 2, 1, 2)
    w.cpu.check()
    assert list(w.cpu.entries) == [key(5)] and w.disk.stats()["files"] == 0
    assert json_block.read(w.stats_block) == w.stats()


async def test_flush_without_a_disk(worker):
    w = worker(disk=False)
    store(w, 1, [0])
    assert await w.flush(2) == TierFlushed(2, 1, 0, 0)


def test_stats_shape(worker):
    w = worker()
    store(w, 1, [0, 1], state=True)
    doc = w.stats()
    assert set(doc) == {"cpu", "disk", "malformed"} and doc["malformed"] == 0
    cpu = doc["cpu"]
    assert set(cpu) == {
        "pages", "states", "page_bytes", "state_bytes", "stores", "state_stores", "store_skipped", "store_refused",
        "evicted_pages", "evicted_states", "rolled_back", "lookups", "hit_pages",
    }  # fmt: skip
    assert cpu["pages"] == {"total": 4, "free": 2, "cached": 0, "in_use": 2}  # pinned by their disk writes
    assert cpu["states"] == {"total": 2, "free": 1, "cached": 0, "in_use": 1}
    assert (cpu["page_bytes"], cpu["state_bytes"], cpu["stores"], cpu["state_stores"]) == (64, 24, 2, 1)
    disk = doc["disk"]
    assert {"files", "bytes", "budget_bytes", "dir", "hit_pages", "read_failed", "write_queue", "writes_queued",
            "writes_skipped"} <= set(disk)  # fmt: skip
    assert (disk["write_queue"], disk["writes_queued"], disk["files"]) == (2, 2, 0)
    assert disk["dir"] == str(w.disk.directory)
    w.write_stats()
    assert json_block.read(w.stats_block) == doc
    assert worker(disk=False).stats()["disk"] is None
