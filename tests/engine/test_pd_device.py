"""Prefill/decode on one GPU, the Scheduler's half: the prefill side holds a for_peer prompt's device pages and
checkpoint and names the hold in its finish; the decode side copies them in the plan that admits the request
(a PeerCopy op) and has the hold released once that plan ran, or falls back to the CPU-tier path."""

from __future__ import annotations

import json

import pytest

from hkv.cache.types import LoadPages, LoadState, PeerCopy, SaveCheckpoint
from hkv.engine import pd_fetching
from hkv.engine.scheduler import Scheduler
from hkv.ipc.messages import (
    GenerateRequest, PdFetch, PdRelease, PeerDevice, Sampled, SamplingParams, StepResult, TierFound, TierLookup,
    TierReserve, TierReserved, TokenDelta,
)  # fmt: skip
from tests.engine.test_pd_fetching import P, PAGES, PEER, ROOT, STATES, make  # the same scheduler

GPU = "GPU-8f0c2a11-0000-4000-8000-000000000001"
KV_DTYPE = "float32"  # the decode side's KV pages, as the router sets them (a peer's must be the same)
SAME = {"kv_dtype": KV_DTYPE, "root": ROOT.hex()}  # a peer's pools name the decode side's KV dtype and fingerprint
POOLS = json.dumps({"version": 1, "uuid": GPU, "kv": {"handle": "00"}, **SAME})
HOLD = 7  # the prefill router's hold id, as the ticket names it


