"""Prefill/decode over a pair process group, the Scheduler's half (hkv/engine/pd_pairing.py).

What this file proves, with a fake clock and no ranks (results are written by hand):

- decode side: a peer hold whose pools document names the instance's pair backend is admitted *arriving*: its
  fresh pages past the decode-side hit are reserved, the admitting plan carries a PeerRecv (no chunk, no
  NewSequence), a PdPairAsk with the same transfer, pages and slot goes to the transporter, and nothing of the
  prompt is cacheable until the rank reports the transfer; then the first chunk starts at the hold's length;
- while only transfers are out, copies-only plans ask the ranks at most every PAIR_POLL_S;
- a failed transfer fails the request (its reason in the error) and rolls back, the next transfer with that
  peer joins a new group; an abort or --pd-timeout answers at once but keeps the pages until the transfer ends;
- an arriving sequence is never preempted, one preempted after it arrived is announced to the ranks once;
  holds that do not name the pair backend, or name another KV dtype or fingerprint (or none), take the
  CPU path;
- prefill side: a valid PdPairSend becomes a PeerSend from the hold, which outlives the hold timeout and
  releases until the send ends; every malformed ask is only counted;
- a prefill and a decode scheduler wired by hand move a prompt end to end, books balanced on both.
"""

from __future__ import annotations

import json

import pytest

from hkv.cache.types import PeerCopy, PeerRecv, PeerSend, SaveCheckpoint
from hkv.engine import pd_fetching, pd_pairing
from hkv.engine.pd_pairing import PAIR_POLL_S
from hkv.engine.scheduler import Scheduler
from hkv.ipc.messages import (
    GenerateRequest, NewSequence, PdFetch, PdPairAsk, PdPairSend, PdRelease, PeerDevice, SamplingParams, StepResult,
    TransferDone,
)  # fmt: skip
from tests.engine.test_pd_device import (
    GPU, HOLD, SAME, FakeClock, check_books_balanced, decode_side, device, finish_of, generate, prefill_side, prompt, result,
    run_to_end, settle_tiers, step,
)  # fmt: skip
from tests.engine.test_pd_fetching import PEER, P, make

PAIR_POOLS = json.dumps({"version": 1, "pair": "gloo", **SAME})
ADDRESS = "127.0.0.1:9"  # the decode rank's rendezvous, from its RankReady


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(pd_fetching, "time", fake)
    monkeypatch.setattr(pd_pairing, "time", fake)
    return fake


def pair_decode(hybrid: bool = True, address: str = ADDRESS, backend: str = "gloo") -> Scheduler:
    sched = make(hybrid)
    sched.pair_backend, sched.pair_address = backend, address
    sched.kv_dtype = SAME["kv_dtype"]
    return sched


def pair_prefill(hybrid: bool = True) -> Scheduler:
    sched = prefill_side(hybrid)
    sched.pair_backend = "gloo"
    return sched


def pair_device(hybrid: bool, pools: str = PAIR_POOLS, **kw) -> PeerDevice:
    return device(slot=5 if hybrid else None, pools=pools, **kw)


def answer(sched: Scheduler, plan, *transfers: TransferDone) -> list:
    """The rank's result for `plan`, reporting `transfers` ended."""
    return sched.on_result(StepResult(plan.step, result(plan).sampled, 0.0, transfers=list(transfers)), plan)


def admit_arriving(sched: Scheduler, req_id: int = 1, peer: str = PEER, base: int = 1000,
                   **kw) -> tuple[object, PdPairAsk]:
    """Add a 200-token request with a pair hold of 192 tokens; (the admitting plan, its ask)."""
    sched.add(generate(req_id, 200, base=base, peer=peer, peer_device=pair_device(sched.limits.hybrid, **kw)))
    assert sched.take_pd_outbox() == []  # no PdFetch, no PdRelease
    settle_tiers(sched)
    plan = sched.schedule()
    (ask,) = sched.take_pd_outbox()
    return plan, ask


def ask_to_send(ask: PdPairAsk, **changes) -> PdPairSend:
    """What the prefill transporter hands its router for the decode side's ask."""
    fields = dict(hold_id=ask.hold_id, transfer_id=ask.transfer_id, address=ask.address, prefix=ask.prefix,
                  first=ask.first, dst_pages=list(ask.dst_pages), dst_slot=ask.dst_slot)
    return PdPairSend(**{**fields, **changes})


