"""CacheWorker's I/O without processes or sockets: a real HostPool over a bytearray and a real DiskTier.

What the policy decides (pins, reservations, runs, malformed messages) is
tested on TierPolicy alone in tests/cache/test_tier_policy.py; these tests
cover the bytes: disk reads into entries, disk writes from them, the write
queue, flush and the stats block.
"""

import asyncio
import os
from types import SimpleNamespace

import pytest

from hkv.actors.cache_worker import CacheWorker, WriteCounters
from hkv.cache.cpu_tier import CpuTier
from hkv.cache.disk import DiskTier
from hkv.cache.tier_policy import TierPolicy
from hkv.ipc import json_block
from hkv.ipc.messages import TierFlushed, TierFound, TierLookup, TierReserve, TierReserved
from hkv.storage.host_pool import HostLayout, HostPool

FP = bytes(range(16))


def key(i: int) -> bytes:
    return bytes([0x50 + i]) + i.to_bytes(15, "little")


def layout(units: int, hybrid: bool) -> HostLayout:
    """Page entry: [2, 1 layer, 2 tokens, 1 head, 4] fp32 = 64 bytes; state entry (hybrid): 2 + 4 floats = 24
    bytes, one unit."""
    state = dict(lin_layers=1, conv_dim=2, conv_width=1, v_heads=1, k_dim=2, v_dim=2) if hybrid else {}
    return HostLayout(num_pages=units, state_units=1 if hybrid else 0, kv_layers=1, page_size=2, kv_heads=1,
                      head_dim=4, kv_dtype="float32", **state)  # fmt: skip


def make_worker(tmp_path, units=6, hybrid=True, disk=True) -> CacheWorker:
    """What CacheWorker.__init__ builds, minus the sockets."""
    lay = layout(units, hybrid)
    worker = CacheWorker.__new__(CacheWorker)
    worker.layout = lay
    worker.host = HostPool(lay, memoryview(bytearray(lay.nbytes)))
    worker.disk = None
    if disk:
        worker.disk = DiskTier(tmp_path / "disk", 10**6, FP, lay.descriptor, lay.page_bytes, lay.state_bytes)
        worker.disk.open()
    worker.policy = TierPolicy(CpuTier(lay.num_pages, lay.state_units, FP, worker.move_page), worker.disk)
    worker.stats_block = memoryview(bytearray(64 * 1024))
    worker.counters = WriteCounters()
    worker.lookups = asyncio.Queue(maxsize=1024)
    worker.writes = asyncio.Queue(maxsize=16)
    worker.changed = asyncio.Event()
    worker.inbox = SimpleNamespace(malformed=0)  # frames that did not decode, counted in stats()["malformed"]
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
    w.policy.cpu.check()
    for i, entry in zip(indexes, got.entries):
        if entry is not None:
            w.host.page_view(entry)[:] = page_bytes(i)
    if got.state_entry is not None:
        w.host.state_view(got.state_entry)[:] = state_bytes(indexes[-1])
    w.commit(offload_id, ok)
    w.policy.cpu.check()
    return got


async def drain_writes(w: CacheWorker) -> None:
    while not w.writes.empty():
        await w._write(w.writes.get_nowait())
        w.policy.cpu.check()


def entry_file(w: CacheWorker, k: bytes, has_state: bool) -> str:
    return w.disk._path(k, has_state)


def test_commit_ok_fills_and_queues_disk_writes(worker):
    w = worker()
    got = store(w, 1, [0, 1], state=True)
    assert got == TierReserved(1, [0, 1], 2)
    cpu = w.policy.cpu
    entries = [cpu.get(key(i)) for i in range(2)]
    assert all(e is not None and e.valid for e in entries)
    assert [e.pins for e in entries] == [1, 1]  # the queued writes read them
    assert cpu.counters.stores == 2 and cpu.counters.state_stores == 1
    assert w.counters.writes_queued == 2 and w.writes.qsize() == 2 and w.policy.offloads == {}
    asyncio.run(drain_writes(w))
    assert [e.pins for e in entries] == [0, 0]
    assert w.disk.contains(key(0)) and not w.disk.has_state(key(0)) and w.disk.has_state(key(1))
    kv, st = bytearray(64), bytearray(24)
    assert w.disk.read_into(key(1), kv, st) is True and (bytes(kv), bytes(st)) == (page_bytes(1), state_bytes(1))
    w.disk.check_integrity()


