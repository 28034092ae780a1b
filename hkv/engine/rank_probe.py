"""When the router probes idle ranks, and how long they have been silent (issue 38).

A rank stopped between steps (SIGSTOP, a hung driver call) goes unnoticed while
nothing runs: no result is due, so none is late. So when the router has nothing
out and the ranks last answered half the stall timeout ago, it sends them a plan
with nothing to run (`Scheduler.probe_plan`, numbered and booked like any plan,
so results still match plans in sending order), which a live rank answers at
once. While the probe is out the router reports how long the ranks have been
silent (EngineState.ranks_silent_s) and the api turns /ready 503 once that
passes the stall timeout. Silence counts from the last answer, not from the
probe, so the 503 comes at most the stall timeout after the rank stopped:

    last answer        probe sent         still no answer: /ready 503
         |--- stall / 2 ---|--- stall / 2 ---|
         ^ the rank stopped here at the earliest

While plans flow nothing is sent: each result is a sign of life, and the api
judges a busy engine by its finished steps. The router sends the probe to every
rank and rank 0 answers for the group, as for any plan, once every rank ran it.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class RankProbe:
    """The ranks' last sign of life and the probe out, on an injectable clock (seconds)."""

    def __init__(self, stall_s: float, clock: Callable[[], float] = time.monotonic):
        self.interval_s: float = stall_s / 2  # silence, with nothing out, after which the ranks are probed
        self._clock = clock
        self._heard_at: float = clock()  # when the ranks last answered (or were last known ready)
        self.step: int | None = None  # the probe out: its plan's step; None when none is

    def heard(self) -> None:
        """The ranks just showed they are alive (they reported ready)."""
        self._heard_at = self._clock()

    def due_in(self) -> float | None:
        """Seconds until a router with nothing out should probe (0: now); None while a probe is out."""
        if self.step is not None:
            return None
        return max(0.0, self._heard_at + self.interval_s - self._clock())

    def sent(self, step: int) -> None:
        """The plan `step` went out as the probe (the router sends one only once it is due)."""
        assert self.step is None, f"probe {self.step} is still out"
        self.step = step

    def answered(self, step: int) -> bool:
        """The result of plan `step` came back, a sign of life whatever it says; True when it answers
        the probe (then it is no step of work and counts as none)."""
        self._heard_at = self._clock()
        if step != self.step:
            return False
        self.step = None
        return True

    def silent_s(self) -> float | None:
        """While a probe is out: seconds since the ranks last answered; None otherwise."""
        if self.step is None:
            return None
        return self._clock() - self._heard_at
