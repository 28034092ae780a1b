"""A pair process group between a prefill rank and a decode rank, and a prompt's pages through it in large messages.

The first building block of the NCCL path of docs/pd.md ("Not built yet"): NCCL
between two GPUs, gloo between two CPU processes (CI runs this code over
gloo). Not yet wired into the ranks.

    decode rank (rank 1)                               prefill rank (rank 0)
    store, address = host_rendezvous("127.0.0.1")      (address and prefix come in a signed control message)
    group = PairGroup(address, prefix, 1, ..., bind)   group = PairGroup(address, prefix, 0, ..., bind)
    group.recv_pages(pools, runs)                      group.send_pages(pools, runs)

- The rendezvous store binds one interface (the caller's `--host`, loopback
  by default); the prefix is a one-time random name the decode side picks,
  so a stranger on the port cannot join this pair. The store lives as long
  as the pair (NCCL builds its communicator at the first transfer, through
  the store); `close` lets it go.
- A transfer first sends a header: its byte count, its part count, its
  tag (the transfer's id), then (layers, pages, bytes a page) of every part
  in order; the receiver refuses one that is not exactly what it reserved,
  before any page is written. Then the pages go in messages of at most
  `MAX_MESSAGE_BYTES`, packed and unpacked through one staging buffer of that size on each side
  (a part is its layers' runs of pages, each contiguous in its pool). A
  failure mid-transfer leaves some reserved pages written: the caller rolls
  its reservation back. Every run is checked against the pools first.
- gloo: every wait is bounded by the group's timeout; a peer that never
  shows raises PairGroupError within it, and the group binds `bind` only.
  NCCL (not run here yet): its bootstrap picks an interface by NCCL's own
  rules (`NCCL_SOCKET_IFNAME`), and a p2p that never completes is ended by
  torch's NCCL watchdog (the process), not by an exception; wiring it into
  the ranks must receive on a side stream and abort the group on timeout
  (docs/pd.md).
"""

from __future__ import annotations

import datetime
import socket
from collections.abc import Sequence

import torch
import torch.distributed as dist

from hkv_kernels.cache_copy.runs import pool_elements

MAX_MESSAGE_BYTES = 256 * 2**20  # one message and each side's staging: NCCL's high-bandwidth regime, bounded
MAX_PARTS = 4096  # runs a transfer may have (the receiver's own count bounds what it reads)


class PairGroupError(Exception):
    """The pair could not form, or a transfer failed, timed out or did not match (nothing was written then
    for a header mismatch; a failure mid-transfer leaves the reserved pages to be rolled back)."""


