"""Request-table slots: which slot a running sequence holds, its row, and when a slot may be reused.

A rank reads the page ids of a plan's slots from the shared request table when
it starts that plan, which can be after the router has planned the next step
(the router plans one step ahead). So a slot that a sent plan still uses is not
cleared or handed out again until that plan's result is in:

    plan n uses slot 3 ... the sequence in slot 3 finishes or is preempted
    -> slot 3 is quarantined: its row stays as plan n read it
    -> result n arrives: row cleared, slot free (and listed in the next plan's `freed`)

Rows of running sequences only grow (pages appended past what any sent plan
reads), so they are written in place.
"""

from __future__ import annotations

from hkv.ipc.request_table import RequestTable, SlotPhase


class SlotBook:
    """Free slots, the quarantine of slots sent plans still use, and row writes."""

    def __init__(self, table: RequestTable, slots: int):
        self.table: RequestTable = table
        self.free: list[int] = list(range(slots))[::-1]  # pop() hands out the lowest first
        self.freed: list[int] = []  # slots released since the last plan (the rank drops their state)
        self._last_step: dict[int, int] = {}  # slot -> the last sent plan that uses it
        self._quarantine: dict[int, int] = {}  # released slot -> the step whose result frees it
        self._done_step: int = 0  # the newest step whose result is in

    def take(self) -> int:
        return self.free.pop()

    def used_by(self, slot: int, step: int) -> None:
        """Plan `step` (being sent) uses `slot`."""
        self._last_step[slot] = step

    def release(self, slot: int) -> None:
        """The slot's sequence left: free it now, or once the last sent plan using it is done."""
        last = self._last_step.get(slot, 0)
        if last > self._done_step:
            self._quarantine[slot] = last
            return
        self._free_now(slot)

    def step_done(self, step: int) -> None:
        """Plan `step`'s result is in: quarantined slots it was the last to use become free."""
        self._done_step = max(self._done_step, step)
        for slot, last in list(self._quarantine.items()):
            if last <= self._done_step:
                del self._quarantine[slot]
                self._free_now(slot)

    def _free_now(self, slot: int) -> None:
        self.table.clear(slot)
        self._last_step.pop(slot, None)
        self.free.append(slot)
        self.freed.append(slot)

    def take_freed(self) -> list[int]:
        out, self.freed = self.freed, []
        return out

    def write_row(self, slot: int, pages: list[int], written: int, req_id: int, prompt_len: int,
                  cached: int, output_len: int, kv_end: int) -> int:
        """Fill the row (in full when `written` is 0, else the pages past `written`); returns the
        pages now written."""
        t = self.table
        if written == 0:
            t.write_pages(slot, pages)
            t.req_id[slot] = req_id
            t.prompt_len[slot] = prompt_len
            t.cached_len[slot] = cached
        elif len(pages) > written:
            t.append_pages(slot, pages[written:])
        t.output_len[slot] = output_len
        t.kv_len[slot] = kv_end
        t.phase[slot] = SlotPhase.DECODE if output_len else SlotPhase.PREFILL
        return len(pages)

    @property
    def quarantined(self) -> int:
        return len(self._quarantine)
