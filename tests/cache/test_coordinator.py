"""CacheCoordinator on tiny specs: exact page ids, ops, eviction order and rollbacks."""

import gc

import pytest

from hkv.cache import (
    CacheCoordinator, CacheSpec, CapacityError, Checkpoint, CheckpointRef, Evicted, Hit, Node, RestoreCheckpoint,
    SaveCheckpoint, TransactionError,
)  # fmt: skip
from tests.cache.snapshot import canonical


def dense(pages=8, page_size=2, prefix_cache=True, fault=None) -> CacheCoordinator:
    return CacheCoordinator(CacheSpec(page_size, pages, 0, 0, False, None, prefix_cache), fault=fault)


def hybrid(pages=12, slots=4, windows=0, page_size=2, fault=None) -> CacheCoordinator:
    return CacheCoordinator(CacheSpec(page_size, pages, slots, windows, True, 4, True), fault=fault)


def run(coord, rid, tokens, *, state_slots=0, window_slots=0, publish=True, checkpoint=False):
    """Admit a request for all of `tokens` in one transaction, then publish all of it."""
    with coord.begin(rid) as txn:
        hit = txn.match(tokens)
        txn.reserve(tokens=len(tokens) - hit.length, state_slots=state_slots, window_slots=window_slots)
        grant = txn.commit()
    published = coord.publish(rid, tokens, len(tokens), checkpoint=checkpoint) if publish else None
    coord.check_integrity()
    return hit, grant, published


def test_admit_publish_and_hit_with_exact_pages():
    coord = dense()
    hit, grant, published = run(coord, 1, [1, 2, 3, 4, 5])
    assert hit == Hit(0, (), None)
    assert grant.pages == (0, 1, 2) and grant.cursor == 5 and grant.cached_tokens == 0 and grant.ops == ()
    # the partial page (token 5) stays private to the request
    assert (published.cached_tokens, published.inserted_tokens) == (4, 4)
    hit, grant, _ = run(coord, 2, [1, 2, 3, 4, 9, 9], publish=False)
    assert hit.length == 4 and hit.pages == (0, 1)
    assert grant.pages == (0, 1, 3) and grant.cursor == 6 and grant.cached_tokens == 4
    # pages 0, 1 are the tree's; 2 (request 1's partial page) and 3 are the requests' own
    assert coord.pages.free_ids() == [4, 5, 6, 7] and coord.tree.cached_pages == 2
    assert [coord.requests[r].owned_pages(2) for r in (1, 2)] == [[2], [3]]


def test_at_least_one_prompt_token_is_recomputed():
    coord = dense()
    run(coord, 1, [1, 2, 3, 4])
    coord.release(1)
    # the whole prompt is cached, but its last token must run to produce logits
    hit, grant, _ = run(coord, 2, [1, 2, 3, 4], publish=False)
    assert hit.length == 2 and hit.pages == (0,) and grant.pages == (0, 2) and grant.cursor == 4


def test_reserve_evicts_the_least_recently_used_unreferenced_leaf():
    coord = dense(pages=6)
    for rid, tokens in ((1, [1, 1, 1, 1]), (2, [2, 2, 2, 2]), (3, [3, 3])):
        run(coord, rid, tokens)
        coord.release(rid)
    run(coord, 4, [1, 1, 1, 1, 7], publish=False)  # hits [1,1,1,1]: it becomes the most recent
    coord.release(4)
    assert coord.pages.free_ids() == [5]  # page 5 was request 4's own and went back
    with coord.begin(5) as txn:
        txn.reserve(tokens=6)  # 3 pages: evicts [2,2,2,2], the LRU leaf, whose pages come first
        grant = txn.commit()
    assert grant.pages == (2, 3, 5)
    assert coord.tree.match((3, 3, 0), 3).length == 2 and coord.tree.match((2, 2, 0), 3).length == 0
    coord.check_integrity()


def test_capacity_error_changes_nothing_and_keeps_the_transaction_open():
    coord = dense(pages=4)
    run(coord, 1, [1, 2, 3, 4])  # 2 pages cached and locked by request 1
    txn = coord.begin(2)
    before = canonical(coord)
    with pytest.raises(CapacityError) as err:
        txn.reserve(tokens=6)
    assert (err.value.needed, err.value.free, err.value.evictable) == (3, 2, 0)
    assert canonical(coord) == before and txn.open
    txn.reserve(tokens=4)
    assert txn.commit().pages == (2, 3)
    coord.check_integrity()


