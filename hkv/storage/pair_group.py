"""A pair process group between a prefill rank and a decode rank, and a prompt's pages through it in large messages.

The building block of the NCCL path of docs/pd.md ("Not built yet"): NCCL
between two GPUs, gloo between two CPU processes (CI runs this code over
gloo). Not yet wired into the ranks.

    decode rank (rank 1)                               prefill rank (rank 0)
    store, address = host_rendezvous("127.0.0.1")      (address and prefix come in a signed control message)
    group = PairGroup(address, prefix, 1, ...)         group = PairGroup(address, prefix, 0, ...)
    group.recv_pages(pools, runs)                      group.send_pages(pools, runs)

- The rendezvous store binds one interface (the caller's `--host`, loopback
  by default) and only for the join: the prefix is a one-time random name
  the decode side picks, so a stranger on the port cannot join this pair.
- A transfer first sends a header (its byte count and run count); the
  receiver refuses one that does not match what it reserved, before any
  page is written. Then the pages, packed into messages of at most
  `MAX_MESSAGE_BYTES` (all layers of a run together), then the receiver
  unpacks each into the reserved pages. Every run is checked against the
  pools before the first byte moves.
- Every wait is bounded by the group's timeout: a peer that never shows
  (killed, or gone another way) raises PairGroupError within it.
"""

from __future__ import annotations

import datetime
import socket
from collections.abc import Sequence

import torch
import torch.distributed as dist

from hkv_kernels.cache_copy.runs import pool_elements

MAX_MESSAGE_BYTES = 256 * 2**20  # one message: large enough for NCCL's high-bandwidth regime, bounded staging


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

    def __init__(self, address: str, prefix: str, rank: int, backend: str, timeout_s: float,
                 store: dist.TCPStore | None = None, bind: str | None = None):  # fmt: skip
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
                opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind or host)]
                self.group = dist.ProcessGroupGloo(prefixed, rank, 2, opts)
            else:
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                self.group = dist.ProcessGroupNCCL(prefixed, rank, 2, opts)
        except (RuntimeError, ValueError, dist.DistError) as exc:
            raise PairGroupError(f"the pair group did not form: {exc}") from None
        self.store = store  # kept alive: the decode side's store serves the join
        self.rank, self.backend = rank, backend
        self.peer = 1 - rank

    def close(self) -> None:
        try:
            self.group.shutdown()
        except (RuntimeError, AttributeError):
            pass

    def send_pages(self, pools: Sequence[torch.Tensor], runs: Sequence[Sequence[tuple[int, int, int]]]) -> int:
        """Rank 0: pools[i][:, s:s+n] for each run (s, _, n) of runs[i], in order; returns the bytes sent."""
        parts = _parts(pools, runs, source=True)
        flat = torch.cat([_bytes(p).reshape(-1) for p in parts]) if parts else None
        total = 0 if flat is None else flat.numel()
        self._wait(self.group.send([torch.tensor([total, len(parts)], dtype=torch.int64,
                                                 device=_device(pools))], self.peer, 0))
        for i in range(0, total, MAX_MESSAGE_BYTES):
            self._wait(self.group.send([flat[i:i + MAX_MESSAGE_BYTES]], self.peer, 1))
        return total

    def recv_pages(self, pools: Sequence[torch.Tensor], runs: Sequence[Sequence[tuple[int, int, int]]]) -> int:
        """Rank 1: into pools[i][:, d:d+n] for each run (_, d, n) of runs[i]; the sender's runs must have the
        same lengths, in the same order. Returns the bytes received."""
        parts = [_bytes(p) for p in _parts(pools, runs, source=False)]
        total = sum(p.numel() for p in parts)
        header = torch.zeros(2, dtype=torch.int64, device=_device(pools))
        self._wait(self.group.recv([header], self.peer, 0))
        if header.tolist() != [total, len(parts)]:
            raise PairGroupError(f"the peer sends {header[0].item()} bytes in {header[1].item()} runs; "
                                 f"{total} in {len(parts)} were reserved")
        flat = torch.empty(total, dtype=torch.uint8, device=_device(pools))
        for i in range(0, total, MAX_MESSAGE_BYTES):
            self._wait(self.group.recv([flat[i:i + MAX_MESSAGE_BYTES]], self.peer, 1))
        offset = 0
        for part in parts:  # every message is in: only now are the reserved pages written
            part.copy_(flat[offset:offset + part.numel()].view(part.shape))
            offset += part.numel()
        return total

    def _wait(self, work) -> None:
        try:
            work.wait()
        except (RuntimeError, dist.DistError) as exc:
            raise PairGroupError(f"the transfer failed: {exc}") from None


def _device(pools: Sequence[torch.Tensor]) -> torch.device:
    return pools[0].device


def _parts(pools: Sequence[torch.Tensor], runs: Sequence[Sequence[tuple[int, int, int]]], source: bool) -> list:
    """The views the runs name, [L, n, elements] each, every run checked against its pool first."""
    if len(pools) != len(runs):
        raise ValueError(f"{len(pools)} pools and {len(runs)} run lists")
    views = []
    for pool, pool_runs in zip(pools, runs):
        flat = pool_elements(pool)
        for s, d, n in pool_runs:
            start = s if source else d
            if not (n > 0 and 0 <= start and start + n <= pool.shape[1]):
                raise IndexError(f"run ({s}, {d}, {n}) outside a pool of {pool.shape[1]}")
            views.append(flat[:, start:start + n])
    return views


def _bytes(part: torch.Tensor) -> torch.Tensor:
    """A [L, n, elements] view (last dim contiguous) as its bytes, [L, n, elements * itemsize], still a view."""
    return part.view(torch.uint8) if part.element_size() != 1 else part