def test_a_new_checkpoint_of_a_page_on_disk_is_written_again(worker):
    async def body():
        w = worker()
        store(w, 1, [0, 1], state=True)
        await drain_writes(w)
        assert w.disk.contains(key(0)) and not w.disk.has_state(key(0))
        # the page is on disk: a state-only offload writes it again, now with its checkpoint
        got = store(w, 2, [0], state=True)
        assert got == TierReserved(2, [None], 3) and w.writes.qsize() == 1 and w.counters.writes_queued == 3
        await drain_writes(w)
        assert w.disk.has_state(key(0)) and w.policy.cpu.get(key(0)).pins == 0

    asyncio.run(body())


def test_queue_write_skips_when_the_queue_is_full(worker):
    w = worker()
    w.writes = asyncio.Queue(maxsize=1)
    store(w, 1, [0, 1], state=True)
    assert w.counters.writes_queued == 1 and w.counters.writes_skipped == 1
    assert [w.policy.cpu.get(key(i)).pins for i in range(2)] == [1, 0]
    w.policy.cpu.check()


def test_no_disk_no_writes(worker):
    w = worker(disk=False)
    store(w, 1, [0], state=True)
    assert w.writes.empty() and w.policy.cpu.get(key(0)).pins == 0


async def test_lookup_prefetches_disk_entries_into_fresh_cpu_entries(worker):
    w = worker(hybrid=False)
    store(w, 1, [0])
    await drain_writes(w)
    for i in (1, 2):
        assert w.disk.write(key(i), page_bytes(i), None)
    found = await w.lookup(TierLookup(4, 0, [key(0), key(1), key(2)], False))
    w.policy.cpu.check()
    assert found == TierFound(4, 0, [0, 1, 2], [False, True, True], None)
    for i, entry in enumerate(found.entries):
        assert bytes(w.host.page_view(entry)) == page_bytes(i)
        assert w.policy.cpu.get(key(i)).pins == 1 and w.policy.cpu.get(key(i)).page == entry
    assert (w.policy.counters.hit_pages_cpu, w.policy.counters.hit_pages_disk) == (1, 2)
    w.policy.release(4)
    w.policy.cpu.check()
    # now all three are CPU hits
    found = await w.lookup(TierLookup(5, 0, [key(0), key(1), key(2)], False))
    assert found.from_disk == [False, False, False]
    w.policy.release(5)
    w.policy.cpu.check()


async def test_lookup_prefetches_a_checkpoint_from_disk(worker):
    w = worker()
    assert w.disk.write(key(0), page_bytes(0), None)
    assert w.disk.write(key(1), page_bytes(1), state_bytes(1))
    found = await w.lookup(TierLookup(1, 0, [key(0), key(1)], True))
    w.policy.cpu.check()
    assert found == TierFound(1, 0, [0, 1], [True, True], 2)
    assert bytes(w.host.state_view(2)) == state_bytes(1) and bytes(w.host.page_view(1)) == page_bytes(1)
    assert w.policy.cpu.get(key(1)).state == 2 and w.policy.cpu.get(key(0)).state is None
    w.policy.release(1)
    w.policy.cpu.check()


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
    cpu = w.policy.cpu
    cpu.check()
    assert found == TierFound(2, 0, [0], [False], 1)
    assert w.policy.counters.disk_read_failed == 1 and key(1) not in cpu.entries and not w.disk.contains(key(1))
    assert (cpu.free_pages, cpu.free_states) == (4, 4)
    w.policy.release(2)
    cpu.check()


async def test_lookup_stops_at_a_corrupt_disk_file(worker):
    w = worker(hybrid=False)
    store(w, 1, [0])
    await drain_writes(w)
    for i in (1, 2):
        assert w.disk.write(key(i), page_bytes(i), None)
    path = entry_file(w, key(1), False)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 20)
        f.write(b"\x00\x00")
    found = await w.lookup(TierLookup(3, 0, [key(0), key(1), key(2)], False))
    cpu = w.policy.cpu
    cpu.check()
    assert found == TierFound(3, 0, [0], [False], None)
    assert w.policy.counters.disk_read_failed == 1 and w.policy.counters.hit_pages_disk == 0
    assert key(1) not in cpu.entries and key(2) not in cpu.entries and cpu.free_pages == 5
    assert not w.disk.contains(key(1)) and w.disk.contains(key(2)) and w.disk.stats()["corrupt"] == 1
    w.policy.release(3)
    cpu.check()
    w.disk.check_integrity()