def test_rollback_restores_evictions_pools_locks_and_cursor_exactly():
    coord = dense(pages=4)
    for rid, tokens in ((1, [1, 2, 3, 4]), (2, [9, 9])):
        run(coord, rid, tokens)
        coord.release(rid)
    run(coord, 3, [5, 6], publish=False)
    before = canonical(coord)
    txn = coord.begin(4)
    assert txn.match([1, 2, 3, 4, 8]).pages == (0, 1)
    txn.reserve(tokens=1)  # evicts [9, 9] for its page
    assert coord.requests[4].pages == [0, 1, 2] and coord.tree.match((9, 9), 2).length == 0
    with pytest.raises(CapacityError):
        txn.reserve(pages=1)
    coord.check_integrity(allow_open_transaction=True)
    txn.rollback()
    assert canonical(coord) == before and 4 not in coord.requests
    coord.check_integrity()


def test_a_failure_inside_the_with_block_rolls_back():
    coord = dense(pages=4)
    run(coord, 1, [1, 2, 3, 4])
    coord.release(1)
    before = canonical(coord)
    with pytest.raises(RuntimeError):
        with coord.begin(2) as txn:
            txn.reserve(tokens=8)  # evicts the cached [1, 2, 3, 4]
            raise RuntimeError("the step could not be planned")
    assert canonical(coord) == before
    coord.check_integrity()


class Faults:
    """A fault hook that raises OSError at the named points it is armed for."""

    def __init__(self):
        self.armed: set[str] = set()

    def __call__(self, name: str) -> None:
        if name in self.armed:
            raise OSError(name)


def test_a_fault_between_eviction_and_allocation_undoes_the_eviction():
    faults = Faults()
    coord = dense(pages=4, fault=faults)
    run(coord, 1, [1, 2, 3, 4])
    coord.release(1)
    txn = coord.begin(2)
    before = canonical(coord)
    faults.armed.add("reserve.evicted")
    with pytest.raises(OSError):
        txn.reserve(tokens=8)
    assert canonical(coord) == before and txn.open
    txn.rollback()
    coord.check_integrity()


def test_duplicate_pages_stay_the_requests_own_until_release():
    coord = dense()
    run(coord, 1, [1, 2, 3, 4], publish=False)
    run(coord, 2, [1, 2, 3, 4], publish=False)  # computed the same prefix concurrently
    assert coord.publish(1, [1, 2, 3, 4], 4).inserted_tokens == 4
    second = coord.publish(2, [1, 2, 3, 4], 4)
    assert (second.cached_tokens, second.inserted_tokens) == (4, 0)
    assert coord.requests[2].pages == [2, 3] and coord.requests[2].owned_pages(2) == [2, 3]
    coord.check_integrity()
    coord.release(2)
    assert coord.pages.free_ids()[:2] == [2, 3]
    assert coord.tree.path_pages(coord.tree.match((1, 2, 3, 4), 4).node, 4) == [0, 1]
    coord.check_integrity()


def test_pause_keeps_the_published_prefix_and_resume_hits_it():
    coord = dense()
    run(coord, 1, [1, 2, 3, 4, 5, 6], publish=False)
    coord.publish(1, [1, 2, 3, 4, 5, 6], 3)  # only [1, 2] (page 0) is published
    coord.pause(1)
    assert coord.requests[1].pages == [] and coord.pages.free_ids()[:2] == [1, 2]
    coord.check_integrity()
    hit, grant, _ = run(coord, 1, [1, 2, 3, 4, 5, 6], publish=False)
    assert hit.pages == (0,) and grant.pages == (0, 1, 2)


def test_flush_drops_every_unreferenced_entry():
    coord = dense()
    run(coord, 1, [1, 2, 3, 4])
    run(coord, 2, [5, 6, 7, 8])
    coord.release(1)
    assert coord.flush().pages == 2
    assert coord.tree.cached_pages == 2  # request 2's published pages are still locked
    coord.release(2)
    coord.flush()
    assert coord.pages.free_count == 8 and coord.tree.num_nodes == 0
    coord.check_integrity()


def test_publish_moves_the_lock_deeper_and_never_up():
    coord = dense()
    run(coord, 1, [1, 2, 3, 4, 5, 6], publish=False)
    assert coord.publish(1, [1, 2, 3, 4, 5, 6], 4).cached_tokens == 4
    assert coord.publish(1, [1, 2, 3, 4, 5, 6], 2).cached_tokens == 4
    assert coord.requests[1].lock.depth == 4
    assert coord.publish(1, [1, 2, 3, 4, 5, 6], 6).inserted_tokens == 2
    assert coord.tree.evictable_pages == 0
    coord.check_integrity()


