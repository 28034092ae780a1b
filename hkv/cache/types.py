"""Settings, cache ops and the small result records of the cache bookkeeping.

Cache ops are msgspec Structs so the router can put them into a StepPlan as
they are; everything else is a frozen dataclass that never leaves the router.

Index convention used everywhere in hkv.cache: page i of a request holds the
tokens [i * page_size, (i + 1) * page_size) of its sequence.

    tokens   0 ......... P-1 | P ....... 2P-1 | 2P ... 2P+r-1 |
    pages [  page 0          | page 1          | page 2 (r < P tokens so far) ]
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec


@dataclass(frozen=True)
class CacheSpec:
    """The shape of the cache one CacheCoordinator keeps books for.

    page_size: tokens per KV page.
    num_pages: KV pages in the device pool (ids 0 .. num_pages-1).
    num_state_slots: linear-attention state slots (live states and checkpoints).
    num_window_slots: MTP draft windows (live windows and checkpointed ones).
    hybrid: the model has linear-attention layers, so a prefix is only usable
        up to a node that carries a state checkpoint.
    checkpoint_interval: tokens between prompt checkpoints (a multiple of
        page_size; the config also makes it one of 64, the GDN chunk, so the
        boundaries inside a prefill chunk are kept from its forward).
    prefix_cache: False turns reuse off: match finds nothing, publish keeps nothing.
    """

    page_size: int
    num_pages: int
    num_state_slots: int
    num_window_slots: int
    hybrid: bool
    checkpoint_interval: int | None
    prefix_cache: bool

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        for name in ("num_pages", "num_state_slots", "num_window_slots"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        interval = self.checkpoint_interval
        if interval is not None and (interval < 1 or interval % self.page_size):
            raise ValueError(f"checkpoint_interval {interval} must be a positive multiple of page_size {self.page_size}")
        if interval is not None and not self.hybrid:
            raise ValueError("checkpoint_interval is only meaningful for a hybrid model")


class RestoreCheckpoint(msgspec.Struct, frozen=True, tag="restore_checkpoint"):
    """Copy a cached checkpoint into a request's live slot; runs before the step's forward.

    Emitted by `Transaction.commit` when `match` hit a checkpoint. The source
    stays pinned (it cannot be evicted or reused) until the request publishes
    deeper, pauses or is released, so the copy always reads intact data.
    """

    src_slot: int  # state slot holding the checkpoint
    dst_slot: int  # the request's live state slot (its state_slots[0])
    length: int  # tokens the state covers: the request's computation resumes at this position
    src_window: int | None = None  # checkpointed draft window, when both sides have one
    dst_window: int | None = None  # the request's live draft window


class SaveCheckpoint(msgspec.Struct, frozen=True, tag="save_checkpoint"):
    """Copy a request's live state into a fresh checkpoint slot.

    Emitted by `CacheCoordinator.publish(..., checkpoint=True)`. The live slot
    must hold the state after exactly `length` tokens when the copy runs, so
    the router puts it in the next plan, before any forward that advances
    that request.
    """

    src_slot: int  # the request's live state slot (its state_slots[0])
    dst_slot: int  # the new checkpoint's slot, now owned by the radix tree
    length: int  # tokens the state covers == depth of the node carrying the checkpoint
    src_window: int | None = None  # the request's live draft window, when it drafts
    dst_window: int | None = None  # the checkpoint's window slot


class StorePages(msgspec.Struct, frozen=True, tag="store_pages"):
    """Copy device KV pages into CPU-tier entries (GPU -> CPU offload).

    The router keeps the source pages locked (a coordinator hold) and the
    cache worker keeps the destination entries reserved until the step that
    carries this op has run; pairs with an index out of range are skipped.
    """

    src_pages: list[int]  # device KV page ids, in sequence order
    dst_entries: list[int]  # CPU-tier page entries, one per source page


class StoreState(msgspec.Struct, frozen=True, tag="store_state"):
    """Copy a checkpoint's state slot into a CPU-tier state entry (runs after any SaveCheckpoint before it)."""

    src_slot: int  # state slot holding the checkpoint (pinned by the router's hold)
    dst_entry: int  # CPU-tier state entry, reserved by the cache worker


class LoadPages(msgspec.Struct, frozen=True, tag="load_pages"):
    """Copy CPU-tier page entries into a request's fresh device pages (a CPU or disk hit)."""

    src_entries: list[int]  # CPU-tier page entries, pinned by the cache worker until the step ran
    dst_pages: list[int]  # device pages the admitting transaction allocated, in sequence order


