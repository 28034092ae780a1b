"""The transporter actor (prefill and decode modes): a prompt's CPU-tier pages and checkpoint between instances.

    decode instance                                          prefill instance
    router --PdFetch--> transporter --PeerLookup-------tcp-->  transporter --TierLookup--> cache worker (pins)
                          |          <--PeerRun--------------
        cache worker <--TierReserve (what this CPU tier lacks)
                          |          --PeerPull-------------->  reads the pinned entries from its shm pool
                          |          <--PeerBytes ... --------
      writes the bytes into the reserved shm entries, TierCommit(ok)
    router <--PdFetched-- |          --PeerDone-------------->  --TierRelease--> cache worker (unpins)

Both ends are transactional: the decode side's reservation is committed
only once every byte arrived and is rolled back (TierCommit ok=False) on a
timeout (`--pd-timeout`), a peer error or a malformed answer; the prefill
side keeps its run pinned until PeerDone or the same timeout. Every peer
frame is authenticated (hkv/ipc/peer_socket.py) and every value from a peer
(page counts, indices, offsets, sizes) is checked before it is used. The
router sees only PdFetched: then it looks the prompt up in its own CPU tier
as for any tier hit (docs/pd.md).

Both modes run both halves: a prefill instance serves pulls, a decode
instance makes them (and serves none, but binding costs nothing and keeps
one code path). The bound address goes to `transporter.json` in the run
directory, where the api reads it for GET /pd/info.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass

import zmq
import zmq.asyncio

from hkv.cache.keys import KEY_BYTES
from hkv.config import HkvConfig
from hkv.ipc import json_block
from hkv.ipc.auth import Signer, Verifier, load_secret
from hkv.ipc.channel import Receiver, Sender
from hkv.ipc.messages import (
    TRANSPORTER_IDS, PdFetch, PdFetched, PdHoldRelease, PdPairAsk, PdPairSend, PdRelease, RouterInbound, TierCommit,
    TierFound, TierInbound, TierLookup, TierRelease, TierReserve, TierReserved, TransporterInbound,
)  # fmt: skip
from hkv.ipc.pd_ticket import TicketError, check_pair_address, check_peer_address
from hkv.ipc.peer_messages import (
    CHUNK_BYTES, MAX_FRAME_PAYLOAD, MAX_KEYS, PeerAnswer, PeerAsk, PeerBytes, PeerDone, PeerLookup, PeerPull,
    PeerPairSend, PeerRelease, PeerRun,
)  # fmt: skip
from hkv.ipc.peer_socket import SealedSocket, tcp_socket
from hkv.ipc.process import ActorContext, run_actor, run_until_stopped
from hkv.ipc.shm import ShmRegion
from hkv.ipc.tier_regions import PD_STATS_REGION, attach_pool
from hkv.storage.host_pool import HostLayout, HostPool, kv_dtype_of, tp_of

log = logging.getLogger("hkv.transporter")
from hkv.openai.pd_route import ADDRESS_FILE  # noqa: E402  (the api reads it back)
MAX_RUNS = 256  # runs pinned for peers at once; past it a lookup is answered "busy"
MAX_FETCHES = 64  # pulls this instance makes at once; more wait
MAX_LINKS = 16  # prefill peers with an open connection
FETCH_QUEUE = 256  # answers waiting for one fetch
STATS_EVERY_S = 0.25


class PeerError(Exception):
    """The peer refused, answered out of turn or sent a value out of range."""


@dataclass
class Run:
    """A run this instance pinned for a peer's pull."""

    identity: bytes  # the ROUTER identity to answer
    lookup_id: int
    entries: list[int]
    state_entry: int | None
    deadline: float


@dataclass
class Counters:
    fetches_ok: int = 0
    fetches_failed: int = 0
    pages_received: int = 0
    bytes_received: int = 0
    runs_served: int = 0
    runs_expired: int = 0
    pages_sent: int = 0
    bytes_sent: int = 0
    malformed: int = 0  # local answers with an unknown id or an index out of range
    pair_asks_sent: int = 0  # decode: asks for a held prefix over the pair group (docs/pd.md)
    pair_asks_received: int = 0  # prefill: ... of them passed on to the router (which checks the hold)


