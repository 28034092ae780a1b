"""RankProbe: when the router probes idle ranks and how long they count as silent, on a fake clock (issue 38)."""

from __future__ import annotations

import pytest

from hkv.engine.rank_probe import RankProbe


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_probe_is_due_half_the_stall_timeout_after_the_last_answer():
    clock = Clock()
    probe = RankProbe(2.0, clock)
    assert probe.due_in() == 1.0 and probe.silent_s() is None
    clock.now += 0.75
    assert probe.due_in() == 0.25
    assert not probe.answered(7)  # a step's result: a sign of life, no probe
    assert probe.due_in() == 1.0
    clock.now += 1.5
    assert probe.due_in() == 0.0  # late: due at once, never negative


def test_silence_counts_from_the_last_answer_not_from_the_probe():
    """The rank may have stopped right after its last answer: 503 comes at most stall_s after that."""
    clock = Clock()
    probe = RankProbe(2.0, clock)
    clock.now += 1.0
    probe.sent(12)
    assert probe.step == 12 and probe.silent_s() == 1.0
    assert probe.due_in() is None  # never a second probe while one is out
    clock.now += 1.25
    assert probe.silent_s() == 2.25
    with pytest.raises(AssertionError):
        probe.sent(13)


def test_only_the_probes_own_result_answers_it():
    """Work that arrives while the probe is out goes behind it; results come back in sending order."""
    clock = Clock()
    probe = RankProbe(4.0, clock)
    clock.now += 2.0
    probe.sent(5)  # plan 6 goes out behind it
    clock.now += 3.0
    assert probe.silent_s() == 5.0
    assert probe.answered(5)
    assert probe.step is None and probe.silent_s() is None and probe.due_in() == 2.0
    clock.now += 0.5
    assert not probe.answered(6)  # a step of work
    assert probe.due_in() == 2.0
    clock.now += 2.0
    probe.sent(7)
    assert not probe.answered(8) and probe.step == 7 and probe.silent_s() == 0.0  # no other number clears it


def test_heard_restarts_the_wait():
    clock = Clock()
    probe = RankProbe(10.0, clock)
    clock.now += 60.0  # model loading: the ranks were not asked anything
    assert probe.due_in() == 0.0
    probe.heard()  # they reported ready
    assert probe.due_in() == 5.0
