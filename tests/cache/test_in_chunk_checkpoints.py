"""In-chunk checkpoints in the coordinator: reserve(checkpoints=...) takes one state slot per depth,
pending until publish attaches it there (no copy); exact slot ids, eviction, rollback, release."""

import pytest

from hkv.cache import CacheCoordinator, CacheSpec, CapacityError, CheckpointRef, SaveCheckpoint
from tests.cache.snapshot import canonical
from tests.cache.test_coordinator import Faults, hybrid

TOKENS = list(range(1, 13))  # 12 tokens, pages of 2


def checkpoints(coord) -> dict[int, int]:
    """{depth: state slot} of every checkpoint in the tree."""
    return {n.depth: n.checkpoint.slot for n in coord.tree.nodes() if n.checkpoint is not None}


def admit(coord, rid, tokens, depths, slots=1):
    with coord.begin(rid) as txn:
        hit = txn.match(tokens)
        txn.reserve(tokens=len(tokens) - hit.length, state_slots=slots, checkpoints=depths)
        grant = txn.commit()
    coord.check_integrity()
    return grant


def test_reserved_slots_are_granted_shallowest_first_and_attached_by_one_publish():
    coord = hybrid(pages=12, slots=5)
    grant = admit(coord, 1, TOKENS[:9], (4, 8))
    assert grant.state_slots == (0,)
    assert grant.checkpoints == (CheckpointRef(1, None, 4), CheckpointRef(2, None, 8))
    assert coord.requests[1].pending == {4: 1, 8: 2}
    published = coord.publish(1, TOKENS[:9], 9)  # aligned to 8: both attach, no copy op
    assert published.ops == () and published.cached_tokens == 8 and published.inserted_tokens == 8
    assert checkpoints(coord) == {4: 1, 8: 2} and coord.requests[1].pending == {}
    coord.check_integrity()
    # a later request hits the deepest one before its end and restores from slot 2
    hit = admit(coord, 2, TOKENS[:8] + [50, 51], ())
    assert hit.cached_tokens == 8 and [(op.src_slot, op.length) for op in hit.ops] == [(2, 8)]


def test_publishing_each_depth_then_the_chunk_end_keeps_the_usual_save():
    coord = hybrid(pages=12, slots=5)
    admit(coord, 1, TOKENS[:10], (4, 8))
    assert coord.publish(1, TOKENS, 4).ops == ()
    assert checkpoints(coord) == {4: 1}
    assert coord.publish(1, TOKENS, 8).ops == ()
    (save,) = coord.publish(1, TOKENS, 10, checkpoint=True).ops
    assert save == SaveCheckpoint(0, 3, 10)  # the chunk end: a fresh slot, copied from the live one
    assert checkpoints(coord) == {4: 1, 8: 2, 10: 3}
    coord.check_integrity()


def test_a_depth_with_a_checkpoint_already_gives_its_slot_back():
    coord = hybrid(pages=12, slots=6)
    first = admit(coord, 1, TOKENS[:6], (4,))
    second = admit(coord, 2, TOKENS[:6], (4,))  # the same prompt, computed side by side
    assert [c.slot for c in first.checkpoints + second.checkpoints] == [1, 3]
    coord.publish(1, TOKENS, 6)
    coord.publish(2, TOKENS, 6)  # the first publish won: slot 3 goes back to the pool
    assert checkpoints(coord) == {4: 1} and 3 in coord.state_slots.free_ids()
    assert coord.requests[2].pending == {}
    coord.check_integrity()


def test_short_slots_raise_having_changed_nothing_and_fewer_fit():
    coord = hybrid(pages=12, slots=3)
    txn = coord.begin(1)
    txn.match(TOKENS[:11])
    txn.reserve(tokens=11, state_slots=1)
    before = canonical(coord)
    with pytest.raises(CapacityError) as err:
        txn.reserve(checkpoints=(4, 6, 8))
    assert err.value.needed == 3 and canonical(coord) == before and txn.open
    txn.reserve(checkpoints=(6, 8))  # the deepest two: what the scheduler retries with
    assert txn.commit().checkpoints == (CheckpointRef(1, None, 6), CheckpointRef(2, None, 8))
    coord.check_integrity()


def test_reserving_evicts_the_least_recently_used_checkpoints():
    coord = hybrid(pages=12, slots=3)
    admit(coord, 1, TOKENS[:5], (2,))
    coord.publish(1, TOKENS, 5)
    coord.release(1)
    assert checkpoints(coord) == {2: 1}
    assert coord.state_slots.free_ids() == [0, 2]
    grant = admit(coord, 2, [7] * 9, (4, 8))  # 3 slots: evicts the one at 2, the pool then hands out 1, 0, 2
    assert grant.state_slots == (1,) and [c.slot for c in grant.checkpoints] == [0, 2]
    assert checkpoints(coord) == {}


def test_rollback_release_and_pause_give_pending_slots_back():
    coord = hybrid(pages=12, slots=4)
    before = canonical(coord)
    txn = coord.begin(1)
    txn.match(TOKENS[:9])
    txn.reserve(tokens=9, state_slots=1, checkpoints=(4, 8))
    coord.check_integrity(allow_open_transaction=True)
    txn.rollback()
    assert canonical(coord) == before
    admit(coord, 1, TOKENS[:9], (4, 8))
    coord.release(1)
    assert coord.state_slots.free_count == 4
    admit(coord, 2, TOKENS[:9], (2, 6))
    coord.pause(2)
    assert coord.state_slots.free_count == 4 and coord.requests[2].pending == {}
    coord.check_integrity()


@pytest.mark.parametrize("point", ["publish.inserted", "publish.checkpointed"])
def test_a_failure_mid_publish_keeps_the_checkpoints_pending(point):
    faults = Faults()
    coord = CacheCoordinator(CacheSpec(2, 12, 4, 0, True, 4, True), fault=faults)
    admit(coord, 1, TOKENS[:9], (4, 8))
    before = canonical(coord)
    faults.armed.add(point)
    with pytest.raises(OSError):
        coord.publish(1, TOKENS, 9)
    assert canonical(coord) == before and coord.requests[1].pending == {4: 1, 8: 2}
    faults.armed.clear()
    coord.publish(1, TOKENS, 9)
    assert checkpoints(coord) == {4: 1, 8: 2}
    coord.check_integrity()


def test_checkpoint_depths_must_lie_inside_the_step():
    coord = hybrid(pages=12, slots=4, windows=1)
    admit(coord, 1, TOKENS[:4], ())
    coord.publish(1, TOKENS, 4)
    for depths in ((4,), (8,), (6, 6), (7,), (8, 6)):
        with coord.begin(1) as txn:
            with pytest.raises(ValueError, match="checkpoints"):
                txn.reserve(tokens=4, checkpoints=depths)
    with coord.begin(2) as txn:
        with pytest.raises(ValueError, match="draft window"):
            txn.reserve(tokens=6, state_slots=1, window_slots=1, checkpoints=(2,))
    dense = CacheCoordinator(CacheSpec(2, 8, 0, 0, False, None, True))
    with dense.begin(1) as txn:
        with pytest.raises(ValueError, match="hybrid"):
            txn.reserve(tokens=6, checkpoints=(2,))
    coord.check_integrity()