class Link:
    """The decode side's connection to one prefill transporter; answers go to their fetch's queue."""

    def __init__(self, sealed: SealedSocket):
        self.sealed = sealed
        self.fetches: dict[int, asyncio.Queue] = {}
        self.tasks: list[asyncio.Task] = []
        self.unexpected = 0  # answers for no fetch in flight (late ones after a timeout, or forged ids)

    async def read(self) -> None:
        while True:
            _, _, msg = await self.sealed.recv(PeerAnswer)
            queue = self.fetches.get(msg.fetch_id)
            if queue is None or queue.full():
                self.unexpected += 1
            else:
                queue.put_nowait(msg)

    def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        self.sealed.close()


class Transporter:
    def __init__(self, cfg: HkvConfig, layout: HostLayout, fingerprint: bytes, host: HostPool, secret: bytes,
                 stats_block: memoryview, zctx: zmq.asyncio.Context):  # fmt: skip
        self.cfg = cfg
        self.layout = layout
        self.fingerprint = fingerprint
        self.host = host
        self.secret = secret
        self.stats_block = stats_block
        self.zctx = zctx
        self.timeout = cfg.server.pd_timeout_s
        self.sender = f"{cfg.server.name}:{os.getpid()}:{os.urandom(4).hex()}".encode()
        self.signer = Signer(secret, self.sender)
        self.inbox: Receiver[TransporterInbound] = Receiver(zctx, cfg.ipc_address("transporter_in"),
                                                            TransporterInbound, "transporter_in")
        self.to_cache: Sender[TierInbound] = Sender(zctx, cfg.ipc_address("cache_in"), "cache_in")
        self.to_router: Sender[RouterInbound] = Sender(zctx, cfg.ipc_address("router_in"), "router_in")
        self.changed = asyncio.Event()  # set when the stats block is stale
        self.server = SealedSocket(tcp_socket(zctx, zmq.ROUTER, MAX_FRAME_PAYLOAD + 1024), self.signer,
                                   Verifier(secret, max_payload=MAX_FRAME_PAYLOAD), routed=True,
                                   on_reject=self.changed.set)
        self.address = ""
        self.ids = itertools.count(TRANSPORTER_IDS)
        self.asks: dict[int, asyncio.Future] = {}  # lookup / offload id -> the cache worker's answer
        self.runs: dict[tuple[bytes, int], Run] = {}  # (peer sender, fetch id) -> its pinned run
        self.links: OrderedDict[str, Link] = OrderedDict()
        self.fetch_slots = asyncio.Semaphore(MAX_FETCHES)
        self.counters = Counters()

    def bind(self) -> str:
        self.server.sock.bind(f"tcp://{self.cfg.server.host}:{self.cfg.server.pd_port}")
        self.address = self.server.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        path = os.path.join(self.cfg.run_dir, ADDRESS_FILE)
        fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"address": self.address}, f)
        os.replace(path + ".tmp", path)
        return self.address

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self.server.run_writer())
            tasks.create_task(self.serve_peers())
            tasks.create_task(self.expire_runs())
            tasks.create_task(self.stats_loop())
            while True:
                msg = await self.inbox.get()
                self.local(msg, tasks)
                self.changed.set()

    # -- the local links: router and cache worker

    def local(self, msg: TransporterInbound, tasks: asyncio.TaskGroup) -> None:
        if isinstance(msg, PdFetch):
            tasks.create_task(self.fetch(msg))
            return
        if isinstance(msg, PdRelease):
            tasks.create_task(self.release(msg))
            return
        if isinstance(msg, PdPairAsk):
            tasks.create_task(self.pair_ask(msg))
            return
        answer_id = msg.lookup_id if isinstance(msg, TierFound) else msg.offload_id
        future = self.asks.pop(answer_id, None)
        if future is not None and not future.done():
            future.set_result(msg)
            return
        self.counters.malformed += 1  # an answer nobody waits for (its ask timed out): give it back
        if isinstance(msg, TierFound) and msg.entries:
            self.to_cache.send_nowait(TierRelease(msg.lookup_id))
        elif isinstance(msg, TierReserved) and (msg.state_entry is not None or any(e is not None for e in msg.entries)):
            self.to_cache.send_nowait(TierCommit(msg.offload_id, False))

    async def ask_cache(self, msg: TierLookup | TierReserve, answer_id: int):
        future = asyncio.get_running_loop().create_future()
        self.asks[answer_id] = future
        try:
            await self.to_cache.send(msg)
            return await future
        finally:
            self.asks.pop(answer_id, None)

    # -- the prefill side: serve pulls

    async def serve_peers(self) -> None:
        async with asyncio.TaskGroup() as tasks:
            while True:
                identity, sender, msg = await self.server.recv(PeerAsk)
                if isinstance(msg, PeerRelease):  # the router checks the id
                    await self.to_router.send(PdHoldRelease(msg.hold_id))
                elif isinstance(msg, PeerPairSend):
                    tasks.create_task(self._guarded(self.pass_pair_send(msg)))
                elif isinstance(msg, PeerLookup):
                    tasks.create_task(self._guarded(self.serve_lookup(identity, (sender, msg.fetch_id), msg)))
                elif isinstance(msg, PeerPull):
                    tasks.create_task(self._guarded(self.serve_pull(identity, (sender, msg.fetch_id), msg)))
                else:
                    self.unpin((sender, msg.fetch_id))
                self.changed.set()

    async def _guarded(self, work) -> None:
        """A peer's ask that fails here is logged and counted; it never takes the transporter down."""
        try:
            await work
        except Exception:  # noqa: BLE001 (a bug or a value no check caught: the peer times out)
            self.counters.malformed += 1
            log.exception("serving a peer's ask failed")

    def _refuse_lookup(self, key: tuple[bytes, int], msg: PeerLookup) -> str | None:
        theirs, ours = kv_dtype_of(msg.layout), self.layout.kv_dtype
        if theirs != ours:
            # the prefill side serves lookups; the line reaches the decode instance's client as it is
            return (f"another KV cache dtype (--kv-cache-dtype): the prefill instance stores {ours} pages, "
                    f"the decode instance {theirs}")
        if tp_of(msg.layout) != self.layout.tp:
            return (f"another tensor parallelism (--tp): the decode instance's pages are split over "
                    f"{tp_of(msg.layout) or 'an unreadable number of'} ranks, the prefill instance's over "
                    f"{self.layout.tp}")
        if msg.layout != self.layout.descriptor or msg.root != self.fingerprint:
            return "another model or layout (the fingerprints or CPU-tier layouts differ)"
        if not 1 <= len(msg.keys) <= MAX_KEYS or any(len(k) != KEY_BYTES for k in msg.keys):
            return "bad keys"
        if key in self.runs:
            return "fetch id in use"
        if len(self.runs) >= MAX_RUNS:
            return "busy"
        return None

    async def serve_lookup(self, identity: bytes, key: tuple[bytes, int], msg: PeerLookup) -> None:
        refused = self._refuse_lookup(key, msg)
        if refused is not None:
            await self.server.send(PeerRun(msg.fetch_id, 0, False, refused), identity)
            return
        lookup_id = next(self.ids)
        self.runs[key] = run = Run(identity, lookup_id, [], None, time.monotonic() + self.timeout)
        ask = TierLookup(lookup_id, 0, msg.keys, msg.need_state, None, to_transporter=True)
        try:
            found = await asyncio.wait_for(self.ask_cache(ask, lookup_id), self.timeout)
        except TimeoutError:  # its answer, if it comes, is given back by `local`
            found = TierFound(lookup_id, 0, [], [], None)
        valid = (all(0 <= e < self.layout.num_pages for e in found.entries) and len(found.entries) <= len(msg.keys)
                 and (found.state_entry is None or 0 <= found.state_entry < self.layout.num_states))
        self.counters.malformed += not valid
        current = self.runs.get(key) is run  # not expired (or done) while the cache worker looked
        if not found.entries or not valid or not current:
            if current:
                del self.runs[key]
            if found.entries:
                await self.to_cache.send(TierRelease(lookup_id))
            await self.server.send(PeerRun(msg.fetch_id, 0, False, None if valid else "tier error"), identity)
            return
        run.entries, run.state_entry = list(found.entries), found.state_entry
        self.counters.runs_served += 1
        await self.server.send(PeerRun(msg.fetch_id, len(run.entries), run.state_entry is not None), identity)

    async def serve_pull(self, identity: bytes, key: tuple[bytes, int], msg: PeerPull) -> None:
        run = self.runs.get(key)
        pages = len(run.entries) if run is not None else 0
        ordered = all(0 <= a < b for a, b in zip(msg.wanted, msg.wanted[1:]))
        if (run is None or not pages or not ordered or (msg.wanted and not 0 <= msg.wanted[-1] < pages)
                or (msg.state and run.state_entry is None) or not (msg.wanted or msg.state)):
            await self.server.send(PeerRun(msg.fetch_id, 0, False, "no such run, or a pull outside it"), identity)
            return
        if self.cfg.server.pd_stall_pull_s:  # fault injection: a prefill side that hangs mid-transfer
            await asyncio.sleep(self.cfg.server.pd_stall_pull_s)
            if self.runs.get(key) is not run:
                return
        views = [self.host.page_view(run.entries[i]) for i in msg.wanted]
        if msg.state:
            views.append(self.host.state_view(run.state_entry))
        total = sum(len(v) for v in views)
        offset = 0
        for chunk in _chunks(views):
            offset += len(chunk)
            await self.server.send(PeerBytes(msg.fetch_id, offset - len(chunk), chunk, offset == total), identity)
        self.counters.pages_sent += len(msg.wanted)
        self.counters.bytes_sent += total

    def unpin(self, key: tuple[bytes, int]) -> None:
        run = self.runs.pop(key, None)
        if run is not None and run.entries:
            self.to_cache.send_nowait(TierRelease(run.lookup_id))

    async def expire_runs(self) -> None:
        """A peer that never says PeerDone (it died, or timed out itself) loses its pins after the timeout."""
        while True:
            await asyncio.sleep(min(1.0, self.timeout / 4))
            now = time.monotonic()
            for key in [k for k, run in self.runs.items() if run.deadline < now]:
                self.counters.runs_expired += 1
                self.unpin(key)
                self.changed.set()

    # -- the decode side: pull a prompt's pages

    async def fetch(self, msg: PdFetch) -> None:
        async with self.fetch_slots:
            try:
                moved = await asyncio.wait_for(self._fetch(msg), self.timeout)
                answer = PdFetched(msg.fetch_id, True, moved)
                self.counters.fetches_ok += 1
            except Exception as exc:  # noqa: BLE001 (whatever failed, the router hears why and nothing stays held)
                reason = f"transfer from {msg.peer} timed out after {self.timeout:g} s" if isinstance(
                    exc, TimeoutError) else f"transfer from {msg.peer} failed: {exc}"
                if not isinstance(exc, (TimeoutError, PeerError, TicketError)):
                    log.exception("fetch %d failed unexpectedly", msg.fetch_id)
                log.warning("fetch %d: %s", msg.fetch_id, reason)
                answer = PdFetched(msg.fetch_id, False, [], reason)
                self.counters.fetches_failed += 1
        await self.to_router.send(answer)
        self.changed.set()

    async def _fetch(self, msg: PdFetch) -> list[int]:
        link = self.link(check_peer_address(msg.peer))
        queue: asyncio.Queue = asyncio.Queue(maxsize=FETCH_QUEUE)
        if msg.fetch_id in link.fetches:
            raise PeerError("fetch id in use")
        link.fetches[msg.fetch_id] = queue
        offload_id = None
        try:
            await link.sealed.send(PeerLookup(msg.fetch_id, self.layout.descriptor, self.fingerprint, msg.keys,
                                              msg.need_state))
            run = await queue.get()
            if not isinstance(run, PeerRun) or run.error is not None:
                raise PeerError(run.error if isinstance(run, PeerRun) else "an answer out of turn")
            if not 0 <= run.pages <= len(msg.keys) or (run.state and not run.pages) or (msg.need_state and run.pages
                                                                                         and not run.state):
                raise PeerError(f"a run of {run.pages} pages for {len(msg.keys)} keys")
            if not run.pages:
                return []
            offload_id = next(self.ids)
            reserved = await self.ask_cache(TierReserve(offload_id, msg.keys[: run.pages], run.state,
                                                        to_transporter=True), offload_id)
            wanted, views = self._reserved_views(reserved, run)
            if not views:
                offload_id = None  # nothing reserved, nothing to commit
                return []
            await link.sealed.send(PeerPull(msg.fetch_id, wanted, reserved.state_entry is not None))
            await _receive_into(queue, views)
            await self.to_cache.send(TierCommit(offload_id, True))
            offload_id = None
            self.counters.pages_received += len(wanted)
            self.counters.bytes_received += sum(len(v) for v in views)
            return wanted
        finally:
            if offload_id is not None:  # timed out, failed or cancelled with a reservation: roll it back
                self.to_cache.send_nowait(TierCommit(offload_id, False))
            link.fetches.pop(msg.fetch_id, None)
            await link.sealed.send(PeerDone(msg.fetch_id))

    async def release(self, msg: PdRelease) -> None:
        """Tell a prefill peer its device hold was copied (best effort: the peer's timeout covers a loss)."""
        try:
            link = self.link(check_peer_address(msg.peer))
        except (PeerError, TicketError) as exc:
            log.warning("hold %d at %s not released: %s", msg.hold_id, msg.peer, exc)
            return
        await link.sealed.send(PeerRelease(msg.hold_id))

    async def pair_ask(self, msg: PdPairAsk) -> None:
        """Ask a prefill peer to send a held prefix over the pair group (a loss: the decode rank's receive times
        out and the router rolls the request back)."""
        try:
            link = self.link(check_peer_address(msg.peer))
        except (PeerError, TicketError) as exc:
            log.warning("pair transfer %d from %s not asked for: %s", msg.transfer_id, msg.peer, exc)
            return
        self.counters.pair_asks_sent += 1
        await link.sealed.send(PeerPairSend(msg.hold_id, msg.transfer_id, msg.address, msg.prefix, msg.first,
                                            msg.dst_pages, msg.dst_slot))

    async def pass_pair_send(self, msg: PeerPairSend) -> None:
        """A decode peer's ask, bounded here; the router checks the hold, the pages and the slot."""
        try:
            check_pair_address(msg.address)
        except TicketError:
            self.counters.malformed += 1
            return
        if not (0 < len(msg.dst_pages) <= MAX_KEYS and 0 < len(msg.prefix) <= 64 and msg.first >= 0):
            self.counters.malformed += 1
            return
        self.counters.pair_asks_received += 1
        if self.cfg.server.pd_stall_pull_s:  # fault injection: a prefill side that hangs before its send
            await asyncio.sleep(self.cfg.server.pd_stall_pull_s)
        await self.to_router.send(PdPairSend(msg.hold_id, msg.transfer_id, msg.address, msg.prefix, msg.first,
                                             msg.dst_pages, msg.dst_slot))

    def _reserved_views(self, reserved: TierReserved, run: PeerRun) -> tuple[list[int], list[memoryview]]:
        """The run indices this tier reserved (it lacks them) and the shm views their bytes go into."""
        entries = reserved.entries
        valid = (len(entries) == run.pages and all(e is None or 0 <= e < self.layout.num_pages for e in entries)
                 and (reserved.state_entry is None or (run.state and 0 <= reserved.state_entry < self.layout.num_states)))
        if not valid:
            self.counters.malformed += 1
            raise PeerError("the CPU tier answered a reservation out of range")
        wanted = [i for i, e in enumerate(entries) if e is not None]
        views = [self.host.page_view(entries[i]) for i in wanted]
        if reserved.state_entry is not None:
            views.append(self.host.state_view(reserved.state_entry))
        return wanted, views

    def link(self, peer: str) -> Link:
        link = self.links.get(peer)
        if link is not None:
            self.links.move_to_end(peer)
            return link
        idle = [p for p, ln in self.links.items() if not ln.fetches]
        if len(self.links) >= MAX_LINKS:
            if not idle:
                raise PeerError("too many prefill peers at once")
            self.links.pop(idle[0]).close()
        sock = tcp_socket(self.zctx, zmq.DEALER, MAX_FRAME_PAYLOAD + 1024)
        sock.connect(peer)
        verifier = Verifier(self.secret, max_payload=MAX_FRAME_PAYLOAD)
        link = Link(SealedSocket(sock, self.signer, verifier, routed=False, on_reject=self.changed.set))
        link.tasks = [asyncio.create_task(link.sealed.run_writer()), asyncio.create_task(link.read())]
        self.links[peer] = link
        return link

    # -- stats

    async def stats_loop(self) -> None:
        while True:
            await self.changed.wait()
            self.changed.clear()
            self.write_stats()
            await asyncio.sleep(STATS_EVERY_S)

    def write_stats(self) -> None:
        json_block.write(self.stats_block, self.stats())

    def stats(self) -> dict:
        frames = self.server.counts()
        for link in self.links.values():
            for reason, n in link.sealed.counts().items():
                frames[reason] = frames.get(reason, 0) + n
        return {"address": self.address, "mode": self.cfg.server.mode, "frames": frames,
                "runs_held": len(self.runs), "links": len(self.links),
                "unexpected": sum(link.unexpected for link in self.links.values()), **vars(self.counters)}

    async def aclose(self) -> None:
        for link in self.links.values():
            link.close()
        self.server.close()
        for channel in (self.inbox, self.to_cache, self.to_router):
            await channel.aclose()


