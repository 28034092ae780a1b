"""A prefill peer's pages and checkpoint copied into this rank's pools by one captured CUDA graph.

Why: the decode rank times a transfer with CUDA events around its copies. Launched from Python
(a strided copy per run of pages, then one per state tensor), the copies sat behind host time
inside that window: each launch took 25-390 us (more after the rank idled), the GPU waited on it,
and the same 0.2 ms of copying measured 0.29-0.74 ms from one device call to the next
(docs/benchmarks.md). Here a transfer is one graph launch: the pages (`copy_blocks` over an index
list padded with -1, which the kernel skips) and the conv and recurrent slots.

    buckets     MIN_BUCKET pages and up: each power of two and the midpoint 1.5x above it (at most a
                third of a bucket is padding), up to the pages one sequence can hold
    arena[b]    int64 [2, b + 2] on the device: row 0 the peer's side, row 1 this rank's;
                columns 0..b-1 the pages (-1 past the transfer's), column b the state slot
                (-1 for dense models, which have no state); b + 2 columns keep every row and
                view 16-byte aligned, so the kernels are the ones `warm_up` compiles
    a transfer  n pages: the smallest bucket b >= n; its indexes go up in one pinned host-to-device
                copy (queued before the timed window, as the eager copy_blocks index upload is),
                then graph[peer, b] replays

A peer's graphs are captured the first time it sends a copy (that copy also maps its pools), on a
side stream, without the synchronize and cache flush torch.cuda.graph adds; the kernels they replay
are compiled at start-up (`warm_up`, with this rank's own pools standing in for a peer's). The
graphs hold the peer's raw pointers, so each entry keeps its peer's tensors alive, and an entry
goes when PeerPools lets the peer's mapping go (`live`: the documents it still maps). A transfer
past the largest bucket, or a peer whose capture failed (logged once), is copied eagerly by the
caller. Off CUDA (tests) the same arenas and copies run eagerly.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Collection

import torch

from hkv.storage.ipc_pools import MAX_PEERS
from hkv_kernels.dispatch import copy_blocks

log = logging.getLogger("hkv.rank")
MIN_BUCKET = 16  # pages: a one-page second turn pads to 16 (a few empty programs)


def buckets(max_pages: int) -> list[int]:
    """The page counts captured: MIN_BUCKET, 1.5x, 2x, 3x, 4x ... up to the first of them >= max_pages."""
    sizes = [MIN_BUCKET]
    while sizes[-1] < max_pages:
        b = sizes[-1]
        sizes.append(b * 3 // 2 if b & (b - 1) == 0 else b // 3 * 4)  # 16, 24, 32, 48, 64, ...
    return sizes


class PeerCopyGraphs:
    """Captured peer copies by page-count bucket, per peer, and their index arenas."""

    def __init__(self, kv: torch.Tensor, conv: torch.Tensor | None, recurrent: torch.Tensor | None, max_pages: int,
                 live: Callable[[], Collection[str]] | None = None):  # fmt: skip
        if max_pages < 1:
            raise ValueError(f"a peer copy graph needs at least one page, got {max_pages}")
        self.kv, self.conv, self.recurrent = kv, conv, recurrent  # this rank's pools ([2L, pages, ...], [L, slots, ...])
        self.device = kv.device
        self.sizes: list[int] = buckets(max_pages)
        self.arenas = {b: torch.full((2, b + 2), -1, dtype=torch.long, device=self.device) for b in self.sizes}
        self._live = live  # the peer documents whose mappings are still open (PeerPools.documents)
        self._peers: OrderedDict[str, tuple[dict[str, torch.Tensor], dict[int, torch.cuda.CUDAGraph | None] | None]]
        self._peers = OrderedDict()
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
        arena = self.arenas[b]
        host = torch.full((2, b + 2), -1, dtype=torch.long, pin_memory=arena.is_cuda)
        host[0, :n], host[1, :n] = torch.tensor(src_pages), torch.tensor(dst_pages)
        if src_slot is not None and self.conv is not None:
            host[0, b], host[1, b] = src_slot, dst_slot
        arena.copy_(host, non_blocking=arena.is_cuda)  # pinned: the caching host allocator keeps it until copied
        graph = graphs[b]
        return (graph.replay if graph is not None else lambda: self._copies(peer, b)), b

    def _copies(self, peer: dict[str, torch.Tensor], b: int) -> None:
        """The transfer of bucket b from the arena: pages, then one slot of each state tensor."""
        idx = self.arenas[b]
        copy_blocks(peer["kv"], self.kv, idx[0, :b], idx[1, :b])
        if self.conv is not None:
            copy_blocks(peer["conv"], self.conv, idx[0, b:b + 1], idx[1, b:b + 1])
            copy_blocks(peer["recurrent"], self.recurrent, idx[0, b:b + 1], idx[1, b:b + 1])

    def warm_up(self) -> None:
        """Compile and load the kernels the graphs replay (start-up), copying nothing: this rank's own
        pools stand in for a peer's, every index -1."""
        own = {"kv": self.kv}
        if self.conv is not None:
            own.update(conv=self.conv, recurrent=self.recurrent)
        b = self.sizes[0]
        self.arenas[b].fill_(-1)
        with torch.inference_mode():
            self._copies(own, b)

    def _graphs(self, key: str, peer: dict[str, torch.Tensor]) -> dict[int, torch.cuda.CUDAGraph | None] | None:
        """The peer's graphs by bucket (captured at its first transfer); None: its capture failed."""
        entry = self._peers.get(key)
        if entry is not None:
            self._peers.move_to_end(key)
            return entry[1]
        if self._live is not None:  # entries whose mapping PeerPools let go (its LRU, or a restarted peer)
            live = set(self._live())
            for gone in [k for k in self._peers if k not in live]:
                del self._peers[gone]
        graphs: dict[int, torch.cuda.CUDAGraph | None] | None = {}
        try:
            small = self.sizes[0]
            self.arenas[small].fill_(-1)
            # every index -1: copies nothing; loads this peer's kernel variants (its pool sizes) outside the
            # captures, once: the buckets differ only in grid, their aligned arena views in nothing Triton keys on
            self._copies(peer, small)
            for b in self.sizes:
                graphs[b] = self._capture(peer, b)
        except Exception as exc:
            first = exc.__context__ or exc  # a capture that failed inside raises again from capture_end
            log.warning("peer copy graphs not captured (%s: %s); this peer's transfers are copied eagerly",
                        type(first).__name__, first)
            graphs = None
        self._peers[key] = (peer, graphs)
        while len(self._peers) > MAX_PEERS:
            self._peers.popitem(last=False)
        if graphs is not None and self.device.type == "cuda":
            log.info("peer copy graphs: %d buckets of %d to %d pages captured", len(self.sizes), self.sizes[0],
                     self.sizes[-1])
        return graphs

    def _capture(self, peer: dict[str, torch.Tensor], b: int) -> torch.cuda.CUDAGraph | None:
        self.arenas[b].fill_(-1)  # a capture records no values, but a replay before an upload must copy nothing
        if self._stream is None:
            return None
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):  # put back even when the capture fails
            # its own (empty) memory pool: the copies allocate nothing, and a pool shared with graphs a failed
            # capture dropped would refuse the next peer's captures
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                self._copies(peer, b)
            finally:
                graph.capture_end()
        current.wait_stream(self._stream)
        return graph