def test_a_hit_inside_an_edge_locks_it_and_publishing_splits_the_lock_exactly():
    coord = dense(pages=12, page_size=1)
    run(coord, 1, [1, 2, 3, 4, 5, 6])
    coord.release(1)
    hit, grant, _ = run(coord, 2, [1, 2, 3, 9], publish=False)
    assert hit.pages == (0, 1, 2) and grant.pages == (0, 1, 2, 6)
    assert coord.tree.evictable_pages == 0  # the whole containing edge [1..6] is locked
    assert coord.publish(2, [1, 2, 3, 9], 4).inserted_tokens == 1
    # split at 3: [1,2,3] stays locked (request 2's path), [4,5,6] is free to go
    assert coord.tree.evictable_pages == 3
    assert coord.evict(pages=1) == Evicted(pages=3, checkpoints=0)
    coord.check_integrity()


def test_prefix_cache_off_finds_and_keeps_nothing():
    coord = dense(prefix_cache=False)
    run(coord, 1, [1, 2, 3, 4])
    coord.release(1)
    hit, grant, published = run(coord, 2, [1, 2, 3, 4])
    assert hit.length == 0 and published.cached_tokens == 0 and coord.tree.num_nodes == 0
    assert grant.pages == (0, 1)


def test_the_api_refuses_calls_out_of_order():
    coord = dense()
    txn = coord.begin(1)
    with pytest.raises(TransactionError):
        coord.begin(2)
    with pytest.raises(TransactionError):
        coord.publish(1, [1, 2], 2)
    with pytest.raises(AssertionError, match="transaction open"):
        coord.check_integrity()
    coord.check_integrity(allow_open_transaction=True)
    txn.reserve(tokens=2)
    with pytest.raises(TransactionError):
        txn.match([1, 2, 3])
    txn.commit()
    with pytest.raises(TransactionError):
        txn.commit()
    again = coord.begin(1)
    with pytest.raises(TransactionError):
        again.match([1, 2, 3])  # a running request matched already
    again.rollback()
    with pytest.raises(ValueError):
        coord.publish(1, [1, 2, 3], 3)  # beyond its cursor
    with pytest.raises(TransactionError):
        coord.release(9)


def test_check_integrity_names_a_leaked_page():
    coord = dense()
    run(coord, 1, [1, 2, 3], publish=False)
    coord.requests[1].pages.pop()  # page 1 is no longer anybody's
    coord.requests[1].cursor = 2
    with pytest.raises(AssertionError, match=r"pages: free 6 \+ owned 1 \+ cached 0 = 7 != 8; missing \[1\]"):
        coord.check_integrity()


def test_hybrid_hits_the_deepest_checkpoint_and_restores_it():
    coord = hybrid()
    _, grant, published = run(coord, 1, [1, 2, 3, 4, 5, 6], state_slots=1, checkpoint=True)
    assert grant.state_slots == (0,)
    assert published.ops == (SaveCheckpoint(src_slot=0, dst_slot=1, length=6),)
    coord.release(1)
    # [1..6] is cached with a checkpoint at 6, but the prompt ends there: 6 > len - 1
    hit, grant, _ = run(coord, 2, [1, 2, 3, 4, 5, 6], state_slots=1, publish=False)
    assert hit.length == 0 and grant.ops == ()
    coord.release(2)
    hit, grant, _ = run(coord, 3, [1, 2, 3, 4, 5, 6, 7], state_slots=1, publish=False)
    assert hit == Hit(6, (0, 1, 2), CheckpointRef(slot=1, window=None, length=6))
    assert grant.ops == (RestoreCheckpoint(src_slot=1, dst_slot=0, length=6),)
    assert coord.tree.evictable_checkpoints == 0  # pinned while request 3 may still be copying it


def test_hybrid_ignores_cached_pages_beyond_the_last_checkpoint():
    coord = hybrid()
    run(coord, 1, [1, 2, 3, 4, 5, 6], state_slots=1, publish=False)
    coord.publish(1, [1, 2, 3, 4, 5, 6], 4, checkpoint=False)
    coord.publish(1, [1, 2, 3, 4, 5, 6], 4, checkpoint=True)  # the state is at 4 only in tests
    coord.publish(1, [1, 2, 3, 4, 5, 6], 6)  # no checkpoint at 6
    coord.release(1)
    hit, _, _ = run(coord, 2, [1, 2, 3, 4, 5, 6, 7], state_slots=1, publish=False)
    assert hit.length == 4 and hit.checkpoint.length == 4