def held_prompt(hybrid: bool) -> tuple[Scheduler, object]:
    """A prefill side that ran a for_peer prompt of 199 tokens: (it, the PeerHold its finish names)."""
    sched = pair_prefill(hybrid)
    sched.add(generate(1, 199, base=1000, for_peer=True))
    _, deltas = run_to_end(sched)
    hold = finish_of(deltas, 1).peer_hold
    assert hold is not None and hold.length == 192
    return sched, hold


# The decode side


@pytest.mark.parametrize("hybrid", [True, False])
def test_a_pair_hold_is_admitted_arriving_then_its_first_chunk_starts_at_the_hold(hybrid, clock):
    sched = pair_decode(hybrid)
    tokens = prompt(200, 1000)
    assert sched.pair_poll_in() is None and not sched.awaiting_transfers()
    plan, ask = admit_arriving(sched)
    seq = sched.running[1]
    assert plan.chunks == [] and plan.new == []
    (recv,) = plan.ops
    assert isinstance(recv, PeerRecv)
    assert (recv.transfer_id, recv.peer, recv.prefix) == (ask.transfer_id, PEER, ask.prefix)
    assert recv.src_pages == list(range(40, 52)) and recv.dst_pages == seq.pages[:12] == ask.dst_pages
    assert len(set(recv.dst_pages)) == 12
    assert (recv.src_slot, recv.dst_slot) == ((5, seq.state_slot) if hybrid else (None, None))
    assert ask == PdPairAsk(PEER, HOLD, recv.transfer_id, ADDRESS, recv.prefix, 0, recv.dst_pages, recv.dst_slot)
    assert seq.arriving == ask.transfer_id and sched.awaiting_transfers()
    assert sched.coord.peek(tokens) == 0 and 1 in sched.coord.requests
    assert answer(sched, plan) == []  # a result without the transfer: still arriving
    assert seq.arriving == ask.transfer_id and sched.coord.peek(tokens) == 0
    clock.now += PAIR_POLL_S
    poll = sched.schedule()
    assert poll.chunks == [] and poll.new == [] and poll.ops == []
    assert answer(sched, poll, TransferDone(ask.transfer_id, True)) == []
    assert seq.arriving is None and not sched.awaiting_transfers() and sched.pair_poll_in() is None
    assert (sched.pair_ok, sched.pair_failed, sched.pair_pages) == (1, 0, 12)
    first = sched.schedule()
    assert first.new == [NewSequence(seq.slot, 1, seq.sampling, seq.state_slot)]
    (chunk,) = first.chunks
    assert (chunk.start_pos, chunk.token_ids) == (192, tokens[192:])
    assert sched.table.page_ids[seq.slot, :12].tolist() == recv.dst_pages
    saves = [op for op in first.ops if isinstance(op, SaveCheckpoint)]
    if hybrid:  # the received state becomes the prefix's checkpoint
        assert [(s.src_slot, s.length) for s in saves] == [(seq.state_slot, 192)]
    else:
        assert saves == []
    deltas = answer(sched, first)
    deltas += run_to_end(sched)[1]
    finish = finish_of(deltas, 1)
    assert finish.finish_reason == "length" and finish.cached_tokens == 192
    assert finish.cache_tiers == {"gpu": 0, "cpu": 0, "disk": 0, "peer": 192}
    assert sched.coord.peek(tokens) == 192  # cacheable now
    assert sched.take_pd_outbox() == [] and sched.pd_malformed == 0  # the peer unholds when its send ends
    check_books_balanced(sched)


@pytest.mark.parametrize("hybrid", [True, False])
def test_another_request_for_the_same_prompt_does_not_read_arriving_pages(hybrid, clock):
    sched = pair_decode(hybrid)
    plan, ask = admit_arriving(sched)
    sched.add(GenerateRequest(2, prompt(200, 1000), SamplingParams(max_tokens=1)))
    settle_tiers(sched)
    other = sched.schedule()
    assert [n.req_id for n in other.new] == [2] and other.chunks[0].start_pos == 0
    assert not set(sched.running[2].pages) & set(ask.dst_pages)
    assert sched.coord.peek(prompt(200, 1000)) == 0
    answer(sched, plan)
    deltas = answer(sched, other, TransferDone(ask.transfer_id, True))
    deltas += run_to_end(sched)[1]
    assert finish_of(deltas, 1).cache_tiers["peer"] == 192 and finish_of(deltas, 2).finish_reason == "length"
    check_books_balanced(sched)