class LoadState(msgspec.Struct, frozen=True, tag="load_state"):
    """Copy a CPU-tier state entry into a request's live state slot (the hit's checkpoint)."""

    src_entry: int  # CPU-tier state entry, pinned until the step ran
    dst_slot: int  # the request's live state slot


class PeerCopy(msgspec.Struct, frozen=True, tag="peer_copy"):
    """Copy a prefill instance's device pages (and its checkpoint) into a request's fresh pages and live
    state slot, device to device over CUDA IPC (prefill/decode on one GPU, docs/pd.md)."""

    pools: str  # the prefill instance's pools document (hkv/storage/ipc_pools.py), from a checked ticket
    src_pages: list[int]  # the peer's device pages, held by its router until this step ran
    dst_pages: list[int]  # device pages the admitting transaction allocated, in sequence order
    src_slot: int | None  # the peer's checkpoint slot (hybrid), held with the pages
    dst_slot: int | None  # the request's live state slot


class PeerSend(msgspec.Struct, frozen=True, tag="peer_send"):
    """Prefill rank: send held device pages (and the checkpoint) to a decode rank through their pair group
    (NCCL across GPUs, gloo on CPU; hkv/engine/pair_transfers.py, docs/pd.md). The rank reports the end in
    a later StepResult (`transfers`)."""

    transfer_id: int  # the decode side's id for the transfer (its receiver refuses another's pages)
    address: str  # the decode rank's rendezvous host:port
    prefix: str  # the pair group's one-time name, the decode side's pick
    src_pages: list[int]  # this rank's held pages
    dst_pages: list[int]  # the decode side's reserved pages: both sides cut the same runs from the two lists
    src_slot: int | None  # the held checkpoint slot (hybrid)
    dst_slot: int | None  # the decode side's reserved state slot


class PeerRecv(msgspec.Struct, frozen=True, tag="peer_recv"):
    """Decode rank: receive a prefill rank's held pages (and checkpoint) into reserved ones through their pair
    group; the pages are the request's to use once a StepResult reports the transfer ok."""

    transfer_id: int
    peer: str  # the prefill instance's transporter (the rank keeps one worker, and one group, per peer)
    prefix: str
    src_pages: list[int]
    dst_pages: list[int]
    src_slot: int | None
    dst_slot: int | None


CacheOp = (RestoreCheckpoint | SaveCheckpoint | StorePages | StoreState | LoadPages | LoadState | PeerCopy | PeerSend
           | PeerRecv)


@dataclass(frozen=True)
class CheckpointRef:
    """Where a cached checkpoint lives: its state slot, draft window and token count."""

    slot: int
    window: int | None
    length: int


@dataclass(frozen=True)
class Hit:
    """What `Transaction.match` found: the first `length` tokens are served from the cache.

        prompt   [0 ............ length) [length ........... L)
                  cached pages(locked)    recomputed (>= 1 token)

    pages: page ids of [0, length), len(pages) == length // page_size; the
    request now uses them (shared with the tree, locked until it lets go).
    checkpoint: the state at `length` (hybrid models only); commit emits the
    RestoreCheckpoint that copies it into the request's live slot.
    """

    length: int
    pages: tuple[int, ...]
    checkpoint: CheckpointRef | None


@dataclass(frozen=True)
class Grant:
    """What a committed transaction leaves the request holding, and the ops to run.

    pages: every page the request uses, in position order (page i holds tokens
    [i*P, (i+1)*P)); pages[new_pages_from:] were added by this transaction.
    cursor: tokens that are (or after this step will be) in those pages.
    cached_tokens: tokens this transaction's match served from the cache.
    state_slots / window_slots: the request's live slots; index 0 is the live one.
    ops: cache ops for this step's plan, to run before its forward.
    checkpoints: the in-chunk checkpoints reserved and not yet published, shallowest
    first: the step's forward writes the state after `length` tokens into `slot`.
    """

    req_id: int
    pages: tuple[int, ...]
    new_pages_from: int
    cursor: int
    cached_tokens: int
    state_slots: tuple[int, ...]
    window_slots: tuple[int, ...]
    ops: tuple[CacheOp, ...]
    checkpoints: tuple[CheckpointRef, ...] = ()


@dataclass(frozen=True)
class Published:
    """What `publish` did.

    cached_tokens: tokens [0, cached_tokens) of the request now live in the tree.
    inserted_tokens: how many of them this call added (0 when another request
    had already cached them: the request's own copies stay its own until release).
    ops: a SaveCheckpoint when a checkpoint was taken, else empty.
    """

    cached_tokens: int
    inserted_tokens: int
    ops: tuple[CacheOp, ...]


@dataclass(frozen=True)
class Evicted:
    """How much an eviction or flush freed: tree pages and checkpoints."""

    pages: int
    checkpoints: int
