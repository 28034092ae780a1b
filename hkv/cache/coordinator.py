"""The CacheCoordinator: the only cache API the scheduler calls.

It owns the page pool, the state-slot and draft-window pools and the radix
tree, and keeps one record per request. Every change goes through an undo
log, so a transaction (and a publish) is all-or-nothing:

    txn = coord.begin(req_id)          open; nothing has changed yet
    hit = txn.match(prompt_ids)        lock the cached prefix (first txn only)
    txn.reserve(tokens=n, state_slots=1, checkpoints=(d, ...))   evict + allocate, or CapacityError (no change)
    grant = txn.commit()               keep it all; ops for this step's plan
    txn.rollback()                     (instead of commit) undo it all, exactly

    coord.publish(req_id, token_ids, upto, checkpoint=..., rolling=...)   cache computed pages
    coord.pause(req_id) / coord.release(req_id)              give resources back

A request's pages, in position order, and what owns each:

    tokens  [0 ........ published) [published ........ cursor) [cursor .. len(pages)*P)
    pages   tree's (locked), or     the request's own           reserved ahead, own
            the request's own
            duplicates of them

One transaction is open at a time, and publish/pause/release/flush/evict
refuse to run while it is. See docs/cache.md for the router's call sequence.
"""

from __future__ import annotations

import itertools
from typing import Callable, Iterator

from hkv.cache.checkpoints import CheckpointPlacement
from hkv.cache.errors import CapacityError, TransactionError
from hkv.cache.pools import IdPool, PagePool, SlotPool
from hkv.cache.radix import Checkpoint, Node, RadixTree, TreeEviction
from hkv.cache.transaction import Hold, Phase, RequestState, Transaction
from hkv.cache.types import (
    CacheOp, CacheSpec, CheckpointRef, Evicted, Hit, Published, RestoreCheckpoint,
)  # fmt: skip