def test_copies_only_plans_ask_the_ranks_at_most_every_pair_poll(clock):
    sched = pair_decode(False)
    plan, ask = admit_arriving(sched)
    answer(sched, plan)
    polls = []
    for _ in range(3):  # any plan asks the ranks: the admitting one defers the first poll as a poll does the next
        assert sched.schedule() is None  # not again before PAIR_POLL_S
        assert sched.pair_poll_in() == pytest.approx(PAIR_POLL_S)
        clock.now += PAIR_POLL_S / 2
        assert sched.schedule() is None and sched.pair_poll_in() == pytest.approx(PAIR_POLL_S / 2)
        clock.now += PAIR_POLL_S / 2
        assert sched.pair_poll_in() == pytest.approx(0.0, abs=1e-9)
        poll = sched.schedule()
        assert (poll.chunks, poll.new, poll.ops) == ([], [], [])
        polls.append(poll)
    assert len({p.step for p in polls}) == 3
    for poll in polls[:-1]:
        answer(sched, poll)
    answer(sched, polls[-1], TransferDone(ask.transfer_id, True))
    assert sched.pair_poll_in() is None
    run_to_end(sched)
    check_books_balanced(sched)


@pytest.mark.parametrize("hybrid", [True, False])
@pytest.mark.parametrize("error,reason", [("gloo recv timed out", "gloo recv timed out"), (None, "no reason given")])
def test_a_failed_transfer_fails_the_request_rolls_back_and_the_peer_gets_a_new_group(hybrid, error, reason, clock):
    sched = pair_decode(hybrid)
    plan, ask = admit_arriving(sched)
    (delta,) = answer(sched, plan, TransferDone(ask.transfer_id, False, error))
    assert (delta.req_id, delta.finish_reason, delta.token_ids) == (1, "error", [])
    assert delta.error == f"the transfer from the prefill instance failed: {reason}"
    assert (sched.pair_ok, sched.pair_failed, sched.pair_pages) == (0, 1, 0)
    assert not sched.has_work() and not sched.awaiting_transfers() and sched.take_pd_outbox() == []
    check_books_balanced(sched)
    assert sched.coord.peek(prompt(200, 1000)) == 0  # nothing of it was published
    _, again = admit_arriving(sched, 2, hold_id=HOLD + 1)
    assert again.prefix != ask.prefix and again.transfer_id != ask.transfer_id


def test_a_peers_group_is_kept_after_a_good_transfer_and_each_peer_has_its_own(clock):
    sched = pair_decode(False)
    plan, ask = admit_arriving(sched)
    answer(sched, plan, TransferDone(ask.transfer_id, True))
    run_to_end(sched)
    _, same = admit_arriving(sched, 2, base=3000, hold_id=HOLD + 1)  # (another prompt: the first is cached)
    _, other = admit_arriving(sched, 3, base=5000, peer="tcp://127.0.0.1:6", hold_id=HOLD + 2)
    assert same.prefix == ask.prefix and same.transfer_id != ask.transfer_id
    assert other.prefix != ask.prefix and other.peer == "tcp://127.0.0.1:6"


def test_only_the_most_recent_peers_groups_are_remembered(clock, monkeypatch):
    monkeypatch.setattr(pd_pairing, "MAX_PAIR_PEERS", 2)
    sched = pair_decode(False)
    prefixes = {}
    for req_id, peer in enumerate(["tcp://a:1", "tcp://b:1", "tcp://c:1", "tcp://b:1", "tcp://a:1"], start=1):
        plan, ask = admit_arriving(sched, req_id, peer=peer, base=req_id * 1000, hold_id=req_id)
        answer(sched, plan, TransferDone(ask.transfer_id, True))
        run_to_end(sched)
        prefixes.setdefault(peer, []).append(ask.prefix)
    assert prefixes["tcp://b:1"][0] == prefixes["tcp://b:1"][1]  # used again while remembered
    assert prefixes["tcp://a:1"][0] != prefixes["tcp://a:1"][1]  # forgotten when c came
    assert list(sched._prefixes) == ["tcp://b:1", "tcp://a:1"]
    check_books_balanced(sched)


