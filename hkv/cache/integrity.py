"""CacheCoordinator.check_integrity: prove the books balance, naming the first breach.

Every pool splits into three disjoint parts that cover it exactly:

    [0, size) = free (in the pool's free list)
              + owned (a request's own pages / live and pending checkpoint slots / live windows)
              + cached (pages of tree nodes / slots and windows of checkpoints)

and every count the tree keeps (lock_refs, holds, evictable totals, heap
entries) is recomputed from scratch and compared.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hkv.cache.pools import IdPool
from hkv.cache.radix import Checkpoint, Node, RadixTree

if TYPE_CHECKING:
    from hkv.cache.coordinator import CacheCoordinator
    from hkv.cache.transaction import RequestState


class _Holders:
    """What the requests hold, gathered once: owned ids and expected lock/hold counts."""

    def __init__(self) -> None:
        self.pages: set[int] = set()
        self.state_slots: set[int] = set()
        self.window_slots: set[int] = set()
        self.locks: dict[int, int] = {}  # id(node) -> requests locking it or a descendant
        self.holds: dict[int, int] = {}  # id(checkpoint) -> requests pinning it
        self.rolling: set[int] = set()  # id(checkpoint) of every attached rolling checkpoint


def check(coord: "CacheCoordinator", allow_open_transaction: bool) -> None:
    txn = coord.open_transaction
    assert allow_open_transaction or txn is None, f"transaction open for request {txn and txn.req_id}"
    holders = _Holders()
    for req in coord.requests.values():
        _check_request(coord, req, holders)
    for hold in coord.holds.values():  # prefixes being copied to a lower tier lock like requests
        assert hold.node.in_tree, f"hold {hold.hold_id}: its node {hold.node.node_id} left the tree"
        node = hold.node
        while node.parent is not None:
            holders.locks[id(node)] = holders.locks.get(id(node), 0) + 1
            node = node.parent
        if hold.checkpoint is not None:
            holders.holds[id(hold.checkpoint)] = holders.holds.get(id(hold.checkpoint), 0) + 1
    cached = _check_tree(coord.tree, coord.spec.hybrid, holders)
    _balance(coord.pages, holders.pages, cached[0])
    _balance(coord.state_slots, holders.state_slots, cached[1])
    _balance(coord.window_slots, holders.window_slots, cached[2])


def _add_disjoint(into: set[int], ids, what: str) -> None:
    ids = list(ids)
    assert len(set(ids)) == len(ids), f"{what}: an id appears twice in {ids}"
    clash = into.intersection(ids)
    assert not clash, f"{what}: {sorted(clash)} already held by another request"
    into.update(ids)


def _check_request(coord: "CacheCoordinator", req: "RequestState", holders: _Holders) -> None:
    from hkv.cache.transaction import Phase

    name, P = f"request {req.req_id}", coord.spec.page_size
    txn = coord.open_transaction
    if req.phase is Phase.NEW:
        assert txn is not None and txn.req_id == req.req_id, f"{name} is NEW outside its first transaction"
    if req.phase is Phase.PAUSED and (txn is None or txn.req_id != req.req_id):
        assert not (req.pages or req.state_slots or req.window_slots or req.lock or req.pending), (
            f"{name} is paused but holds"
        )
    assert len(set(req.pages)) == len(req.pages), f"{name}: a page appears twice in {req.pages}"
    assert req.published <= req.cursor <= len(req.pages) * P, (
        f"{name}: published {req.published}, cursor {req.cursor}, {len(req.pages)} pages of {P}"
    )
    assert req.published % P == 0, f"{name}: published {req.published} is not page-aligned"
    _check_request_prefix(coord, req, name)
    _check_rolling(req, name, holders)
    _add_disjoint(holders.pages, req.owned_pages(P), f"{name} pages")
    _add_disjoint(holders.state_slots, req.state_slots + list(req.pending.values()), f"{name} state slots")
    for depth in req.pending:
        assert req.published < depth < req.cursor and depth % P == 0, (
            f"{name}: a checkpoint pending at {depth}, outside its unpublished pages ({req.published}, {req.cursor})"
        )
    _add_disjoint(holders.window_slots, req.window_slots, f"{name} window slots")
    node = req.lock
    while node is not None and node.parent is not None:
        holders.locks[id(node)] = holders.locks.get(id(node), 0) + 1
        node = node.parent
    if req.held is not None:
        holders.holds[id(req.held)] = holders.holds.get(id(req.held), 0) + 1


def _check_request_prefix(coord: "CacheCoordinator", req: "RequestState", name: str) -> None:
    """Pages [0, published) are the tree's or listed duplicates; the rest are its own."""
    assert (req.lock is None) == (req.published == 0), f"{name}: published {req.published} but lock {req.lock}"
    shared = []
    if req.lock is not None:
        lock = req.lock
        assert lock.in_tree and lock.depth >= req.published, f"{name}: lock node {lock.node_id} gone or too short"
        if coord.spec.hybrid:
            assert lock.depth == req.published, f"{name}: hybrid lock ends at {lock.depth}, not {req.published}"
        shared = coord.tree.path_pages(lock, req.published)
    duplicates = set(req.duplicates)
    assert len(duplicates) == len(req.duplicates), f"{name}: a duplicate is listed twice in {req.duplicates}"
    for i, page in enumerate(shared):
        if req.pages[i] == page:
            assert page not in duplicates, f"{name}: lists page {page}, which the tree holds, as a duplicate"
        else:
            assert req.pages[i] in duplicates, f"{name}: page {req.pages[i]} at index {i} is neither the tree's nor its own"
    unused = duplicates.difference(req.pages[: len(shared)])
    assert not unused, f"{name}: lists duplicates {sorted(unused)} outside its published pages"
    held = req.held
    if held is not None:
        assert held.node is req.lock and req.lock.checkpoint is held, f"{name}: pins a checkpoint off its lock node"


