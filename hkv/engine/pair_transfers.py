"""A rank's prefill/decode transfers over pair process groups, off its step loop (the NCCL path of docs/pd.md).

The second building block of that path, after hkv/storage/pair_group.py: a
rank hands a transfer to `PairTransfers` and goes on running steps; a worker
thread per peer forms the pair group when needed, moves the pages, and the
rank collects what ended with `finished()` (for its next StepResult). The
routers and transporters do not drive it yet (docs/pd.md, "Not built yet").

    decode rank                                   prefill rank
    t = PairTransfers(pools, "nccl", host, 30)    t = PairTransfers(pools, "nccl", host, 30)
    p = t.new_prefix()  (again after a failure)
    t.recv(id, peer, p, runs)  --t.address, p-->  t.send(id, address, p, runs)   (a signed control message)
    t.finished() -> [(id, ok, error)]             t.finished() -> [(id, ok, error)]

- One worker thread and one bounded queue per peer, so a peer's transfers
  run in the order they were handed over and a slow peer holds up only its
  own; a full queue refuses the transfer at once (`PairTransferError`).
- The decode side hosts the rendezvous store (bound to `bind`, its `--host`).
  A transfer names its pair group by a one-time prefix the decode side picks;
  a worker joins the group its transfer names (leaving the one it was in).
  A transfer that fails or times out closes its group, and every transfer
  queued for that group fails at once on that side; the decode side then
  names a new group, which a restarted prefill instance joins.
- Runs are checked against the pools before a transfer is queued (nothing
  moves for a bad one); the receiver also checks the sender's header against
  its own runs before writing a page (pair_group).
- CUDA: a transfer runs on the worker's own stream, after an event recorded
  on the caller's stream when it was handed over (so a send reads pages the
  steps before it wrote), and reports done only once that stream finished;
  the pages a receive writes are the caller's to use only after `finished()`
  names it. gloo moves CPU tensors; every wait is bounded by the timeout.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hkv.storage import pair_group
from hkv.storage.pair_group import PairGroup, PairGroupError, host_rendezvous

log = logging.getLogger("hkv.rank")
MAX_QUEUED = 64  # transfers waiting per peer; past it one is refused
MAX_PEER_WORKERS = 16  # peers with a worker at once; past it a new peer's transfer is refused
Runs = Sequence[Sequence[tuple[int, int, int]]]  # per pool: (peer start, own start, pages)


class PairTransferError(ValueError):
    """A transfer refused before it was queued: bad runs, a full queue, too many peers, or closed."""


@dataclass
class _Job:
    transfer_id: int
    runs: Runs
    ready: object = None  # CUDA: an event on the caller's stream at hand-over
    address: str = ""  # prefill side: the decode side's rendezvous and the group's prefix
    prefix: str = ""


@dataclass
class _Peer:
    jobs: queue.Queue
    thread: threading.Thread
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
        self._done: list[tuple[int, bool, str | None]] = []
        self._lock = threading.Lock()
        self._store = None  # decode side: the rendezvous store, opened at the first address asked for
        self._address = ""
        self._closed = False

    # -- decode side

    @property
    def address(self) -> str:
        """The rendezvous "host:port" prefill peers join (decode side; opened on first use)."""
        with self._lock:
            if self._store is None:
                self._store, self._address = host_rendezvous(self.bind, self.timeout_s)
            return self._address

    def recv(self, transfer_id: int, peer: str, prefix: str, runs: Runs) -> None:
        """Queue a receive into this rank's pools (runs: (peer start, own start, pages) per pool) in the pair group
        `prefix` names (the caller's pick, `new_prefix()`: it tells the peer in the control message that asks
        for the send, and picks a new one after a transfer with the peer failed)."""
        self.address  # noqa: B018  (the store must exist before the peer joins)
        self._queue(peer, _Job(transfer_id, runs, prefix=prefix), source=False)

    @staticmethod
    def new_prefix() -> str:
        """A one-time pair group name: a stranger on the rendezvous port cannot guess its way in."""
        return secrets.token_hex(8)

    # -- prefill side

    def send(self, transfer_id: int, address: str, prefix: str, runs: Runs) -> None:
        """Queue a send of this rank's pages to the decode rank at `address`, in the group `prefix` names."""
        self._queue(address, _Job(transfer_id, runs, address=address, prefix=prefix), source=True)

    # -- both

    def finished(self) -> list[tuple[int, bool, str | None]]:
        """The transfers that ended since the last call: (id, ok, why not)."""
        with self._lock:
            done, self._done = self._done, []
        return done

    def close(self) -> None:
        """Stop the workers (what is queued fails) and close the groups and the store."""
        with self._lock:
            self._closed = True
            peers = list(self._peers.values())
        for peer in peers:
            peer.jobs.put(None)
        for peer in peers:
            peer.thread.join(self.timeout_s + 5)
        self._store = None

    def _queue(self, key: str, job: _Job, source: bool) -> None:
        if not job.prefix:
            raise PairTransferError(f"transfer {job.transfer_id} names no pair group prefix")
        try:
            pair_group._parts(self.pools, job.runs, source=source)
        except (IndexError, ValueError) as exc:
            raise PairTransferError(f"transfer {job.transfer_id}: {exc}") from None
        if self.pools[0].is_cuda:
            job.ready = torch.cuda.Event()
            job.ready.record()
        with self._lock:
            peer = self._peer(key)
            try:
                peer.jobs.put_nowait(job)
            except queue.Full:
                raise PairTransferError(f"transfer {job.transfer_id}: {MAX_QUEUED} transfers already wait for "
                                        f"{key}") from None

    def _peer(self, key: str) -> _Peer:
        """The peer's worker (started on first use); the caller holds the lock."""
        if self._closed:
            raise PairTransferError("the pair transfers are closed")
        peer = self._peers.get(key)
        if peer is None:
            if len(self._peers) >= MAX_PEER_WORKERS:
                raise PairTransferError(f"pair transfers with {MAX_PEER_WORKERS} peers already")
            peer = _Peer(queue.Queue(MAX_QUEUED), threading.Thread(target=lambda: None))
            peer.thread = threading.Thread(target=self._work, args=(key, peer), daemon=True,
                                           name=f"pair-{len(self._peers)}")
            self._peers[key] = peer
            peer.thread.start()
        return peer

    def _work(self, key: str, peer: _Peer) -> None:
        stream = torch.cuda.Stream(self.pools[0].device) if self.pools[0].is_cuda else None
        while True:
            job = peer.jobs.get()
            if job is None:
                break
            stale = self._stale(peer, job)
            if stale:  # queued for a group that failed since: the peer was told to join that one
                result = (job.transfer_id, False, stale)
            else:
                try:
                    if stream is not None:
                        with torch.cuda.stream(stream):
                            stream.wait_event(job.ready)
                            self._move(peer, job)
                        stream.synchronize()
                    else:
                        self._move(peer, job)
                    result = (job.transfer_id, True, None)
                except (PairGroupError, RuntimeError, ValueError) as exc:
                    log.warning("pair transfer %d with %s failed: %s", job.transfer_id, key, exc)
                    self._drop_group(peer, failed=True)
                    result = (job.transfer_id, False, str(exc))
            with self._lock:
                self._done.append(result)
        self._drop_group(peer, failed=False)
        while True:  # what was queued behind the close
            try:
                job = peer.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                with self._lock:
                    self._done.append((job.transfer_id, False, "the pair transfers closed"))

    @staticmethod
    def _stale(peer: _Peer, job: _Job) -> str | None:
        return "its pair group failed before it ran" if job.prefix == peer.failed else None

    def _move(self, peer: _Peer, job: _Job) -> None:
        """Join the group the job names (leaving another one), then move its pages."""
        if peer.group is not None and peer.prefix != job.prefix:
            self._drop_group(peer, failed=False)
        if peer.group is None:
            peer.prefix = job.prefix  # (a group that does not form fails under this name too)
            if job.address:  # prefill side: pair rank 0, at the decode side's store
                peer.group = PairGroup(job.address, job.prefix, 0, self.backend, self.timeout_s, self.bind)
            else:
                peer.group = PairGroup(self._address, job.prefix, 1, self.backend, self.timeout_s, self.bind,
                                       store=self._store)
        if job.address:
            peer.group.send_pages(self.pools, job.runs)
        else:
            peer.group.recv_pages(self.pools, job.runs)

    @staticmethod
    def _drop_group(peer: _Peer, failed: bool) -> None:
        if peer.group is not None:
            peer.group.close()
            peer.group = None
        if failed:
            peer.failed = peer.prefix  # jobs queued for it fail at once; the caller names a new group
