"""A rank's start-up phases (hkv/engine/startup.py): what each reports and when, and stopping mid-way."""

from __future__ import annotations

import threading

import pytest

from hkv.engine.startup import LINE_GAP_S, StartupReporter, StartupStopped
from hkv.ipc.request_table import RequestTable, TableLayout
from hkv.ipc.startup import StartupProgress, describe


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _reporter() -> tuple[StartupReporter, list[StartupProgress], Clock, threading.Event]:
    reports: list[StartupProgress] = []
    clock, stopping = Clock(), threading.Event()
    return StartupReporter(reports.append, stopping, clock), reports, clock, stopping


def test_a_phase_reports_its_start_and_its_end_with_the_time_it_took():
    startup, reports, clock, _ = _reporter()
    with startup.phase("allocating the KV pool"):
        clock.now += 0.25
    assert reports == [StartupProgress("allocating the KV pool"),
                       StartupProgress("allocating the KV pool", elapsed_s=0.25, ended=True)]
    assert [describe(r) for r in reports] == ["allocating the KV pool", "allocating the KV pool: done in 0.2 s"]


def test_a_long_phase_reports_each_quarter_at_most_once_a_gap_and_never_at_its_last_part():
    startup, reports, clock, _ = _reporter()
    with startup.phase("capturing decode graphs", 24, "graphs") as phase:
        for i in range(24):
            clock.now += 0.5 if i < 8 else 3.0  # the first third fast, then slow
            phase.advance()
    seen = [(r.done, r.elapsed_s, r.ended) for r in reports]
    # a line at each quarter (6, 12, 18: each LINE_GAP_S or more after the last), none at 24: the end says it
    assert seen == [(0, 0.0, False), (6, 3.0, False), (12, 16.0, False), (18, 34.0, False), (24, 52.0, True)]
    assert describe(reports[2]) == "capturing decode graphs (12/24 graphs, 16.0 s)"
    assert describe(reports[0]) == "capturing decode graphs (0/24 graphs)"
    assert describe(reports[-1]) == "capturing decode graphs: done in 52.0 s (24/24 graphs)"


def test_a_fast_phase_gets_two_lines_however_many_parts_it_has():
    startup, reports, clock, _ = _reporter()
    with startup.phase("loading weights", 311, "tensors") as phase:
        for _ in range(311):
            clock.now += LINE_GAP_S / 400  # the whole phase takes less than the gap
            phase.advance()
    assert [(r.done, r.ended) for r in reports] == [(0, False), (311, True)]


def test_a_stop_ends_start_up_at_the_next_report_past_except_exception():
    startup, reports, _, stopping = _reporter()
    with pytest.raises(StartupStopped):
        with startup.phase("capturing prefill graphs", 4, "graphs") as phase:
            phase.advance()
            stopping.set()
            try:  # the build's fallbacks (a failed capture is logged and skipped) must not swallow it
                phase.advance()
            except Exception:  # pragma: no cover
                pytest.fail("StartupStopped is not an Exception")
    assert not reports[-1].ended  # a stopped phase never says it is done
    with pytest.raises(StartupStopped):
        with startup.phase("next"):
            pass
    assert reports[-1].phase == "capturing prefill graphs"


def test_hold_reports_where_the_phase_is_and_gives_way_to_a_stop():
    startup, reports, clock, stopping = _reporter()
    with startup.phase("loading weights", 3, "tensors") as phase:
        for _ in range(3):
            phase.advance()
        clock.now += 0.5
        phase.hold(0.0)  # no stall: nothing reported
        assert len(reports) == 1
        stopping.set()
        with pytest.raises(StartupStopped):
            phase.hold(30.0)  # returns at once: the stop is already asked for
    held = reports[1]  # (then the phase ended: the test caught the stop inside it)
    assert (held.done, held.total, held.ended) == (3, 3, False) and len(reports) == 3
    assert describe(held) == "loading weights (3/3 tensors, 0.5 s)"


def test_describe_shows_the_live_age_of_a_phase():
    running = StartupProgress("compiling prefill kernels", 1, 3, "steps", 2.0)
    assert describe(running, 42.25) == "compiling prefill kernels (1/3 steps, 42.2 s)"
    assert describe(StartupProgress("sizing the KV pool", elapsed_s=1.0), 12.0) == "sizing the KV pool (12.0 s)"


def test_capture_graphs_reports_each_graph_set_as_a_phase():
    """On CPU the graph sets are built without capturing (tests' path): the phases are the same."""
    from tests.engine.test_model_runner import SLOTS, _model, _runner

    layout = TableLayout(slots=SLOTS, max_pages=16)
    runner = _runner(_model("hybrid"), RequestTable(layout, memoryview(bytearray(layout.nbytes()))), True)
    startup, reports, _, _ = _reporter()
    runner.capture_graphs(startup)
    ends = [(r.phase, r.done, r.total) for r in reports if r.ended]
    assert ends == [("capturing decode graphs", len(runner.graphs.graphs), len(runner.graphs.graphs)),
                    ("capturing prefill graphs", len(runner.prefill_graphs.sizes), len(runner.prefill_graphs.sizes))]
    assert [r.phase for r in reports if not r.ended][0] == "capturing decode graphs"
