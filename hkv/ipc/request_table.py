"""The request table: request slot -> page ids and lengths, in shared memory.

Writer: the router (it fills a row before sending the StepPlan that uses it).
Readers: every rank (page ids of the slots in a plan) and `hkv-inspect`.

Layout (one region, numpy views over the payload, little endian):

    page_ids     int32 [slots, max_pages]   pages of the slot's sequence, in order
    num_pages    int32 [slots]              valid entries of page_ids[slot]
    req_id       int64 [slots]              the api's request id (0 when free)
    prompt_len   int32 [slots]              prompt tokens
    output_len   int32 [slots]              tokens generated so far
    kv_len       int32 [slots]              tokens whose K/V are in the pages
    cached_len   int32 [slots]              prompt tokens served from the cache
    phase        uint8 [slots]              SlotPhase
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from hkv.ipc.shm import ShmRegion

REGION = "requests"
VERSION = 1


class SlotPhase(enum.IntEnum):
    FREE = 0
    PREFILL = 1
    DECODE = 2


@dataclass(frozen=True)
class TableLayout:
    slots: int
    max_pages: int

    def fields(self) -> list[tuple[str, str, tuple[int, ...]]]:
        s, p = self.slots, self.max_pages
        return [
            ("page_ids", "<i4", (s, p)),
            ("num_pages", "<i4", (s,)),
            ("req_id", "<i8", (s,)),
            ("prompt_len", "<i4", (s,)),
            ("output_len", "<i4", (s,)),
            ("kv_len", "<i4", (s,)),
            ("cached_len", "<i4", (s,)),
            ("phase", "u1", (s,)),
        ]

    def nbytes(self) -> int:
        total = 0
        for _, dtype, shape in self.fields():
            total = _align(total) + int(np.dtype(dtype).itemsize * np.prod(shape))
        return total

    def to_dict(self) -> dict:
        return {"slots": self.slots, "max_pages": self.max_pages}


def attach(instance: str, readonly: bool) -> tuple["ShmRegion", "RequestTable"]:
    """Map a live instance's request table (layout from its registry); close the region when done."""
    from hkv.ipc.shm import Registry, ShmRegion

    with Registry.attach(instance, readonly=True) as registry:
        entry = next(e for e in registry.entries() if e.region == REGION)
    region = ShmRegion.attach(instance, REGION, readonly=readonly)
    return region, RequestTable(TableLayout(**entry.layout), region.payload)


def _align(offset: int, to: int = 64) -> int:
    return (offset + to - 1) // to * to


class RequestTable:
    """Numpy views over the request-table payload (writable only in the router)."""

    def __init__(self, layout: TableLayout, payload: memoryview):
        if len(payload) < layout.nbytes():
            raise ValueError(f"request table payload is {len(payload)} bytes, layout needs {layout.nbytes()}")
        self.layout = layout
        offset = 0
        views = {}
        for name, dtype, shape in layout.fields():
            offset = _align(offset)
            count = int(np.prod(shape))
            views[name] = np.frombuffer(payload, dtype=dtype, count=count, offset=offset).reshape(shape)
            offset += views[name].nbytes
        self.page_ids: np.ndarray = views["page_ids"]
        self.num_pages: np.ndarray = views["num_pages"]
        self.req_id: np.ndarray = views["req_id"]
        self.prompt_len: np.ndarray = views["prompt_len"]
        self.output_len: np.ndarray = views["output_len"]
        self.kv_len: np.ndarray = views["kv_len"]
        self.cached_len: np.ndarray = views["cached_len"]
        self.phase: np.ndarray = views["phase"]

    def write_pages(self, slot: int, pages: list[int]) -> None:
        """Router only: the slot's page ids, in sequence order."""
        n = len(pages)
        if n > self.layout.max_pages:
            raise ValueError(f"slot {slot}: {n} pages exceed the table's {self.layout.max_pages}")
        self.page_ids[slot, :n] = pages
        self.num_pages[slot] = n

    def append_pages(self, slot: int, pages: list[int]) -> None:
        """Router only: pages added at the end of the slot's sequence."""
        start = int(self.num_pages[slot])
        end = start + len(pages)
        if end > self.layout.max_pages:
            raise ValueError(f"slot {slot}: {end} pages exceed the table's {self.layout.max_pages}")
        self.page_ids[slot, start:end] = pages
        self.num_pages[slot] = end

    def clear(self, slot: int) -> None:
        """Router only: mark the slot free."""
        self.num_pages[slot] = 0
        self.req_id[slot] = 0
        self.prompt_len[slot] = 0
        self.output_len[slot] = 0
        self.kv_len[slot] = 0
        self.cached_len[slot] = 0
        self.phase[slot] = SlotPhase.FREE

    def release_views(self) -> None:
        """Drop the numpy views so the underlying mapping can be closed."""
        for name, _, _ in self.layout.fields():
            setattr(self, name, None)

    def snapshot(self) -> list[dict]:
        """Readers: the occupied rows as plain dicts (for hkv-inspect)."""
        rows = []
        for slot in np.nonzero(self.phase != SlotPhase.FREE)[0].tolist():
            rows.append(
                {
                    "slot": slot,
                    "req_id": int(self.req_id[slot]),
                    "phase": SlotPhase(int(self.phase[slot])).name.lower(),
                    "prompt_len": int(self.prompt_len[slot]),
                    "output_len": int(self.output_len[slot]),
                    "kv_len": int(self.kv_len[slot]),
                    "cached_len": int(self.cached_len[slot]),
                    "pages": int(self.num_pages[slot]),
                }
            )
        return rows
