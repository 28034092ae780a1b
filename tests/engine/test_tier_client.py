"""TierClient with a real CacheCoordinator: lookup keys, answers, offload holds and the plan follow-ups."""

import pytest

from hkv.cache import CacheCoordinator, CacheSpec, SaveCheckpoint
from hkv.cache.keys import page_keys
from hkv.cache.types import StorePages, StoreState
from hkv.engine import tier_client
from hkv.engine.tier_client import TierClient, TierHit
from hkv.ipc.messages import TierCommit, TierFound, TierLookup, TierRelease, TierReserve, TierReserved

ROOT = bytes(range(16))
P = 2
ENTRIES, STATES = 10, 3  # the CPU tier's page and state entries


def client(hybrid=False, pages=16) -> TierClient:
    spec = CacheSpec(P, pages, 4 if hybrid else 0, 0, hybrid, 4 if hybrid else None, True)
    return TierClient(CacheCoordinator(spec), ROOT, P, hybrid, ENTRIES, STATES if hybrid else 0)


def admit_and_publish(tc: TierClient, rid: int, tokens: list[int], checkpoint=False):
    """One request computes all of `tokens` and publishes them; returns the publish result."""
    coord = tc.coord
    with coord.begin(rid) as txn:
        txn.match(tokens)
        txn.reserve(tokens=len(tokens), state_slots=1 if tc.hybrid else 0)
        txn.commit()
    published = coord.publish(rid, tokens, len(tokens), checkpoint=checkpoint)
    coord.check_integrity()
    return published


def test_keys_chain_from_the_root_and_extend_the_known_list():
    tc = client()
    tokens = [5, 6, 7, 8, 9, 10, 11]
    known: list[bytes] = []
    assert tc.keys(known, tokens, 2) == page_keys(ROOT, tokens[:4], P)
    assert known == page_keys(ROOT, tokens[:4], P)
    # a longer request continues the chain from the last known key
    assert tc.keys(known, tokens, 3) == page_keys(ROOT, tokens[:6], P)
    assert len(known) == 3
    assert tc.keys(known, tokens, 1) == known[:1] and len(known) == 3


def test_lookup_asks_for_the_pages_past_the_device_hit():
    tc = client()
    prompt = [1, 2, 3, 4, 5, 6, 7]  # pages wholly inside prompt[:-1]: [0, 3)
    known: list[bytes] = []
    assert tc.lookup(9, known, prompt, device_hit=2)
    keys = page_keys(ROOT, prompt[:6], P)
    assert tc.take_outbox() == [TierLookup(1, 1, keys[1:], False, keys[0])]  # the run hangs under page 0
    assert known == keys and tc.waiting_lookups == {1: 9}
    assert tc.lookup(10, [], prompt, device_hit=0)
    assert tc.take_outbox() == [TierLookup(2, 0, keys, False)]


def test_lookup_of_a_prompt_with_no_page_left_sends_nothing():
    tc = client()
    assert not tc.lookup(1, [], [1, 2, 3, 4, 5], device_hit=4)
    assert not tc.lookup(1, [], [1, 2, 3, 4], device_hit=2)  # page [2, 4) holds the last prompt token
    assert not tc.lookup(1, [], [1], device_hit=0)
    assert tc.take_outbox() == [] and tc.waiting_lookups == {}


def test_hybrid_lookup_asks_for_a_state():
    tc = client(hybrid=True)
    assert tc.lookup(3, [], [1, 2, 3, 4, 5], device_hit=0)
    assert tc.take_outbox() == [TierLookup(1, 0, page_keys(ROOT, [1, 2, 3, 4], P), True)]


def test_found_returns_the_hit_for_a_waiting_request():
    tc = client()
    tc.lookup(7, [], [1, 2, 3, 4, 5, 6, 7], 0)
    tc.take_outbox()
    got = tc.found(TierFound(1, 0, [4, 2], [False, True], None))
    assert got == (7, TierHit(1, 0, (4, 2), (False, True), None))
    assert tc.waiting_lookups == {} and tc.take_outbox() == []
    # answered once: a repeat is unknown
    assert tc.found(TierFound(1, 0, [4, 2], [False, True], None)) is None


def test_found_for_an_unknown_id_does_nothing():
    tc = client()
    assert tc.found(TierFound(42, 0, [1], [False], None)) is None
    assert tc.take_outbox() == []


def test_found_after_the_request_left_releases_the_pins():
    tc = client()
    tc.lookup(7, [], [1, 2, 3, 4, 5], 0)
    tc.lookup(8, [], [1, 2, 3, 4, 5], 0)
    tc.take_outbox()
    tc.forget_lookup(7)
    assert tc.waiting_lookups == {1: None, 2: 8}
    assert tc.found(TierFound(1, 0, [3], [False], None)) is None
    assert tc.take_outbox() == [TierRelease(1)]
    tc.forget_lookup(8)
    assert tc.found(TierFound(2, 0, [], [], None)) is None  # nothing pinned: nothing to release
    assert tc.take_outbox() == [] and tc.waiting_lookups == {}