@pytest.mark.parametrize("hybrid", [True, False])
@pytest.mark.parametrize("ok", [True, False])
def test_an_abort_while_arriving_answers_at_once_and_frees_the_pages_when_the_transfer_ends(hybrid, ok, clock):
    sched = pair_decode(hybrid)
    plan, ask = admit_arriving(sched)
    sched.abort(1)
    (delta,) = sched.take_finished()
    assert (delta.req_id, delta.finish_reason) == (1, "abort")
    sched.abort(1)  # answered already
    assert sched.take_finished() == []
    assert 1 in sched.coord.requests and sched.running[1].pages  # a receive may still be writing them
    assert answer(sched, plan) == []
    clock.now += PAIR_POLL_S
    poll = sched.schedule()
    assert poll is not None and poll.chunks == [] and 1 in sched.coord.requests
    assert answer(sched, poll, TransferDone(ask.transfer_id, ok, None if ok else "late")) == []
    assert (sched.pair_ok, sched.pair_failed) == ((1, 0) if ok else (0, 1))
    assert not sched.has_work() and sched.take_finished() == [] and sched.take_pd_outbox() == []
    check_books_balanced(sched)
    assert sched.coord.peek(prompt(200, 1000)) == 0  # what arrived for an aborted request is not published


@pytest.mark.parametrize("hybrid", [True, False])
@pytest.mark.parametrize("ok", [True, False])
def test_past_pd_timeout_an_arriving_request_errors_and_its_pages_wait_for_the_transfer(hybrid, ok, clock):
    sched = pair_decode(hybrid)
    sched.pd_timeout_s = 5.0
    plan, ask = admit_arriving(sched)
    answer(sched, plan)
    clock.now += 5.0  # on the deadline: still waiting
    sched.schedule()
    assert sched.take_finished() == []
    clock.now += 0.01
    sched.schedule()
    (delta,) = sched.take_finished()
    assert (delta.req_id, delta.finish_reason) == (1, "error")
    assert delta.error == "the transfer from the prefill instance timed out after 5 s"
    assert 1 in sched.coord.requests and sched.awaiting_transfers()
    sched.abort(1)  # answered already: no second delta
    clock.now += 60.0
    poll = sched.schedule()
    assert sched.take_finished() == []
    assert answer(sched, poll, TransferDone(ask.transfer_id, ok)) == []
    assert not sched.has_work()
    check_books_balanced(sched)


@pytest.mark.parametrize("hybrid", [True, False])
def test_an_arriving_sequence_is_never_the_preemption_victim(hybrid, clock):
    sched = pair_decode(hybrid)
    sched.add(GenerateRequest(2, prompt(800, 5000), SamplingParams(max_tokens=40, ignore_eos=True)))
    for _ in range(3):  # its prompt in two chunks, then decoding: 51 of the 64 pages
        step(sched)
    plan, ask = admit_arriving(sched)  # newer, 12 pages
    arriving = sched.running[1]
    assert sched._newest_running() is sched.running[2]
    assert arriving.admit_order > sched.running[2].admit_order
    answer(sched, plan)
    for _ in range(100):
        step(sched)
        if 2 not in sched.running:
            break
    assert sched.preemptions == 1 and [s.req_id for s in sched.waiting] == [2]  # it gave way, not the newer one
    assert sched.running == {1: arriving} and arriving.pages[:12] == ask.dst_pages and arriving.arriving
    clock.now += PAIR_POLL_S
    poll = sched.schedule()
    deltas = answer(sched, poll, TransferDone(ask.transfer_id, True))
    deltas += run_to_end(sched)[1]
    assert finish_of(deltas, 1).cache_tiers["peer"] == 192 and finish_of(deltas, 2).finish_reason == "length"
    check_books_balanced(sched)


