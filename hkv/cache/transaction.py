"""The handle of one all-or-nothing cache change, and the records it changes.

`CacheCoordinator.begin` returns a `Transaction`; its methods are the API. It
keeps its own state (what it matched, how far it extended) and checks the
call order; the coordinator (hkv/cache/coordinator.py) does the work on the
pools, the tree and the request records, and keeps the undo log.
`RequestState` is the coordinator's record of one request, `Hold` a
published prefix kept in place while a lower tier copies it out.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hkv.cache.errors import TransactionError
from hkv.cache.radix import Checkpoint, Node
from hkv.cache.types import CheckpointRef, Grant, Hit

if TYPE_CHECKING:
    from hkv.cache.coordinator import CacheCoordinator


@dataclass(frozen=True)
class Hold:
    """A published prefix kept in place while a lower tier copies it (see CacheCoordinator.hold)."""

    hold_id: int
    node: Node  # locked: its root path cannot be evicted
    checkpoint: Checkpoint | None  # pinned: the state at `length`, when the node carries one
    length: int  # tokens held, page-aligned
    pages: tuple[int, ...]  # device pages of [0, length), in sequence order


class Phase(enum.Enum):
    """Where a request stands with the coordinator."""

    NEW = "new"  # first transaction still open
    RUNNING = "running"  # committed at least once; holds what its grants gave it
    PAUSED = "paused"  # preempted: holds nothing; its next begin matches again


class RequestState:
    """The coordinator's record of one request (read-only outside this module)."""

    __slots__ = (
        "req_id", "phase", "pages", "duplicates", "cursor", "published", "lock", "held",
        "state_slots", "window_slots", "cached_tokens", "rolling", "pending",
    )  # fmt: skip

    def __init__(self, req_id: int):
        self.req_id: int = req_id
        self.phase: Phase = Phase.NEW
        self.pages: list[int] = []  # page i holds tokens [i*P, (i+1)*P)
        self.cursor: int = 0  # tokens computed, or being computed by the planned step
        self.published: int = 0  # tokens [0, published) are cached in the tree on lock's path
        # Its own copies of pages in [0, published) that another request cached first. With
        # pages[published // P:], these are the pages it alone holds (see owned_pages).
        self.duplicates: list[int] = []
        self.lock: Node | None = None  # the node whose root path this request locks
        self.held: Checkpoint | None = None  # checkpoint it restored from, pinned until it moves on
        self.state_slots: list[int] = []  # [0] is the live state; more for speculative candidates
        self.window_slots: list[int] = []  # [0] is the live draft window
        self.cached_tokens: int = 0  # tokens its latest match served from the cache
        # Its rolling checkpoint (publish(..., rolling=True)): the next checkpoint it publishes
        # moves this one's slot when it can. Stale once evicted; outlives a pause, not a release.
        self.rolling: Checkpoint | None = None
        # depth -> state slot reserved for an in-chunk checkpoint (reserve(checkpoints=...)): the step's
        # forward writes the state after `depth` tokens there; publish attaches it, release frees it
        self.pending: dict[int, int] = {}

    def owned_pages(self, page_size: int) -> list[int]:
        """Pages only this request holds: its duplicates, then every page past `published`.

            pages [ tree's or duplicate ... | own ........................ ]
                  0                published // P                     len(pages)
        """
        return self.duplicates + self.pages[self.published // page_size :]


class Transaction:
    """One all-or-nothing change for one request; created by `CacheCoordinator.begin`.

    The transaction owns its own state: whether it may still match, what its
    match locked and how far `extend` grew the hit. The coordinator owns the
    pools, the tree, the request records and the undo log; each method here
    checks the call order and then asks the coordinator for the work.

    Use as a context manager to roll back on an exception or when the block
    ends without `commit`.
    """

    def __init__(self, coord: "CacheCoordinator", req: RequestState, created: bool):
        self.req_id: int = req.req_id
        self.open: bool = True
        self._coord: CacheCoordinator = coord
        self._req: RequestState = req  # the coordinator's record: read here, written there only
        self._created: bool = created  # begin made the request's record; rollback removes it
        self._may_match: bool = req.phase is not Phase.RUNNING
        self._pages_before: int = len(req.pages)
        self._hit_node: Node | None = None  # the node match locked, touched (LRU) at commit
        self._hit_checkpoint: Checkpoint | None = None  # the checkpoint match pinned, restored at commit
        self._matched: bool = False  # match ran in this transaction (extend may follow it)
        self._extended: int = 0  # tokens a lower tier supplies past the hit (see extend)
        self._step_start: int | None = None  # the cursor at the first reserve: where the step's tokens start

    def _check_open(self) -> RequestState:
        # the coordinator's word, not only the flag: a closed handle stays closed whatever `open` says
        if not self.open or not self._coord._is_open(self):
            raise TransactionError(f"request {self.req_id}: the transaction is closed")
        return self._req

    def match(self, token_ids: list[int] | tuple[int, ...]) -> Hit:
        """Find and lock the longest reusable cached prefix of `token_ids`.

        Allowed once, first in the first transaction of a new or paused
        request. Dense: the deepest page-aligned cached prefix. Hybrid: the
        deepest node carrying a checkpoint. Either way at most len-1 tokens,
        so at least one prompt token is recomputed. Mutates (undone by
        rollback): locks the hit's path, pins its checkpoint, sets the
        request's pages to the hit's pages and its cursor to hit.length.
        """
        req = self._check_open()
        if not self._may_match or req.pages or req.state_slots or req.window_slots or req.pending:
            raise TransactionError(f"request {req.req_id}: match must come first in a new or paused request")
        self._may_match, self._matched = False, True
        hit, self._hit_node, self._hit_checkpoint = self._coord._match(req, token_ids)
        return hit

    def extend(self, tokens: int) -> tuple[int, ...]:
        """Grow the hit by `tokens` whose K/V (and state) a lower tier supplies (a CPU or disk hit).

            tokens  [0 ..... hit) [hit ........ hit + tokens) [ ... recomputed
            pages    tree's         fresh pages, own: the caller loads them

        Allowed right after `match` (before `reserve`); `tokens` is a positive
        multiple of the page size. Allocates the pages (evicting like reserve;
        CapacityError having changed nothing), advances the cursor and the
        cached count. The caller emits the loads (LoadPages, and LoadState into
        the live slot on a hybrid model), so commit emits no RestoreCheckpoint.
        Returns the new page ids, in sequence order.
        """
        req = self._check_open()
        P = self._coord.spec.page_size
        if (not self._matched or req.cursor != req.published + self._extended or req.state_slots
                or req.pending or len(req.pages) * P != req.cursor):
            raise TransactionError(f"request {req.req_id}: extend must follow match, before reserve")
        if tokens <= 0 or tokens % P:
            raise ValueError(f"extend({tokens}): a positive multiple of the page size {P}")
        pages = self._coord._extend(req, tokens)
        self._extended += tokens
        return pages

    def reserve(self, *, tokens: int = 0, pages: int = 0, state_slots: int = 0, window_slots: int = 0,
                checkpoints: tuple[int, ...] | list[int] = ()) -> None:
        """Reserve what the request's next step needs, evicting unreferenced cache entries.

        tokens: the step computes this many more tokens; the cursor advances
            by it and pages are added so [0, cursor) fits:
                before  [ page 0 | page 1 | p2 .. cursor)
                after   [ page 0 | page 1 | page 2 | p3 .. cursor + tokens)
        pages: extra pages beyond that (look-ahead); state_slots,
        window_slots: appended to the request's live slots.
        checkpoints: depths inside the step's tokens where its forward keeps the
            state (in-chunk checkpoints; hybrid, prefix cache on, no draft window):
            one state slot each, pending until `publish` attaches it at that depth
            (release, pause or rollback frees it). Increasing and page-aligned:
                step    [start ........................................ cursor + tokens)
                depths          ^ d1 ......... ^ d2     start < d1 < d2 < cursor + tokens
        Raises CapacityError having changed nothing (the transaction stays
        open: reserve less, or roll back). Eviction follows the tree's order.
        """
        req = self._check_open()
        if min(tokens, pages, state_slots, window_slots) < 0:
            raise ValueError("reserve amounts must be >= 0")
        self._may_match = False
        if self._step_start is None:
            self._step_start = req.cursor
        depths = tuple(checkpoints)
        if depths:
            self._check_checkpoints(req, depths, req.cursor + tokens, window_slots)
        self._coord._reserve(req, tokens, pages, state_slots, window_slots, depths)

    def _check_checkpoints(self, req: RequestState, depths: tuple[int, ...], end: int, window_slots: int) -> None:
        """ValueError unless `depths` may be reserved as in-chunk checkpoints of a step ending at `end`."""
        spec = self._coord.spec
        if not (spec.hybrid and spec.prefix_cache) or window_slots or req.window_slots:
            raise ValueError("in-chunk checkpoints need a hybrid model, the prefix cache and no draft window")
        bounds = (self._step_start, *depths, end)
        if any(a >= b for a, b in zip(bounds, bounds[1:])) or any(d % spec.page_size for d in depths):
            raise ValueError(f"checkpoints {depths}: increasing page boundaries inside ({self._step_start}, {end})")
        if set(depths) & req.pending.keys():
            raise ValueError(f"checkpoints {depths}: reserved already")

    def commit(self) -> Grant:
        """Close the transaction keeping every change; returns the request's holdings and ops.

        Raises TransactionError (after rolling back) when a checkpoint hit
        has no live state slot to restore into.
        """
        req = self._check_open()
        # a tier run loaded past the hit replaces the checkpoint's state (the caller's LoadState)
        restore = self._hit_checkpoint if not self._extended else None
        if restore is not None and not req.state_slots:
            self.rollback()
            raise TransactionError(f"request {req.req_id}: a checkpoint hit needs a live state slot")
        ops = self._coord._commit(req, self._hit_node, restore)
        self.open = False
        served = self._hit_node is not None or self._extended > 0
        pending = tuple(CheckpointRef(slot, None, depth) for depth, slot in sorted(req.pending.items()))
        return Grant(
            req.req_id, tuple(req.pages), self._pages_before, req.cursor, req.cached_tokens if served else 0,
            tuple(req.state_slots), tuple(req.window_slots), ops, pending,
        )  # fmt: skip

    def rollback(self) -> None:
        """Close the transaction undoing every change: pools, tree, locks, cursor."""
        req = self._check_open()
        self.open = False
        self._coord._rollback(req, forget=self._created)

    def __enter__(self) -> "Transaction":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.open:
            self.rollback()
