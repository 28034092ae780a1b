"""Named errors of the cache bookkeeping; nothing here signals with sentinel values."""

from __future__ import annotations


class CacheError(Exception):
    """Base of every error raised by hkv.cache."""


class CapacityError(CacheError):
    """A reservation cannot be met even after evicting every unreferenced entry.

    Raised before anything changes: the pools, the tree and the request are
    exactly as they were before the call, and the transaction stays open.
    """

    def __init__(self, resource: str, needed: int, free: int, evictable: int):
        self.resource: str = resource  # "pages", "state_slots" or "window_slots"
        self.needed: int = needed
        self.free: int = free
        self.evictable: int = evictable
        super().__init__(f"need {needed} {resource}, have {free} free + {evictable} evictable")


class TransactionError(CacheError):
    """The coordinator was called out of order: a bug in the caller, not a lack of room.

    Examples: `begin` while another transaction is open, `match` after
    `reserve`, `publish` of an unknown request, commit of a closed transaction.
    """
