"""A prefill peer's pages and checkpoint copied into this rank's pools by one captured CUDA graph.

Why: the decode rank times a transfer with CUDA events around its copies. Launched from Python
(a strided copy per run of pages, then one per state tensor), the copies sat behind host time
inside that window: each launch took 25-390 us (more after the rank idled), the GPU waited on it,
and the same 0.2 ms of copying measured 0.29-0.74 ms from one device call to the next
(docs/benchmarks.md). Here a transfer is one graph launch: the pages (`copy_blocks` over an index
list padded with -1, which the kernel skips) and the conv and recurrent slots.

    buckets     the powers of two from MIN_BUCKET up to the pages one sequence can hold
    arena[b]    int64 [2, b + 1] on the device: row 0 the peer's side, row 1 this rank's;
                columns 0..b-1 the pages (-1 past the transfer's), column b the state slot
                (-1 for dense models, which have no state)
    a transfer  n pages: the smallest bucket b >= n; its indexes go up in one pinned host-to-device
                copy (queued before the timed window, as the eager copy_blocks index upload is),
                then graph[peer, b] replays

A peer's graphs are captured the first time it sends a copy (that copy also maps its pools), on a
side stream, without the synchronize and cache flush torch.cuda.graph adds. The graphs hold the
peer's raw pointers, so each peer entry keeps its tensors alive; at most MAX_PEERS peers are held,
as PeerPools maps (the oldest let go first). A transfer past the largest bucket, or a peer whose
capture failed (logged once), is copied eagerly by the caller. Off CUDA (tests) the same arenas
and copies run eagerly.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch

from hkv.storage.ipc_pools import MAX_PEERS
from hkv_kernels.dispatch import copy_blocks

log = logging.getLogger("hkv.rank")
MIN_BUCKET = 16  # pages: a one-page second turn pads to 16 (a few empty programs)


def buckets(max_pages: int) -> list[int]:
    """The page counts captured: MIN_BUCKET, 2 * MIN_BUCKET, ... up to the first power of two >= max_pages."""
    sizes = [MIN_BUCKET]
    while sizes[-1] < max_pages:
        sizes.append(sizes[-1] * 2)
    return sizes


class PeerCopyGraphs:
    """Captured peer copies by page-count bucket, per peer, and their index arenas."""

    def __init__(self, kv: torch.Tensor, conv: torch.Tensor | None, recurrent: torch.Tensor | None, max_pages: int):
        if max_pages < 1:
            raise ValueError(f"a peer copy graph needs at least one page, got {max_pages}")
        self.kv, self.conv, self.recurrent = kv, conv, recurrent  # this rank's pools ([2L, pages, ...], [L, slots, ...])
        self.device = kv.device
        self.sizes: list[int] = buckets(max_pages)
        self.arenas = {b: torch.full((2, b + 1), -1, dtype=torch.long, device=self.device) for b in self.sizes}
        self._peers: OrderedDict[str, tuple[dict[str, torch.Tensor], dict[int, torch.cuda.CUDAGraph | None] | None]]
        self._peers = OrderedDict()
        self._pool = None  # one memory pool for every capture (the copies allocate nothing)
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def bucket(self, n: int) -> int | None:
        """The smallest bucket that holds n pages; None past the largest (or for n < 1)."""
        return next((b for b in self.sizes if b >= n), None) if n >= 1 else None

    def prepare(self, key: str, peer: dict[str, torch.Tensor], src_pages: list[int], dst_pages: list[int],
                src_slot: int | None, dst_slot: int | None):  # fmt: skip
        """Upload a validated transfer's indexes; returns (replay, bucket) to launch it, or None when
        this transfer is copied eagerly (too many pages, or the peer's capture failed)."""
        b = self.bucket(len(src_pages))
        if b is None:
            return None
        graphs = self._graphs(key, peer)
        if graphs is None:
            return None
        n = len(src_pages)
        host = torch.full((2, b + 1), -1, dtype=torch.long)
        host[0, :n], host[1, :n] = torch.tensor(src_pages), torch.tensor(dst_pages)
        if src_slot is not None and self.conv is not None:
            host[0, b], host[1, b] = src_slot, dst_slot
        arena = self.arenas[b]
        if arena.is_cuda:
            arena.copy_(host.pin_memory(), non_blocking=True)  # the caching host allocator keeps it until copied
        else:
            arena.copy_(host)
        graph = graphs[b]
        return (graph.replay if graph is not None else lambda: self._copies(peer, b)), b

    def _copies(self, peer: dict[str, torch.Tensor], b: int) -> None:
        """The transfer of bucket b from the arena: pages, then one slot of each state tensor."""
        idx = self.arenas[b]
        copy_blocks(peer["kv"], self.kv, idx[0, :b], idx[1, :b])
        if self.conv is not None:
            copy_blocks(peer["conv"], self.conv, idx[0, b:], idx[1, b:])
            copy_blocks(peer["recurrent"], self.recurrent, idx[0, b:], idx[1, b:])

    def _graphs(self, key: str, peer: dict[str, torch.Tensor]) -> dict[int, torch.cuda.CUDAGraph | None] | None:
        """The peer's graphs by bucket (captured at its first transfer); None: its capture failed."""
        entry = self._peers.get(key)
        if entry is not None:
            self._peers.move_to_end(key)
            return entry[1]
        graphs: dict[int, torch.cuda.CUDAGraph | None] | None = {}
        try:
            for b in self.sizes:
                graphs[b] = self._capture(peer, b)
        except Exception as exc:
            log.warning("peer copy graphs not captured (%s: %s); this peer's transfers are copied eagerly",
                        type(exc).__name__, exc)
            graphs = None
        self._peers[key] = (peer, graphs)
        while len(self._peers) > MAX_PEERS:
            self._peers.popitem(last=False)
        if graphs is not None and self.device.type == "cuda":
            log.info("peer copy graphs: %d buckets of %d to %d pages captured", len(self.sizes), self.sizes[0],
                     self.sizes[-1])
        return graphs

    def _capture(self, peer: dict[str, torch.Tensor], b: int) -> torch.cuda.CUDAGraph | None:
        arena = self.arenas[b]
        arena.fill_(-1)
        self._copies(peer, b)  # every index -1: copies nothing, compiles and loads the kernels outside the capture
        if self._stream is None:
            return None
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):  # put back even when the capture fails
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                self._copies(peer, b)
            finally:
                graph.capture_end()
        current.wait_stream(self._stream)
        if self._pool is None:
            self._pool = graph.pool()
        return graph