async def test_lookups_that_find_nothing_or_break_the_contract_answer_empty(worker):
    w = worker(hybrid=False, disk=False)
    store(w, 1, [0])
    assert await w.lookup(TierLookup(1, 3, [key(1)], False)) == TierFound(1, 3, [], [], None)
    assert await w.lookup(TierLookup(2, 3, [key(0)], False)) == TierFound(2, 3, [0], [False], None)
    assert await w.lookup(TierLookup(2, 3, [key(0)], False)) == TierFound(2, 3, [], [], None)  # id pinned already
    assert await w.lookup(TierLookup(3, 0, [b"\x01" * 8], False)) == TierFound(3, 0, [], [], None)
    assert w.policy.counters.malformed == 2 and w.stats()["malformed"] == 2
    w.policy.release(2)
    w.policy.cpu.check()


async def test_flush_drops_unpinned_cpu_entries_and_disk_files(worker):
    w = worker()
    store(w, 1, [0, 1], state=True)
    await drain_writes(w)
    w.reserve(TierReserve(2, [key(5)], False))  # reserved: stays
    assert await w.flush(8) == TierFlushed(8, 2, 1, 2)
    w.policy.cpu.check()
    assert list(w.policy.cpu.entries) == [key(5)] and w.disk.stats()["files"] == 0
    assert json_block.read(w.stats_block) == w.stats()


async def test_flush_without_a_disk(worker):
    w = worker(hybrid=False, disk=False)
    store(w, 1, [0])
    assert await w.flush(2) == TierFlushed(2, 1, 0, 0)


def test_stats_shape(worker):
    w = worker()
    store(w, 1, [0, 1], state=True)
    doc = w.stats()
    assert set(doc) == {"cpu", "disk", "malformed"} and doc["malformed"] == 0
    cpu = doc["cpu"]
    assert set(cpu) == {
        "pages", "states", "page_bytes", "state_bytes", "budget_bytes", "state_units", "held_tokens",
        "reachable_tokens", "stores", "state_stores", "store_skipped", "store_refused", "evicted_pages",
        "evicted_states", "pruned_pages", "pruned_states", "moved_pages", "rolled_back", "lookups", "hit_pages",
    }  # fmt: skip
    # one budget of 6 units: 2 pages (pinned by their disk writes) and a checkpoint
    assert cpu["pages"] == {"total": 5, "free": 3, "cached": 0, "in_use": 2}
    assert cpu["states"] == {"total": 4, "free": 3, "cached": 0, "in_use": 1}
    assert (cpu["page_bytes"], cpu["state_bytes"], cpu["stores"], cpu["state_stores"]) == (64, 24, 2, 1)
    assert (cpu["budget_bytes"], cpu["state_units"], cpu["held_tokens"], cpu["reachable_tokens"]) == (384, 1, 4, 4)
    disk = doc["disk"]
    assert {"files", "bytes", "budget_bytes", "dir", "hit_pages", "read_failed", "write_queue", "writes_queued",
            "writes_skipped", "held_tokens", "reachable_tokens"} <= set(disk)  # fmt: skip
    assert (disk["write_queue"], disk["writes_queued"], disk["files"]) == (2, 2, 0)
    assert (disk["held_tokens"], disk["reachable_tokens"]) == (0, 0)
    assert disk["dir"] == str(w.disk.directory)
    w.write_stats()
    assert json_block.read(w.stats_block) == doc
    assert worker(disk=False).stats()["disk"] is None


async def test_disk_coverage_follows_the_chains_written(worker):
    w = worker()
    store(w, 1, [0, 1], state=True)
    await drain_writes(w)
    disk = w.stats()["disk"]
    assert (disk["files"], disk["held_tokens"], disk["reachable_tokens"]) == (2, 4, 4)  # parents come with writes


def test_move_page_copies_an_entry_for_compaction(worker):
    w = worker()
    w.host.page_view(1)[:] = page_bytes(7)
    w.move_page(1, 4)
    assert bytes(w.host.page_view(4)) == page_bytes(7)