def host_rendezvous(host: str, timeout_s: float) -> tuple[dist.TCPStore, str]:
    """The decode side's rendezvous store on `host` (a free port): (the store, "host:port").

    A TCPStore binds every interface when it opens its own port, so it gets a socket already bound to
    `host` instead (its listening fd, which the store then owns)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen(16)
        port = sock.getsockname()[1]
        store = dist.TCPStore(host, port, 2, True, datetime.timedelta(seconds=timeout_s), wait_for_workers=False,
                              master_listen_fd=sock.fileno(), use_libuv=True)
    except (OSError, RuntimeError) as exc:
        sock.close()
        raise PairGroupError(f"no rendezvous on {host}: {exc}") from None
    sock.detach()  # the store closes it
    return store, f"{host}:{port}"


class PairGroup:
    """Two ranks, 0 sends and 1 receives; backend "gloo" (CPU tensors) or "nccl" (CUDA tensors)."""

    def __init__(self, address: str, prefix: str, rank: int, backend: str, timeout_s: float, bind: str,
                 store: dist.TCPStore | None = None):  # fmt: skip
        """`bind`: this side's address for gloo's connections (its `--host`); `store`: the decode side's own."""
        if rank not in (0, 1) or backend not in ("gloo", "nccl"):
            raise ValueError(f"a pair group has ranks 0 and 1 over gloo or nccl, not rank {rank} over {backend}")
        host, _, port = address.rpartition(":")
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            if store is None:
                store = dist.TCPStore(host, int(port), 2, False, timeout)
            prefixed = dist.PrefixStore(prefix, store)
            if backend == "gloo":
                opts = dist.ProcessGroupGloo._Options()
                opts._timeout = timeout
                opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind)]
                self.group = dist.ProcessGroupGloo(prefixed, rank, 2, opts)
            else:
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                self.group = dist.ProcessGroupNCCL(prefixed, rank, 2, opts)
        except (RuntimeError, ValueError, dist.DistError) as exc:
            raise PairGroupError(f"the pair group did not form: {exc}") from None
        self.store: dist.TCPStore | None = store  # the pair's rendezvous, until close
        self.peer = 1 - rank

    def close(self) -> None:
        try:
            self.group.shutdown()
        except (RuntimeError, AttributeError):
            pass
        self.store = None  # the decode side's store closes its port with its last reference

    def send_pages(self, pools: Sequence[torch.Tensor], runs: Sequence[Sequence[tuple[int, int, int]]],
                   tag: int = 0) -> int:  # fmt: skip
        """Rank 0: pools[i][:, s:s+n] for each run (s, _, n) of runs[i], in order; returns the bytes sent.
        `tag` names the transfer (the receiver refuses another one's pages)."""
        parts = _parts(pools, runs, source=True)
        device, total = _device(pools), sum(p.numel() for p in parts)
        header = torch.tensor([total, len(parts), tag], dtype=torch.int64, device=device)
        self._wait(self.group.send([header], self.peer, 0))
        if parts:
            self._wait(self.group.send([_shapes(parts, device)], self.peer, 0))
        staging = torch.empty(min(total, MAX_MESSAGE_BYTES), dtype=torch.uint8, device=device)
        for message, pieces in _messages(parts):
            for offset, segment in pieces:
                staging[offset:offset + segment.numel()].copy_(segment)
            self._wait(self.group.send([staging[:message]], self.peer, 1))
        return total

    def recv_pages(self, pools: Sequence[torch.Tensor], runs: Sequence[Sequence[tuple[int, int, int]]],
                   tag: int = 0) -> int:  # fmt: skip
        """Rank 1: into pools[i][:, d:d+n] for each run (_, d, n) of runs[i]; the sender's transfer must carry
        `tag` and its runs the same lengths, in the same order (checked). Returns the bytes received."""
        parts = _parts(pools, runs, source=False)
        device, total = _device(pools), sum(p.numel() for p in parts)
        header = torch.zeros(3, dtype=torch.int64, device=device)
        self._wait(self.group.recv([header], self.peer, 0))
        sent_total, sent_parts, sent_tag = header.tolist()
        if sent_tag != tag:
            raise PairGroupError(f"the peer sends transfer {sent_tag}; transfer {tag} was expected")
        if [sent_total, sent_parts] != [total, len(parts)]:
            raise PairGroupError(f"the peer sends {sent_total} bytes in {sent_parts} runs; "
                                 f"{total} in {len(parts)} were reserved")
        if parts:
            shapes = torch.zeros(len(parts), 3, dtype=torch.int64, device=device)
            self._wait(self.group.recv([shapes], self.peer, 0))
            if not torch.equal(shapes, _shapes(parts, device)):
                raise PairGroupError("the peer's runs are split otherwise than the reserved ones")
        staging = torch.empty(min(total, MAX_MESSAGE_BYTES), dtype=torch.uint8, device=device)
        for message, pieces in _messages(parts):
            self._wait(self.group.recv([staging[:message]], self.peer, 1))
            for offset, segment in pieces:
                segment.copy_(staging[offset:offset + segment.numel()])
        return total

    def _wait(self, work) -> None:
        try:
            work.wait()
        except (RuntimeError, dist.DistError) as exc:
            raise PairGroupError(f"the transfer failed: {exc}") from None


def _device(pools: Sequence[torch.Tensor]) -> torch.device:
    return pools[0].device


def _parts(pools: Sequence[torch.Tensor], runs: Sequence[Sequence[tuple[int, int, int]]], source: bool) -> list:
    """The byte views the runs name, [layers, pages, bytes a page] each (a view: writes reach the pool), every
    run checked against its pool first."""
    if len(pools) != len(runs):
        raise ValueError(f"{len(pools)} pools and {len(runs)} run lists")
    if sum(len(r) for r in runs) > MAX_PARTS:
        raise ValueError(f"more than {MAX_PARTS} runs in one transfer")
    views = []
    for pool, pool_runs in zip(pools, runs):
        flat = pool_elements(pool)
        flat = flat.view(torch.uint8)  # bytes: an FP8 pool copied into the uint8 staging would convert values
        if flat.shape[1] > 1 and flat.stride(1) != flat.shape[2]:  # a layer's run must be one contiguous segment
            raise ValueError("a pool's pages must be contiguous within a layer")
        for s, d, n in pool_runs:
            start = s if source else d
            if not (n > 0 and 0 <= start and start + n <= pool.shape[1]):
                raise IndexError(f"run ({s}, {d}, {n}) outside a pool of {pool.shape[1]}")
            views.append(flat[:, start:start + n])
    return views


def _shapes(parts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    return torch.tensor([list(p.shape) for p in parts], dtype=torch.int64, device=device)


def _messages(parts: list[torch.Tensor]):
    """(message bytes, [(offset in the message, contiguous 1-D segment of a pool)]) per message: each part is
    its layers' runs (contiguous), cut where a message of MAX_MESSAGE_BYTES fills."""
    pieces, filled = [], 0
    for part in parts:
        for layer in part:
            segment = layer.reshape(-1)  # one layer's run of pages: contiguous, so a view
            done = 0
            while done < segment.numel():
                take = min(segment.numel() - done, MAX_MESSAGE_BYTES - filled)
                pieces.append((filled, segment[done:done + take]))
                filled, done = filled + take, done + take
                if filled == MAX_MESSAGE_BYTES:
                    yield filled, pieces
                    pieces, filled = [], 0
    if filled:
        yield filled, pieces
