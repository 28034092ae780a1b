"""The Scheduler's prefill/decode half: a decode request pulls its prompt before its tier lookup, a prefill
request for a peer answers once its copies out settled, and usage.cache counts the peer's pages."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hkv.cache.coordinator import CacheCoordinator
from hkv.cache.keys import page_keys
from hkv.cache.types import CacheSpec, LoadPages, LoadState
from hkv.engine.scheduler import Scheduler, SchedulerLimits
from hkv.engine.tier_client import TierClient, TierHit
from hkv.ipc.messages import (
    GenerateRequest, PdFetch, PdFetched, Sampled, SamplingParams, StepResult, TierFound, TierLookup,
    TierReserve, TierReserved,
)  # fmt: skip
from hkv.ipc.request_table import RequestTable, TableLayout

EOS = 99
ROOT = bytes(16)
P = 16  # page size
PEER = "tcp://127.0.0.1:5"
PAGES, STATES = 64, 16


def make(hybrid: bool = True) -> Scheduler:
    """A scheduler with CPU/disk tiers (hybrid by default): 64 device pages of 16 tokens, 16 state slots."""
    layout = TableLayout(slots=4, max_pages=64)
    table = RequestTable(layout, memoryview(bytearray(layout.nbytes())))
    limits = SchedulerLimits(P, 4, 512, 1024, frozenset({EOS}), hybrid, 64 if hybrid else None, 64)
    coord = CacheCoordinator(CacheSpec(P, PAGES, STATES if hybrid else 0, 0, hybrid, 64 if hybrid else None, True))
    return Scheduler(limits, coord, table, TierClient(coord, ROOT, P, hybrid, 64, 16))


def prompt(n: int, base: int = 1) -> list[int]:
    return list(range(base, base + n))


def generate(req_id: int, n: int, peer: str | None = PEER, max_tokens: int = 1, **kw) -> GenerateRequest:
    return GenerateRequest(req_id, prompt(n, base=req_id * 1000), SamplingParams(max_tokens=max_tokens), peer=peer,
                           **kw)  # fmt: skip


def step(sched: Scheduler):
    plan = sched.schedule()
    if plan is None:
        return None, sched.take_finished()
    sampled = [Sampled(c.slot, 7, None, None) for c in plan.chunks if c.sample]
    return plan, sched.on_result(StepResult(plan.step, sampled, 0.0), plan)


def check_books_balanced(sched: Scheduler) -> None:
    """Nothing is held by anyone: every device page and state slot is free or an evictable cache entry."""
    sched.coord.check_integrity()
    assert sched.coord.requests == {} and sched.coord.holds == {}
    assert sched.coord.pages.free_count + sched.coord.tree.evictable_pages == PAGES
    assert sched.tiers.waiting_lookups == {} and sched.tiers.offloads == {}


def lookups(sched: Scheduler) -> list[TierLookup]:
    return [m for m in sched.tiers.take_outbox() if isinstance(m, TierLookup)]


# A decode request: the fetch first


@pytest.mark.parametrize("hybrid", [True, False])
def test_a_request_naming_a_peer_queues_one_fetch_of_its_prompt_pages_and_no_lookup(hybrid):
    sched = make(hybrid)
    sched.add(generate(1, 200))
    (fetch,) = sched.take_pd_outbox()
    tokens = prompt(200, base=1000)
    assert isinstance(fetch, PdFetch) and fetch.peer == PEER and fetch.need_state is hybrid
    assert fetch.keys == page_keys(ROOT, tokens[: 199 // P * P], P) and len(fetch.keys) == 12
    assert sched.tiers.take_outbox() == []
    assert sched.take_pd_outbox() == []  # taken once
    assert sched.waiting[0].lookup_pending


def test_the_request_is_not_admitted_while_its_fetch_is_out_and_others_pass_it():
    sched = make()
    sched.add(generate(1, 200))
    assert sched.schedule() is None and sched.take_finished() == []
    assert [s.req_id for s in sched.waiting] == [1] and sched.running == {}
    sched.add(generate(2, 10, peer=None))  # too short for a tier lookup: ready at once
    plan = sched.schedule()
    assert [n.req_id for n in plan.new] == [2]
    assert [s.req_id for s in sched.waiting] == [1]


def test_a_good_fetch_issues_the_tier_lookup_then_admits_as_a_cpu_hit_with_peer_tokens():
    sched = make()
    sched.add(generate(1, 200))
    (fetch,) = sched.take_pd_outbox()
    sched.on_pd_fetched(PdFetched(fetch.fetch_id, True, [3, 4, 11]))
    (lookup,) = lookups(sched)
    assert (lookup.first, lookup.keys, lookup.need_state, lookup.parent) == (0, fetch.keys, True, None)
    assert sched.schedule() is None  # it waits for the lookup now
    entries = list(range(20, 32))
    from_disk = [True] + [False] * 11  # page 0 came back from the disk tier
    sched.on_tier_found(TierFound(lookup.lookup_id, 0, entries, from_disk, 5))
    plan = sched.schedule()
    (chunk,) = plan.chunks
    assert chunk.start_pos == 192  # 12 pages loaded, the prompt's last 8 tokens computed
    loads = [op for op in plan.ops if isinstance(op, (LoadPages, LoadState))]
    assert loads[0].src_entries == entries and loads[1].src_entry == 5
    deltas = sched.on_result(StepResult(plan.step, [Sampled(chunk.slot, 7, None, None)], 0.0), plan)
    (delta,) = deltas
    assert delta.finish_reason == "length" and delta.cached_tokens == 192
    assert delta.cache_tiers == {"gpu": 0, "cpu": 128, "disk": 16, "peer": 48}
    assert sched.pd_malformed == 0


def test_a_lookup_that_finds_nothing_after_the_fetch_computes_the_prompt():
    sched = make()
    sched.add(generate(1, 40))
    (fetch,) = sched.take_pd_outbox()
    sched.on_pd_fetched(PdFetched(fetch.fetch_id, True, []))
    (lookup,) = lookups(sched)
    sched.on_tier_found(TierFound(lookup.lookup_id, 0, [], [], None))
    plan, _ = step(sched)
    assert plan.chunks[0].start_pos == 0
    while sched.has_work():
        _, deltas = step(sched)
    assert deltas[-1].cache_tiers == {"gpu": 0, "cpu": 0, "disk": 0, "peer": 0}


@pytest.mark.parametrize("error,text", [("transfer from tcp://127.0.0.1:5 failed: busy",
                                         "transfer from tcp://127.0.0.1:5 failed: busy"),
                                        (None, "the transfer failed")])
def test_a_failed_fetch_fails_the_request_with_its_reason_and_frees_nothing_it_did_not_hold(error, text):
    sched = make()
    sched.add(generate(1, 200))
    (fetch,) = sched.take_pd_outbox()
    sched.on_pd_fetched(PdFetched(fetch.fetch_id, False, [], error))
    (delta,) = sched.take_finished()
    assert (delta.req_id, delta.finish_reason, delta.error, delta.token_ids) == (1, "error", text, [])
    assert delta.prompt_tokens == 200 and delta.cached_tokens == 0
    assert not sched.has_work()
    assert sched.tiers.take_outbox() == []  # no lookup, and no release of a run it never had
    check_books_balanced(sched)
    assert sched.coord.pages.free_count == PAGES and sched.coord.state_slots.free_count == STATES


def test_a_fetched_answer_for_no_fetch_is_counted_and_changes_nothing():
    sched = make()
    sched.add(generate(1, 200))
    (fetch,) = sched.take_pd_outbox()
    sched.on_pd_fetched(PdFetched(fetch.fetch_id + 1000, True, [0]))
    assert sched.pd_malformed == 1
    assert sched.tiers.take_outbox() == [] and sched.take_finished() == []
    assert sched.waiting[0].lookup_pending
    sched.on_pd_fetched(PdFetched(fetch.fetch_id, True, [0]))  # the real one still counts
    assert len(lookups(sched)) == 1
    sched.on_pd_fetched(PdFetched(fetch.fetch_id, True, [0]))  # a second answer for the same fetch
    assert sched.pd_malformed == 2 and sched.tiers.take_outbox() == []


@pytest.mark.parametrize("moved", [[12], [0, 12], [-1], [0, 1, 500]])
def test_pages_outside_the_prompt_are_counted_and_fail_the_request(moved):
    sched = make()
    sched.add(generate(1, 200))  # pages [0, 12)
    (fetch,) = sched.take_pd_outbox()
    sched.on_pd_fetched(PdFetched(fetch.fetch_id, True, moved))
    assert sched.pd_malformed == 1
    (delta,) = sched.take_finished()
    assert delta.finish_reason == "error" and delta.error == "the transporter named pages outside the prompt"
    assert sched.tiers.take_outbox() == [] and not sched.has_work()
    check_books_balanced(sched)


@pytest.mark.parametrize("ok", [True, False])
def test_an_abort_while_the_fetch_is_out_leaves_no_trace_when_the_answer_comes(ok):
    sched = make()
    sched.add(generate(1, 200))
    (fetch,) = sched.take_pd_outbox()
    sched.abort(1)
    (delta,) = sched.take_finished()
    assert delta.finish_reason == "abort"
    sched.on_pd_fetched(PdFetched(fetch.fetch_id, ok, [0, 1] if ok else [], None if ok else "late"))
    assert sched.take_finished() == [] and sched.tiers.take_outbox() == [] and sched.take_pd_outbox() == []
    assert sched.pd_malformed == 0 and not sched.has_work()
    assert sched._fetching == {}
    check_books_balanced(sched)
    sched.on_pd_fetched(PdFetched(fetch.fetch_id, ok, []))  # its id is gone: a repeat is malformed
    assert sched.pd_malformed == 1


@pytest.mark.parametrize("n", [1, 2, P - 1, P, P + 1])
def test_a_prompt_of_at_most_one_page_queues_no_fetch(n):
    sched = make()
    sched.add(generate(1, n))
    fetches = sched.take_pd_outbox()
    if n <= P:  # a hit leaves one prompt token: no full page to pull
        assert fetches == [] and sched.tiers.take_outbox() == []
        plan = sched.schedule()
        assert [c.start_pos for c in plan.chunks] == [0]
    else:
        (fetch,) = fetches
        assert fetch.keys == page_keys(ROOT, prompt(P, base=1000), P)


def test_a_prompt_the_device_holds_already_queues_no_fetch_but_its_lookup():
    sched = make()
    sched.add(generate(1, 200, peer=None))
    (lookup,) = lookups(sched)
    sched.on_tier_found(TierFound(lookup.lookup_id, 0, [], [], None))
    while sched.has_work():
        step(sched)
    assert sched.coord.peek(prompt(200, base=1000)) >= 192
    sched.add(GenerateRequest(2, prompt(200, base=1000), SamplingParams(max_tokens=1), peer=PEER))
    assert sched.take_pd_outbox() == []
    assert lookups(sched) == []  # the device hit covers every page a lookup could name


# A prefill request for a peer: its answer waits for its copies out


def answer_reservations(sched: Scheduler, reserve: bool = True) -> int:
    """Play the cache worker: reserve entries for every copy out asked (or none); returns how many."""
    asked = [m for m in sched.tiers.take_outbox() if isinstance(m, TierReserve)]
    for i, m in enumerate(asked):
        entries = [30 + i * 8 + j for j in range(len(m.keys))] if reserve else [None] * len(m.keys)
        sched.on_tier_reserved(TierReserved(m.offload_id, entries, (i % STATES) if reserve and m.state else None))
    return len(asked)


def start_prefills(sched: Scheduler) -> None:
    sched.add(generate(1, 40, peer=None, for_peer=True))
    sched.add(generate(2, 41, peer=None))
    for lookup in lookups(sched):
        sched.on_tier_found(TierFound(lookup.lookup_id, 0, [], [], None))
    step(sched)  # [0, 32) of both: their prompt-end checkpoints publish and are copied out
    assert answer_reservations(sched) == 2


def test_a_for_peer_finish_is_held_until_its_copies_out_settle_others_pass():
    sched = make()
    start_prefills(sched)
    _, deltas = step(sched)  # both finish; their copies out ride this plan
    assert [(d.req_id, d.finish_reason) for d in deltas] == [(2, "length")]  # 2 has copies out too
    assert sched.tiers.offloading.get(1) and sched.tiers.offloading.get(2)
    assert sched.take_finished() == []  # still held
    answer_reservations(sched)
    _, deltas = step(sched)  # the plan that stores the finish copies: once it ran they are committed
    assert sched.tiers.offloading == {}
    (delta,) = deltas
    assert (delta.req_id, delta.finish_reason, delta.token_ids) == (1, "length", [7])
    assert sched.take_finished() == []  # released once


def test_a_held_finish_is_released_by_take_finished_when_the_copy_settles_outside_a_step():
    sched = make()
    start_prefills(sched)
    step(sched)
    assert sched.tiers.offloading.get(1) == 1
    answer_reservations(sched, reserve=False)  # the CPU tier holds it all: settled without a plan
    assert sched.tiers.offloading == {}
    (delta,) = sched.take_finished()
    assert (delta.req_id, delta.finish_reason) == (1, "length")
    assert sched.take_finished() == []


def test_a_for_peer_finish_with_nothing_in_flight_passes_at_once():
    sched = make()
    sched.add(generate(1, 10, peer=None, for_peer=True))  # no page: nothing is copied out
    _, deltas = step(sched)
    assert [(d.req_id, d.finish_reason) for d in deltas] == [(1, "length")]
    assert sched._for_peer == set() and sched._held == {}


def test_a_held_abort_of_a_for_peer_request_waits_for_its_copies_too():
    sched = make()
    start_prefills(sched)
    sched.abort(1)
    assert sched.tiers.offloading.get(1) == 1
    assert [d.req_id for d in sched.take_finished()] == []
    plan, deltas = step(sched)  # the copies of the prompt-end checkpoints ride this plan
    assert 1 in [d.req_id for d in deltas] and sched.tiers.offloading.get(1) is None


# usage.cache per tier


def test_tier_counts_put_peer_pages_under_peer_and_the_rest_under_cpu_and_disk():
    sched = make()
    # a device hit of 2 pages, then a run of pages [2, 10) loaded, page 5 from the disk tier
    run = TierHit(1, 2, tuple(range(8)), (False, False, False, True, False, False, False, False), 4)
    seq = SimpleNamespace(prompt_ids=prompt(200), peer_pages=frozenset({2, 3, 9}), tier=run)
    assert sched._tier_counts(seq, 32, 128) == {"gpu": 32, "cpu": 64, "disk": 16, "peer": 48}
    assert sched._tier_counts(seq, 32, 0) == {"gpu": 32, "cpu": 0, "disk": 0, "peer": 0}
    seq.peer_pages = frozenset({0, 1})  # device-hit pages: not the run's, so not the peer's tokens here
    assert sched._tier_counts(seq, 32, 128) == {"gpu": 32, "cpu": 112, "disk": 16, "peer": 0}