def test_an_empty_answer_is_a_miss_without_a_release():
    tc = client()
    tc.lookup(7, [], [1, 2, 3, 4, 5], 0)
    tc.take_outbox()
    assert tc.found(TierFound(1, 0, [], [], None)) == (7, None)
    assert tc.take_outbox() == []


def test_a_malformed_answer_is_a_miss_and_released():
    tc = client()
    tc.lookup(7, [], [1, 2, 3, 4, 5], 0)
    tc.take_outbox()
    assert tc.found(TierFound(1, 0, [3, 4], [False], None)) == (7, None)
    assert tc.take_outbox() == [TierRelease(1)]


@pytest.mark.parametrize("answer", [
    TierFound(1, 0, [3, ENTRIES], [False, False], None),  # an entry past the pool
    TierFound(1, 0, [-1], [False], None),
    TierFound(1, -1, [3], [False], None),  # a negative first page
    TierFound(1, 0, [3], [False], 0),  # a dense answer naming a state
])  # fmt: skip
def test_an_answer_naming_an_index_outside_the_pool_is_a_miss_and_released(answer):
    tc = client()
    tc.lookup(7, [], [1, 2, 3, 4, 5], 0)
    tc.take_outbox()
    assert tc.found(answer) == (7, None)
    assert tc.take_outbox() == [TierRelease(1)]


def test_a_hybrid_answer_with_a_state_past_the_pool_is_a_miss():
    tc = client(hybrid=True)
    tc.lookup(7, [], [1, 2, 3, 4, 5], 0)
    tc.take_outbox()
    assert tc.found(TierFound(1, 0, [3, 4], [False, False], STATES)) == (7, None)
    assert tc.take_outbox() == [TierRelease(1)]


def test_a_hybrid_answer_without_a_state_is_a_miss_and_released():
    tc = client(hybrid=True)
    tc.lookup(7, [], [1, 2, 3, 4, 5], 0)
    tc.take_outbox()
    assert tc.found(TierFound(1, 0, [3, 4], [False, False], None)) == (7, None)
    assert tc.take_outbox() == [TierRelease(1)]
    tc.lookup(8, [], [1, 2, 3, 4, 5], 0)
    tc.take_outbox()
    assert tc.found(TierFound(2, 0, [3, 4], [False, False], 1)) == (8, TierHit(2, 0, (3, 4), (False, False), 1))


def test_tier_hit_usable_counts_entries_past_the_device_hit():
    hit = TierHit(1, 2, (10, 11, 12), (False,) * 3, None)  # pages [2, 5)
    assert [hit.usable(tokens, P) for tokens in (0, 2, 4, 6, 8, 10, 12)] == [0, 0, 3, 2, 1, 0, 0]


def test_release_after_the_plan_waits_for_its_step():
    tc = client()
    tc.release(5, after_plan=True)
    assert tc.take_outbox() == [] and tc.has_pending()
    tc.plan_built(3)
    assert not tc.has_pending()
    tc.step_done(2, True)  # another step: nothing
    assert tc.take_outbox() == []
    tc.step_done(3, False)  # released either way
    assert tc.take_outbox() == [TierRelease(5)]
    tc.step_done(3, True)  # once
    assert tc.take_outbox() == []


def test_offload_holds_the_published_prefix_and_asks_for_entries():
    tc = client()
    tokens = [1, 2, 3, 4, 5, 6, 7]
    admit_and_publish(tc, 1, tokens)
    known: list[bytes] = []
    assert tc.offload(1, known, tokens)
    coord = tc.coord
    [hold] = coord.holds.values()
    assert (hold.length, hold.pages, hold.checkpoint) == (6, (0, 1, 2), None)
    assert tc.take_outbox() == [TierReserve(1, page_keys(ROOT, tokens[:6], P), False)]
    assert list(tc.offloads) == [1] and tc.offloads[1].pages == (0, 1, 2)
    coord.check_integrity()
    # the request may finish meanwhile: the hold keeps its pages from eviction
    coord.release(1)
    assert coord.flush().pages == 0
    coord.check_integrity()


def test_offload_of_an_unpublished_request_is_skipped():
    tc = client()
    coord = tc.coord
    with coord.begin(1) as txn:
        txn.match([1, 2, 3])
        txn.reserve(tokens=3)
        txn.commit()
    assert not tc.offload(1, [], [1, 2, 3])
    assert coord.holds == {} and tc.take_outbox() == [] and tc.offloads == {}
    coord.check_integrity()