def _check_rolling(req: "RequestState", name: str, holders: _Holders) -> None:
    """An attached rolling checkpoint has one owner: its publishes move it, and a second owner
    would move it from under the first. (The tree walk counts its slot as cached.)"""
    ckpt = req.rolling
    if ckpt is None or not ckpt.node.in_tree or ckpt.node.checkpoint is not ckpt:
        return  # none, or evicted: the next checkpoint it publishes takes a fresh slot
    assert id(ckpt) not in holders.rolling, f"{name}: its rolling checkpoint is another request's too"
    holders.rolling.add(id(ckpt))


def _check_tree(tree: RadixTree, hybrid: bool, holders: _Holders) -> tuple[set[int], set[int], set[int]]:
    """Walk every node; returns the (pages, state slots, windows) the tree holds."""
    pages: set[int] = set()
    slots: set[int] = set()
    windows: set[int] = set()
    counts = {"nodes": 0, "evictable_pages": 0, "checkpoints": 0, "evictable_ckpts": 0, "evictable_windows": 0}
    leaf_seqs = {entry[3]: entry for entry in tree._leaf_heap}
    ckpt_seqs = {entry[2]: entry for entry in tree._ckpt_heap}
    for node in tree.nodes():
        where = f"node {node.node_id} (depth {node.depth})"
        _check_node_shape(tree, node, where)
        assert node.lock_ref == holders.locks.get(id(node), 0), (
            f"{where}: lock_ref {node.lock_ref}, but {holders.locks.get(id(node), 0)} requests lock it"
        )
        _add_disjoint(pages, node.pages, f"{where} pages")
        counts["nodes"] += 1
        if node.lock_ref == 0:
            counts["evictable_pages"] += len(node.pages)
            if not node.children:
                entry = leaf_seqs.get(node.heap_seq)
                rank = (node.checkpoint is not None, node.last_access, node.node_id)
                assert entry is not None and entry[:3] == rank, f"{where}: evictable leaf has no current heap entry"
        ckpt = node.checkpoint
        if ckpt is not None:
            assert hybrid, f"{where}: a dense model's tree carries a checkpoint"
            _check_checkpoint(tree, ckpt, node, where, holders, ckpt_seqs, counts)
            _add_disjoint(slots, [ckpt.slot], f"{where} checkpoint slot")
            if ckpt.window is not None:
                _add_disjoint(windows, [ckpt.window], f"{where} checkpoint window")
    assert tree.cached_pages == len(pages), f"tree counts {tree.cached_pages} cached pages, the walk finds {len(pages)}"
    for key, value in (
        ("nodes", tree.num_nodes),
        ("evictable_pages", tree.evictable_pages),
        ("checkpoints", tree.num_checkpoints),
        ("evictable_ckpts", tree.evictable_checkpoints),
        ("evictable_windows", tree.evictable_windows),
    ):
        assert counts[key] == value, f"tree counts {value} {key}, the walk finds {counts[key]}"
    return pages, slots, windows


def _check_node_shape(tree: RadixTree, node: Node, where: str) -> None:
    parent = node.parent
    assert node.in_tree and parent is not None, f"{where}: walked but detached"
    assert node.key and len(node.key) == len(node.pages) * tree.page_size, (
        f"{where}: {len(node.key)} tokens for {len(node.pages)} pages of {tree.page_size}"
    )
    assert node.depth == parent.depth + len(node.key), f"{where}: depth != parent {parent.depth} + {len(node.key)}"
    assert parent.children.get(tree._child_key(node.key)) is node, f"{where}: not under its first-page key"
    assert node.lock_ref >= 0, f"{where}: negative lock_ref"


def _check_checkpoint(tree: RadixTree, ckpt: Checkpoint, node: Node, where: str, holders: _Holders, seqs: dict,
                      counts: dict) -> None:
    assert ckpt.node is node and ckpt.length == node.depth, f"{where}: checkpoint length {ckpt.length} != depth"
    expected = holders.holds.get(id(ckpt), 0)
    assert ckpt.holds == expected, f"{where}: checkpoint holds {ckpt.holds}, but {expected} requests pin it"
    assert ckpt.holds <= node.lock_ref, f"{where}: checkpoint pinned by {ckpt.holds} but node locked by {node.lock_ref}"
    counts["checkpoints"] += 1
    if ckpt.holds == 0:
        counts["evictable_ckpts"] += 1
        counts["evictable_windows"] += ckpt.window is not None
        entry = seqs.get(ckpt.heap_seq)
        rank = (tree.checkpoint_rank(ckpt), ckpt.ckpt_id)
        assert entry is not None and entry[:2] == rank, f"{where}: evictable checkpoint has no current heap entry"


def _balance(pool: IdPool, owned: set[int], cached: set[int]) -> None:
    free = pool.check()
    for a, b, what in ((free, owned, "free and owned"), (free, cached, "free and cached"), (owned, cached, "owned and cached")):
        both = a & b
        assert not both, f"{pool.name}: {sorted(both)[:8]} are both {what}"
    total = len(free) + len(owned) + len(cached)
    assert total == pool.size, (
        f"{pool.name}: free {len(free)} + owned {len(owned)} + cached {len(cached)} = {total} != {pool.size}"
        f"; missing {sorted(set(range(pool.size)) - free - owned - cached)[:8]}"
    )
