"""The handle of one all-or-nothing cache change, and the records it changes.

`CacheCoordinator.begin` returns a `Transaction`; its methods are the API and
the coordinator (hkv/cache/coordinator.py) does the work. `RequestState` is the
coordinator's record of one request, `Hold` a published prefix kept in place
while a lower tier copies it out.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from hkv.cache.radix import Checkpoint, Node
from hkv.cache.types import Grant, Hit

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
        "state_slots", "window_slots", "cached_tokens",
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

    def owned_pages(self, page_size: int) -> list[int]:
        """Pages only this request holds: its duplicates, then every page past `published`.

            pages [ tree's or duplicate ... | own ........................ ]
                  0                published // P                     len(pages)
        """
        return self.duplicates + self.pages[self.published // page_size :]


class Transaction:
    """One all-or-nothing change for one request; created by `CacheCoordinator.begin`.

    Use as a context manager to roll back on an exception or when the block
    ends without `commit`.
    """

    def __init__(self, coord: "CacheCoordinator", req: RequestState, created: bool):
        self.req_id: int = req.req_id
        self.open: bool = True
        self._coord: CacheCoordinator = coord
        self._req: RequestState = req
        self._created: bool = created  # begin made the request's record; rollback removes it
        self._may_match: bool = req.phase is not Phase.RUNNING
        self._pages_before: int = len(req.pages)
        self._hit_node: Node | None = None
        self._hit_ckpt: Checkpoint | None = None
        self._matched: bool = False  # match ran in this transaction (extend may follow it)
        self._extended: int = 0  # tokens a lower tier supplies past the hit (see extend)
        self._undo: list[Callable[[], None]] = []

    def match(self, token_ids: list[int] | tuple[int, ...]) -> Hit:
        """Find and lock the longest reusable cached prefix of `token_ids`.

        Allowed once, first in the first transaction of a new or paused
        request. Dense: the deepest page-aligned cached prefix. Hybrid: the
        deepest node carrying a checkpoint. Either way at most len-1 tokens,
        so at least one prompt token is recomputed. Mutates (undone by
        rollback): locks the hit's path, pins its checkpoint, sets the
        request's pages to the hit's pages and its cursor to hit.length.
        """
        return self._coord._match(self, token_ids)

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
        return self._coord._extend(self, tokens)

    def reserve(self, *, tokens: int = 0, pages: int = 0, state_slots: int = 0, window_slots: int = 0) -> None:
        """Reserve what the request's next step needs, evicting unreferenced cache entries.

        tokens: the step computes this many more tokens; the cursor advances
            by it and pages are added so [0, cursor) fits:
                before  [ page 0 | page 1 | p2 .. cursor)
                after   [ page 0 | page 1 | page 2 | p3 .. cursor + tokens)
        pages: extra pages beyond that (look-ahead); state_slots,
        window_slots: appended to the request's live slots.
        Raises CapacityError having changed nothing (the transaction stays
        open: reserve less, or roll back). Eviction follows the tree's order.
        """
        self._coord._reserve(self, tokens, pages, state_slots, window_slots)

    def commit(self) -> Grant:
        """Close the transaction keeping every change; returns the request's holdings and ops.

        Raises TransactionError (after rolling back) when a checkpoint hit
        has no live state slot to restore into.
        """
        return self._coord._commit(self)

    def rollback(self) -> None:
        """Close the transaction undoing every change: pools, tree, locks, cursor."""
        self._coord._rollback(self)

    def __enter__(self) -> "Transaction":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.open:
            self.rollback()
