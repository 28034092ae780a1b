"""Cache bookkeeping owned by the router: pools, radix tree, coordinator, page keys.

Pure Python: no device memory, sockets or processes. The scheduler calls only
`CacheCoordinator`; see docs/cache.md.
"""

from hkv.cache.coordinator import CacheCoordinator
from hkv.cache.transaction import Phase, RequestState, Transaction
from hkv.cache.errors import CacheError, CapacityError, TransactionError
from hkv.cache.keys import ModelFingerprint, page_key, page_keys
from hkv.cache.pools import IdPool, PagePool, SlotPool
from hkv.cache.radix import Checkpoint, Node, RadixTree
from hkv.cache.types import (
    CacheOp,
    CacheSpec,
    CheckpointRef,
    Evicted,
    Grant,
    Hit,
    Published,
    RestoreCheckpoint,
    SaveCheckpoint,
)

__all__ = [
    "CacheCoordinator", "Phase", "RequestState", "Transaction",
    "CacheError", "CapacityError", "TransactionError",
    "ModelFingerprint", "page_key", "page_keys",
    "IdPool", "PagePool", "SlotPool",
    "Checkpoint", "Node", "RadixTree",
    "CacheOp", "CacheSpec", "CheckpointRef", "Evicted", "Grant", "Hit", "Published",
    "RestoreCheckpoint", "SaveCheckpoint",
]  # fmt: skip