def test_a_checkpoint_hit_without_a_live_slot_is_refused_and_rolled_back():
    coord = hybrid()
    run(coord, 1, [1, 2, 3, 4], state_slots=1, checkpoint=True)
    coord.release(1)
    before = canonical(coord)
    txn = coord.begin(2)
    txn.match([1, 2, 3, 4, 5])
    with pytest.raises(TransactionError):
        txn.commit()
    assert not txn.open and canonical(coord) == before


def test_checkpoints_are_evicted_lru_when_state_slots_run_out():
    coord = hybrid(slots=4)
    for rid, tokens in ((1, [1, 1]), (2, [2, 2]), (3, [3, 3])):
        run(coord, rid, tokens, state_slots=1, checkpoint=True)
        coord.release(rid)
    # each request lived in slot 0 and checkpointed into the next fresh slot
    assert [coord.tree.match((k, k, 0), 3).checkpoint_node.checkpoint.slot for k in (1, 2, 3)] == [1, 2, 3]
    with coord.begin(4) as txn:
        txn.reserve(tokens=2, state_slots=2)  # free slot 0, then evict the LRU checkpoint (slot 1)
        grant = txn.commit()
    assert grant.state_slots == (1, 0)
    assert coord.tree.match((1, 1, 0), 3).checkpoint_node is None
    # the pages of [1, 1] lost their checkpoint: useless now, so they go before the older useful ones
    assert coord.evict(pages=1) == Evicted(pages=1, checkpoints=0)
    assert coord.tree.match((1, 1, 0), 3).length == 0 and coord.tree.match((2, 2, 0), 3).length == 2
    coord.check_integrity()


def test_a_shared_prefix_that_keeps_being_hit_outlives_a_stream_of_one_time_checkpoints():
    """The coordinator ranks never-hit checkpoints first: the shared prefix [9, 9] was restored from once,
    so the checkpoints of later one-time prompts evict each other, not it, though it was used longest ago."""
    coord = hybrid(pages=40, slots=4)  # a horizon of 8 stores and hits
    run(coord, 1, [9, 9], state_slots=1, checkpoint=True)  # the shared prefix's checkpoint (slot 1)
    coord.release(1)
    hit, _, _ = run(coord, 2, [9, 9, 5], state_slots=1, publish=False)
    assert hit.length == 2
    coord.release(2)
    for rid in range(3, 7):  # one-time prompts, each keeping a checkpoint: two slots turn over among them
        run(coord, rid, [rid, rid], state_slots=1, checkpoint=True)
        coord.release(rid)
    assert [coord.tree.match((k, k, 0), 3).checkpoint_node is not None for k in (3, 4, 5, 6)] == [
        False, False, True, True]
    hit, grant, _ = run(coord, 7, [9, 9, 7], state_slots=1, publish=False)
    assert hit.length == 2 and grant.ops == (RestoreCheckpoint(src_slot=1, dst_slot=0, length=2),)
    coord.check_integrity()


def test_a_drafting_requests_checkpoint_carries_its_window():
    coord = hybrid(windows=2)
    _, grant, published = run(coord, 1, [1, 2, 3, 4], state_slots=1, window_slots=1, checkpoint=True)
    assert published.ops == (SaveCheckpoint(src_slot=0, dst_slot=1, length=4, src_window=0, dst_window=1),)
    coord.release(1)
    _, grant, _ = run(coord, 2, [1, 2, 3, 4, 5], state_slots=1, window_slots=1, publish=False)
    assert grant.ops == (RestoreCheckpoint(src_slot=1, dst_slot=0, length=4, src_window=1, dst_window=0),)


def test_publish_without_a_slot_to_spare_keeps_the_pages_and_skips_the_checkpoint():
    coord = hybrid(slots=1)
    _, _, published = run(coord, 1, [1, 2, 3, 4], state_slots=1, checkpoint=True)
    assert published.cached_tokens == 4 and published.ops == ()