def test_reserved_emits_store_ops_and_the_step_commits_and_unholds():
    tc = client()
    tokens = [1, 2, 3, 4, 5, 6, 7]
    admit_and_publish(tc, 1, tokens)
    tc.offload(1, [], tokens)
    tc.take_outbox()
    ops = tc.reserved(TierReserved(1, [5, None, 7], None))  # page 1 is in the CPU tier already
    assert ops == [StorePages([0, 2], [5, 7])]
    assert tc.offloads == {} and tc.has_pending() and len(tc.coord.holds) == 1
    tc.plan_built(4)
    tc.step_done(4, True)
    assert tc.take_outbox() == [TierCommit(1, True)]
    assert tc.coord.holds == {}
    tc.coord.check_integrity()
    tc.coord.release(1)
    assert tc.coord.flush().pages == 3  # unheld: evictable again
    tc.coord.check_integrity()


def test_a_failed_step_commits_not_ok_and_still_unholds():
    tc = client()
    tokens = [1, 2, 3, 4, 5]
    admit_and_publish(tc, 1, tokens)
    tc.offload(1, [], tokens)
    tc.take_outbox()
    assert tc.reserved(TierReserved(1, [0, 1], None)) == [StorePages([0, 1], [0, 1])]
    tc.plan_built(9)
    tc.step_done(9, False)
    assert tc.take_outbox() == [TierCommit(1, False)] and tc.coord.holds == {}
    tc.coord.check_integrity()


def test_reserved_with_nothing_to_copy_unholds_at_once():
    tc = client()
    tokens = [1, 2, 3, 4, 5]
    admit_and_publish(tc, 1, tokens)
    tc.offload(1, [], tokens)
    tc.take_outbox()
    assert tc.reserved(TierReserved(1, [None, None], None)) == []
    assert tc.coord.holds == {} and not tc.has_pending()
    assert tc.take_outbox() == []  # the worker reserved nothing: no commit owed
    tc.coord.check_integrity()


def test_reserved_with_the_wrong_entry_count_frees_what_the_worker_reserved():
    tc = client()
    tokens = [1, 2, 3, 4, 5]
    admit_and_publish(tc, 1, tokens)
    tc.offload(1, [], tokens)
    tc.take_outbox()
    assert tc.reserved(TierReserved(1, [3], None)) == []
    assert tc.take_outbox() == [TierCommit(1, False)] and tc.coord.holds == {}
    tc.coord.check_integrity()


@pytest.mark.parametrize("entries,state", [([3, ENTRIES], None), ([-1, 2], None), ([3, 4], 0)])
def test_reserved_naming_an_index_outside_the_pool_stores_nothing(entries, state):
    tc = client()  # dense: no state may come back either
    tokens = [1, 2, 3, 4, 5]
    admit_and_publish(tc, 1, tokens)
    tc.offload(1, [], tokens)
    tc.take_outbox()
    assert tc.reserved(TierReserved(1, entries, state)) == []
    assert tc.take_outbox() == [TierCommit(1, False)] and tc.coord.holds == {} and not tc.has_pending()
    tc.coord.check_integrity()


def test_hybrid_reserved_with_a_state_past_the_pool_stores_nothing():
    tc = client(hybrid=True)
    tokens = [1, 2, 3, 4]
    admit_and_publish(tc, 1, tokens, checkpoint=True)
    tc.offload(1, [], tokens)
    tc.take_outbox()
    assert tc.reserved(TierReserved(1, [3, 4], STATES)) == []
    assert tc.take_outbox() == [TierCommit(1, False)] and tc.coord.holds == {}
    tc.coord.check_integrity()


def test_reserved_for_an_unknown_offload_does_nothing():
    tc = client()
    assert tc.reserved(TierReserved(99, [1, 2], None)) == []
    assert tc.take_outbox() == [] and not tc.has_pending()


def test_offloads_in_flight_are_bounded(monkeypatch):
    monkeypatch.setattr(tier_client, "MAX_OFFLOADS", 3)
    tc = client()
    tokens = [1, 2, 3, 4, 5]
    admit_and_publish(tc, 1, tokens)
    assert all(tc.offload(1, [], tokens) for _ in range(3))
    assert len(tc.coord.holds) == 3
    assert not tc.offload(1, [], tokens)
    assert tc.skipped_offloads == 1 and len(tc.coord.holds) == 3 and len(tc.take_outbox()) == 3
    tc.coord.check_integrity()
    # an answer frees a place
    tc.reserved(TierReserved(1, [None, None], None))
    assert tc.offload(1, [], tokens) and tc.skipped_offloads == 1
    for offload_id in list(tc.offloads):
        tc.reserved(TierReserved(offload_id, [None, None], None))
    assert tc.coord.holds == {}
    tc.coord.check_integrity()


