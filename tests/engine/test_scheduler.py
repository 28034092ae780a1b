"""Scheduler: chunking, page accounting, preemption with recompute, aborts."""

from __future__ import annotations

import pytest

from hkv.engine.pages import PageAllocator
from hkv.engine.scheduler import Scheduler, SchedulerLimits
from hkv.ipc.messages import GenerateRequest, Sampled, SamplingParams, StepResult
from hkv.ipc.request_table import RequestTable, SlotPhase, TableLayout

EOS = 99


def make(num_pages=16, page_size=4, max_running=4, budget=8, max_context=256):
    layout = TableLayout(slots=max_running, max_pages=64)
    table = RequestTable(layout, memoryview(bytearray(layout.nbytes())))
    limits = SchedulerLimits(page_size, max_running, budget, max_context, frozenset({EOS}))
    return Scheduler(limits, PageAllocator(num_pages), table)


def req(req_id, prompt_len, max_tokens=4, **kw):
    return GenerateRequest(req_id, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, **kw))


def step(sched, token_for=lambda slot: 7):
    """Run one step with a fake rank; returns (plan, deltas)."""
    plan = sched.schedule()
    if plan is None:
        return None, sched.take_finished()
    sampled = [Sampled(c.slot, token_for(c.slot), None, None) for c in plan.chunks if c.sample]
    return plan, sched.on_result(StepResult(plan.step, sampled, 0.0), plan)


def check_table_matches(sched):
    for seq in sched.running.values():
        n = sched.table.num_pages[seq.slot]
        assert sched.table.page_ids[seq.slot, :n].tolist() == seq.pages


def test_chunked_prefill_splits_by_budget_and_allocates_pages_per_chunk():
    sched = make(budget=8, page_size=4)
    sched.add(req(1, 10))
    plan, deltas = step(sched)
    assert [len(c.token_ids) for c in plan.chunks] == [8]
    assert plan.chunks[0].start_pos == 0 and not plan.chunks[0].sample
    assert plan.new[0].req_id == 1
    assert sched.running[1].pages == [0, 1]
    assert deltas == []
    plan, deltas = step(sched)
    assert plan.chunks[0].token_ids == [9, 10] and plan.chunks[0].start_pos == 8 and plan.chunks[0].sample
    assert sched.running[1].pages == [0, 1, 2]
    assert [d.token_ids for d in deltas] == [[7]]
    check_table_matches(sched)
    assert sched.table.phase[plan.chunks[0].slot] == SlotPhase.PREFILL


def test_decode_feeds_last_token_and_finishes_on_length():
    sched = make()
    sched.add(req(1, 3, max_tokens=3))
    outputs = []
    for _ in range(3):
        plan, deltas = step(sched, token_for=lambda s: 40 + len(outputs))
        outputs += [t for d in deltas for t in d.token_ids]
    assert outputs == [40, 41, 42]
    assert deltas[-1].finish_reason == "length"
    assert not sched.has_work()
    assert sched.pages.free_count == sched.pages.num_pages
    sched.pages.check_integrity()


def test_eos_finishes_unless_ignored():
    sched = make()
    sched.add(req(1, 3, max_tokens=5))
    sched.add(req(2, 3, max_tokens=2, ignore_eos=True))
    _, deltas = step(sched, token_for=lambda s: EOS)
    reasons = {d.req_id: d.finish_reason for d in deltas}
    assert reasons == {1: "stop", 2: None}


def test_abort_waiting_and_running_return_everything():
    sched = make(max_running=1)
    sched.add(req(1, 3, max_tokens=10))
    sched.add(req(2, 3, max_tokens=10))
    step(sched)
    sched.abort(2)  # still waiting
    sched.abort(1)  # running
    plan = sched.schedule()
    assert plan is None
    reasons = sorted((d.req_id, d.finish_reason) for d in sched.take_finished())
    assert reasons == [(1, "abort"), (2, "abort")]
    assert sched.pages.free_count == sched.pages.num_pages
    assert sched.table.phase.tolist() == [SlotPhase.FREE]


def test_preemption_recomputes_prompt_and_outputs():
    # 4 pages of 4 tokens: two sequences outgrow them and the newer one is preempted.
    sched = make(num_pages=4, page_size=4, budget=64, max_running=2)
    sched.add(req(1, 4, max_tokens=6))
    sched.add(req(2, 3, max_tokens=6))
    produced = {1: [], 2: []}
    preempted = False
    for _ in range(40):
        if not sched.has_work():
            break
        plan, deltas = step(sched, token_for=lambda s: 50 + s)
        if plan is not None and any(c.start_pos == 0 and len(c.token_ids) > 4 for c in plan.chunks):
            preempted = True  # a resumed sequence recomputes prompt + outputs in one chunk
        for d in deltas:
            produced[d.req_id] += d.token_ids
        sched.pages.check_integrity()
        check_table_matches(sched)
    assert preempted
    assert all(len(v) == 6 for v in produced.values())
    assert sched.pages.free_count == 4


def test_request_that_cannot_fit_fails_instead_of_spinning():
    sched = make(num_pages=2, page_size=4, budget=64)
    sched.add(req(1, 12))
    assert sched.schedule() is None
    (delta,) = sched.take_finished()
    assert delta.finish_reason == "error" and "KV pages" in delta.error
    assert not sched.has_work()


def test_step_error_fails_its_requests_and_frees_pages():
    sched = make()
    sched.add(req(1, 5))
    plan = sched.schedule()
    deltas = sched.on_result(StepResult(plan.step, [], 0.0, "boom"), plan)
    assert [(d.req_id, d.finish_reason, d.error) for d in deltas] == [(1, "error", "boom")]
    assert sched.pages.free_count == sched.pages.num_pages


@pytest.mark.parametrize("prompt_len", [1, 4, 5, 16])
def test_freed_slots_are_reported_once(prompt_len):
    sched = make(budget=64)
    sched.add(req(1, prompt_len, max_tokens=1))
    plan, deltas = step(sched)
    first_slot = plan.chunks[0].slot
    assert deltas[0].finish_reason == "length"
    sched.add(req(2, 2, max_tokens=1))
    plan, deltas = step(sched)
    assert plan.freed == [first_slot]
    assert plan.new[0].slot == first_slot  # a freed slot is reused; ranks apply `freed` first
    assert deltas[0].finish_reason == "length"
    assert sched.schedule() is None
    assert sched.take_finished() == []
