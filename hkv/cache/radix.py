"""A page-aligned, path-compressed radix tree over token ids.

Each edge holds a whole number of pages: `key` is a tuple of
`len(pages) * page_size` token ids and `pages` the KV page ids that hold
them. Children are keyed by the first page of their edge (the first token
when page_size == 1, else a tuple of page_size tokens), so a lookup is one
dict probe per edge and comparisons are tuple slices, not per-token Python.

    depth:   0            parent.depth           node.depth
    tokens:  [ ........... )[ node.key ............ )
    pages:                  [ node.pages: len(key) // P ids ]
                                                   ^ node.checkpoint (if any) covers
                                                     tokens [0, node.depth)

A node's `lock_ref` counts the requests whose locked node lies in its
subtree (locking walks to the root), so a node is evictable exactly when
lock_ref == 0, and a leaf is evicted whole.

Eviction order (pages): unlocked leaves, those without a checkpoint first
(useless to a hybrid model, and a dense model has none), then by last
access, oldest first, ties by node id. Checkpoints are evicted separately:
unheld ones, oldest last use first. Both orders live in heaps updated
incrementally: an entry is pushed when its node or checkpoint becomes a
candidate or changes rank, and stale entries are skipped on pop.

The tree never touches pools: eviction detaches a node and hands it back
with its checkpoint; the caller frees its pages and checkpoint. A detached
node no longer points at its checkpoint (the checkpoint still points at the
node, so a stale reference to it sees the node out of the tree): the pair
would otherwise be a reference cycle, and every evicted prefix, its key's
token ids included, would wait for a full collection of the cycle collector.
Every mutation used inside a transaction has an exact inverse (`remove_leaf`,
`reattach`, `detach_checkpoint`, `reattach_checkpoint`, lock/unlock, hold/unhold).
Splits are refinements that keep every page and lock where it was, so they
are never undone.
"""

from __future__ import annotations

from heapq import heapify, heappop, heappush
from typing import Iterator, NamedTuple


class Checkpoint:
    """A saved linear-attention state (and draft window) after `length` tokens."""

    __slots__ = ("slot", "window", "length", "ckpt_id", "node", "holds", "last_access", "last_event", "hit", "heap_seq")

    def __init__(self, slot: int, window: int | None, length: int, ckpt_id: int, node: "Node"):
        self.slot: int = slot  # state slot, owned by the tree while attached
        self.window: int | None = window  # draft window slot, when the publisher drafts
        self.length: int = length  # == node.depth
        self.ckpt_id: int = ckpt_id  # creation order; breaks ties in eviction order
        self.node: Node = node  # the node whose end it sits at
        self.holds: int = 0  # requests that restored from it and still pin it
        self.last_access: int = 0  # logical clock of its creation or last use (hit or publish touch)
        self.last_event: int = 0  # the checkpoint clock (stores and hits) at that use
        self.hit: bool = False  # a request restored from it since it was stored
        self.heap_seq: int | None = None  # seq of its live eviction-heap entry


class Node:
    """One edge of the tree: the tokens, pages and state of [parent.depth, depth)."""

    __slots__ = (
        "key", "pages", "children", "parent", "depth", "lock_ref", "last_access",
        "checkpoint", "in_tree", "node_id", "heap_seq",
    )  # fmt: skip

    def __init__(self, key: tuple, pages: tuple[int, ...], parent: "Node | None", depth: int, node_id: int):
        self.key: tuple = key  # token ids of this edge, len(pages) * page_size of them
        # Page ids holding those tokens, in order. A tuple of ints is untracked by the
        # garbage collector once seen; a list would be traversed on every full collection.
        self.pages: tuple[int, ...] = pages
        self.children: dict = {}  # first page of the child's key -> child
        self.parent: Node | None = parent  # None only for the root
        self.depth: int = depth  # tokens from the root to the end of this edge
        self.lock_ref: int = 0  # requests locking this node or a descendant
        self.last_access: int = 0  # logical clock of the last match/insert through it
        self.checkpoint: Checkpoint | None = None  # state after `depth` tokens; None once detached
        self.in_tree: bool = True  # False once evicted or removed
        self.node_id: int = node_id  # creation order; breaks ties in eviction order
        self.heap_seq: int | None = None  # seq of its live eviction-heap entry


