"""The cache worker actor: the CPU tier (an shm page pool) and the disk tier behind it.

    router --TierInbound--> [inbox] -> lookup / reserve / commit / release / flush --TierOutbound--> router
                                        |                        |
                                  disk reads (prefetch)     disk writes (after a commit)
                                  in worker threads         a bounded queue, worker threads

It never blocks the router: lookups that read disk run in their own task
(one at a time, in arrival order) and disk writes drain a bounded queue; the
index (`CpuTier`) changes only on the event loop. Ranks copy page contents
between their device pools and the shm entries the worker hands out.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import zmq.asyncio

from hkv.cache.cpu_tier import CpuTier, Entry
from hkv.cache.keys import KEY_BYTES
from hkv.config import HkvConfig
from hkv.ipc import json_block
from hkv.ipc.channel import Receiver, Sender
from hkv.ipc.messages import (
    RouterInbound, TierCommit, TierFlush, TierFlushed, TierFound, TierInbound, TierLookup, TierRelease,
    TierReserve, TierReserved,
)  # fmt: skip
from hkv.ipc.process import ActorContext, run_actor, run_until_stopped
from hkv.ipc.shm import ShmRegion
from hkv.ipc.tier_regions import TIER_STATS_REGION, attach_pool
from hkv.storage.host_pool import HostLayout, HostPool

log = logging.getLogger("hkv.cache_worker")
WRITE_QUEUE_BOUND = 4096  # entries waiting for the disk; beyond it a write is skipped (counted)
DISK_WRITERS = 2  # concurrent disk writes (an fsync per entry bounds one writer)
DRAIN_WRITES_S = 8.0  # on stop, finish queued disk writes for at most this long
STATS_EVERY_S = 0.25


@dataclass
class Offload:
    """Entries reserved for one TierReserve, until its TierCommit."""

    new: list[Entry]  # entries created for it (reserved, pinned)
    state_of: Entry | None  # an existing entry that got a new state entry (pinned by us)


@dataclass
class Counters:
    lookups: int = 0
    hit_pages_cpu: int = 0  # pages lookups found in the CPU tier
    hit_pages_disk: int = 0  # pages lookups read from the disk tier
    disk_read_failed: int = 0  # disk entries that were missing or corrupt on read
    writes_queued: int = 0
    writes_skipped: int = 0  # the write queue was full
    malformed: int = 0  # messages that broke the contract (bad key sizes, unknown ids)


class CacheWorker:
    """The actor's state and its message handlers."""

    def __init__(self, cfg: HkvConfig, layout: HostLayout, fingerprint: bytes, host: HostPool,
                 stats_block: memoryview, zctx: zmq.asyncio.Context):
        self.layout = layout
        self.host = host
        self.cpu = CpuTier(layout.num_pages, layout.num_states)
        self.disk = None
        if cfg.cache.disk_cache_dir:
            from hkv.cache.disk import DiskTier

            budget = int(cfg.cache.disk_cache_gb * 2**30)
            self.disk = DiskTier(cfg.cache.disk_cache_dir, budget, fingerprint, layout.descriptor,
                                 layout.page_bytes, layout.state_bytes)
        self.stats_block = stats_block
        self.counters = Counters()
        self.lookup_pins: dict[int, list[Entry]] = {}  # lookup id -> entries it pinned
        self.offloads: dict[int, Offload] = {}
        self.lookups: asyncio.Queue[TierLookup] = asyncio.Queue(maxsize=1024)
        self.writes: asyncio.Queue[Entry] = asyncio.Queue(maxsize=WRITE_QUEUE_BOUND)
        self.changed = asyncio.Event()  # set when the stats block is stale
        self.inbox: Receiver[TierInbound] = Receiver(zctx, cfg.ipc_address("cache_in"), TierInbound, "cache_in")
        self.to_router: Sender[RouterInbound] = Sender(zctx, cfg.ipc_address("router_in"), "router_in")

    async def open(self) -> None:
        if self.disk is not None:
            await asyncio.to_thread(self.disk.open)
            log.info("disk tier: %s", self.disk.stats())
        self.write_stats()

    async def run(self) -> None:
        """Handle messages; lookups and disk writes run in their own tasks."""
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self.lookup_loop())
            tasks.create_task(self.write_loop())
            tasks.create_task(self.stats_loop())
            while True:
                msg = await self.inbox.get()
                await self.handle(msg)
                for msg in self.inbox.drain():
                    await self.handle(msg)
                self.changed.set()

    async def handle(self, msg: TierInbound) -> None:
        if isinstance(msg, TierLookup):
            if self.lookups.full():
                await self.to_router.send(TierFound(msg.lookup_id, msg.first, [], [], None))
            else:
                self.lookups.put_nowait(msg)
        elif isinstance(msg, TierRelease):
            self.release(msg.lookup_id)
        elif isinstance(msg, TierReserve):
            await self.to_router.send(self.reserve(msg))
        elif isinstance(msg, TierCommit):
            self.commit(msg.offload_id, msg.ok)
        elif isinstance(msg, TierFlush):
            await self.to_router.send(await self.flush(msg.flush_id))

    # ---- lookups: CPU hits, disk prefetch -------------------------------------------------

    async def lookup_loop(self) -> None:
        while True:
            msg = await self.lookups.get()
            found = await self.lookup(msg)
            await self.to_router.send(found)
            self.changed.set()

    async def lookup(self, msg: TierLookup) -> TierFound:
        """Pin the longest usable run of msg.keys, reading disk entries into fresh CPU entries.

            keys   [ cpu | cpu | disk | cpu | disk | (absent) ...
            run    [ pinned ........................ ]            hybrid: cut back to the deepest checkpoint
        """
        self.counters.lookups += 1
        if msg.lookup_id in self.lookup_pins or any(len(k) != KEY_BYTES for k in msg.keys):
            self.counters.malformed += 1
            return TierFound(msg.lookup_id, msg.first, [], [], None)
        run = self._plan_run(msg.keys, msg.need_state)
        entries, from_disk = self._pin_run(run, msg.need_state)
        entries, from_disk = await self._read_disk(entries, from_disk)
        if msg.need_state:
            entries, from_disk = self._cut_to_state(entries, from_disk)
        if not entries:
            return TierFound(msg.lookup_id, msg.first, [], [], None)
        self.lookup_pins[msg.lookup_id] = entries
        self.counters.hit_pages_cpu += sum(1 for d in from_disk if not d)
        self.counters.hit_pages_disk += sum(from_disk)
        state = entries[-1].checkpoint if msg.need_state else None
        return TierFound(msg.lookup_id, msg.first, [e.page for e in entries], from_disk, state)

    def _plan_run(self, keys: list[bytes], need_state: bool) -> list[tuple[bytes, Entry | None]]:
        """The leading keys held by a tier: (key, CPU entry) or (key, None) for disk-only ones."""
        run: list[tuple[bytes, Entry | None]] = []
        last_state = -1
        for key in keys:
            entry = self.cpu.get(key)
            if entry is not None:
                has_state = entry.checkpoint is not None
            elif key not in self.cpu.entries and self.disk is not None and self.disk.contains(key):
                has_state = self.disk.has_state(key)
            else:
                break
            run.append((key, entry))
            if has_state:
                last_state = len(run) - 1
        return run[: last_state + 1] if need_state else run

    def _pin_run(self, run, need_state: bool) -> tuple[list[Entry], list[bool]]:
        """Pin the run's CPU entries, then reserve entries for its disk ones; stops where none can be had.

        Pinning first keeps a disk page's reservation from evicting a later
        CPU page of the same run (LRU makes the deeper pages the likeliest victims).
        """
        for _, entry in run:
            if entry is not None:
                self.cpu.pin(entry)
        entries: list[Entry] = []
        for i, (key, entry) in enumerate(run):
            if entry is None:
                entry = self.cpu.reserve(key)
                if entry is not None and need_state and i == len(run) - 1 and self.cpu.reserve_state(entry) is None:
                    self.cpu.drop(entry)
                    entry = None
                if entry is None:
                    self._unpin_all([e for _, e in run[i:] if e is not None])
                    break
            entries.append(entry)
        return entries, [not entry.valid for entry in entries]

    async def _read_disk(self, entries: list[Entry], from_disk: list[bool]):
        """Fill the reserved entries from disk (one worker-thread hop for the run); the run ends
        before the first entry that is missing or corrupt."""
        jobs = [(i, e.key, self.host.page_view(e.page), self.host.state_view(e.state) if e.state is not None else None)
                for i, (e, disk) in enumerate(zip(entries, from_disk)) if disk]
        if not jobs:
            return entries, from_disk
        failed = await asyncio.to_thread(self._read_files, jobs)
        end = len(entries) if failed is None else failed
        for entry in entries[:end]:
            if not entry.valid:
                self.cpu.fill(entry)
        if failed is not None:
            self.counters.disk_read_failed += 1
            self._unpin_all(entries[failed:])
        return entries[:end], from_disk[:end]

    def _read_files(self, jobs) -> int | None:
        """(In a worker thread.) Read each job's file into its entry; the index of the first failure, or None."""
        for i, key, page_out, state_out in jobs:
            got = self.disk.read_into(key, page_out, state_out)
            if got is None or (state_out is not None and not got):
                return i
        return None

    def _cut_to_state(self, entries: list[Entry], from_disk: list[bool]):
        """A hybrid run must end at a checkpoint: cut back to the deepest entry with a state."""
        keep = len(entries)
        while keep and entries[keep - 1].checkpoint is None:
            keep -= 1
        self._unpin_all(entries[keep:])
        return entries[:keep], from_disk[:keep]

    def _unpin_all(self, entries: list[Entry]) -> None:
        """Unpin deepest first, so a chain's first pages end up most recent (evicted last)."""
        for entry in reversed(entries):
            self.cpu.unpin(entry)
            if not entry.valid and entry.pins == 0:
                self.cpu.drop(entry)

    def release(self, lookup_id: int) -> None:
        entries = self.lookup_pins.pop(lookup_id, None)
        if entries is None:
            self.counters.malformed += 1
            return
        self._unpin_all(entries)

    # ---- offloads: device -> CPU, then disk -----------------------------------------------

    def reserve(self, msg: TierReserve) -> TierReserved:
        """Reserve entries for the keys not held yet; stops at the first key no entry can take."""
        if msg.offload_id in self.offloads or any(len(k) != KEY_BYTES for k in msg.keys):
            self.counters.malformed += 1
            return TierReserved(msg.offload_id, [None] * len(msg.keys), None)
        out: list[int | None] = []
        new: list[Entry] = []
        skipped: list[Entry] = []  # pinned while reserving, so making room never evicts the chain's own pages
        for key in msg.keys:
            held = self.cpu.entries.get(key)
            if held is not None:
                self.cpu.counters.store_skipped += 1
                self.cpu.pin(held)
                skipped.append(held)
                out.append(None)
                continue
            entry = self.cpu.reserve(key)
            if entry is None:
                self.cpu.counters.store_refused += 1
                break
            out.append(entry.page)
            new.append(entry)
        out += [None] * (len(msg.keys) - len(out))
        state_of, state = self._reserve_state(msg, out)
        self._unpin_all(skipped)
        if new or state_of is not None:
            self.offloads[msg.offload_id] = Offload(new, state_of)
        return TierReserved(msg.offload_id, out, state)

    def _reserve_state(self, msg: TierReserve, out: list[int | None]) -> tuple[Entry | None, int | None]:
        """A state entry for the last key's checkpoint, when asked and the page is (being) stored."""
        if not msg.state or not msg.keys:
            return None, None
        last = self.cpu.entries.get(msg.keys[-1])
        if last is None or last.state is not None:
            return None, None
        fresh = out[-1] is not None  # reserved by this very message (pinned already)
        if not fresh:
            if not last.valid:
                return None, None  # another store is filling it; its own checkpoint comes with it
            self.cpu.pin(last)
        state = self.cpu.reserve_state(last)
        if state is None:
            if not fresh:
                self.cpu.unpin(last)
            return None, None
        return (None if fresh else last), state

    def commit(self, offload_id: int, ok: bool) -> None:
        """The ranks copied (ok) or failed: validate and queue for disk, or free the reservations."""
        offload = self.offloads.pop(offload_id, None)
        if offload is None:
            self.counters.malformed += 1
            return
        for entry in offload.new:
            if ok:
                self.cpu.fill(entry)
                self.cpu.counters.stores += 1
                self.cpu.counters.state_stores += entry.state is not None
                self._queue_write(entry)
            else:
                self.cpu.counters.rolled_back += 1
            self._unpin_all([entry])
        if offload.state_of is not None:
            if ok:
                self.cpu.fill_state(offload.state_of)
                self.cpu.counters.state_stores += 1
                self._queue_write(offload.state_of)
            else:
                self.cpu.drop_state(offload.state_of)
            self._unpin_all([offload.state_of])

    def _queue_write(self, entry: Entry) -> None:
        if self.disk is None:
            return
        if self.disk.contains(entry.key) and (entry.checkpoint is None or self.disk.has_state(entry.key)):
            return  # the disk has it (a prefetched entry, or written before)
        if self.writes.full():
            self.counters.writes_skipped += 1
            return
        self.cpu.pin(entry)  # the write reads the entry's bytes; it must not be reused meanwhile
        self.writes.put_nowait(entry)
        self.counters.writes_queued += 1

    async def write_loop(self) -> None:
        """DISK_WRITERS writes at once: each one waits mostly on its own fsync."""
        async def writer() -> None:
            while True:
                await self._write(await self.writes.get())

        async with asyncio.TaskGroup() as writers:
            for _ in range(DISK_WRITERS):
                writers.create_task(writer())

    async def _write(self, entry: Entry) -> None:
        # a state still being stored (reserved after this write was queued) is not written
        state = self.host.state_view(entry.checkpoint) if entry.checkpoint is not None else None
        try:
            await asyncio.to_thread(self.disk.write, entry.key, self.host.page_view(entry.page), state)
        finally:
            self._unpin_all([entry])
            self.changed.set()

    async def drain_writes(self) -> None:
        """On stop: finish the queued disk writes, for a bounded time."""
        deadline = time.monotonic() + DRAIN_WRITES_S
        while not self.writes.empty() and time.monotonic() < deadline:
            await self._write(self.writes.get_nowait())
        if not self.writes.empty():
            log.warning("stopping with %d disk writes not done", self.writes.qsize())

    # ---- flush and stats ---------------------------------------------------------------------

    async def flush(self, flush_id: int) -> TierFlushed:
        pages, states = self.cpu.flush()
        files = await asyncio.to_thread(self.disk.flush) if self.disk is not None else 0
        self.write_stats()
        return TierFlushed(flush_id, pages, states, files)

    async def stats_loop(self) -> None:
        """Publish the stats block after changes, at most every STATS_EVERY_S."""
        while True:
            await self.changed.wait()
            self.changed.clear()
            self.write_stats()
            await asyncio.sleep(STATS_EVERY_S)

    def write_stats(self) -> None:
        json_block.write(self.stats_block, self.stats())

    def stats(self) -> dict:
        usage = self.cpu.usage()
        c, cc = self.counters, self.cpu.counters
        cpu = {
            "pages": usage["pages"], "states": usage["states"],
            "page_bytes": self.layout.page_bytes, "state_bytes": self.layout.state_bytes,
            "stores": cc.stores, "state_stores": cc.state_stores, "store_skipped": cc.store_skipped,
            "store_refused": cc.store_refused, "evicted_pages": cc.evicted_pages,
            "evicted_states": cc.evicted_states, "rolled_back": cc.rolled_back,
            "lookups": c.lookups, "hit_pages": c.hit_pages_cpu,
        }
        doc = {"cpu": cpu, "disk": None, "malformed": c.malformed}
        if self.disk is not None:
            doc["disk"] = {**self.disk.stats(), "dir": str(self.disk.directory), "hit_pages": c.hit_pages_disk,
                           "read_failed": c.disk_read_failed, "write_queue": self.writes.qsize(),
                           "writes_queued": c.writes_queued, "writes_skipped": c.writes_skipped}
        return doc

    async def aclose(self) -> None:
        for channel in (self.inbox, self.to_router):
            await channel.aclose()
        if self.disk is not None:
            self.disk.close()


async def serve(cfg: HkvConfig, ctx: ActorContext) -> None:
    region, layout, fingerprint = attach_pool(cfg.server.name)
    stats_region = ShmRegion.attach(cfg.server.name, TIER_STATS_REGION)
    host = HostPool(layout, region.payload)
    zctx = zmq.asyncio.Context()
    worker = CacheWorker(cfg, layout, fingerprint, host, stats_region.payload, zctx)
    try:
        await worker.open()
        worker.inbox.start()
        ctx.ready(pages=layout.num_pages, states=layout.num_states)
        await run_until_stopped(worker.run(), ctx.stop)
        await worker.drain_writes()
    finally:
        await worker.aclose()
        zctx.term()
        host.release()
        worker.stats_block = None
        region.close()
        stats_region.close()


def main() -> None:
    run_actor("cache_worker", serve)


if __name__ == "__main__":
    main()