@pytest.mark.parametrize("hybrid", [True, False])
def test_an_arrived_sequence_preempted_before_its_first_chunk_is_announced_once(hybrid, clock):
    sched = pair_decode(hybrid)
    sched.add(GenerateRequest(2, prompt(800, 5000), SamplingParams(max_tokens=40, ignore_eos=True)))
    for _ in range(3):
        step(sched)
    plan, ask = admit_arriving(sched)
    older, arrived = sched.running[2], sched.running[1]
    older_slot = older.slot
    while not (sched.coord.pages.free_count == 0 and older.kv_len == P * len(older.pages)):
        answer(sched, plan)  # the older one decodes until its next token needs a page the pool lacks
        plan = sched.schedule()
    deltas = answer(sched, plan, TransferDone(ask.transfer_id, True))
    assert arrived.arriving is None and not arrived.announced  # arrived, its first chunk not planned yet
    plans, more = run_to_end(sched)  # the older one takes its page from the arrived one, the newest
    assert sched.preemptions == 1 and plans[0].new == [] and [c.slot for c in plans[0].chunks] == [older_slot]
    assert [n.req_id for p in plans for n in p.new] == [1]  # announced when admitted again, and only then
    deltas += more
    assert finish_of(deltas, 1).finish_reason == "length" and finish_of(deltas, 2).finish_reason == "length"
    check_books_balanced(sched)


FALLBACKS = {  # name: (scheduler settings, pools)
    "no pair in the pools": (dict(), json.dumps({"version": 1, **SAME})),
    "another backend": (dict(), json.dumps({"version": 1, "pair": "nccl", **SAME})),
    "another KV dtype": (dict(), json.dumps({"version": 1, "pair": "gloo", **SAME, "kv_dtype": "float8_e4m3fn"})),
    "another fingerprint": (dict(), json.dumps({"version": 1, "pair": "gloo", **SAME, "root": "11" * 16})),
    "no KV dtype or fingerprint named": (dict(), json.dumps({"version": 1, "pair": "gloo"})),
    "pools not JSON": (dict(), "not json"),
    "pools not an object": (dict(), json.dumps(["pair", "gloo"])),
    "no rendezvous address": (dict(address=""), PAIR_POOLS),
    "no pair backend": (dict(backend=""), PAIR_POOLS),
}


@pytest.mark.parametrize("name", list(FALLBACKS))
@pytest.mark.parametrize("hybrid", [True, False])
def test_a_hold_not_on_this_instances_pair_backend_takes_the_cpu_path(name, hybrid, clock):
    settings, pools = FALLBACKS[name]
    sched = pair_decode(hybrid, **settings)
    sched.add(generate(1, 200, peer=PEER, peer_device=pair_device(hybrid, pools=pools)))
    release, fetch = sched.take_pd_outbox()
    assert release == PdRelease(PEER, HOLD)
    assert isinstance(fetch, PdFetch) and fetch.peer == PEER and len(fetch.keys) == 12
    assert sched.pd_malformed == 0 and sched.waiting[0].peer_device is None and sched.waiting[0].lookup_pending


def test_a_pair_hold_that_does_not_fit_the_prompt_is_counted_and_takes_the_cpu_path(clock):
    sched = pair_decode(True)
    sched.add(generate(1, 200, peer=PEER, peer_device=pair_device(True, length=100, pages=list(range(6)))))
    release, fetch = sched.take_pd_outbox()
    assert release == PdRelease(PEER, HOLD) and isinstance(fetch, PdFetch)
    assert sched.pd_malformed == 1


def test_a_hold_on_this_gpu_is_copied_over_cuda_ipc_even_with_a_pair_backend(clock):
    sched = decode_side(True)
    sched.pair_backend, sched.pair_address = "nccl", ADDRESS
    pools = json.dumps({"version": 1, "uuid": GPU, "pair": "nccl", **SAME})
    sched.add(generate(1, 200, peer=PEER, peer_device=device(pools=pools)))
    settle_tiers(sched)
    plan = sched.schedule()
    assert [type(op) for op in plan.ops if isinstance(op, (PeerCopy, PeerRecv))] == [PeerCopy]
    assert plan.chunks[0].start_pos == 192 and sched.running[1].arriving is None
    answer(sched, plan)
    assert sched.take_pd_outbox() == [PdRelease(PEER, HOLD)] and not sched.awaiting_transfers()


@pytest.mark.parametrize("hybrid", [True, False])
def test_an_unknown_or_repeated_transfer_end_is_only_counted(hybrid, clock):
    sched = pair_decode(hybrid)
    plan, ask = admit_arriving(sched)
    assert answer(sched, plan, TransferDone(ask.transfer_id ^ 1, True)) == []
    assert sched.pd_malformed == 1 and sched.running[1].arriving == ask.transfer_id
    assert (sched.pair_ok, sched.pair_failed) == (0, 0)
    clock.now += PAIR_POLL_S
    poll = sched.schedule()
    answer(sched, poll, TransferDone(ask.transfer_id, True))
    first = sched.schedule()
    assert answer(sched, first, TransferDone(ask.transfer_id, False, "again"))[0].finish_reason == "length"
    assert sched.pd_malformed == 2 and (sched.pair_ok, sched.pair_failed) == (1, 0)
    run_to_end(sched)
    check_books_balanced(sched)


