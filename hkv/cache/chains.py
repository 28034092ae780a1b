"""The keys a lower tier holds as chains, and the order in which it gives them up: by usable prefix.

A key names a page and its whole prefix (hkv/cache/keys.py), so a tier's keys
form a forest: each key's parent is the key of the page before it, and the
fingerprint's root key is the parent of every prompt's first page.

    root -- k1 -- k2 -- k3 -- k4*            * a checkpoint is held after that page
                   \\-- k5 -- k6*             leaves: k4, k6 (no held key names them as parent)

A hit walks a chain from the page after the device's hit and, on a hybrid
model, ends at a checkpoint. So a tier gives up keys in this order
(`victim`):

1. leaves only: a chain is shortened from its deep end, and a key that
   another held key needs as its prefix stays;
2. on a tier that keeps checkpoints, leaves without one first: pages beyond
   the deepest checkpoint of their chain serve no hit;
3. then by the use before the last one (LRU-2): a key stored and not hit
   since goes before any key used again, and keys used again go by their
   second-to-last use, so a stream of one-time prompts cannot flush the
   prefixes that keep being hit; among keys used once, least recently used
   first (`touch` is a use; ties by the order of use).

A key whose parent is unknown (a disk file found at start-up) is ranked by
use alone. A key whose parent is not held waits for it: when the parent
arrives, it adopts its waiting children.

`reachable` counts the keys a hit on this tier alone could reach: present,
the chain from the root held, and (with checkpoints) a checkpoint held at the
key or below it. It is kept up to date incrementally: a checkpoint change
walks its ancestors, a change of rootedness walks the subtree that moved.
Plain Python, no I/O; callers serialize access.
"""

from __future__ import annotations

from heapq import heapify, heappop, heappush


class Link:
    """One held key's place in the forest."""

    __slots__ = ("key", "parent", "children", "checkpoint", "evictable", "present", "last_use", "used_before",
                 "heap_seq", "rooted", "below")  # fmt: skip

    def __init__(self, key: bytes, parent: bytes | None):
        self.key: bytes = key
        self.parent: bytes | None = parent  # the previous page's key (the root key for a first page); None: unknown
        self.children: set[bytes] = set()  # held keys whose parent this is
        self.checkpoint: bool = False  # a usable checkpoint is held after this page
        self.evictable: bool = True  # the tier may give it up now (not pinned, not being filled)
        self.present: bool = True  # its contents are there (not just reserved)
        self.last_use: int = 0
        self.used_before: int = 0  # the use before last_use (0: stored, never hit since)
        self.heap_seq: int | None = None  # seq of its live entry in the victim heap
        self.rooted: bool = False  # every page from the root down to this one is held
        self.below: int = 0  # checkpoints held at this key or below it


