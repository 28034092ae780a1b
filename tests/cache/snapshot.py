"""A comparable picture of a CacheCoordinator that ignores edge splits.

Rollbacks keep splits (they only refine edges), so snapshots record what is
cached per page boundary, not how edges are cut.
"""

from hkv.cache import CacheCoordinator


def canonical(coord: CacheCoordinator) -> tuple:
    """(free ids per pool, per-page tree entries, checkpoints, requests, tree counters)."""
    tree = coord.tree
    P = tree.page_size
    pages, checkpoints = [], []
    stack = [(child, ()) for child in tree.root.children.values()]
    while stack:
        node, prefix = stack.pop()
        tokens = prefix + node.key
        for i, page in enumerate(node.pages):
            pages.append((tokens[: len(prefix) + (i + 1) * P], page, node.lock_ref))
        ckpt = node.checkpoint
        if ckpt is not None:
            checkpoints.append((tokens, ckpt.slot, ckpt.window, ckpt.holds))
        stack.extend((child, tokens) for child in node.children.values())
    requests = []
    for rid, req in sorted(coord.requests.items()):
        lock_depth = None if req.lock is None else req.lock.depth
        held = None if req.held is None else req.held.slot
        ckpt = req.rolling
        rolling = None if ckpt is None else (ckpt.slot, ckpt.length, ckpt.node.in_tree and ckpt.node.checkpoint is ckpt)
        requests.append((
            rid, req.phase, tuple(req.pages), tuple(req.duplicates), req.cursor, req.published,
            lock_depth, held, tuple(req.state_slots), tuple(req.window_slots), req.cached_tokens, rolling,
            tuple(sorted(req.pending.items())),
        ))  # fmt: skip
    counters = (
        tree.cached_pages, tree.evictable_pages, tree.num_checkpoints,
        tree.evictable_checkpoints, tree.evictable_windows,
    )  # fmt: skip
    pools = (coord.pages.free_ids(), coord.state_slots.free_ids(), coord.window_slots.free_ids())
    return pools, sorted(pages), sorted(checkpoints), requests, counters