# The prefill side


@pytest.mark.parametrize("hybrid", [True, False])
@pytest.mark.parametrize("ok", [True, False])
@pytest.mark.parametrize("first", [0, 4])
def test_a_valid_ask_sends_from_the_hold_which_lives_until_the_send_ends(hybrid, ok, first, clock):
    sched, hold = held_prompt(hybrid)
    dst = list(range(100, 112 - first))
    dst_slot = 3 if hybrid else None
    sched.on_pair_send(PdPairSend(hold.hold_id, 77, ADDRESS, "pfx", first, dst, dst_slot))
    assert sched.pd_malformed == 0 and sched.awaiting_transfers() and sched.sending_hold(hold.hold_id)
    plan = sched.schedule()
    assert plan.chunks == [] and plan.new == []
    assert plan.ops == [PeerSend(77, ADDRESS, "pfx", hold.pages[first:], dst, hold.slot, dst_slot)]
    clock.now += 3600.0
    sched.expire_peer_holds(0.0)
    sched.release_peer_hold(hold.hold_id)  # the send's end releases it
    assert list(sched.coord.holds) == [hold.hold_id] and sched.pd_malformed == 0
    assert answer(sched, plan) == [] and sched.coord.holds  # a result that does not report it
    poll = sched.schedule()
    assert poll is not None and poll.ops == []  # the prefill side asks its ranks too
    assert answer(sched, poll, TransferDone(77, ok, None if ok else "peer gone")) == []
    assert (sched.pair_ok, sched.pair_failed, sched.pair_pages) == ((1, 0, 12 - first) if ok else (0, 1, 0))
    assert not sched.awaiting_transfers() and sched.pd_malformed == 0
    check_books_balanced(sched)
    assert sched.coord.peek(prompt(200, 1000)) == 192  # still cached, evictable now


BAD_ASKS = {  # name: (hybrid, PdPairSend fields changed from a valid ask of the whole hold)
    "unknown hold": (True, dict(hold_id=12345)),
    "too few pages": (True, dict(first=4, dst_pages=list(range(100, 107)))),
    "too many pages": (True, dict(dst_pages=list(range(100, 113)))),
    "pages short of the hold's end": (True, dict(dst_pages=list(range(100, 111)))),
    "first past the hold": (True, dict(first=13, dst_pages=[100])),
    "a negative first": (True, dict(first=-4, dst_pages=list(range(100, 104)))),
    "a negative page": (True, dict(dst_pages=[-1] + list(range(101, 112)))),
    "a negative transfer id": (True, dict(transfer_id=-5)),
    "no pages": (True, dict(first=12, dst_pages=[])),
    "no slot on a hybrid model": (True, dict(dst_slot=None)),
    "a negative slot": (True, dict(dst_slot=-1)),
    "a slot on a dense model": (False, dict(dst_slot=3)),
    "a negative page, dense": (False, dict(dst_pages=list(range(100, 111)) + [-2])),
}


@pytest.mark.parametrize("name", list(BAD_ASKS))
def test_a_malformed_ask_is_only_counted(name, clock):
    hybrid, changes = BAD_ASKS[name]
    sched, hold = held_prompt(hybrid)
    valid = PdPairSend(hold.hold_id, 77, ADDRESS, "pfx", 0, list(range(100, 112)), 3 if hybrid else None)
    sched.on_pair_send(PdPairSend(**{f: changes.get(f, getattr(valid, f)) for f in valid.__struct_fields__}))
    assert sched.pd_malformed == 1
    assert sched.schedule() is None and not sched.awaiting_transfers()  # no PeerSend
    assert list(sched._peer_holds) == [hold.hold_id]  # the hold stays, and expires as any other
    sched.on_pair_send(valid)  # the hold can still be sent
    assert [type(op) for op in sched.schedule().ops] == [PeerSend] and sched.pd_malformed == 1