def test_offloads_waiting_for_their_step_count_toward_the_bound(monkeypatch):
    monkeypatch.setattr(tier_client, "MAX_OFFLOADS", 2)
    tc = client()
    tokens = [1, 2, 3]
    admit_and_publish(tc, 1, tokens)
    for offload_id in (1, 2):
        assert tc.offload(1, [], tokens)
        assert tc.reserved(TierReserved(offload_id, [offload_id], None)) == [StorePages([0], [offload_id])]
    # both still hold their pages until the plan carrying their copies has run
    assert len(tc.coord.holds) == 2
    assert not tc.offload(1, [], tokens), f"{len(tc.coord.holds)} holds for a bound of 2"


def test_the_default_bound():
    assert tier_client.MAX_OFFLOADS == 64
    tc = client()
    tokens = [1, 2, 3]
    admit_and_publish(tc, 1, tokens)
    results = [tc.offload(1, [], tokens) for _ in range(65)]
    assert results == [True] * 64 + [False] and tc.skipped_offloads == 1
    for offload_id in list(tc.offloads):
        tc.reserved(TierReserved(offload_id, [None], None))
    tc.coord.check_integrity()


def test_hybrid_offload_without_a_checkpoint_is_skipped():
    tc = client(hybrid=True)
    tokens = [1, 2, 3, 4, 5]
    admit_and_publish(tc, 1, tokens[:4], checkpoint=False)
    assert not tc.offload(1, [], tokens)
    assert tc.coord.holds == {} and tc.take_outbox() == [] and tc.offloads == {}
    tc.coord.check_integrity()


def test_hybrid_offload_stores_the_checkpoint_too():
    tc = client(hybrid=True)
    tokens = [1, 2, 3, 4]
    published = admit_and_publish(tc, 1, tokens, checkpoint=True)
    [save] = published.ops
    assert isinstance(save, SaveCheckpoint)
    assert tc.offload(1, [], tokens)
    [hold] = tc.coord.holds.values()
    assert hold.checkpoint is not None and hold.checkpoint.slot == save.dst_slot and hold.checkpoint.holds == 1
    assert tc.take_outbox() == [TierReserve(1, page_keys(ROOT, tokens, P), True)]
    ops = tc.reserved(TierReserved(1, [3, 8], 2))
    assert ops == [StorePages([0, 1], [3, 8]), StoreState(save.dst_slot, 2)]
    tc.coord.check_integrity()
    tc.plan_built(1)
    tc.step_done(1, True)
    assert tc.take_outbox() == [TierCommit(1, True)] and tc.coord.holds == {}
    assert hold.checkpoint.holds == 0
    tc.coord.check_integrity()


def test_hybrid_reserved_with_only_the_state_still_copies_it():
    tc = client(hybrid=True)
    tokens = [1, 2, 3, 4]
    [save] = admit_and_publish(tc, 1, tokens, checkpoint=True).ops
    tc.offload(1, [], tokens)
    tc.take_outbox()
    assert tc.reserved(TierReserved(1, [None, None], 0)) == [StoreState(save.dst_slot, 0)]
    tc.plan_built(2)
    tc.step_done(2, True)
    assert tc.take_outbox() == [TierCommit(1, True)] and tc.coord.holds == {}
    tc.coord.check_integrity()


def test_ops_of_two_plans_follow_their_own_steps():
    tc = client()
    a, b = [1, 2, 3, 4, 5], [7, 7, 7, 7, 7]
    admit_and_publish(tc, 1, a)
    admit_and_publish(tc, 2, b)
    tc.offload(1, [], a)
    tc.offload(2, [], b)
    tc.take_outbox()
    tc.reserved(TierReserved(1, [0, 1], None))
    tc.plan_built(1)
    tc.reserved(TierReserved(2, [2, 3], None))
    tc.plan_built(2)
    tc.step_done(2, True)
    assert tc.take_outbox() == [TierCommit(2, True)] and len(tc.coord.holds) == 1
    tc.step_done(1, False)
    assert tc.take_outbox() == [TierCommit(1, False)] and tc.coord.holds == {}
    tc.coord.check_integrity()


@pytest.mark.parametrize("hybrid", [False, True])
def test_lookup_and_offload_ids_never_collide(hybrid):
    tc = client(hybrid=hybrid)
    tokens = [1, 2, 3, 4, 5]
    admit_and_publish(tc, 1, tokens[:4], checkpoint=hybrid)
    tc.lookup(2, [], tokens, 0)
    tc.offload(1, [], tokens[:4])
    tc.lookup(3, [], tokens, 0)
    ids = [getattr(m, "lookup_id", getattr(m, "offload_id", None)) for m in tc.take_outbox()]
    assert ids == [1, 2, 3]
    tc.reserved(TierReserved(2, [None, None], None))
    tc.coord.check_integrity()
