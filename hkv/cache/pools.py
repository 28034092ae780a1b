"""Free lists of device resources: KV pages, state slots and draft windows.

A pool only knows which ids are free. Who holds the others (a running
request, the radix tree) is the CacheCoordinator's business, and
`CacheCoordinator.check_integrity` proves free + owned + cached == size.

Free ids are a stack of returned ids (the end of a Python list is its top)
above a fresh range that was never handed out, and allocation and freeing
are slice operations, not per-id Python work:

    handed out next ->  _stack top ... bottom | fresh: [watermark, size)
    fresh pool:         []                    | [0, size)     allocate(3) -> [0, 1, 2]
    after free([5,6,7]): [7, 6, 5] (5 on top) | [8, size)     allocate(4) -> [5, 6, 7, 8]

Every mutation has an inverse (`unallocate`, `unfree`) that the
coordinator's undo log replays in reverse order to roll a transaction back;
afterwards `free_ids()` (the order ids will be handed out) is as before.
"""

from __future__ import annotations

from hkv.cache.errors import CapacityError


class IdPool:
    """All-or-nothing allocation of ids in [0, size), lowest ids first when fresh."""

    def __init__(self, name: str, size: int):
        self.name: str = name  # what the ids are, for messages: "pages", "state_slots", ...
        self.size: int = size
        self._stack: list[int] = []  # returned ids; the end is handed out next
        self._watermark: int = 0  # ids >= this were never handed out
        # The ids as int objects made once: handing out a slice copies pointers instead of
        # creating ints, and the collector stops traversing a tuple of ints once it has seen it.
        self._ids: tuple[int, ...] = tuple(range(size))

    @property
    def free_count(self) -> int:
        return len(self._stack) + self.size - self._watermark

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= self.free_count

    def allocate(self, n: int) -> list[int]:
        """Take n ids, or raise CapacityError having taken none.

        Mutates the free ids only. Returns them in hand-out order: the
        stack's top first, then fresh ids once the stack is empty.
        """
        if not self.can_allocate(n):
            raise CapacityError(self.name, n, self.free_count, 0)
        stack = self._stack
        k = min(n, len(stack))
        if k:
            ids = stack[-k:]
            del stack[-k:]
            ids.reverse()
        else:
            ids = []
        if n > k:
            ids += self._ids[self._watermark : self._watermark + n - k]
            self._watermark += n - k
        return ids

    def free(self, ids: list[int] | tuple[int, ...]) -> None:
        """Return ids the caller holds; the next allocate(len(ids)) yields them in this order.

        Does not check for double frees (that is per-id work on the hot path);
        `check` and the coordinator's integrity check catch them.
        """
        self._stack.extend(reversed(ids))

    def unallocate(self, ids: list[int] | tuple[int, ...]) -> None:
        """Undo the `allocate` that returned `ids`; valid only as the latest change.

        Fresh ids go back onto the stack, not below the watermark: an
        allocate that took fresh ids had emptied the stack first, so the
        hand-out order is exactly what it was.
        """
        self._stack.extend(reversed(ids))

    def unfree(self, ids: list[int] | tuple[int, ...]) -> None:
        """Undo the `free(ids)` that was the latest change to this pool."""
        n = len(ids)
        if n == 0:
            return
        top = self._stack[-n:]
        top.reverse()
        assert top == list(ids), f"{self.name}: unfree({ids}) does not match the top of the free stack {top}"
        del self._stack[-n:]

    def free_ids(self) -> list[int]:
        """Every free id, in the order allocation hands them out."""
        return self._stack[::-1] + list(self._ids[self._watermark :])

    def check(self) -> set[int]:
        """Assert the free ids are distinct and in range; returns them as a set."""
        stack = self._stack
        free = set(stack)
        assert len(free) == len(stack), f"{self.name}: an id is free twice"
        bad = [i for i in free if not 0 <= i < self._watermark]
        assert not bad, f"{self.name}: freed ids out of range or never handed out: {sorted(bad)[:8]}"
        assert 0 <= self._watermark <= self.size, f"{self.name}: watermark {self._watermark} outside [0, {self.size}]"
        free.update(range(self._watermark, self.size))
        return free


class PagePool(IdPool):
    """KV pages of the device pool; page i of a request holds tokens [i*P, (i+1)*P)."""

    def __init__(self, num_pages: int, page_size: int):
        super().__init__("pages", num_pages)
        self.page_size: int = page_size

    def pages_for(self, tokens: int) -> int:
        """Pages needed to hold `tokens` tokens: ceil(tokens / page_size)."""
        return -(-tokens // self.page_size)


class SlotPool(IdPool):
    """State slots (live linear-attention states, checkpoints) or draft windows."""