@pytest.mark.parametrize("hybrid", [True, False])
def test_a_second_ask_for_the_same_hold_or_transfer_is_only_counted(hybrid, clock):
    sched = pair_prefill(hybrid)
    sched.add(generate(1, 199, base=1000, for_peer=True))
    sched.add(generate(2, 199, base=3000, for_peer=True))
    _, deltas = run_to_end(sched)
    one, two = (finish_of(deltas, r).peer_hold for r in (1, 2))
    slot = 3 if hybrid else None
    sched.on_pair_send(PdPairSend(one.hold_id, 77, ADDRESS, "pfx", 0, list(range(100, 112)), slot))
    sched.on_pair_send(PdPairSend(one.hold_id, 78, ADDRESS, "pfx", 0, list(range(100, 112)), slot))  # same hold
    sched.on_pair_send(PdPairSend(two.hold_id, 77, ADDRESS, "pfx", 0, list(range(100, 112)), slot))  # same id
    assert sched.pd_malformed == 2
    (send,) = sched.schedule().ops
    assert send.transfer_id == 77 and send.src_pages == one.pages
    sched.on_pair_send(PdPairSend(two.hold_id, 79, ADDRESS, "pfx", 0, list(range(100, 112)), slot))
    plan = sched.schedule()
    assert [op.src_pages for op in plan.ops] == [two.pages] and sched.pd_malformed == 2
    answer(sched, plan, TransferDone(77, True), TransferDone(79, True))
    assert (sched.pair_ok, sched.pair_pages) == (2, 24)
    sched.on_pair_send(PdPairSend(one.hold_id, 80, ADDRESS, "pfx", 0, list(range(100, 112)), slot))  # released
    assert sched.pd_malformed == 3
    check_books_balanced(sched)


# Both, wired by hand: the ask from the decode router is the prefill router's PdPairSend


@pytest.mark.parametrize("hybrid", [True, False])
@pytest.mark.parametrize("decode_hit", [False, True])
def test_a_round_trip_moves_the_held_prefix_and_balances_both_books(hybrid, decode_hit, clock):
    pre, hold = held_prompt(hybrid)
    dec = pair_decode(hybrid)
    tokens = prompt(200, 1000)
    if decode_hit:  # an earlier turn cached [0, 64) on the decode side
        dec.add(GenerateRequest(9, tokens[:70], SamplingParams(max_tokens=1)))
        run_to_end(dec)
    dev = PeerDevice(PAIR_POOLS, hold.hold_id, hold.length, hold.pages, hold.slot)
    dec.add(generate(2, 200, base=1000, peer=PEER, peer_device=dev))
    settle_tiers(dec)
    recv_plan = dec.schedule()
    (ask,) = dec.take_pd_outbox()
    (recv,) = [op for op in recv_plan.ops if isinstance(op, PeerRecv)]
    first = 4 if decode_hit else 0
    assert ask.first == first and len(ask.dst_pages) == 12 - first
    pre.on_pair_send(ask_to_send(ask))
    send_plan = pre.schedule()
    (send,) = send_plan.ops
    assert (send.transfer_id, send.address, send.prefix) == (recv.transfer_id, ADDRESS, recv.prefix)
    assert send.src_pages == recv.src_pages == hold.pages[first:] and send.dst_pages == recv.dst_pages
    assert (send.src_slot, send.dst_slot) == (recv.src_slot, recv.dst_slot)
    assert send.src_slot == hold.slot and (send.dst_slot is not None) == hybrid
    # the ranks move the pages; each reports the transfer's end in a later result
    assert answer(pre, send_plan, TransferDone(ask.transfer_id, True)) == []
    check_books_balanced(pre)
    answer(dec, recv_plan)
    assert dec.coord.peek(tokens) == (64 if decode_hit else 0)
    clock.now += PAIR_POLL_S
    assert answer(dec, dec.schedule(), TransferDone(ask.transfer_id, True)) == []
    plans, deltas = run_to_end(dec)
    assert plans[0].chunks[0].start_pos == 192 and [n.req_id for n in plans[0].new] == [2]
    finish = finish_of(deltas, 2)
    assert finish.cache_tiers == {"gpu": 64 * decode_hit, "cpu": 0, "disk": 0, "peer": 192 - 64 * decode_hit}
    for sched in (pre, dec):
        assert (sched.pair_ok, sched.pair_failed, sched.pair_pages) == (1, 0, 12 - first)
        assert sched.pd_malformed == 0 and not sched.awaiting_transfers()
    assert dec.take_pd_outbox() == []
    check_books_balanced(dec)