class FakeClock:
    """time.monotonic for hkv.engine.pd_fetching: moves only when a test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(pd_fetching, "time", fake)
    return fake


def prefill_side(hybrid: bool = True) -> Scheduler:
    sched = make(hybrid)
    sched.peer_holds_enabled = True  # what the router sets in prefill mode on CUDA
    return sched


def decode_side(hybrid: bool = True) -> Scheduler:
    sched = make(hybrid)
    sched.peer_gpu = GPU  # what the router sets from the rank's RankReady on CUDA
    sched.kv_dtype = KV_DTYPE
    return sched


def prompt(n: int, base: int) -> list[int]:
    return list(range(base, base + n))


def generate(req_id: int, n: int, base: int | None = None, peer: str | None = None, **kw) -> GenerateRequest:
    """A request; a for_peer one also asks for a device hold (a one-prompt prefill) unless told otherwise."""
    kw.setdefault("device_hold", kw.get("for_peer", False))
    tokens = prompt(n, req_id * 1000 if base is None else base)
    return GenerateRequest(req_id, tokens, SamplingParams(max_tokens=1), peer=peer, **kw)


def device(length: int = 192, pages: list[int] | None = None, slot: int | None = 5, pools: str = POOLS,
           hold_id: int = HOLD) -> PeerDevice:
    """The prefill peer's held pages as a ticket names them: pages 40.. of its pool by default."""
    return PeerDevice(pools, hold_id, length, list(range(40, 40 + length // P)) if pages is None else pages, slot)


def settle_tiers(sched: Scheduler) -> None:
    """Play the cache worker: every lookup finds nothing, every copy out finds the CPU tier holding it already."""
    for msg in sched.tiers.take_outbox():
        if isinstance(msg, TierLookup):
            sched.on_tier_found(TierFound(msg.lookup_id, msg.first, [], [], None))
        elif isinstance(msg, TierReserve):
            sched.on_tier_reserved(TierReserved(msg.offload_id, [None] * len(msg.keys), None))


def admitting_plan() -> tuple[Scheduler, object]:
    """A decode side and the plan admitting request 1 (200 tokens) with the peer's device hold."""
    sched = decode_side()
    sched.add(generate(1, 200, peer=PEER, peer_device=device()))
    settle_tiers(sched)
    return sched, sched.schedule()


def result(plan, error: str | None = None) -> StepResult:
    sampled = [] if error else [Sampled(c.slot, 7, None, None) for c in plan.chunks if c.sample]
    return StepResult(plan.step, sampled, 0.0, error)


def step(sched: Scheduler):
    settle_tiers(sched)
    plan = sched.schedule()
    if plan is None:
        return None, sched.take_finished()
    return plan, sched.on_result(result(plan), plan)


def run_to_end(sched: Scheduler) -> tuple[list, list[TokenDelta]]:
    """Step until nothing runs, waits or is held: (the plans, every delta)."""
    plans, deltas = [], []
    for _ in range(50):
        plan, out = step(sched)
        settle_tiers(sched)
        deltas += out + sched.take_finished()
        if plan is not None:
            plans.append(plan)
        elif not sched.has_work() and not sched.tiers.offloading:
            return plans, deltas
    raise AssertionError("the scheduler did not drain")


def finish_of(deltas: list[TokenDelta], req_id: int) -> TokenDelta:
    (finish,) = [d for d in deltas if d.req_id == req_id and d.finish_reason is not None]
    return finish


def check_books_balanced(sched: Scheduler) -> None:
    """Nothing is held by anyone: every device page and state slot is free or an evictable cache entry."""
    coord = sched.coord
    coord.check_integrity()
    assert coord.requests == {} and coord.holds == {} and sched._peer_holds == {} and sched._hold_of == {}
    assert coord.pages.free_count + coord.tree.evictable_pages == PAGES
    if sched.limits.hybrid:
        assert coord.state_slots.free_count + coord.tree.evictable_checkpoints == STATES
    assert sched.tiers.waiting_lookups == {} and sched.tiers.offloads == {}


def ops_of(plans, kind) -> list:
    return [op for plan in plans for op in plan.ops if isinstance(op, kind)]


# The prefill side: a for_peer prompt's device pages are held at its last page boundary


@pytest.mark.parametrize("hybrid", [True, False])
def test_a_for_peer_finish_names_the_one_hold_of_its_prompt_pages_and_checkpoint(hybrid, clock):
    sched = prefill_side(hybrid)
    sched.add(generate(1, 199, for_peer=True))  # the prefill's prompt: 200 less its last token
    settle_tiers(sched)
    first = sched.schedule()
    assert first.chunks[0].start_pos == 0
    pages = list(sched.running[1].pages)  # the device pages its first chunk computes into
    deltas = sched.on_result(result(first), first)
    plans, rest = run_to_end(sched)
    finish = finish_of(deltas + rest, 1)
    assert finish.finish_reason == "length" and finish.peer_hold is not None
    hold = finish.peer_hold
    assert hold.length == 199 // P * P == 192
    assert hold.pages == pages[:12]
    if hybrid:  # the checkpoint the prompt's last page boundary saved
        (save,) = [op for op in ops_of(plans, SaveCheckpoint) if op.length == 192]
        assert hold.slot == save.dst_slot
    else:
        assert hold.slot is None
    assert [d.peer_hold for d in deltas + rest if d is not finish] == [None] * (len(deltas + rest) - 1)
    assert list(sched.coord.holds) == [hold.hold_id] and list(sched._peer_holds) == [hold.hold_id]
    held = sched.coord.holds[hold.hold_id]
    assert (held.length, list(held.pages)) == (192, hold.pages)
    # held: the prompt's 12 pages are neither free nor evictable
    assert sched.coord.pages.free_count + sched.coord.tree.evictable_pages == PAGES - 12
    assert sched.flush()[0] == 0  # a flush cannot take them
    assert sched.pd_malformed == 0


@pytest.mark.parametrize("hybrid", [True, False])
def test_release_peer_hold_frees_the_pages_and_a_second_or_unknown_release_is_only_counted(hybrid, clock):
    sched = prefill_side(hybrid)
    sched.add(generate(1, 199, for_peer=True))
    _, deltas = run_to_end(sched)
    hold_id = finish_of(deltas, 1).peer_hold.hold_id
    sched.release_peer_hold(hold_id)
    assert sched.pd_malformed == 0
    check_books_balanced(sched)
    assert sched.coord.peek(prompt(199, 1000) + [5]) == 192  # still cached, now evictable
    sched.release_peer_hold(hold_id)  # released already
    assert sched.pd_malformed == 1
    sched.release_peer_hold(hold_id + 1000)  # never held
    assert sched.pd_malformed == 2
    check_books_balanced(sched)


@pytest.mark.parametrize("enabled,for_peer,hold", [(False, True, True), (True, False, False), (False, False, False),
                                                   (True, True, False)])
def test_no_hold_unless_enabled_for_peer_and_asked(enabled, for_peer, hold, clock):
    """(True, True, False): a prefill of several prompts asks for no hold (its answer could name only one)."""
    sched = make()
    sched.peer_holds_enabled = enabled
    sched.add(generate(1, 199, for_peer=for_peer, device_hold=hold))
    _, deltas = run_to_end(sched)
    assert finish_of(deltas, 1).finish_reason == "length"
    assert all(d.peer_hold is None for d in deltas)
    assert sched.coord.holds == {} and sched._hold_wanted == set()
    check_books_balanced(sched)


def test_a_prompt_without_a_full_page_holds_nothing(clock):
    sched = prefill_side()
    sched.add(generate(1, P - 1, for_peer=True))
    _, deltas = run_to_end(sched)
    assert finish_of(deltas, 1).peer_hold is None
    check_books_balanced(sched)


@pytest.mark.parametrize("hybrid", [True, False])
def test_expire_peer_holds_frees_every_hold_older_than_the_timeout(hybrid, clock):
    sched = prefill_side(hybrid)
    sched.add(generate(1, 199, for_peer=True))
    sched.add(generate(2, 100, for_peer=True))
    _, deltas = run_to_end(sched)
    ids = sorted(finish_of(deltas, r).peer_hold.hold_id for r in (1, 2))
    assert sorted(sched.coord.holds) == ids
    sched.expire_peer_holds(0.0)  # no time has passed: none is older than 0 s
    assert sorted(sched.coord.holds) == ids
    clock.now += 1.0
    sched.expire_peer_holds(3600.0)
    assert sorted(sched.coord.holds) == ids
    sched.expire_peer_holds(0.0)
    check_books_balanced(sched)
    sched.release_peer_hold(ids[0])  # the decode peer's late release: counted, nothing else
    assert sched.pd_malformed == 1
    check_books_balanced(sched)


@pytest.mark.parametrize("hybrid", [True, False])
def test_an_aborted_for_peer_request_releases_its_hold_and_no_delta_names_it(hybrid, clock):
    sched = prefill_side(hybrid)
    sched.add(generate(1, 199, for_peer=True))
    settle_tiers(sched)
    first = sched.schedule()
    second = sched.schedule()  # planning ahead publishes the first: the prompt's last page boundary is held
    assert len(sched._peer_holds) == 1
    sched.abort(1)
    deltas = sched.take_finished() + sched.on_result(result(first), first)
    if second is not None:
        deltas += sched.on_result(result(second), second)
    _, rest = run_to_end(sched)
    deltas += rest
    (abort,) = [d for d in deltas if d.req_id == 1]
    assert abort.finish_reason == "abort" and abort.peer_hold is None
    assert sched.pd_malformed == 0
    check_books_balanced(sched)


def test_a_hold_that_expired_before_the_finish_is_not_named_in_it(clock):
    """A decode peer must never be sent to pages that may be evicted and reused."""
    sched = prefill_side()
    sched.add(generate(1, 199, for_peer=True))
    settle_tiers(sched)
    first = sched.schedule()  # [0, 192): its publish holds the prompt
    sched.on_result(result(first), first)
    assert len(sched._peer_holds) == 1
    clock.now += 60.0
    sched.expire_peer_holds(30.0)  # the router's loop, before the last prompt chunk ran
    assert sched._peer_holds == {}
    _, deltas = run_to_end(sched)
    assert finish_of(deltas, 1).peer_hold is None


def test_the_hold_timeout_counts_from_the_answer_that_names_it(clock):
    sched = prefill_side()
    sched.add(generate(1, 199, for_peer=True))
    settle_tiers(sched)
    first = sched.schedule()
    sched.on_result(result(first), first)
    clock.now += 20.0  # the request takes a while to finish
    _, deltas = run_to_end(sched)
    hold = finish_of(deltas, 1).peer_hold
    assert hold is not None
    clock.now += 20.0  # 40 s after the hold, 20 s after the answer
    sched.expire_peer_holds(30.0)
    assert hold.hold_id in sched._peer_holds
    clock.now += 11.0
    sched.expire_peer_holds(30.0)
    assert sched._peer_holds == {}


# The decode side: the peer's held pages are copied in the admitting plan


@pytest.mark.parametrize("hybrid", [True, False])
def test_a_fitting_device_hold_is_copied_in_the_admitting_plan_and_released_after_its_result(hybrid, clock):
    sched = decode_side(hybrid)
    dev = device(slot=5 if hybrid else None)
    sched.add(generate(1, 200, peer=PEER, peer_device=dev))
    assert sched.take_pd_outbox() == []  # no PdFetch: nothing goes through the CPU tier
    settle_tiers(sched)  # its tier lookup (none found)
    plan = sched.schedule()
    seq = sched.running[1]
    ((chunk,), (new,)) = plan.chunks, plan.new
    assert chunk.start_pos == 192 and new.req_id == 1
    (copy,) = [op for op in plan.ops if isinstance(op, PeerCopy)]
    assert copy.pools == POOLS and copy.src_pages == dev.pages
    assert copy.dst_pages == seq.pages[:12]
    assert sched.table.page_ids[seq.slot, :12].tolist() == copy.dst_pages
    assert not set(copy.dst_pages) & set(seq.pages[12:])
    if hybrid:
        assert (copy.src_slot, copy.dst_slot) == (5, seq.state_slot) and seq.state_slot is not None
        # the copied state is published as the prefix's checkpoint, after the copy wrote it
        (save,) = [op for op in plan.ops if isinstance(op, SaveCheckpoint)]
        assert (save.src_slot, save.length) == (seq.state_slot, 192)
        assert plan.ops.index(copy) < plan.ops.index(save)
    else:
        assert (copy.src_slot, copy.dst_slot) == (None, None)
    assert sched.take_pd_outbox() == []  # the peer keeps its hold while the plan runs
    assert sched.schedule() is None  # a plan after it does not release either
    assert sched.take_pd_outbox() == []
    deltas = sched.on_result(result(plan), plan)
    assert sched.take_pd_outbox() == [PdRelease(PEER, HOLD)]
    _, rest = run_to_end(sched)
    finish = finish_of(deltas + rest, 1)
    assert finish.cached_tokens == 192
    assert finish.cache_tiers == {"gpu": 0, "cpu": 0, "disk": 0, "peer": 192}
    assert sched.take_pd_outbox() == [] and sched.pd_malformed == 0
    check_books_balanced(sched)


@pytest.mark.parametrize("hybrid", [True, False])
def test_only_the_pages_past_the_decode_sides_own_hit_are_copied(hybrid, clock):
    sched = decode_side(hybrid)
    tokens = prompt(200, 1000)
    sched.add(GenerateRequest(9, tokens[:70], SamplingParams(max_tokens=1)))  # an earlier turn: [0, 64) cached
    run_to_end(sched)
    dev = device(slot=5 if hybrid else None)
    sched.add(generate(1, 200, peer=PEER, peer_device=dev))
    assert sched.take_pd_outbox() == []
    settle_tiers(sched)
    plan = sched.schedule()
    seq = sched.running[1]
    (copy,) = [op for op in plan.ops if isinstance(op, PeerCopy)]
    assert copy.src_pages == dev.pages[4:12]
    assert copy.dst_pages == seq.pages[4:12] == sched.table.page_ids[seq.slot, 4:12].tolist()
    assert plan.chunks[0].start_pos == 192
    deltas = sched.on_result(result(plan), plan)
    assert sched.take_pd_outbox() == [PdRelease(PEER, HOLD)]
    deltas += run_to_end(sched)[1]
    finish = finish_of(deltas, 1)
    assert finish.cached_tokens == 192
    assert finish.cache_tiers == {"gpu": 64, "cpu": 0, "disk": 0, "peer": 128}
    check_books_balanced(sched)


@pytest.mark.parametrize("hybrid", [True, False])
def test_a_cpu_tier_run_loads_first_and_the_peer_copies_the_rest(hybrid, clock):
    sched = decode_side(hybrid)
    dev = device(slot=5 if hybrid else None)
    sched.add(generate(1, 200, peer=PEER, peer_device=dev))
    (lookup,) = [m for m in sched.tiers.take_outbox() if isinstance(m, TierLookup)]
    sched.on_tier_found(TierFound(lookup.lookup_id, 0, [20, 21, 22, 23], [False] * 4, 3 if hybrid else None))
    plan = sched.schedule()
    seq = sched.running[1]
    (load,) = [op for op in plan.ops if isinstance(op, LoadPages)]
    (copy,) = [op for op in plan.ops if isinstance(op, PeerCopy)]
    assert (load.src_entries, load.dst_pages) == ([20, 21, 22, 23], seq.pages[:4])
    assert copy.src_pages == dev.pages[4:12] and copy.dst_pages == seq.pages[4:12]
    if hybrid:  # the peer's checkpoint (at 192) overwrites the run's (at 64) in the live slot
        (load_state,) = [op for op in plan.ops if isinstance(op, LoadState)]
        assert plan.ops.index(load_state) < plan.ops.index(copy)
    deltas = sched.on_result(result(plan), plan)
    assert sched.take_pd_outbox() == [PdRelease(PEER, HOLD)]
    deltas += run_to_end(sched)[1]
    assert finish_of(deltas, 1).cache_tiers == {"gpu": 0, "cpu": 64, "disk": 0, "peer": 128}
    check_books_balanced(sched)


def test_the_release_follows_the_admitting_plan_even_when_it_failed(clock):
    sched, plan = admitting_plan()
    assert sched.take_pd_outbox() == []
    deltas = sched.on_result(result(plan, error="rank 0: CUDA error"), plan)
    assert finish_of(deltas, 1).finish_reason == "error"
    assert sched.take_pd_outbox() == [PdRelease(PEER, HOLD)]
    run_to_end(sched)
    check_books_balanced(sched)


# The decode side: a hold it cannot use goes back at once, the CPU path instead


MISMATCHES = {  # name: (device, hybrid, malformed)
    "another GPU": (device(pools=json.dumps({"version": 1, "uuid": "GPU-other", **SAME})), True, 0),
    "another KV dtype": (device(pools=json.dumps({"version": 1, "uuid": GPU, **SAME, "kv_dtype": "float8_e4m3fn"})),
                         True, 0),
    "another fingerprint": (device(pools=json.dumps({"version": 1, "uuid": GPU, **SAME, "root": "11" * 16})), True,
                            0),
    "no KV dtype or fingerprint named": (device(pools=json.dumps({"version": 1, "uuid": GPU})), True, 0),
    "pools not JSON": (device(pools="not json"), True, 0),
    "pools not an object": (device(pools="[1, 2]"), True, 0),
    "length off a page": (device(length=100, pages=list(range(6))), True, 1),
    "length past the prompt's last full page": (device(length=208), True, 1),
    "length zero": (device(length=0, pages=[]), True, 1),
    "pages short of length": (device(pages=list(range(11))), True, 1),
    "pages past length": (device(pages=list(range(13))), True, 1),
    "a negative page": (device(pages=[-1] + list(range(11))), True, 1),
    "no slot on a hybrid model": (device(slot=None), True, 1),
    "a negative slot": (device(slot=-1), True, 1),
    "a slot on a dense model": (device(slot=5), False, 1),
}


@pytest.mark.parametrize("name", list(MISMATCHES))
def test_a_device_hold_that_does_not_fit_is_released_at_once_and_the_prompt_fetched(name, clock):
    dev, hybrid, malformed = MISMATCHES[name]
    sched = decode_side(hybrid)
    sched.add(generate(1, 200, peer=PEER, peer_device=dev))
    release, fetch = sched.take_pd_outbox()
    assert release == PdRelease(PEER, HOLD)
    assert isinstance(fetch, PdFetch) and fetch.peer == PEER and len(fetch.keys) == 12
    assert sched.pd_malformed == malformed
    seq = sched.waiting[0]
    assert seq.peer_device is None and seq.lookup_pending


@pytest.mark.parametrize("hybrid", [True, False])
def test_without_a_peer_gpu_the_hold_goes_back_uncounted(hybrid, clock):
    sched = make(hybrid)  # off CUDA, or a rank that maps no peer pools: peer_gpu ""
    sched.add(generate(1, 200, peer=PEER, peer_device=device(slot=5 if hybrid else None)))
    release, fetch = sched.take_pd_outbox()
    assert release == PdRelease(PEER, HOLD) and isinstance(fetch, PdFetch)
    assert sched.pd_malformed == 0


def test_a_fallen_back_request_is_admitted_with_no_copy(clock):
    sched = decode_side()
    sched.add(generate(1, 200, peer=PEER, peer_device=device(slot=None)))
    _, fetch = sched.take_pd_outbox()
    sched.abort(1)
    assert sched.take_pd_outbox() == []  # released once, at add
    sched.add(generate(2, 40, peer=None))
    plans, _ = run_to_end(sched)
    assert ops_of(plans, PeerCopy) == []


@pytest.mark.parametrize("hybrid", [True, False])
def test_a_device_hit_that_covers_the_peers_length_copies_nothing_and_releases_at_once(hybrid, clock):
    sched = decode_side(hybrid)
    tokens = prompt(200, 1000)
    sched.add(GenerateRequest(9, tokens, SamplingParams(max_tokens=1)))  # the same prompt ran here before
    run_to_end(sched)
    assert sched.coord.peek(tokens) == 192
    sched.add(generate(1, 200, peer=PEER, peer_device=device(slot=5 if hybrid else None)))
    assert sched.take_pd_outbox() == []
    settle_tiers(sched)
    plan = sched.schedule()
    assert [op for op in plan.ops if isinstance(op, PeerCopy)] == []
    assert plan.chunks[0].start_pos == 192
    assert sched.take_pd_outbox() == [PdRelease(PEER, HOLD)]  # before the plan's result
    deltas = sched.on_result(result(plan), plan)
    assert sched.take_pd_outbox() == []
    deltas += run_to_end(sched)[1]
    assert finish_of(deltas, 1).cache_tiers == {"gpu": 192, "cpu": 0, "disk": 0, "peer": 0}
    check_books_balanced(sched)


@pytest.mark.parametrize("hybrid", [True, False])
def test_an_abort_while_waiting_releases_the_hold_at_once(hybrid, clock):
    sched = decode_side(hybrid)
    sched.add(generate(1, 200, peer=PEER, peer_device=device(slot=5 if hybrid else None)))
    assert sched.waiting[0].lookup_pending  # its tier lookup is out
    sched.abort(1)
    assert sched.take_pd_outbox() == [PdRelease(PEER, HOLD)]
    (delta,) = sched.take_finished()
    assert delta.finish_reason == "abort"
    settle_tiers(sched)
    assert sched.schedule() is None and sched.take_pd_outbox() == []
    check_books_balanced(sched)


def test_an_abort_after_the_admitting_plan_was_sent_releases_once_after_its_result(clock):
    sched, plan = admitting_plan()
    sched.abort(1)
    assert sched.take_pd_outbox() == []  # the copy may be running: the peer keeps its hold till the result
    sched.on_result(result(plan), plan)
    assert sched.take_pd_outbox() == [PdRelease(PEER, HOLD)]
    run_to_end(sched)
    assert sched.take_pd_outbox() == []
    check_books_balanced(sched)


def test_a_device_hold_without_a_peer_is_ignored(clock):
    sched = decode_side()
    sched.add(generate(1, 200, peer=None, peer_device=device()))  # no transporter to release it through
    assert sched.take_pd_outbox() == [] and sched.pd_malformed == 0
    plans, deltas = run_to_end(sched)
    assert ops_of(plans, PeerCopy) == [] and plans[0].chunks[0].start_pos == 0
    assert finish_of(deltas, 1).cache_tiers["peer"] == 0
    assert sched.take_pd_outbox() == []


@pytest.mark.parametrize("late", [0.0, 0.01, 60.0])
def test_a_request_admitted_after_peer_copy_by_copies_nothing_and_releases(late, clock):
    sched = decode_side()
    sched.pd_timeout_s = 30.0
    sched.add(generate(1, 200, peer=PEER, peer_device=device()))
    assert sched.waiting[0].peer_copy_by == clock.now + 15.0  # half the peer's hold timeout
    settle_tiers(sched)
    clock.now += 15.0 + late
    plan = sched.schedule()
    copies = [op for op in plan.ops if isinstance(op, PeerCopy)]
    if late == 0.0:  # on the deadline: still copied
        assert len(copies) == 1 and plan.chunks[0].start_pos == 192
        assert sched.take_pd_outbox() == []
        sched.on_result(result(plan), plan)
        assert sched.take_pd_outbox() == [PdRelease(PEER, HOLD)]
        return
    assert copies == [] and plan.chunks[0].start_pos == 0
    assert sched.take_pd_outbox() == [PdRelease(PEER, HOLD)]  # at once
    deltas = sched.on_result(result(plan), plan)
    deltas += run_to_end(sched)[1]
    assert sched.take_pd_outbox() == []
    assert finish_of(deltas, 1).cache_tiers == {"gpu": 0, "cpu": 0, "disk": 0, "peer": 0}
    check_books_balanced(sched)


def test_two_requests_with_holds_release_each_after_its_own_plan(clock):
    sched = decode_side()
    sched.add(generate(1, 200, peer=PEER, peer_device=device(hold_id=1)))
    settle_tiers(sched)
    first = sched.schedule()
    sched.add(generate(2, 100, peer=PEER, peer_device=device(length=96, hold_id=2)))
    settle_tiers(sched)
    second = sched.schedule()
    assert [n.req_id for n in second.new] == [2]
    assert len([op for op in second.ops if isinstance(op, PeerCopy)]) == 1
    assert sched.take_pd_outbox() == []
    sched.on_result(result(first), first)
    assert sched.take_pd_outbox() == [PdRelease(PEER, 1)]
    sched.on_result(result(second), second)
    assert sched.take_pd_outbox() == [PdRelease(PEER, 2)]
    run_to_end(sched)
    check_books_balanced(sched)
