"""The router's per-request stage times (hkv/engine/timeline.py, --log-request-times)."""

import logging

from hkv.engine import timeline as tl
from hkv.engine.timeline import Timeline
from hkv.ipc.messages import Chunk, NewSequence, SamplingParams, StepPlan, StepResult, TokenDelta


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _plan(step, req_id, slot, tokens, ops=()):
    return StepPlan(step, [NewSequence(slot, req_id, SamplingParams(max_tokens=4))],
                    [Chunk(slot, list(range(tokens)), 0, True)], [], list(ops))


def test_a_request_line_names_each_stage_once_in_ms_from_arrival(caplog):
    clock = Clock()
    line = Timeline(True, clock)
    line.arrived(7, 300)
    clock.now += 0.003
    line.mark(7, "tier")
    line.mark(8, "tier")  # not followed: ignored
    line.mark(None, "tier")  # a lookup that is not a request's any more
    clock.now += 0.001
    plan = _plan(41, 7, slot=2, tokens=44)
    line.plan_sent(plan)
    clock.now += 0.010
    line.plan_done(plan, StepResult(41, [], 0.0085))
    line.plan_sent(_plan(50, 7, slot=2, tokens=9))  # re-admitted after a preemption: the first admission stays
    line.published([TokenDelta(7, [5], None, None, None, 300, 256)])
    clock.now += 0.5
    line.published([TokenDelta(7, [6], None, None, None, 300, 256)])
    with caplog.at_level(logging.INFO, logger=tl.log.name):
        line.published([TokenDelta(7, [9], None, None, "length", 300, 256,
                                   {"gpu": 0, "cpu": 256, "disk": 0, "peer": 0})])
    (record,) = [r.getMessage() for r in caplog.records]
    assert record == ("request 7: 300 prompt tokens, cached gpu 0 cpu 256 disk 0 peer 0; tier 3.0 ms, admitted 4.0 ms "
                      "(step 41, 44 tokens, 0 cache ops), first step done 14.0 ms (forward 8.5 ms), first token 14.0 ms, "
                      "finished 514.0 ms (length)")
    assert line._reqs == {}  # a finished request is forgotten


def test_off_it_keeps_nothing_and_the_tracked_set_is_bounded(monkeypatch):
    off = Timeline(False)
    off.arrived(1, 10)
    off.mark(1, "tier")
    off.published([TokenDelta(1, [2], None, None, "stop", 10, 0)])
    assert off._reqs == {}
    monkeypatch.setattr(tl, "MAX_TRACKED", 3)
    on = Timeline(True)
    for req_id in range(5):
        on.arrived(req_id, 10)
    assert list(on._reqs) == [2, 3, 4]  # the oldest went


def test_times_count_from_the_apis_receive_time_when_it_is_plausible(caplog):
    """A request that waited in the router's inbox (it reads new requests between steps) shows the
    wait as its `router` stage, every later stage counted from the api's receive time; a missing,
    future or ancient receive time falls back to the router's clock."""
    clock = Clock()
    line = Timeline(True, clock)
    line.arrived(1, 20, received_at=clock.now - 0.040)  # came during a 40 ms step
    line.arrived(2, 20, received_at=0.0)  # unknown (an older api)
    line.arrived(3, 20, received_at=clock.now + 5.0)  # ahead of this clock: not this host's
    line.arrived(4, 20, received_at=clock.now - 2 * tl.MAX_WAIT_S)
    clock.now += 0.002
    for req_id in (1, 2, 3, 4):
        plan = _plan(req_id, req_id, slot=req_id, tokens=8)
        line.plan_sent(plan)
    with caplog.at_level(logging.INFO, logger=tl.log.name):
        line.published([TokenDelta(r, [5], None, None, "length", 20, 0) for r in (1, 2, 3, 4)])
    lines = [r.getMessage().split("; ", 1)[1] for r in caplog.records]
    assert lines[0] == ("router 40.0 ms, admitted 42.0 ms (step 1, 8 tokens, 0 cache ops), first token 42.0 ms, "
                        "finished 42.0 ms (length)")
    assert all(rest.startswith("admitted 2.0 ms") for rest in lines[1:]), lines
