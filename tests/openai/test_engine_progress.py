"""EngineProgress: the api's judgement of a stalled engine, on a fake clock (issue 16, item 3)."""

from __future__ import annotations

from hkv.ipc.messages import ENGINE_HEARTBEAT_S, EngineState
from hkv.openai.router_link import EngineProgress


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _state(steps: int, waiting: int = 0, running: int = 0) -> EngineState:
    return EngineState(ready=True, alive=True, waiting=waiting, running=running, steps=steps)


def test_no_report_yet_is_not_a_stall():
    assert EngineProgress(5.0, Clock()).stalled() is None


def test_pending_work_without_a_finished_step_stalls_after_the_timeout():
    clock = Clock()
    p = EngineProgress(5.0, clock)
    p.on_state(_state(10, running=1))
    for _ in range(4):  # heartbeats with the same step count
        clock.now += 1.0
        p.on_state(_state(10, running=1))
        assert p.stalled() is None
    clock.now += 1.5
    p.on_state(_state(10, running=1))
    assert p.stalled() == "no step finished for 5.5 s with work pending"
    p.on_state(_state(11, running=1))
    assert p.stalled() is None


def test_an_idle_engine_never_stalls_and_new_work_starts_the_clock():
    clock = Clock()
    p = EngineProgress(5.0, clock)
    p.on_state(_state(10))
    for _ in range(30):
        clock.now += 1.0
        p.on_state(_state(10))
    assert p.stalled() is None
    p.on_state(_state(10, waiting=1))  # work arrives after a long idle: not stalled yet
    assert p.stalled() is None
    clock.now += 5.1
    p.on_state(_state(10, waiting=1))
    assert p.stalled() is not None


def test_a_silent_router_stalls_even_when_idle():
    clock = Clock()
    p = EngineProgress(2.0, clock)
    p.on_state(_state(3))
    clock.now += 2.0 + ENGINE_HEARTBEAT_S - 0.01
    assert p.stalled() is None
    clock.now += 0.02
    assert p.stalled().startswith("the router has not reported for")


def test_new_tokens_are_a_step_that_moved():
    """A stream can end right after a stalled engine resumes, before the router's next report: the
    tokens it got say the engine moves (the stopped-rank test saw /ready 503 after its [DONE])."""
    clock = Clock()
    p = EngineProgress(2.0, clock)
    p.on_tokens()  # before the first report: nothing to judge yet
    assert p.stalled() is None
    p.on_state(_state(10, running=1))
    clock.now += 2.5
    assert p.stalled() == "no step finished for 2.5 s with work pending"
    p.on_tokens()
    assert p.stalled() is None
    clock.now += 0.6  # tokens go on, state reports do not: silent once the last report is over stall + 1 s old
    p.on_tokens()
    assert p.stalled().startswith("the router has not reported for 3.1")


def test_ranks_silent_under_a_probe_stall_an_idle_engine():
    """Issue 38: the router probes idle ranks and reports how long they have been silent; the api adds the
    time since that report, so /ready turns 503 once the ranks are silent for the stall timeout."""
    clock = Clock()
    p = EngineProgress(2.0, clock)
    p.on_state(_state(10))
    p.on_state(EngineState(ready=True, alive=True, waiting=0, running=0, steps=10, ranks_silent_s=1.0))
    clock.now += 0.99
    assert p.stalled() is None
    clock.now += 0.02
    assert p.stalled() == "the ranks have not answered for 2.0 s (idle, probed by the router)"
    clock.now += 0.5  # the heartbeat's next report: still silent
    p.on_state(EngineState(ready=True, alive=True, waiting=0, running=0, steps=10, ranks_silent_s=2.5))
    assert p.stalled() is not None
    p.on_state(_state(10))  # the probe was answered: steps did not move, and need not
    assert p.stalled() is None


def test_a_step_is_dated_when_it_finished_not_when_it_was_reported():
    """Steps alone wake no report, so the one that says they moved may come up to a heartbeat later: a rank
    stopped mid-stream still makes /ready 503 the stall timeout after its last step, not a second later."""
    clock = Clock()
    p = EngineProgress(2.0, clock)
    p.on_state(_state(10, running=1))
    clock.now += 1.0
    p.on_state(EngineState(ready=True, alive=True, waiting=0, running=1, steps=40, since_step_s=0.8))
    clock.now += 1.1
    assert p.stalled() is None
    clock.now += 0.2  # 2.1 s after the last step, 1.3 s after the report
    assert p.stalled() == "no step finished for 2.1 s with work pending"
    p.on_state(EngineState(ready=True, alive=True, waiting=0, running=1, steps=40, since_step_s=2.1))
    assert p.stalled() is not None  # the same count: nothing moved