class CacheCoordinator(CheckpointPlacement):
    """Pools + radix tree + request records, changed only through transactions.

    fault: test hook called with the name of a point inside reserve and
    publish ("reserve.evicted", "publish.inserted", "publish.checkpointed");
    raising from it simulates a failure there, which must undo everything.
    """

    def __init__(self, spec: CacheSpec, fault: Callable[[str], None] | None = None):
        self.spec: CacheSpec = spec
        self.pages: PagePool = PagePool(spec.num_pages, spec.page_size)
        self.state_slots: SlotPool = SlotPool("state_slots", spec.num_state_slots)
        self.window_slots: SlotPool = SlotPool("window_slots", spec.num_window_slots)
        # never-hit checkpoints go first: a prefix that keeps being hit outlives the one-time checkpoints of
        # every prompt's end and finish, for twice the state pool's slots in stores and hits (checkpoint_rank)
        self.tree: RadixTree = RadixTree(spec.page_size, checkpoint_horizon=2 * spec.num_state_slots)
        self.requests: dict[int, RequestState] = {}  # read-only outside this module
        self._txn: Transaction | None = None  # the open transaction, if any (one at a time)
        self._undo: list[Callable[[], None]] | None = None  # the open transaction's or publish's undo log
        self._fault: Callable[[str], None] | None = fault
        self.holds: dict[int, Hold] = {}  # hold id -> a prefix being copied to a lower tier
        self._hold_ids: Iterator[int] = itertools.count(1)

    def _log(self, undo: Callable[[], None]) -> None:
        if self._undo is not None:
            self._undo.append(undo)

    def _undo_to(self, mark: int) -> None:
        log = self._undo
        while len(log) > mark:
            log.pop()()

    def _fault_point(self, name: str) -> None:
        if self._fault is not None:
            self._fault(name)

    def _alloc(self, pool: IdPool, n: int) -> list[int]:
        ids = pool.allocate(n)
        self._log(lambda: pool.unallocate(ids))
        return ids

    def _free(self, pool: IdPool, ids: list[int]) -> None:
        pool.free(ids)
        self._log(lambda: pool.unfree(ids))

    def begin(self, req_id: int) -> Transaction:
        """Open the (single) transaction for `req_id`, registering it if unknown.

        A new or paused request's transaction may `match`; a running one's
        only reserves more (the next chunk, a decode page). Raises
        TransactionError while another transaction is open.
        """
        if self._txn is not None:
            raise TransactionError(f"begin({req_id}) while request {self._txn.req_id}'s transaction is open")
        req = self.requests.get(req_id)
        created = req is None
        if req is None:
            req = self.requests[req_id] = RequestState(req_id)
        self._txn, self._undo = Transaction(self, req, created), []
        return self._txn

    def _match(self, req: RequestState, token_ids) -> tuple[Hit, Node | None, Checkpoint | None]:
        """Transaction.match's work: lock the hit's path, pin its checkpoint, point the request at it.

        Returns the hit, and the node locked and checkpoint pinned (None, None on a miss).
        """
        if not self.spec.prefix_cache or len(token_ids) < 2:
            return Hit(0, (), None), None, None
        found = self.tree.match(tuple(token_ids), len(token_ids) - 1)
        node, length = found.node, found.length
        if self.spec.hybrid:
            node = found.checkpoint_node
            length = 0 if node is None else node.depth
        if node is None or length == 0:
            return Hit(0, (), None), None, None
        pages = self.tree.path_pages(node, length)  # a fresh list: the request's from now on
        self.tree.lock(node)
        ckpt = node.checkpoint if self.spec.hybrid else None
        if ckpt is not None:
            self.tree.hold(ckpt)
        old_cached = req.cached_tokens
        req.pages, req.cursor, req.published, req.lock, req.held = pages, length, length, node, ckpt
        req.cached_tokens = length
        self._log(lambda: self._unmatch(req, node, ckpt, old_cached))
        ref = None if ckpt is None else CheckpointRef(ckpt.slot, ckpt.window, ckpt.length)
        return Hit(length, tuple(pages), ref), node, ckpt

    def _unmatch(self, req: RequestState, node: Node, ckpt: Checkpoint | None, cached_tokens: int) -> None:
        if ckpt is not None:
            self.tree.unhold(ckpt)
        self.tree.unlock(node)
        req.pages, req.cursor, req.published, req.lock, req.held = [], 0, 0, None, None
        req.cached_tokens = cached_tokens

    def _extend(self, req: RequestState, tokens: int) -> tuple[int, ...]:
        """Transaction.extend's work (order and amount checked there): fresh pages for `tokens` more."""
        need = tokens // self.spec.page_size
        self._check_room(need, 0, 0)
        mark = len(self._undo)
        try:
            self._make_room(need, 0, 0)
            start = len(req.pages)
            self._grant(req, need, 0, 0)
            old = (req.cursor, req.cached_tokens)
            req.cursor += tokens
            req.cached_tokens = req.cursor

            def undo() -> None:
                req.cursor, req.cached_tokens = old

            self._log(undo)
        except BaseException:
            self._undo_to(mark)
            raise
        return tuple(req.pages[start:])

    def _reserve(self, req: RequestState, tokens: int, pages: int, state_slots: int, window_slots: int,
                 checkpoints: tuple[int, ...] = ()) -> None:
        """Transaction.reserve's work: room for the cursor + `tokens`, plus the extras asked for
        (`checkpoints`: depths, checked there, each taking a state slot into req.pending)."""
        cursor = req.cursor + tokens
        need_pages = max(0, self.pages.pages_for(cursor) - len(req.pages)) + pages
        self._check_room(need_pages, state_slots + len(checkpoints), window_slots)
        mark = len(self._undo)
        try:
            self._make_room(need_pages, state_slots + len(checkpoints), window_slots)
            self._fault_point("reserve.evicted")
            self._grant(req, need_pages, state_slots, window_slots)
            if checkpoints:
                old_pending = req.pending
                req.pending = {**old_pending, **dict(zip(checkpoints, self._alloc(self.state_slots, len(checkpoints))))}
                self._log(lambda: setattr(req, "pending", old_pending))
            old_cursor = req.cursor
            req.cursor = cursor
            self._log(lambda: setattr(req, "cursor", old_cursor))
        except BaseException:
            self._undo_to(mark)
            raise

    def _check_room(self, pages: int, state_slots: int, window_slots: int) -> None:
        """Raise CapacityError unless free + evictable covers each need; changes nothing."""
        tree = self.tree
        for pool, need, evictable in (
            (self.pages, pages, tree.evictable_pages),
            (self.state_slots, state_slots, tree.evictable_checkpoints),
            (self.window_slots, window_slots, tree.evictable_windows),
        ):
            if need > pool.free_count + evictable:
                raise CapacityError(pool.name, need, pool.free_count, evictable)

    def _make_room(self, pages: int, state_slots: int, window_slots: int) -> None:
        """Evict until each pool has the free ids asked for; the caller checked it can."""
        # (not `assert self._evict_leaf()`: under python -O that would never evict)
        while self.pages.free_count < pages:
            if not self._evict_leaf():
                raise AssertionError("evictable_pages overstated")
        while self.state_slots.free_count < state_slots:
            if not self._evict_checkpoint(False):
                raise AssertionError("evictable_checkpoints overstated")
        while self.window_slots.free_count < window_slots:
            if not self._evict_checkpoint(True):
                raise AssertionError("evictable_windows overstated")

    def _evict_leaf(self) -> bool:
        evicted = self.tree.evict_leaf()
        if evicted is None:
            return False
        node, ckpt = evicted
        self._log(lambda: self.tree.reattach(node, ckpt))
        self._free(self.pages, node.pages)
        if ckpt is not None:
            self._free_checkpoint_slots(ckpt)
        return True

    def _evict_checkpoint(self, with_window: bool) -> bool:
        ckpt = self.tree.evict_checkpoint(with_window)
        if ckpt is None:
            return False
        self._log(lambda: self.tree.reattach_checkpoint(ckpt))
        self._free_checkpoint_slots(ckpt)
        return True

    def _free_checkpoint_slots(self, ckpt: Checkpoint) -> None:
        self._free(self.state_slots, [ckpt.slot])
        if ckpt.window is not None:
            self._free(self.window_slots, [ckpt.window])

    def _grant(self, req: RequestState, pages: int, state_slots: int, window_slots: int) -> None:
        """Allocate into the request's lists; each append is logged for rollback."""
        for pool, n, held in (
            (self.pages, pages, req.pages),
            (self.state_slots, state_slots, req.state_slots),
            (self.window_slots, window_slots, req.window_slots),
        ):
            if n == 0:
                continue
            ids = self._alloc(pool, n)
            start = len(held)
            held.extend(ids)
            self._log(lambda held=held, start=start: held.__delitem__(slice(start, None)))

    def _commit(self, req: RequestState, hit_node: Node | None, restore: Checkpoint | None) -> tuple[CacheOp, ...]:
        """Transaction.commit's work: keep every change, touch the hit, close.

        restore: the checkpoint to copy into the request's live slot (the
        caller checked it has one); returns its RestoreCheckpoint op.
        """
        ops: tuple[CacheOp, ...] = ()
        if restore is not None:
            src_window = restore.window if req.window_slots else None
            dst_window = req.window_slots[0] if src_window is not None else None
            ops = (RestoreCheckpoint(restore.slot, req.state_slots[0], restore.length, src_window, dst_window),)
            self.tree.touch_checkpoint(restore, hit=True)
        if hit_node is not None:
            self.tree.touch(hit_node)
        req.phase = Phase.RUNNING
        self._close()
        return ops

    def _rollback(self, req: RequestState, forget: bool) -> None:
        """Transaction.rollback's work: replay the undo log; forget a request the transaction registered."""
        self._undo_to(0)
        if forget:
            del self.requests[req.req_id]
        self._close()

    def _close(self) -> None:
        self._txn, self._undo = None, None

    def _is_open(self, txn: Transaction) -> bool:
        """True while `txn` is the open transaction."""
        return self._txn is txn

    def _refuse_in_transaction(self, what: str) -> None:
        """Raise TransactionError while a transaction is open (`what` names the refused call)."""
        if self._txn is not None:
            raise TransactionError(f"{what} while request {self._txn.req_id}'s transaction is open")

    def _record_outside_transaction(self, req_id: int, what: str) -> RequestState:
        """The request's record, for a call that must run between transactions (`what` names it).

        Raises TransactionError while a transaction is open or when the request is unknown.
        """
        self._refuse_in_transaction(f"{what}({req_id})")
        req = self.requests.get(req_id)
        if req is None:
            raise TransactionError(f"{what}({req_id}): unknown request")
        return req

    def publish(self, req_id: int, token_ids, upto: int, checkpoint: bool = False, rolling: bool = False) -> Published:
        """Cache the request's computed prefix token_ids[:upto], rounded down to a page.

            token_ids [0 .... published) [published ..... aligned) [aligned .. upto)
                       already cached      inserted now              partial page, kept private

        Pages another request already cached stay the request's own
        duplicates until release; the rest move to the tree. The request's
        lock moves to the node ending at `aligned` (it never moves up), and
        the checkpoint it restored from is unpinned.
        checkpoint=True (hybrid; upto must be page-aligned and equal the
        position the live state is at): attach a checkpoint there and return
        its SaveCheckpoint op, or none when the node already has one or no
        slot can be had. The slot is the request's rolling checkpoint's when
        that one can move (see `_checkpoint`), else a fresh one, evicting LRU
        checkpoints for it (plus a window if the request drafts).
        rolling=True (with checkpoint=True): the checkpoint becomes the
        request's rolling one, which its next checkpointed publish moves on;
        rolling=False makes it permanent. A checkpoint pending at a depth in
        (published, aligned] (reserved with `checkpoints=`: the forward wrote
        it) is attached there, permanent and without an op, whatever the flags;
        the shallower ones first, each by a publish of its own depth:
            token_ids [published .. d1)[d1 ...... d2)[d2 ....... aligned)
            ckpts                  ^ pending     ^ pending      ^ checkpoint=True: as above
        All-or-nothing: a failure inside undoes it all (the moved checkpoint
        goes back where it was).
        """
        req = self._record_outside_transaction(req_id, "publish")
        if req.phase is not Phase.RUNNING:
            raise TransactionError(f"publish({req_id}): the request is {req.phase.value}")
        if checkpoint and (not self.spec.hybrid or upto % self.spec.page_size):
            raise ValueError(f"publish({req_id}): checkpoints need a hybrid model and a page-aligned upto ({upto})")
        if rolling and not checkpoint:
            raise ValueError(f"publish({req_id}): rolling=True needs checkpoint=True")
        if not 0 <= upto <= min(req.cursor, len(token_ids)):
            raise ValueError(f"publish({req_id}): upto {upto} beyond cursor {req.cursor} or the tokens given")
        aligned = upto - upto % self.spec.page_size
        if not self.spec.prefix_cache or aligned < req.published or aligned == 0:
            return Published(req.published, 0, ())
        self._undo = []
        try:
            return self._publish(req, tuple(token_ids[:aligned]), aligned, checkpoint, rolling)
        except BaseException:
            self._undo_to(0)
            raise
        finally:
            self._undo = None

    def _publish(self, req: RequestState, tokens: tuple, aligned: int, checkpoint: bool, rolling: bool) -> Published:
        """publish's work; pending checkpoints shallower than `aligned` are published at their own depth first."""
        inserted = 0
        for depth in sorted(d for d in req.pending if d < aligned):
            inserted += self._insert(req, tokens[:depth], depth)
            self._attach_pending(req, req.lock)
        inserted += self._insert(req, tokens, aligned)
        node = req.lock
        ops = self._checkpoint(req, node, rolling) if checkpoint or aligned in req.pending else ()
        self._fault_point("publish.checkpointed")
        self.tree.touch(node)
        if node.checkpoint is not None:
            self.tree.touch_checkpoint(node.checkpoint)
        return Published(aligned, inserted, ops)

    def _insert(self, req: RequestState, tokens: tuple, aligned: int) -> int:
        """Insert tokens[:aligned] (aligned >= published) and move the lock there; returns the tokens inserted."""
        P, inserted = self.spec.page_size, 0
        if aligned > req.published:
            # resume the walk at the request's locked node when it ends where its cached prefix does
            lock = req.lock
            start = lock if lock is not None and lock.depth == req.published else None
            found = self.tree.insert(tokens, req.pages[: aligned // P], start)
            # the locked prefix [0, published) was walked, never adopted
            assert found.adopted_from * P >= req.published and found.node.depth == aligned
            leaf = found.leaf
            if leaf is not None:
                self._log(lambda: self.tree.remove_leaf(leaf))
                inserted = aligned - found.adopted_from * P
            # pages the walk found cached already: the request keeps its copies until release
            duplicates = req.pages[req.published // P : found.adopted_from]
            if duplicates:
                req.duplicates += duplicates
                self._log(lambda: req.duplicates.__delitem__(slice(-len(duplicates), None)))
            self._move_lock(req, found.node, aligned)
            self._fault_point("publish.inserted")
        return inserted

    def _move_lock(self, req: RequestState, node: Node, aligned: int) -> None:
        """Lock the path to `node` and let go of the old lock and pinned checkpoint."""
        tree = self.tree
        old_lock, old_published, old_held = req.lock, req.published, req.held
        tree.lock(node)
        if old_lock is not None:
            tree.unlock(old_lock)
        if old_held is not None:
            tree.unhold(old_held)
        req.lock, req.published, req.held = node, aligned, None

        def undo() -> None:
            if old_held is not None:
                tree.hold(old_held)
            if old_lock is not None:
                tree.lock(old_lock)
            tree.unlock(node)
            req.lock, req.published, req.held = old_lock, old_published, old_held

        self._log(undo)

    def rewind(self, req_id: int, cursor: int) -> int:
        """Speculative decoding: the verified length is `cursor`, short of what the step reserved.
        Moves the cursor back and frees the request's own pages past it; returns the pages freed.

            pages [ ... | page of cursor - 1 ] [ look-ahead pages the rejected drafts had ]
                                               ^ freed
        """
        req = self._record_outside_transaction(req_id, "rewind")
        if req.phase is not Phase.RUNNING:
            raise TransactionError(f"rewind({req_id}): the request is {req.phase.value}")
        if not req.published <= cursor <= req.cursor:
            raise ValueError(f"rewind({req_id}): cursor {cursor} outside [published {req.published}, "
                             f"cursor {req.cursor}]")
        if any(depth > cursor for depth in req.pending):
            raise ValueError(f"rewind({req_id}): a pending checkpoint lies past {cursor}")
        keep = self.pages.pages_for(cursor)
        extra = req.pages[keep:]
        del req.pages[keep:]
        self.pages.free(extra)
        req.cursor = cursor
        return len(extra)

    def pause(self, req_id: int) -> None:
        """Preempt: free everything the request holds except what it published.

        Its own pages (unpublished ones and duplicates), live state slots
        and windows go back to the pools; its lock and pin are dropped, so
        its published prefix stays cached, unreferenced. The record stays,
        PAUSED; the next `begin` may match again. Publish first to keep more.
        Its rolling checkpoint stays its own: once resumed, its next rolling
        publish moves it on (the resumed match pins it until then), unless
        it was evicted meanwhile.
        """
        req = self._record_outside_transaction(req_id, "pause")
        self._drop(req)
        req.phase = Phase.PAUSED

    def release(self, req_id: int) -> None:
        """Finish or abort: like pause, then forget the request.

        Its rolling checkpoint (its last page boundary while decoding) stays
        in the tree as an ordinary one: what a next turn of the conversation hits.
        """
        req = self._record_outside_transaction(req_id, "release")
        self._drop(req)
        del self.requests[req_id]

    def _drop(self, req: RequestState) -> None:
        self.pages.free(req.owned_pages(self.spec.page_size))
        self.state_slots.free(req.state_slots + list(req.pending.values()))
        self.window_slots.free(req.window_slots)
        if req.held is not None:
            self.tree.unhold(req.held)
        if req.lock is not None:
            self.tree.unlock(req.lock)
        req.pages, req.duplicates, req.cursor, req.published = [], [], 0, 0
        req.lock, req.held, req.state_slots, req.window_slots, req.pending = None, None, [], [], {}

    def hold(self, req_id: int) -> Hold | None:
        """Keep the request's published prefix (and its checkpoint) from eviction while it is copied out.

            tokens [0 ............ published)   the path to the request's lock node
            hold    locks that path; pins the node's checkpoint when it has one
                    (a pinned rolling checkpoint does not move: the copy reads it)

        The hold outlives the request: release it with `unhold` once the copy
        ran. Returns None when nothing is published. No transaction may be open.
        """
        req = self._record_outside_transaction(req_id, "hold")
        node = req.lock
        if node is None or req.published == 0:
            return None
        self.tree.lock(node)
        ckpt = node.checkpoint if node.depth == req.published else None
        if ckpt is not None:
            self.tree.hold(ckpt)
        hold_id = next(self._hold_ids)
        pages = tuple(self.tree.path_pages(node, req.published))
        hold = Hold(hold_id, node, ckpt, req.published, pages)
        self.holds[hold_id] = hold
        return hold

    def unhold(self, hold: Hold) -> None:
        """Let go of a hold (the copy ran or failed); its entries become evictable again."""
        self._refuse_in_transaction("unhold")
        if self.holds.pop(hold.hold_id, None) is None:
            raise TransactionError(f"unhold: hold {hold.hold_id} is not held")
        if hold.checkpoint is not None:
            self.tree.unhold(hold.checkpoint)
        self.tree.unlock(hold.node)

    def peek(self, token_ids) -> int:
        """Tokens `match` would serve from the device right now (read-only: locks nothing, touches nothing)."""
        if not self.spec.prefix_cache or len(token_ids) < 2:
            return 0
        found = self.tree.match(tuple(token_ids), len(token_ids) - 1)
        if self.spec.hybrid:
            node = found.checkpoint_node
            return 0 if node is None else node.depth
        return found.length

    def evict(self, pages: int = 0, checkpoints: int = 0) -> Evicted:
        """Free at least `pages` tree pages and `checkpoints` checkpoints, as far as possible.

        Follows the eviction orders (see hkv.cache.radix); a leaf is freed
        whole, so more pages than asked may go. Returns what was freed.
        """
        self._refuse_in_transaction("evict")
        freed_pages = freed_ckpts = 0
        while freed_pages < pages:
            evicted = self.tree.evict_leaf()
            if evicted is None:
                break
            freed_pages += len(evicted.node.pages)
            freed_ckpts += self._release_evicted(evicted)
        while freed_ckpts < checkpoints and self._evict_checkpoint(False):
            freed_ckpts += 1
        return Evicted(freed_pages, freed_ckpts)

    def flush(self) -> Evicted:
        """Drop every unreferenced entry: unlocked nodes and unpinned checkpoints."""
        self._refuse_in_transaction("flush")
        return self.evict(pages=self.spec.num_pages + 1, checkpoints=self.spec.num_state_slots + 1)

    def _release_evicted(self, evicted: TreeEviction) -> int:
        self.pages.free(evicted.node.pages)
        if evicted.checkpoint is None:
            return 0
        self._free_checkpoint_slots(evicted.checkpoint)
        return 1

    def check_integrity(self, allow_open_transaction: bool = False) -> None:
        """Prove the books balance; raises AssertionError naming the first breach.

        free + owned + cached == size for pages, state slots and windows;
        node lock_refs and checkpoint holds equal their holders; counters and
        eviction heaps agree with the tree; no transaction is open (unless
        allowed: a mid-transaction check counts its changes as the request's).
        """
        from hkv.cache.integrity import check

        check(self, allow_open_transaction)

    @property
    def open_transaction(self) -> Transaction | None:
        """The transaction open now, if any (publish, pause, release and flush must wait for it)."""
        return self._txn
