"""Planning one step ahead: the router sends plan n+1 before plan n's result is in.

A fake rank runs plans in order the way the real one does: a `follows` chunk's token is the
one its slot sampled last, and the token sampled after position p is a function of p alone,
so a run that plans ahead must produce exactly what a run that waits for every result
produces, with the books balanced after every result and no KV computed from a wrong token.
"""

from __future__ import annotations

from collections import deque

import pytest

from hkv.ipc.messages import Sampled, StepPlan, StepResult
from tests.engine.test_scheduler import EOS, make, req


def token_at(pos: int, eos_at: int | None = None) -> int:
    return EOS if pos == eos_at else 3 + pos % 89


class FakeRank:
    """Runs plans in order; records every token it computed, by (request, position)."""

    def __init__(self, eos_at: int | None = None, fail_step: int | None = None):
        self.eos_at, self.fail_step = eos_at, fail_step
        self.req_of: dict[int, int] = {}  # slot -> request
        self.last: dict[int, int] = {}  # slot -> token it sampled last
        self.computed: dict[tuple[int, int], int] = {}  # (request, position) -> token fed there
        self.follows = 0

    def run(self, plan: StepPlan) -> StepResult:
        for seq in plan.new:
            self.req_of[seq.slot] = seq.req_id
        if plan.step == self.fail_step:
            return StepResult(plan.step, [], 0.0, "injected failure")
        sampled = []
        for c in plan.chunks:
            tokens = [self.last[c.slot]] if c.follows else c.token_ids
            self.follows += c.follows
            for i, t in enumerate(tokens):
                self.computed[(self.req_of[c.slot], c.start_pos + i)] = t
            if c.sample:
                token = token_at(c.start_pos + len(tokens), self.eos_at)
                self.last[c.slot] = token
                sampled.append(Sampled(c.slot, token, None, None))
        return StepResult(plan.step, sampled, 0.0)


def drive(sched, rank: FakeRank, ahead: int, limit: int = 400) -> dict[int, list]:
    """Plan up to `ahead` steps out, like the router; returns each request's deltas."""
    out: dict[int, list] = {}
    sent: deque[tuple[StepPlan, StepResult]] = deque()
    for _ in range(limit):
        if not (sched.has_work() or sent):
            break
        while len(sent) < ahead and sched.has_work():
            plan = sched.schedule()
            if plan is None:
                break
            sent.append((plan, rank.run(plan)))
        if not sent:
            deltas = sched.take_finished()
            assert deltas, "stuck with nothing out"
        else:
            plan, result = sent.popleft()
            deltas = sched.on_result(result, plan)
            sched.coord.check_integrity()
        for d in deltas:
            out.setdefault(d.req_id, []).append(d)
    assert not sched.has_work() and not sent
    return out


def _run(ahead: int, hybrid: bool, eos_at: int | None = None, fail_step: int | None = None, **kw):
    sched = make(prefix_cache=True, hybrid=hybrid, interval=8 if hybrid else None, state_slots=24 if hybrid else 0,
                 align=4, **{"num_pages": 48, "budget": 12, "max_running": 4, **kw})
    prompts = {1: 9, 2: 5, 3: 14, 4: 3, 5: 9}
    for r, n in prompts.items():
        sched.add(req(r, n, max_tokens=6 + r))
    rank = FakeRank(eos_at, fail_step)
    out = drive(sched, rank, ahead)
    return sched, rank, out, prompts


def _tokens(out: dict[int, list]) -> dict[int, list[int]]:
    return {r: [t for d in ds for t in d.token_ids] for r, ds in out.items()}


def _reasons(out: dict[int, list]) -> dict[int, str]:
    return {r: ds[-1].finish_reason for r, ds in out.items()}


