"""A plain free list of KV pages for the walking skeleton's router.

The CacheCoordinator (hkv/cache/, issue 3) replaces this with transactional,
refcounted bookkeeping and prefix reuse; until then pages are private to one
sequence and go back to the free list when it ends.
"""

from __future__ import annotations


class PageAllocator:
    """All-or-nothing allocation of page ids in [0, num_pages)."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages))[::-1]  # pop() hands out low ids first
        self._owned: set[int] = set()

    @property
    def free_count(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take n pages; the caller checked can_allocate(n)."""
        assert self.can_allocate(n), f"asked for {n} pages, {len(self._free)} free"
        pages = [self._free.pop() for _ in range(n)]
        self._owned.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for page in pages:
            assert page in self._owned, f"page {page} freed but not owned"
            self._owned.remove(page)
            self._free.append(page)

    def check_integrity(self) -> None:
        assert len(self._free) + len(self._owned) == self.num_pages, "pages leaked"
        assert not self._owned.intersection(self._free), "a page is both free and owned"