class TreeMatch(NamedTuple):
    """Result of `RadixTree.match`.

    length: tokens matched, page-aligned, <= the limit.
    node: the node whose edge contains token length-1 (node.depth may exceed
        length when the match ends inside an edge); the root when length == 0.
    checkpoint_node: the deepest node on the path with a checkpoint and
        depth <= length, or None.
    """

    node: Node
    length: int
    checkpoint_node: Node | None


class TreeEviction(NamedTuple):
    """Result of `RadixTree.evict_leaf`: the detached leaf and the checkpoint it carried (or None).

    The caller frees node.pages and the checkpoint's slots; `reattach(node, checkpoint)` undoes it.
    """

    node: Node
    checkpoint: Checkpoint | None


class TreeInsert(NamedTuple):
    """Result of `RadixTree.insert`.

    node: the node ending exactly at the inserted length (the root for length 0).
    leaf: the leaf created for the new suffix, or None when all was cached.
    adopted_from: index of the first page the tree took: pages[adopted_from:]
        now belong to the tree; pages[:adopted_from] were already cached
        (the caller's copies of those are duplicates, still the caller's).
    """

    node: Node
    leaf: Node | None
    adopted_from: int


def _common_len(key: tuple, tokens: tuple, pos: int, m: int) -> int:
    """Largest c <= m with key[:c] == tokens[pos:pos+c]; binary search over slices."""
    if key[:m] == tokens[pos : pos + m]:
        return m
    lo, hi = 0, m - 1  # key[:lo] matches; key[:hi+1] does not
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if key[lo:mid] == tokens[pos + lo : pos + mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class RadixTree:
    """Prefix index of cached pages and checkpoints; see the module docstring."""

    def __init__(self, page_size: int, checkpoint_horizon: int = 0):
        self.page_size: int = page_size
        # checkpoint eviction: 0 is plain LRU; H > 0 ranks one never hit as if last used H checkpoint stores
        # or hits earlier (checkpoint_rank): a stream of one-time checkpoints evicts each other first
        self.checkpoint_horizon: int = checkpoint_horizon
        self.root: Node = Node((), (), None, 0, 0)
        self.num_nodes: int = 0  # excluding the root
        self.cached_pages: int = 0  # pages held by nodes in the tree
        self.evictable_pages: int = 0  # pages of nodes with lock_ref == 0
        self.num_checkpoints: int = 0  # attached checkpoints
        self.evictable_checkpoints: int = 0  # attached, unheld checkpoints
        self.evictable_windows: int = 0  # those of them that carry a window
        self._clock: int = 0  # logical time for last_access (nodes and checkpoints)
        self._ckpt_clock: int = 0  # the horizon's time: each checkpoint stored and each hit ticks it
        self._next_id: int = 1  # ids of nodes and checkpoints, in creation order
        self._seq: int = 0  # heap entry sequence numbers
        self._leaf_heap: list[tuple] = []  # (no-checkpoint first, last_access, node_id, seq, node)
        self._ckpt_heap: list[tuple] = []  # (checkpoint_rank, ckpt_id, seq, checkpoint)

    def _child_key(self, key: tuple):
        """The dict key of an edge in its parent: its first page's token(s)."""
        return key[0] if self.page_size == 1 else key[: self.page_size]

    def match(self, tokens: tuple, limit: int) -> TreeMatch:
        """The longest cached prefix of tokens[:limit], page-aligned. Read-only.

            tokens [0 ....... length) [length ... limit) [limit ...)
                    cached in tree     not cached        not considered
        """
        P = self.page_size
        limit -= limit % P
        node, pos, ckpt_node = self.root, 0, None
        children = node.children
        while pos < limit:
            child = children.get(tokens[pos] if P == 1 else tokens[pos : pos + P])
            if child is None:
                break
            key = child.key
            end = pos + len(key)
            if end <= limit and tokens[pos:end] == key:
                node, pos, children = child, end, child.children
                if child.checkpoint is not None:
                    ckpt_node = child
                continue
            common = _common_len(key, tokens, pos, min(len(key), limit - pos))
            common -= common % P
            if common:
                node, pos = child, pos + common
            break
        return TreeMatch(node, pos, ckpt_node)

    def path_pages(self, node: Node, length: int) -> list[int]:
        """Page ids of tokens [0, length) along the path to `node` (length <= node.depth)."""
        chunks = []
        while node.parent is not None:
            chunks.append(node.pages)
            node = node.parent
        pages: list[int] = []
        for chunk in reversed(chunks):
            pages += chunk
        del pages[length // self.page_size :]
        return pages

    def touch(self, node: Node) -> None:
        """Mark the path to `node` as used now (LRU); no effect on what is cached."""
        self._clock += 1
        now = self._clock
        top = node
        while top.parent is not None:
            top.last_access = now
            top = top.parent
        self._push_leaf(node)

    def insert(self, tokens: tuple, pages: list[int], start: Node | None = None) -> TreeInsert:
        """Cache tokens (len(tokens) == len(pages) * page_size) backed by `pages`.

        start: optionally a node in the tree, on the path of `tokens`, with
        depth <= len(tokens) (for instance the caller's locked match): the walk
        begins there instead of at the root, skipping the compare of its prefix.
        Mutates: splits an edge where the tokens diverge or end inside it, and
        adds one leaf for the uncached suffix, which takes pages[adopted_from:]
        (see TreeInsert). Does not touch; the caller touches on success.
        """
        P, total = self.page_size, len(tokens)
        assert total == len(pages) * P, f"{total} tokens do not fill {len(pages)} pages of {P}"
        node = self.root if start is None else start
        pos = node.depth
        assert node.in_tree and pos <= total, "insert must start at a node of the tree on the tokens' path"
        while pos < total:
            child = node.children.get(tokens[pos] if P == 1 else tokens[pos : pos + P])
            if child is None:
                leaf = self._add_leaf(node, tokens[pos:], tuple(pages[pos // P :]))
                return TreeInsert(leaf, leaf, pos // P)
            key = child.key
            end = pos + len(key)
            if end <= total and tokens[pos:end] == key:
                node, pos = child, end
                continue
            common = _common_len(key, tokens, pos, min(len(key), total - pos))
            common -= common % P  # >= P: the first page matched the dict key
            if common < len(key):
                child = self._split(child, common)
            node, pos = child, pos + common
        return TreeInsert(node, None, len(pages))

    def _add_leaf(self, parent: Node, key: tuple, pages: tuple[int, ...]) -> Node:
        leaf = Node(key, pages, parent, parent.depth + len(key), self._next_id)
        self._next_id += 1
        self._clock += 1
        leaf.last_access = self._clock
        parent.children[key[0] if self.page_size == 1 else key[: self.page_size]] = leaf
        self.num_nodes += 1
        self.cached_pages += len(pages)
        self.evictable_pages += len(pages)
        self._push_leaf(leaf)
        return leaf

    def _split(self, child: Node, at: int) -> Node:
        """Cut child's edge after `at` tokens; returns the new upper node (same locks)."""
        parent = child.parent
        upper = Node(child.key[:at], child.pages[: at // self.page_size], parent, parent.depth + at, self._next_id)
        self._next_id += 1
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        parent.children[self._child_key(upper.key)] = upper
        child.key = child.key[at:]
        child.pages = child.pages[at // self.page_size :]
        child.parent = upper
        upper.children[self._child_key(child.key)] = child
        self.num_nodes += 1
        return upper

    def remove_leaf(self, leaf: Node) -> None:
        """Undo the insert that created `leaf` (unlocked, childless, no checkpoint).

        Its pages go back to whoever gave them to `insert`; nothing is freed.
        """
        assert leaf.in_tree and not leaf.children and leaf.lock_ref == 0 and leaf.checkpoint is None
        self._detach(leaf)

    def lock(self, node: Node) -> None:
        """Pin the path root..node against eviction (one more holder)."""
        while node.parent is not None:
            if node.lock_ref == 0:
                self.evictable_pages -= len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        """Drop one holder of the path root..node; an unpinned leaf becomes evictable."""
        bottom = node
        while node.parent is not None:
            node.lock_ref -= 1
            assert node.lock_ref >= 0, f"node {node.node_id} unlocked more often than locked"
            if node.lock_ref == 0:
                self.evictable_pages += len(node.pages)
            node = node.parent
        self._push_leaf(bottom)

    def _leaf_evictable(self, node: Node) -> bool:
        return node.in_tree and node.lock_ref == 0 and not node.children and node.parent is not None

    def _push_leaf(self, node: Node) -> None:
        # _leaf_evictable, inlined: this runs on every insert, touch and unlock
        if node.children or node.lock_ref or not node.in_tree or node.parent is None:
            return
        self._seq += 1
        node.heap_seq = self._seq
        heap = self._leaf_heap
        heappush(heap, (node.checkpoint is not None, node.last_access, node.node_id, self._seq, node))
        if len(heap) > 2 * self.num_nodes + 64:
            self._leaf_heap = [e for e in heap if e[3] == e[4].heap_seq and self._leaf_evictable(e[4])]
            heapify(self._leaf_heap)

    def evict_leaf(self) -> TreeEviction | None:
        """Detach the first leaf in eviction order and return it with its checkpoint, or None if
        none is evictable.

        The caller frees node.pages and, if there is one, the checkpoint's slots. The node keeps
        its other fields so `reattach` can undo this exactly.
        """
        heap = self._leaf_heap
        while heap:
            entry = heappop(heap)
            node = entry[4]
            if entry[3] == node.heap_seq and self._leaf_evictable(node):
                ckpt = node.checkpoint
                self._detach(node)
                return TreeEviction(node, ckpt)
        return None

    def _detach(self, node: Node) -> None:
        parent = node.parent
        del parent.children[self._child_key(node.key)]
        node.in_tree = False
        node.heap_seq = None
        self.num_nodes -= 1
        self.cached_pages -= len(node.pages)
        self.evictable_pages -= len(node.pages)
        ckpt = node.checkpoint
        if ckpt is not None:
            self.num_checkpoints -= 1
            self._count_evictable(ckpt, -1)
            node.checkpoint = None  # no node <-> checkpoint cycle outside the tree (module docstring)
        self._push_leaf(parent)

    def reattach(self, node: Node, checkpoint: Checkpoint | None) -> None:
        """Undo `evict_leaf` (the latest change to node's parent): put node back as it was,
        carrying the checkpoint the eviction returned."""
        parent = node.parent
        key = self._child_key(node.key)
        assert parent.in_tree and key not in parent.children, "reattach out of order"
        assert checkpoint is None or checkpoint.node is node, "reattach with another node's checkpoint"
        parent.children[key] = node
        node.in_tree = True
        node.checkpoint = checkpoint
        self.num_nodes += 1
        self.cached_pages += len(node.pages)
        self.evictable_pages += len(node.pages)
        ckpt = node.checkpoint
        if ckpt is not None:
            self.num_checkpoints += 1
            self._count_evictable(ckpt, +1)
            self._push_checkpoint(ckpt)
        self._push_leaf(node)

    def _count_evictable(self, ckpt: Checkpoint, sign: int) -> None:
        if ckpt.holds == 0:
            self.evictable_checkpoints += sign
            if ckpt.window is not None:
                self.evictable_windows += sign

    def attach_checkpoint(self, node: Node, slot: int, window: int | None, moved: bool = False) -> Checkpoint:
        """Record that `slot` (and `window`) hold the state after node.depth tokens; a new store ticks
        the checkpoint clock, a rolling checkpoint `moved` here does not (it is no new checkpoint).

        The tree owns the slots from now on. Undo: `detach_checkpoint`.
        """
        assert node.checkpoint is None and node.parent is not None and node.in_tree
        ckpt = Checkpoint(slot, window, node.depth, self._next_id, node)
        self._next_id += 1
        self._clock += 1
        ckpt.last_access = self._clock
        if not moved:
            self._ckpt_clock += 1
        ckpt.last_event = self._ckpt_clock
        node.checkpoint = ckpt
        self.num_checkpoints += 1
        self._count_evictable(ckpt, +1)
        self._push_checkpoint(ckpt)
        self._push_leaf(node)
        return ckpt

    def detach_checkpoint(self, ckpt: Checkpoint) -> None:
        """Take an unheld checkpoint off its node; the caller frees its slots."""
        assert ckpt.holds == 0 and ckpt.node.checkpoint is ckpt
        ckpt.node.checkpoint = None
        ckpt.heap_seq = None
        if ckpt.node.in_tree:
            self.num_checkpoints -= 1
            self._count_evictable(ckpt, -1)
            self._push_leaf(ckpt.node)

    def reattach_checkpoint(self, ckpt: Checkpoint) -> None:
        """Undo `detach_checkpoint` or `evict_checkpoint` exactly."""
        node = ckpt.node
        assert node.checkpoint is None and node.in_tree, "reattach_checkpoint out of order"
        node.checkpoint = ckpt
        self.num_checkpoints += 1
        self._count_evictable(ckpt, +1)
        self._push_checkpoint(ckpt)
        self._push_leaf(node)

    def _ckpt_evictable(self, ckpt: Checkpoint) -> bool:
        return ckpt.holds == 0 and ckpt.node.in_tree and ckpt.node.checkpoint is ckpt

    def _push_checkpoint(self, ckpt: Checkpoint) -> None:
        if not self._ckpt_evictable(ckpt):
            return
        self._seq += 1
        ckpt.heap_seq = self._seq
        heap = self._ckpt_heap
        heappush(heap, (self.checkpoint_rank(ckpt), ckpt.ckpt_id, self._seq, ckpt))
        if len(heap) > 2 * self.num_checkpoints + 64:
            self._ckpt_heap = [e for e in heap if e[2] == e[3].heap_seq and self._ckpt_evictable(e[3])]
            heapify(self._ckpt_heap)

    def checkpoint_rank(self, ckpt: Checkpoint) -> tuple[int, int]:
        """Where a checkpoint stands in the eviction order, lowest first: its last use, in the ticks of
        a clock that counts checkpoints stored and hits, then in the tree's clock (plain LRU when the
        horizon is 0). With a horizon H, a checkpoint never hit since it was stored ranks H ticks older:

            hit since stored, last used at tick u    (u, ...)
            stored at tick s, never hit since        (s - H, ...)   (a publish touch moves s to now)

        So the one-time checkpoints of every prompt's end and every finish evict each other before a
        prefix that keeps being hit, as long as its last hit is less than H ticks old; among hit ones,
        and among never-hit ones, it is plain LRU. A rolling checkpoint's move is no store (no tick):
        with it, a decoding batch ran the clock hundreds of ticks a second."""
        shift = self.checkpoint_horizon if not ckpt.hit else 0
        return ckpt.last_event - shift, ckpt.last_access

    def evict_checkpoint(self, with_window: bool) -> Checkpoint | None:
        """Detach the unheld checkpoint first in the eviction order (checkpoint_rank; one with a window if asked).

        Returns it (the caller frees ckpt.slot and ckpt.window) or None.
        """
        heap, skipped, found = self._ckpt_heap, [], None
        while heap:
            entry = heappop(heap)
            ckpt = entry[3]
            if entry[2] != ckpt.heap_seq or not self._ckpt_evictable(ckpt):
                continue
            if with_window and ckpt.window is None:
                skipped.append(entry)
                continue
            found = ckpt
            break
        for entry in skipped:
            heappush(heap, entry)
        if found is not None:
            self.detach_checkpoint(found)
        return found

    def hold(self, ckpt: Checkpoint) -> None:
        """Pin a checkpoint a request restores from; it cannot be evicted until unhold."""
        if ckpt.holds == 0 and ckpt.node.in_tree:
            self._count_evictable(ckpt, -1)
        ckpt.holds += 1

    def unhold(self, ckpt: Checkpoint) -> None:
        """Drop one pin; an unpinned checkpoint becomes evictable again."""
        ckpt.holds -= 1
        assert ckpt.holds >= 0, "checkpoint released more often than held"
        if ckpt.holds == 0 and ckpt.node.in_tree:
            self._count_evictable(ckpt, +1)
            self._push_checkpoint(ckpt)

    def touch_checkpoint(self, ckpt: Checkpoint, hit: bool = False) -> None:
        """Mark a checkpoint as used now (its own order, separate from pages). `hit`: a request restored
        from it, which ticks the horizon's clock; a publish touch (a prefix published again) does not."""
        self._clock += 1
        ckpt.last_access = self._clock
        if hit:
            self._ckpt_clock += 1
            ckpt.hit = True
        ckpt.last_event = self._ckpt_clock
        self._push_checkpoint(ckpt)

    def nodes(self) -> Iterator[Node]:
        """Every node below the root, parents before children (for checks and flush)."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def pages_under_checkpoints(self) -> int:
        """Cached pages on a path from the root to a checkpoint: what a hybrid hit could reach. O(nodes)."""
        covered: set[int] = set()  # ids of nodes with a checkpoint at or below them
        total = 0
        for node in reversed(list(self.nodes())):  # children before their parents
            if node.checkpoint is not None or node.node_id in covered:
                total += len(node.pages)
                covered.add(node.parent.node_id)
        return total

    def dump(self, node: Node | None = None) -> tuple:
        """A nested, comparable picture of the tree: (key, pages, lock_ref, checkpoint, children)."""
        node = self.root if node is None else node
        ckpt = node.checkpoint
        ckpt_view = None if ckpt is None else (ckpt.slot, ckpt.window, ckpt.length, ckpt.holds)
        children = tuple(sorted((self.dump(c) for c in node.children.values()), key=repr))
        return (node.key, tuple(node.pages), node.lock_ref, ckpt_view, children)