@pytest.mark.parametrize("hybrid", [False, True], ids=["dense", "hybrid"])
def test_planning_ahead_changes_nothing_a_client_sees(hybrid):
    _, _, waited, _ = _run(1, hybrid)
    sched, rank, ahead, prompts = _run(2, hybrid)
    assert _tokens(ahead) == _tokens(waited) and _reasons(ahead) == _reasons(waited)
    assert rank.follows > 0  # it did plan ahead: decode chunks fed their previous token in
    for r, n in prompts.items():  # every token the rank computed is the sequence's own
        sequence = list(range(1, n + 1)) + _tokens(ahead)[r]
        assert all(rank.computed[(r, p)] == sequence[p] for (q, p) in rank.computed if q == r)
    assert sched.slots.quarantined == 0 and len(sched.free_slots) == 4


@pytest.mark.parametrize("hybrid", [False, True], ids=["dense", "hybrid"])
def test_an_eos_with_the_next_chunk_out_drops_that_chunk(hybrid):
    """Every sequence reaching position 12 samples EOS there: the chunk planned past it is already out."""
    _, _, waited, _ = _run(1, hybrid, eos_at=12)
    sched, rank, ahead, _ = _run(2, hybrid, eos_at=12)
    assert _tokens(ahead) == _tokens(waited)
    # requests 1, 2, 4 and 5 reach it (request 3's prompt is longer), each one token past its prompt or more
    assert [r for r, why in sorted(_reasons(ahead).items()) if why == "stop"] == [1, 2, 4, 5]
    assert sched.coord.pages.free_count + sched.coord.tree.cached_pages == sched.coord.spec.num_pages


def test_a_slot_in_a_sent_plan_is_not_reused_before_that_plan_is_done():
    sched = make(prefix_cache=False, budget=8, max_running=1, num_pages=16)
    sched.add(req(1, 3, max_tokens=1))
    sched.add(req(2, 3, max_tokens=1))
    first = sched.schedule()  # request 1's prompt; its one token ends it
    assert sched.schedule() is None  # nothing to plan ahead: request 1 ends with that token, no slot free
    result = StepResult(first.step, [Sampled(first.chunks[0].slot, 7, None, None)], 0.0)
    sched.on_result(result, first)
    assert sched.slots.quarantined == 0
    second = sched.schedule()
    assert [c.slot for c in second.chunks] == [first.chunks[0].slot] and second.freed == [first.chunks[0].slot]


def test_a_sequence_preempted_with_a_chunk_out_drops_its_result():
    """Request 2 is preempted while its chunk is out; the slot waits for that result."""
    sched = make(prefix_cache=True, budget=64, max_running=2, num_pages=6)
    sched.add(req(1, 8, max_tokens=9))
    sched.add(req(2, 7, max_tokens=9))
    rank = FakeRank()
    out = drive(sched, rank, ahead=2)
    assert sched.preemptions >= 1
    assert {r: len(t) for r, t in _tokens(out).items()} == {1: 9, 2: 9}
    for r, n in ((1, 8), (2, 7)):
        sequence = list(range(1, n + 1)) + _tokens(out)[r]
        assert all(rank.computed[(r, p)] == sequence[p] for (q, p) in rank.computed if q == r)


def test_a_failed_step_whose_prefixes_were_published_ahead_drops_the_cache():
    """Plan 2 is planned before plan 1's result, publishing what plan 1 computes; plan 1 fails."""
    sched = make(prefix_cache=True, budget=64, max_running=2, num_pages=16)
    sched.add(req(1, 9, max_tokens=4))
    sched.add(req(2, 5, max_tokens=4))
    first = sched.schedule()
    second = sched.schedule()
    # tokens 1..8 of request 1 (request 2, tokens 1..5, shares the first page)
    assert all(c.follows for c in second.chunks) and sched.coord.tree.cached_pages == 2
    deltas = sched.on_result(StepResult(first.step, [], 0.0, "injected failure"), first)
    assert {d.req_id: d.finish_reason for d in deltas} == {1: "error", 2: "error"}
    assert sched.coord.tree.cached_pages == 0  # the failed step's prefixes are not served
    sampled = [Sampled(c.slot, 5, None, None) for c in second.chunks]
    assert sched.on_result(StepResult(second.step, sampled, 0.0), second) == []  # its tokens are dropped
    assert not sched.has_work() and len(sched.free_slots) == 2 and sched.slots.quarantined == 0
    sched.coord.check_integrity()
