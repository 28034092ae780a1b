"""The cache worker actor: the CPU tier (an shm page pool) and the disk tier behind it.

    router --TierInbound--> [inbox] -> lookup / reserve / commit / release / flush --TierOutbound--> router
                                        |                        |
                                  disk reads (prefetch)     disk writes (after a commit)
                                  in worker threads         a bounded queue, worker threads

The worker does the I/O: sockets, disk reads and writes in worker threads,
the write queue, the stats block. Which entry holds what, and what is pinned,
reserved or committed, is `TierPolicy`'s (hkv/cache/tier_policy.py), whose
steps the worker calls around its awaits, so the index changes only on the
event loop. It never blocks the router: lookups that read disk run in their
own task (one at a time, in arrival order) and disk writes drain a bounded
queue. Ranks copy page contents between their device pools and the shm
entries the worker hands out.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import zmq.asyncio

from hkv.cache.cpu_tier import CpuTier, Entry
from hkv.cache.tier_policy import TierPolicy
from hkv.config import HkvConfig
from hkv.ipc import json_block
from hkv.ipc.channel import Receiver, Sender
from hkv.ipc.messages import (
    RouterInbound, TierCommit, TierFlush, TierFlushed, TierFound, TierInbound, TierLookup, TierRelease,
    TierReserve, TierReserved, TransporterInbound,
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
class WriteCounters:
    writes_queued: int = 0
    writes_skipped: int = 0  # the write queue was full


class CacheWorker:
    """The actor's state and its message handlers; `policy` decides what each entry holds."""

    def __init__(self, cfg: HkvConfig, layout: HostLayout, fingerprint: bytes, host: HostPool,
                 stats_block: memoryview, zctx: zmq.asyncio.Context):
        self.layout = layout
        self.host = host
        self.disk = None
        if cfg.cache.disk_cache_dir:
            from hkv.cache.disk import DiskTier

            budget = int(cfg.cache.disk_cache_gb * 2**30)
            self.disk = DiskTier(cfg.cache.disk_cache_dir, budget, fingerprint, layout.descriptor,
                                 layout.page_bytes, layout.state_bytes)
        self.policy = TierPolicy(CpuTier(layout.num_pages, layout.state_units, fingerprint, self.move_page), self.disk)
        self.stats_block = stats_block
        self.counters = WriteCounters()
        self.lookups: asyncio.Queue[TierLookup] = asyncio.Queue(maxsize=1024)
        self.writes: asyncio.Queue[Entry] = asyncio.Queue(maxsize=WRITE_QUEUE_BOUND)
        self.changed = asyncio.Event()  # set when the stats block is stale
        self.inbox: Receiver[TierInbound] = Receiver(zctx, cfg.ipc_address("cache_in"), TierInbound, "cache_in")
        self.to_router: Sender[RouterInbound] = Sender(zctx, cfg.ipc_address("router_in"), "router_in")
        # prefill/decode: the transporter's pulls and reservations are answered to it
        self.to_transporter: Sender[TransporterInbound] | None = (
            Sender(zctx, cfg.ipc_address("transporter_in"), "transporter_in")
            if cfg.server.mode in ("prefill", "decode") else None)

    def move_page(self, src: int, dst: int) -> None:
        """Copy page entry src to dst (compaction; the tier moves only entries no rank or thread touches)."""
        self.host.page_view(dst)[:] = self.host.page_view(src)

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
                await self.answer(msg, TierFound(msg.lookup_id, msg.first, [], [], None))
            else:
                self.lookups.put_nowait(msg)
        elif isinstance(msg, TierRelease):
            self.policy.release(msg.lookup_id)
        elif isinstance(msg, TierReserve):
            await self.answer(msg, self.reserve(msg))
        elif isinstance(msg, TierCommit):
            self.commit(msg.offload_id, msg.ok)
        elif isinstance(msg, TierFlush):
            await self.to_router.send(await self.flush(msg.flush_id))

    async def answer(self, msg: TierLookup | TierReserve, reply: TierFound | TierReserved) -> None:
        """To the router, or to the transporter for its own asks (refused, with nothing held, without one)."""
        if not msg.to_transporter:
            await self.to_router.send(reply)
        elif self.to_transporter is not None:
            await self.to_transporter.send(reply)
        else:
            self.policy.counters.malformed += 1
            if isinstance(reply, TierFound) and reply.entries:
                self.policy.release(reply.lookup_id)
            elif isinstance(reply, TierReserved) and reply.offload_id in self.policy.offloads:
                self.policy.commit(reply.offload_id, False, 0)

    async def lookup_loop(self) -> None:
        while True:
            msg = await self.lookups.get()
            found = await self.lookup(msg)
            await self.answer(msg, found)
            self.changed.set()

    async def lookup(self, msg: TierLookup) -> TierFound:
        """Pin the longest usable run of msg.keys, reading its disk-only pages into fresh CPU entries."""
        plan = self.policy.begin_lookup(msg.lookup_id, msg.keys, msg.need_state, msg.parent)
        reads = plan.disk_reads
        failed_at = await self._read_disk(reads) if reads else None
        hit = self.policy.finish_lookup(plan, failed_at)
        if hit is None:
            return TierFound(msg.lookup_id, msg.first, [], [], None)
        return TierFound(msg.lookup_id, msg.first, hit.pages, hit.from_disk, hit.state_entry)

    async def _read_disk(self, reads: list[tuple[int, Entry]]) -> int | None:
        """Read each entry's file into it, in one worker-thread hop; the run index of the first failure, or None."""
        jobs = [(i, e.key, self.host.page_view(e.page), self.host.state_view(e.state) if e.state is not None else None)
                for i, e in reads]
        return await asyncio.to_thread(self._read_files, jobs)

    def _read_files(self, jobs) -> int | None:
        """(In a worker thread.) Read each job's file into its entry; the index of the first failure, or None."""
        for i, key, page_out, state_out in jobs:
            got = self.disk.read_into(key, page_out, state_out)
            if got is None or (state_out is not None and not got):
                return i
        return None

    def reserve(self, msg: TierReserve) -> TierReserved:
        reserved = self.policy.reserve(msg.offload_id, msg.keys, msg.state)
        return TierReserved(msg.offload_id, reserved.entries, reserved.state_entry)

    def commit(self, offload_id: int, ok: bool) -> None:
        """Settle the offload; queue the entries it leaves for the disk."""
        committed = self.policy.commit(offload_id, ok, self.writes.maxsize - self.writes.qsize())
        for entry in committed.to_write:
            self.writes.put_nowait(entry)
        self.counters.writes_queued += len(committed.to_write)
        self.counters.writes_skipped += committed.skipped

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
            await asyncio.to_thread(self.disk.write, entry.key, self.host.page_view(entry.page), state, entry.parent)
        finally:
            self.policy.write_done(entry)
            self.changed.set()

    async def drain_writes(self) -> None:
        """On stop: finish the queued disk writes, for a bounded time."""
        deadline = time.monotonic() + DRAIN_WRITES_S
        while not self.writes.empty() and time.monotonic() < deadline:
            await self._write(self.writes.get_nowait())
        if not self.writes.empty():
            log.warning("stopping with %d disk writes not done", self.writes.qsize())

    async def flush(self, flush_id: int) -> TierFlushed:
        pages, states = self.policy.cpu.flush()
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
        """The stats block: counters, pools and coverage (held_tokens: tokens whose pages the tier holds;
        reachable_tokens: tokens a hit on that tier alone could reach, from a prompt's first page)."""
        cpu_tier, P = self.policy.cpu, self.layout.page_size
        usage = cpu_tier.usage()
        held, reachable = cpu_tier.coverage()
        c, cc, wc = self.policy.counters, cpu_tier.counters, self.counters
        cpu = {
            "pages": usage["pages"], "states": usage["states"],
            "page_bytes": self.layout.page_bytes, "state_bytes": self.layout.state_bytes,
            "budget_bytes": self.layout.nbytes, "state_units": self.layout.state_units,
            "held_tokens": held * P, "reachable_tokens": reachable * P,
            "stores": cc.stores, "state_stores": cc.state_stores, "store_skipped": cc.store_skipped,
            "store_refused": cc.store_refused, "evicted_pages": cc.evicted_pages,
            "evicted_states": cc.evicted_states, "pruned_pages": cc.pruned_pages, "pruned_states": cc.pruned_states,
            "moved_pages": cc.moved_pages, "rolled_back": cc.rolled_back,
            "lookups": c.lookups, "hit_pages": c.hit_pages_cpu,
        }  # fmt: skip
        # cache_in's drops: frames that did not decode and messages that broke the contract
        doc = {"cpu": cpu, "disk": None, "malformed": c.malformed + self.inbox.malformed}
        if self.disk is not None:
            files, reachable_files = self.disk.coverage()
            doc["disk"] = {**self.disk.stats(), "dir": str(self.disk.directory), "hit_pages": c.hit_pages_disk,
                           "held_tokens": files * P, "reachable_tokens": reachable_files * P,
                           "read_failed": c.disk_read_failed, "write_queue": self.writes.qsize(),
                           "writes_queued": wc.writes_queued, "writes_skipped": wc.writes_skipped}
        return doc

    async def aclose(self) -> None:
        for channel in (self.inbox, self.to_router, self.to_transporter):
            if channel is not None:
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
