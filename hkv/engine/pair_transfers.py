"""A rank's prefill/decode transfers over pair process groups, off its step loop (the NCCL path of docs/pd.md).

The second building block of that path, after hkv/storage/pair_group.py: a
rank hands a transfer to `PairTransfers` and goes on running steps; a worker
thread per peer forms the pair group when needed, moves the pages, and the
rank collects what ended with `finished()` (for its next StepResult). The
routers drive it through PeerSend / PeerRecv plan ops (hkv/engine/pd_pairing.py),
and each transfer that went well is logged with its size and time (CUDA-event
timed on the worker's stream; on the prefill side, whose receiver is already
waiting, that is the transfer's own bandwidth).

    decode rank                                   prefill rank
    t = PairTransfers(pools, "nccl", host, 30)    t = PairTransfers(pools, "nccl", host, 30)
    p = t.new_prefix()  (again after a failure)
    t.recv(id, peer, p, runs)  --t.address, p-->  t.send(id, address, p, runs)   (a signed control message)
    t.finished() -> [(id, ok, error)]             t.finished() -> [(id, ok, error)]

- One worker thread and one bounded queue per peer, so a peer's transfers
  run in the order they were handed over and a slow peer holds up only its
  own; a full queue refuses the transfer at once (`PairTransferError`). A
  worker idle for IDLE_S lets its group go and retires, so restarted peers
  (new names) do not use up the MAX_PEER_WORKERS places.
- The decode side hosts the rendezvous store (bound to `bind`, its `--host`);
  each of its groups joins through a client connection of its own, so one
  peer that never shows does not hold up another's rendezvous.
  A transfer names its pair group by a one-time prefix the decode side picks;
  a worker joins the group its transfer names (leaving the one it was in).
  A transfer that fails or times out closes its group, and every transfer
  queued for that group fails at once on that side; the decode side then
  names a new group, which a restarted prefill instance joins.
- Runs are checked against the pools before a transfer is queued (nothing
  moves for a bad one); the receiver also checks the sender's header (the
  transfer id and every run's shape) against its own before writing a page
  (pair_group), so two sides whose queues fell out of step fail instead of
  swapping pages.
- CUDA: a transfer runs on the worker's own stream, after an event recorded
  on the caller's stream when it was handed over (so a send reads pages the
  steps before it wrote), and reports done only once that stream finished;
  the pages a receive writes are the caller's to use only after `finished()`
  names it, and a failed transfer is reported only once its stream is idle
  (nothing still writes the pages the router then rolls back). gloo moves
  CPU tensors and bounds every wait by the timeout; under NCCL a p2p that
  never completes is ended by torch's watchdog (the process), not here.
- `close()` fails what is still queued ("closed") and joins the workers
  against one deadline.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hkv.storage import pair_group
from hkv.storage.pair_group import PairGroup, PairGroupError, host_rendezvous

log = logging.getLogger("hkv.rank")
MAX_QUEUED = 64  # transfers waiting per peer; past it one is refused
MAX_PEER_WORKERS = 16  # peers with a worker at once; past it a new peer's transfer is refused
IDLE_S = 300.0  # a worker with nothing to do this long lets its group go and retires
Runs = Sequence[Sequence[tuple[int, int, int]]]  # per pool: (peer start, own start, pages)


class PairTransferError(ValueError):
    """A transfer refused before it was queued: bad runs, a full queue, too many peers, or closed."""


@dataclass
class _Job:
    transfer_id: int
    runs: tuple
    prefix: str
    address: str = ""  # prefill side: the decode side's rendezvous
    ready: object = None  # CUDA: an event on the caller's stream at hand-over


@dataclass
class _Peer:
    jobs: queue.Queue
    thread: threading.Thread | None = None
    prefix: str = ""  # the prefix of the group this peer is in
    failed: str = ""  # the prefix of the last group that failed
    group: PairGroup | None = field(default=None, repr=False)


class PairTransfers:
    """Sends (prefill rank, pair rank 0) or receives (decode rank, pair rank 1) prompts' pages and states."""

    def __init__(self, pools: list[torch.Tensor], backend: str, bind: str, timeout_s: float):
        if backend not in ("gloo", "nccl") or (backend == "nccl") != pools[0].is_cuda:
            raise ValueError(f"pair transfers run nccl between CUDA pools or gloo between CPU ones, not {backend} "
                             f"on {pools[0].device}")
        self.pools, self.backend, self.bind, self.timeout_s = pools, backend, bind, timeout_s
        self._peers: dict[str, _Peer] = {}
        self._done: list[tuple[int, bool, str | None]] = []  # bounded: at most MAX_PEER_WORKERS x MAX_QUEUED wait
        self._lock = threading.Lock()
        self._store = None  # decode side: the rendezvous store, opened at the first address asked for
        self._address = ""
        self._closing = threading.Event()

    # -- decode side

    @property
    def address(self) -> str:
        """The rendezvous "host:port" prefill peers join (decode side; opened on first use)."""
        with self._lock:
            if self._closing.is_set():
                raise PairTransferError("the pair transfers are closed")
            if self._store is None:
                try:
                    self._store, self._address = host_rendezvous(self.bind, self.timeout_s)
                except PairGroupError as exc:
                    raise PairTransferError(str(exc)) from None
            return self._address

    def recv(self, transfer_id: int, peer: str, prefix: str, runs: Runs) -> None:
        """Queue a receive into this rank's pools (runs: (peer start, own start, pages) per pool) in the pair group
        `prefix` names (the caller's pick, `new_prefix()`: it tells the peer in the control message that asks
        for the send, with this transfer id, and picks a new one after a transfer with the peer failed)."""
        job = self._job(transfer_id, runs, prefix, source=False)
        self.address  # noqa: B018  (the store must exist before the peer joins)
        self._queue(peer, job)

    @staticmethod
    def new_prefix() -> str:
        """A one-time pair group name: a stranger on the rendezvous port cannot guess its way in."""
        return secrets.token_hex(8)

    # -- prefill side

    def send(self, transfer_id: int, address: str, prefix: str, runs: Runs) -> None:
        """Queue a send of this rank's pages to the decode rank at `address`, in the group `prefix` names, under
        the decode side's transfer id (the receiver checks it)."""
        job = self._job(transfer_id, runs, prefix, source=True)
        if not address:
            raise PairTransferError(f"transfer {transfer_id} names no decode side")
        job.address = address
        self._queue(address, job)

    # -- both

    def finished(self) -> list[tuple[int, bool, str | None]]:
        """The transfers that ended since the last call: (id, ok, why not)."""
        with self._lock:
            done, self._done = self._done, []
        return done

    def close(self) -> None:
        """Fail what is still queued, stop the workers (one deadline for all) and let the store go."""
        self._closing.set()
        with self._lock:
            peers = list(self._peers.values())
        deadline = time.monotonic() + self.timeout_s + 5
        for peer in peers:
            try:
                peer.jobs.put_nowait(None)  # wakes an idle worker; a busy one sees the event after its job
            except queue.Full:
                pass
        alive = False
        for peer in peers:
            peer.thread.join(max(0.0, deadline - time.monotonic()))
            alive |= peer.thread.is_alive()
        if not alive:  # a worker still in a transfer keeps the store it may be using
            with self._lock:
                self._store = None

    def _job(self, transfer_id: int, runs: Runs, prefix: str, source: bool) -> _Job:
        if not prefix:
            raise PairTransferError(f"transfer {transfer_id} names no pair group prefix")
        try:
            frozen = tuple(tuple((int(a), int(b), int(n)) for a, b, n in pool_runs) for pool_runs in runs)
            pair_group._parts(self.pools, frozen, source=source)
        except (IndexError, ValueError, TypeError) as exc:
            raise PairTransferError(f"transfer {transfer_id}: {exc}") from None
        return _Job(int(transfer_id), frozen, prefix)

    def _queue(self, key: str, job: _Job) -> None:
        if self.pools[0].is_cuda:
            device = self.pools[0].device
            job.ready = torch.cuda.Event()
            job.ready.record(torch.cuda.current_stream(device))
        with self._lock:
            if self._closing.is_set():
                raise PairTransferError("the pair transfers are closed")
            peer = self._peers.get(key)
            if peer is None:
                if len(self._peers) >= MAX_PEER_WORKERS:
                    raise PairTransferError(f"pair transfers with {MAX_PEER_WORKERS} peers already")
                peer = _Peer(queue.Queue(MAX_QUEUED))
                peer.thread = threading.Thread(target=self._work, args=(key, peer), daemon=True, name="pair-worker")
                self._peers[key] = peer
                peer.thread.start()
            try:
                peer.jobs.put_nowait(job)  # under the lock: a worker retires only with an empty queue
            except queue.Full:
                raise PairTransferError(f"transfer {job.transfer_id}: {MAX_QUEUED} transfers already wait for "
                                        f"{key}") from None

    def _report(self, *result) -> None:
        with self._lock:
            self._done.append(result)

    def _work(self, key: str, peer: _Peer) -> None:
        try:
            stream = torch.cuda.Stream(self.pools[0].device) if self.pools[0].is_cuda else None
            while True:
                try:
                    job = peer.jobs.get(timeout=IDLE_S)
                except queue.Empty:
                    with self._lock:
                        if peer.jobs.empty():  # nothing queued (puts happen under this lock): retire
                            self._peers.pop(key, None)
                            break
                    continue
                if self._closing.is_set():  # (job None: close's wake-up)
                    if job is not None:
                        self._report(job.transfer_id, False, "the pair transfers closed")
                    self._fail_queued(peer, "the pair transfers closed")
                    break
                self._run(key, peer, job, stream)
        except Exception as exc:  # noqa: BLE001 (a worker must not die with transfers unreported)
            log.exception("pair transfer worker for %s stopped", key)
            with self._lock:
                if self._peers.get(key) is peer:
                    del self._peers[key]
            self._fail_queued(peer, f"the pair transfer worker stopped: {exc}")
        finally:
            self._drop_group(peer, failed=False)

    def _run(self, key: str, peer: _Peer, job: _Job, stream) -> None:
        if job.prefix == peer.failed:  # queued for a group that failed since: the peer was told to join that one
            self._report(job.transfer_id, False, "its pair group failed before it ran")
            return
        started, began, ended, moved = time.perf_counter(), None, None, 0
        try:
            try:
                if stream is not None:
                    with torch.cuda.stream(stream):
                        stream.wait_event(job.ready)
                        began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        began.record(stream)
                        moved = self._move(peer, job)
                        ended.record(stream)
                else:
                    moved = self._move(peer, job)
            finally:
                if stream is not None:
                    stream.synchronize()  # a failure is reported once nothing still touches the pages
        except Exception as exc:  # noqa: BLE001 (every failure fails this transfer and its group)
            log.warning("pair transfer %d with %s failed: %s", job.transfer_id, key, exc)
            self._drop_group(peer, failed=True)
            self._report(job.transfer_id, False, str(exc) or type(exc).__name__)
            return
        ms = began.elapsed_time(ended) if began is not None else (time.perf_counter() - started) * 1e3
        log.info("pair transfer %d %s %s: %.1f MiB in %.2f ms (%.1f GB/s)", job.transfer_id,
                 "to" if job.address else "from", key, moved / 2**20, ms, moved / max(ms, 1e-6) / 1e6)
        self._report(job.transfer_id, True, None)

    def _fail_queued(self, peer: _Peer, why: str) -> None:
        while True:
            try:
                job = peer.jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                self._report(job.transfer_id, False, why)

    def _move(self, peer: _Peer, job: _Job) -> int:
        """Join the group the job names (leaving another one), then move its pages; the bytes moved."""
        if peer.group is not None and peer.prefix != job.prefix:
            self._drop_group(peer, failed=False)
        if peer.group is None:
            peer.prefix = job.prefix  # (a group that does not form fails under this name too)
            if job.address:  # prefill side: pair rank 0
                peer.group = PairGroup(job.address, job.prefix, 0, self.backend, self.timeout_s, self.bind)
            else:  # decode side: pair rank 1, through a client of its own store
                peer.group = PairGroup(self._address, job.prefix, 1, self.backend, self.timeout_s, self.bind)
        if job.address:
            return peer.group.send_pages(self.pools, job.runs, tag=job.transfer_id)
        return peer.group.recv_pages(self.pools, job.runs, tag=job.transfer_id)

    @staticmethod
    def _drop_group(peer: _Peer, failed: bool) -> None:
        if peer.group is not None:
            peer.group.close()
            peer.group = None
        if failed:
            peer.failed = peer.prefix  # jobs queued for it fail at once; the caller names a new group
