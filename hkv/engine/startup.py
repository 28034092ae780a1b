"""A rank's start-up phases, timed and reported as they go (hkv/ipc/startup.py carries the reports).

    with startup.phase("capturing decode graphs", total=24, unit="graphs") as phase:
        for bucket in buckets:
            capture(bucket)
            phase.advance()

Each phase reports its start, its end, and in between a line when another
quarter of its parts is done and at least LINE_GAP_S passed since its last
report: a long graph capture gets a few lines, a fast one two. The launcher
prints them and keeps the latest for `/ready`; it also repeats the current
phase when a long one stays silent.

The build runs in a thread that cannot await the actor's stop event: every
report checks `stopping` first and raises StartupStopped when the actor was
asked to stop, so a SIGTERM during start-up ends it at the next report.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

from hkv.ipc.startup import StartupProgress

LINE_GAP_S = 1.0  # at least this long between two reports of a phase's progress


class StartupStopped(BaseException):
    """The actor was asked to stop while starting. A BaseException, as asyncio's CancelledError: the
    build's `except Exception` fallbacks (a warm-up or a capture that fails is logged and skipped) must
    not swallow it."""


class Phase:
    """One running phase: `advance` as its parts get done."""

    def __init__(self, reporter: StartupReporter, name: str, total: int, unit: str):
        self.reporter = reporter
        self.name = name
        self.total = total
        self.unit = unit
        self.done = 0
        self.began_at = reporter.clock()
        self._reported_at = self.began_at
        self._quarter = 0  # quarters of `total` done as of the last report

    def advance(self, parts: int = 1) -> None:
        """`parts` more are done; reports when another quarter is and the last report is LINE_GAP_S old.
        Raises StartupStopped if the actor is stopping."""
        self.reporter.check()
        self.done += parts
        now = self.reporter.clock()
        quarter = 4 * self.done // self.total if self.total else 0
        if quarter > self._quarter and self.done < self.total and now - self._reported_at >= LINE_GAP_S:
            self._quarter = quarter
            self.report(now)

    def hold(self, seconds: float) -> None:
        """Report where the phase is, then wait `seconds` (fault injection: $HKV_STARTUP_STALL_S) unless asked
        to stop, which raises StartupStopped."""
        if seconds > 0:
            self.report(self.reporter.clock())
            if self.reporter.stopping.wait(seconds):
                raise StartupStopped

    def report(self, now: float, ended: bool = False) -> None:
        self._reported_at = now
        self.reporter.emit(StartupProgress(self.name, self.done, self.total, self.unit, now - self.began_at, ended))


class StartupReporter:
    """Times the start-up phases and hands each report to `emit` (called in the building thread).

    stopping: set when the actor is asked to stop (ActorContext.stopping); clock: time.monotonic, or a
    fake one in tests.
    """

    def __init__(self, emit: Callable[[StartupProgress], None], stopping: threading.Event,
                 clock: Callable[[], float] = time.monotonic):
        self.emit = emit
        self.stopping = stopping
        self.clock = clock

    @classmethod
    def silent(cls) -> StartupReporter:
        """Reports nothing and is never stopped (tests and tools that build a runner themselves)."""
        return cls(lambda progress: None, threading.Event())

    @contextlib.contextmanager
    def phase(self, name: str, total: int = 0, unit: str = "") -> Iterator[Phase]:
        """Report the phase's start, yield it, report its end (not when it fails: the actor reports that)."""
        self.check()
        phase = Phase(self, name, total, unit)
        phase.report(phase.began_at)
        yield phase
        phase.report(self.clock(), ended=True)

    def check(self) -> None:
        """Raise StartupStopped if the actor is stopping."""
        if self.stopping.is_set():
            raise StartupStopped
