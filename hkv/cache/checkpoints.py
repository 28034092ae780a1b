"""Where a published checkpoint's state goes: a slot reserved for it, the rolling one moved, or a fresh one.

`CheckpointPlacement` is part of `CacheCoordinator` (hkv/cache/coordinator.py),
split out to keep that file readable; its methods run inside a publish, so
every change they make goes to the publish's undo log. docs/cache.md
("Checkpoints: who allocates them", "Rolling checkpoints", "In-chunk
checkpoints") describes the rules.
"""

from __future__ import annotations

from hkv.cache.errors import CapacityError, TransactionError
from hkv.cache.pools import SlotPool
from hkv.cache.radix import Checkpoint, Node, RadixTree
from hkv.cache.transaction import RequestState
from hkv.cache.types import CacheOp, SaveCheckpoint


class CheckpointPlacement:
    """The checkpoint half of a publish. CacheCoordinator provides the tree and slot pools
    (declared here), the undo log (`_log`, `_alloc`, `_free`) and the room checks
    (`_check_room`, `_make_room`)."""

    tree: RadixTree
    state_slots: SlotPool
    window_slots: SlotPool

    def _checkpoint(self, req: RequestState, node: Node, rolling: bool) -> tuple[CacheOp, ...]:
        """Save the live state at `node` (the request's lock): its rolling checkpoint moved, or a fresh one.

            tokens  [0 ........ r) ........ [r ............. node.depth)
            before   rolling ckpt at r (slot s)
            after    nothing at r             ckpt at node.depth (slot s); op: SaveCheckpoint(live -> s)

        The rolling one moves only when `_can_move` says nobody may read its
        slot; then the request's rolling checkpoint is the moved one (rolling)
        or none (permanent). Otherwise a fresh slot is taken, which becomes the
        rolling one (rolling) or leaves it as it was (permanent); the old one
        stays where it is, an ordinary checkpoint. Why a moved slot is safe to
        overwrite: ops run in emission order before the next forward, so a
        RestoreCheckpoint from a later match (in this plan or after) follows
        this SaveCheckpoint and reads the new state, and a reader of the old
        state pins it until its copy ran (a request until it publishes deeper,
        pauses or is released; a tier hold until its StoreState ran).
        """
        if node.depth in req.pending:
            self._attach_pending(req, node)
            return ()
        if node.checkpoint is not None:
            if node.checkpoint is req.rolling and not rolling:
                self._set_rolling(req, None)  # published for good where it already is
            return ()
        if not req.state_slots:
            raise TransactionError(f"publish({req.req_id}): a checkpoint needs the request's live state slot")
        old = req.rolling
        moved = old is not None and self._can_move(req, old)
        ckpt = self._move_checkpoint(old, node) if moved else self._take_checkpoint(req, node)
        if ckpt is None:
            return ()  # caching is best effort: the pages are published without it
        if rolling or moved:
            self._set_rolling(req, ckpt if rolling else None)
        src_window = req.window_slots[0] if ckpt.window is not None else None
        return (SaveCheckpoint(req.state_slots[0], ckpt.slot, node.depth, src_window, ckpt.window),)

    def _attach_pending(self, req: RequestState, node: Node) -> None:
        """Attach the slot reserved for node.depth, permanent; no op: the step's forward wrote the state.

        A node that has a checkpoint already keeps it (permanent now, if it was the
        request's rolling one) and the slot goes back to the pool.
        """
        depth = node.depth
        slot = req.pending.pop(depth)
        self._log(lambda: req.pending.__setitem__(depth, slot))  # readers sort the pending depths
        if node.checkpoint is None:
            ckpt = self.tree.attach_checkpoint(node, slot, None)
            self._log(lambda: self.tree.detach_checkpoint(ckpt))
            return
        self._free(self.state_slots, [slot])
        if node.checkpoint is req.rolling:
            self._set_rolling(req, None)

    def _can_move(self, req: RequestState, ckpt: Checkpoint) -> bool:
        """Nobody may read the slot: still attached (not evicted), unpinned, and shaped like
        the request's state (a window exactly when the request drafts)."""
        return (
            ckpt.node.in_tree and ckpt.node.checkpoint is ckpt and ckpt.holds == 0
            and (ckpt.window is not None) == bool(req.window_slots)
        )  # fmt: skip

    def _move_checkpoint(self, ckpt: Checkpoint, node: Node) -> Checkpoint:
        """Detach `ckpt` and attach its slot and window at `node`; both steps are logged."""
        tree = self.tree
        tree.detach_checkpoint(ckpt)
        self._log(lambda: tree.reattach_checkpoint(ckpt))
        moved = tree.attach_checkpoint(node, ckpt.slot, ckpt.window, moved=True)
        self._log(lambda: tree.detach_checkpoint(moved))
        return moved

    def _take_checkpoint(self, req: RequestState, node: Node) -> Checkpoint | None:
        """A fresh slot (and window if the request drafts) attached at `node`, or None when none can be had."""
        windows = 1 if req.window_slots else 0
        try:
            self._check_room(0, 1, windows)
        except CapacityError:
            return None
        self._make_room(0, 1, windows)
        slot = self._alloc(self.state_slots, 1)[0]
        window = self._alloc(self.window_slots, 1)[0] if windows else None
        ckpt = self.tree.attach_checkpoint(node, slot, window)
        self._log(lambda: self.tree.detach_checkpoint(ckpt))
        return ckpt

    def _set_rolling(self, req: RequestState, ckpt: Checkpoint | None) -> None:
        old = req.rolling
        req.rolling = ckpt
        self._log(lambda: setattr(req, "rolling", old))