def _chunks(views: list[memoryview]):
    """The views' bytes, concatenated, cut into pieces of at most CHUNK_BYTES."""
    pending: list[memoryview] = []
    size = 0
    for view in views:
        while len(view):
            take = view[: CHUNK_BYTES - size]
            pending.append(take)
            size += len(take)
            view = view[len(take):]
            if size == CHUNK_BYTES:
                yield b"".join(pending)
                pending, size = [], 0
    if pending:
        yield b"".join(pending)


async def _receive_into(queue: asyncio.Queue, views: list[memoryview]) -> None:
    """Write the PeerBytes stream into `views` in order; every offset and size is checked first."""
    total = sum(len(v) for v in views)
    offset, index, within = 0, 0, 0
    while True:
        msg = await queue.get()
        if not isinstance(msg, PeerBytes):
            raise PeerError(msg.error if isinstance(msg, PeerRun) and msg.error else "an answer out of turn")
        data = msg.data
        if msg.offset != offset or offset + len(data) > total or msg.last != (offset + len(data) == total):
            raise PeerError(f"bytes at {msg.offset}+{len(data)} for a stream at {offset} of {total}")
        pos = 0
        while pos < len(data):
            view = views[index]
            n = min(len(view) - within, len(data) - pos)
            view[within : within + n] = data[pos : pos + n]
            pos, within = pos + n, within + n
            if within == len(view):
                index, within = index + 1, 0
        offset += len(data)
        if msg.last:
            return


async def serve(cfg: HkvConfig, ctx: ActorContext) -> None:
    secret = load_secret(cfg.server.secret_file)
    region, layout, fingerprint = attach_pool(cfg.server.name)
    stats_region = ShmRegion.attach(cfg.server.name, PD_STATS_REGION)
    host = HostPool(layout, region.payload)
    zctx = zmq.asyncio.Context()
    transporter = Transporter(cfg, layout, fingerprint, host, secret, stats_region.payload, zctx)
    try:
        address = transporter.bind()
        transporter.inbox.start()
        transporter.write_stats()
        log.info("transporter (%s) on %s", cfg.server.mode, address)
        ctx.ready(address=address)
        await run_until_stopped(transporter.run(), ctx.stop)
    finally:
        await transporter.aclose()
        zctx.destroy(linger=0)
        host.release()
        transporter.stats_block = None
        region.close()
        stats_region.close()


def main() -> None:
    run_actor("transporter", serve)


if __name__ == "__main__":
    main()