@pytest.mark.parametrize("point", ["publish.inserted", "publish.checkpointed"])
def test_a_failure_mid_publish_undoes_all_of_it(point):
    faults = Faults()
    coord = hybrid(slots=2, fault=faults)
    run(coord, 1, [7, 7], state_slots=1, checkpoint=True)  # occupies the spare slot
    coord.release(1)
    run(coord, 2, [1, 2, 3, 4, 5, 6], state_slots=1, publish=False)
    coord.publish(2, [1, 2, 3, 4, 5, 6], 2)
    before = canonical(coord)
    faults.armed.add(point)
    with pytest.raises(OSError):
        coord.publish(2, [1, 2, 3, 4, 5, 6], 6, checkpoint=True)  # evicts [7,7]'s checkpoint on the way
    assert canonical(coord) == before
    coord.check_integrity()
    faults.armed.clear()
    assert coord.publish(2, [1, 2, 3, 4, 5, 6], 6, checkpoint=True).ops == (SaveCheckpoint(0, 1, 6),)
    coord.check_integrity()


def decode(coord, rid, tokens, upto, rolling=True):
    """A running request computes up to `upto` in its own transaction, then checkpoints there."""
    with coord.begin(rid) as txn:
        txn.reserve(tokens=upto - coord.requests[rid].cursor)
        txn.commit()
    published = coord.publish(rid, tokens, upto, checkpoint=True, rolling=rolling)
    coord.check_integrity()
    return published.ops


def checkpoints(coord):
    """{depth: slot} of every checkpoint in the tree."""
    return {n.depth: n.checkpoint.slot for n in coord.tree.nodes() if n.checkpoint is not None}


TURN = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]  # prompt [1..5], then decoded tokens


def prompt_checkpointed(coord, rid=1):
    """Request `rid` (live slot 0) prefilled TURN[:5] and checkpointed its prompt at 4 in slot 1."""
    with coord.begin(rid) as txn:
        txn.match(TURN[:5])
        txn.reserve(tokens=4, state_slots=1)
        txn.commit()
    assert coord.publish(rid, TURN, 4, checkpoint=True).ops == (SaveCheckpoint(0, 1, 4),)


def test_a_rolling_checkpoint_moves_its_slot_to_each_new_boundary():
    coord = hybrid(slots=4)
    prompt_checkpointed(coord)
    assert decode(coord, 1, TURN, 6) == (SaveCheckpoint(0, 2, 6),)  # the first one takes a fresh slot
    assert decode(coord, 1, TURN, 8) == (SaveCheckpoint(0, 2, 8),)  # then it moves: same slot, new length
    assert decode(coord, 1, TURN, 10) == (SaveCheckpoint(0, 2, 10),)
    assert checkpoints(coord) == {4: 1, 10: 2} and coord.state_slots.free_ids() == [3]
    coord.release(1)  # the finish leaves the rolling one as an ordinary checkpoint
    assert checkpoints(coord) == {4: 1, 10: 2}
    hit, grant, _ = run(coord, 2, TURN[:10] + [50], state_slots=1, publish=False)
    assert hit.checkpoint == CheckpointRef(2, None, 10)  # the next turn hits where the last one ended
    assert grant.ops == (RestoreCheckpoint(2, 0, 10),)


def test_a_pinned_rolling_checkpoint_stays_and_a_fresh_slot_rolls_on():
    coord = hybrid(slots=6)
    prompt_checkpointed(coord)
    decode(coord, 1, TURN, 6)  # rolling at 6 in slot 2
    hit, grant, _ = run(coord, 2, TURN[:6] + [60], state_slots=1, publish=False)
    assert hit.length == 6 and grant.ops == (RestoreCheckpoint(2, 3, 6),)  # may still be copying slot 2
    assert decode(coord, 1, TURN, 8) == (SaveCheckpoint(0, 4, 8),)
    assert checkpoints(coord) == {4: 1, 6: 2, 8: 4}
    coord.release(2)  # slot 2 is unpinned, but it is no longer request 1's rolling checkpoint
    assert decode(coord, 1, TURN, 10) == (SaveCheckpoint(0, 4, 10),)
    assert checkpoints(coord) == {4: 1, 6: 2, 10: 4}


def test_a_tier_hold_keeps_the_rolling_checkpoint_in_place():
    coord = hybrid(slots=4)
    prompt_checkpointed(coord)
    decode(coord, 1, TURN, 6)
    hold = coord.hold(1)  # a tier copies slot 2 out
    assert hold.checkpoint.slot == 2
    assert decode(coord, 1, TURN, 8) == (SaveCheckpoint(0, 3, 8),)
    coord.unhold(hold)
    assert checkpoints(coord) == {4: 1, 6: 2, 8: 3}
    coord.check_integrity()