class ChainIndex:
    """Parent links, leaves in eviction order, and the count of reachable keys, for one tier."""

    def __init__(self, root: bytes, checkpoints: bool):
        self.root: bytes = root  # the fingerprint's root key: parent of every first page
        self.checkpoints: bool = checkpoints  # the tier keeps checkpoints (hybrid): leaves without one go first
        self.links: dict[bytes, Link] = {}
        self.reachable: int = 0  # keys a hit on this tier alone could reach
        self._waiting: dict[bytes, set[bytes]] = {}  # a parent key not held -> held keys naming it
        self._heap: list[tuple[int, int, int, int, bytes]] = []  # (useful, used_before, last_use, seq, key)
        self._seq: int = 0
        self._clock: int = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self.links

    def __len__(self) -> int:
        return len(self.links)

    def add(self, key: bytes, parent: bytes | None, checkpoint: bool = False, evictable: bool = True,
            present: bool = True) -> None:  # fmt: skip
        """Hold `key` (absent), most recently used; it adopts held keys that were waiting for it."""
        if key in self.links:
            raise ValueError(f"key {key.hex()} is held already")
        if parent == key or (key in self._waiting and parent is not None and self._is_above(key, parent)):
            parent = None  # keys are chained hashes: a loop is a caller's bug, not a chain
        link = Link(key, parent)
        link.evictable, link.present = evictable, present
        self.links[key] = link
        link.children = self._waiting.pop(key, set())
        link.below = sum(self.links[c].below for c in link.children)
        self._clock += 1
        link.last_use = self._clock
        self._attach(link)
        if checkpoint:
            self.set_checkpoint(key, True)
        self._push(link)

    def remove(self, key: bytes) -> None:
        """Forget `key`; its children (if any) wait for it again, no longer rooted."""
        link = self.links.pop(key)
        for child in link.children:
            self._set_rooted(self.links[child], False)
        if link.children:
            self._waiting[key] = link.children
        if self._counted(link):
            self.reachable -= 1
        parent = self.links.get(link.parent) if link.parent is not None else None
        if parent is not None:
            self._shift_below(parent, -link.below)  # its own checkpoint and its children's subtrees leave
            parent.children.discard(key)
            self._push(parent)
        elif link.parent is not None and link.parent in self._waiting:
            siblings = self._waiting[link.parent]
            siblings.discard(key)
            if not siblings:
                del self._waiting[link.parent]
        link.heap_seq = None

    def set_parent(self, key: bytes, parent: bytes) -> None:
        """Learn the parent of a key held with an unknown one; a known parent stays as it is."""
        link = self.links[key]
        if link.parent is None and not self._is_above(key, parent):
            link.parent = parent
            self._attach(link)
            self._push(link)

    def set_checkpoint(self, key: bytes, held: bool) -> None:
        """Whether a usable checkpoint is held after `key`'s page."""
        link = self.links[key]
        if link.checkpoint != held:
            link.checkpoint = held
            self._shift_below(link, 1 if held else -1)
            self._push(link)

    def set_evictable(self, key: bytes, evictable: bool) -> None:
        link = self.links[key]
        link.evictable = evictable
        self._push(link)

    def set_present(self, key: bytes) -> None:
        """`key`'s contents arrived."""
        link = self.links[key]
        if not link.present:
            link.present = True
            self.reachable += self._counted(link)

    def touch(self, key: bytes) -> None:
        """Mark `key` used now."""
        link = self.links[key]
        self._clock += 1
        link.used_before, link.last_use = link.last_use, self._clock
        self._push(link)

    def is_leaf(self, key: bytes) -> bool:
        return not self.links[key].children

    def victim(self) -> bytes | None:
        """The first evictable leaf in eviction order (left held: the caller gives it up), or None."""
        heap = self._heap
        while heap:
            _, _, _, seq, key = heap[0]
            link = self.links.get(key)
            if link is not None and link.heap_seq == seq and link.evictable and not link.children:
                return key
            heappop(heap)
        return None

    def _is_above(self, key: bytes, start: bytes) -> bool:
        """Whether `key` is `start` or one of its held ancestors (or an ancestor waits for it)."""
        while start != key:
            link = self.links.get(start)
            if link is None or link.parent is None:
                return False
            start = link.parent
        return True

    def _attach(self, link: Link) -> None:
        """Hang `link` (and the subtree it adopted) under its parent, or make it wait for it."""
        parent = link.parent
        if parent is None:
            return
        if parent == self.root:
            self._set_rooted(link, True)
            return
        above = self.links.get(parent)
        if above is None:
            self._waiting.setdefault(parent, set()).add(link.key)
            return
        above.children.add(link.key)
        self._shift_below(above, link.below)
        self._set_rooted(link, above.rooted)

    def _counted(self, link: Link) -> bool:
        return link.present and link.rooted and (link.below > 0 or not self.checkpoints)

    def _shift_below(self, link: Link | None, delta: int) -> None:
        """Add `delta` checkpoints below `link` and each of its held ancestors."""
        while link is not None and delta:
            before = self._counted(link)
            link.below += delta
            self.reachable += self._counted(link) - before
            link = self.links.get(link.parent) if link.parent is not None else None

    def _set_rooted(self, top: Link, rooted: bool) -> None:
        stack = [top]
        while stack:
            link = stack.pop()
            if link.rooted == rooted:
                continue
            before = self._counted(link)
            link.rooted = rooted
            self.reachable += self._counted(link) - before
            stack.extend(self.links[c] for c in link.children)

    def _push(self, link: Link) -> None:
        if not link.evictable or link.children:
            return
        useful = not self.checkpoints or link.checkpoint or link.parent is None
        self._seq += 1
        link.heap_seq = self._seq
        heappush(self._heap, (int(useful), link.used_before, link.last_use, self._seq, link.key))
        if len(self._heap) > 2 * len(self.links) + 64:
            self._heap = [e for e in self._heap if e[4] in self.links and self.links[e[4]].heap_seq == e[3]]
            heapify(self._heap)

    def check(self) -> None:
        """Recompute children, waiting keys, rootedness, checkpoints below and `reachable`; compare."""
        children: dict[bytes, set[bytes]] = {k: set() for k in self.links}
        waiting: dict[bytes, set[bytes]] = {}
        for key, link in self.links.items():
            if link.parent is None or link.parent == self.root:
                continue
            (children[link.parent] if link.parent in self.links else waiting.setdefault(link.parent, set())).add(key)
        for key, link in self.links.items():
            assert link.children == children[key], f"children of {key.hex()} are {link.children}, not {children[key]}"
        assert waiting == self._waiting, f"waiting keys {self._waiting} != {waiting}"
        reachable = 0
        for key, link in self.links.items():
            assert link.rooted == self._rooted_from_scratch(link), f"rootedness of {key.hex()}"
            assert link.below == self._below_from_scratch(link), f"checkpoints below {key.hex()}"
            reachable += self._counted(link)
            if link.evictable and not link.children:
                live = [e for e in self._heap if e[4] == key and e[3] == link.heap_seq]
                assert live, f"evictable leaf {key.hex()} has no current heap entry"
        assert self.reachable == reachable, f"reachable {self.reachable} != {reachable}"

    def _rooted_from_scratch(self, link: Link) -> bool:
        while link.parent is not None and link.parent != self.root:
            if link.parent not in self.links:
                return False
            link = self.links[link.parent]
        return link.parent == self.root

    def _below_from_scratch(self, link: Link) -> int:
        total, stack = 0, [link]
        while stack:
            node = stack.pop()
            total += node.checkpoint
            stack.extend(self.links[c] for c in node.children)
        return total