def test_an_interval_checkpoint_takes_the_rolling_slot_for_good():
    coord = hybrid(slots=4)
    prompt_checkpointed(coord)
    decode(coord, 1, TURN, 6)
    assert decode(coord, 1, TURN, 8, rolling=False) == (SaveCheckpoint(0, 2, 8),)
    assert coord.requests[1].rolling is None
    assert decode(coord, 1, TURN, 10) == (SaveCheckpoint(0, 3, 10),)  # no rolling one left: a fresh slot
    assert decode(coord, 1, TURN, 12) == (SaveCheckpoint(0, 3, 12),)
    assert checkpoints(coord) == {4: 1, 8: 2, 12: 3}


def test_an_evicted_rolling_checkpoint_is_replaced_by_a_fresh_one():
    coord = hybrid(slots=4)
    prompt_checkpointed(coord)
    decode(coord, 1, TURN, 6)
    assert coord.evict(checkpoints=2) == Evicted(pages=0, checkpoints=2)  # the prompt's (LRU), then slot 2
    assert coord.state_slots.free_ids() == [2, 1, 3]
    assert decode(coord, 1, TURN, 8) == (SaveCheckpoint(0, 2, 8),)
    assert checkpoints(coord) == {8: 2}


def test_a_rolling_checkpoint_outlives_a_pause():
    coord = hybrid(slots=4)
    prompt_checkpointed(coord)
    decode(coord, 1, TURN, 6)
    coord.pause(1)
    hit, grant, _ = run(coord, 1, TURN[:7], state_slots=1, publish=False)  # resumes from its own checkpoint
    assert hit.length == 6 and grant.ops == (RestoreCheckpoint(2, 0, 6),)
    assert decode(coord, 1, TURN, 8) == (SaveCheckpoint(0, 2, 8),)  # published deeper: unpinned, so it moves
    assert checkpoints(coord) == {4: 1, 8: 2}


@pytest.mark.parametrize("point", ["publish.inserted", "publish.checkpointed"])
def test_a_failure_mid_publish_leaves_the_rolling_checkpoint_where_it_was(point):
    faults = Faults()
    coord = hybrid(slots=4, fault=faults)
    prompt_checkpointed(coord)
    decode(coord, 1, TURN, 6)
    with coord.begin(1) as txn:
        txn.reserve(tokens=2)
        txn.commit()
    before = canonical(coord)
    faults.armed.add(point)
    with pytest.raises(OSError):
        coord.publish(1, TURN, 8, checkpoint=True, rolling=True)
    assert canonical(coord) == before and checkpoints(coord) == {4: 1, 6: 2}
    assert coord.requests[1].rolling.length == 6
    coord.check_integrity()
    faults.armed.clear()
    assert coord.publish(1, TURN, 8, checkpoint=True, rolling=True).ops == (SaveCheckpoint(0, 2, 8),)
    coord.check_integrity()


def test_rolling_needs_a_checkpoint():
    coord = hybrid()
    run(coord, 1, [1, 2, 3, 4], state_slots=1, publish=False)
    with pytest.raises(ValueError, match="rolling=True needs checkpoint=True"):
        coord.publish(1, [1, 2, 3, 4], 4, rolling=True)


def cyclic_garbage() -> list:
    """What only the cycle collector would free now (DEBUG_SAVEALL keeps it in gc.garbage for a look)."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        return list(gc.garbage)
    finally:
        gc.garbage.clear()
        gc.set_debug(0)


def test_evicted_nodes_and_their_checkpoints_are_freed_at_once():
    """An evicted leaf and its checkpoint must not refer to each other: such a pair, with the token
    ids of its key, waits for a full collection, which a process with a big heap runs rarely (the
    router's RSS grew under the soak that way)."""
    coord = hybrid(pages=6, slots=4)
    gc.collect()
    gc.disable()  # only reference counting frees anything until the census
    try:
        for rid in range(1, 9):  # 2 pages each: from the 4th on, every admission evicts a leaf
            run(coord, rid, [rid] * 4, state_slots=1, checkpoint=True)
            coord.release(rid)
        assert coord.flush() == Evicted(pages=6, checkpoints=3)  # the last three, each at its checkpoint
        left = [type(o).__name__ for o in cyclic_garbage() if isinstance(o, (Node, Checkpoint))]
    finally:
        gc.enable()
    assert left == []
