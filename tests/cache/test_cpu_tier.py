"""CpuTier: exact unit and block ids, eviction by usable prefix, pruning at rest, compaction, pins and coverage."""

import pytest

from hkv.cache.cpu_tier import CpuTier

ROOT = bytes(16)


def key(i: int) -> bytes:
    return bytes([0xC0 + i]) + i.to_bytes(15, "little")


def parent_of(i: int, chain: list[int]) -> bytes:
    at = chain.index(i)
    return key(chain[at - 1]) if at else ROOT


class Tier:
    """A CpuTier and the moves its compaction asked for."""

    def __init__(self, units: int, state_units: int = 0):
        self.moves: list[tuple[int, int]] = []
        self.tier = CpuTier(units, state_units, ROOT, lambda src, dst: self.moves.append((src, dst)))


def make(units: int, state_units: int = 0) -> tuple[CpuTier, list[tuple[int, int]]]:
    made = Tier(units, state_units)
    return made.tier, made.moves


def store(tier: CpuTier, chain: list[int], checkpoints=(), upto: int | None = None) -> list:
    """A chain of pages (keys chain[0], chain[1], ...), a checkpoint after each page in `checkpoints`,
    stored as an offload does: reserve in chain order, fill, unpin deepest first. Only chain[:upto] is new."""
    new = []
    for i in chain[:upto]:
        if key(i) in tier.entries:
            continue
        entry = tier.reserve(key(i), parent_of(i, chain))
        assert entry is not None, f"no room for page {i}"
        if i in checkpoints:
            assert tier.reserve_state(entry) is not None, f"no room for the checkpoint after page {i}"
        new.append(entry)
    for entry in new:
        tier.fill(entry)
    for entry in reversed(new):
        tier.unpin(entry)
    tier.check()
    return new


def held(tier: CpuTier) -> list[int]:
    return sorted(int.from_bytes(k[1:], "little") for k in tier.entries)


def test_units_must_be_whole_blocks():
    with pytest.raises(ValueError, match="multiple of state_units"):
        make(-1)
    with pytest.raises(ValueError, match="multiple of state_units"):
        make(7, 3)
    tier, _ = make(6, 3)
    assert (tier.num_pages, tier.num_states, tier.free_pages, tier.free_states) == (6, 2, 6, 2)
    dense, _ = make(4)
    assert (dense.num_pages, dense.num_states, dense.checkpoints) == (4, 0, False)


def test_reserve_hands_out_units_in_order_pinned_and_invalid():
    tier, _ = make(3)
    entries = [tier.reserve(key(i), key(i - 1) if i else ROOT) for i in range(3)]
    assert [e.page for e in entries] == [0, 1, 2]
    for i, e in enumerate(entries):
        assert (e.key, e.pins, e.valid, e.state, e.anchored) == (key(i), 1, False, None, True)
        assert tier.get(key(i)) is None and tier.entries[key(i)] is e
    assert tier.free_pages == 0 and tier.reserve(key(3), key(2)) is None  # all reserved: none can go
    tier.check()
    assert key(3) not in tier.entries and tier.counters.evicted_pages == 0


def test_reserve_of_a_present_key_raises():
    tier, _ = make(2)
    tier.reserve(key(0), ROOT)
    with pytest.raises(ValueError, match="already in the CPU tier"):
        tier.reserve(key(0), ROOT)
    tier.check()


def test_zero_units_refuse_everything_and_a_dense_tier_has_no_states():
    tier, _ = make(0)
    assert tier.reserve(key(0), ROOT) is None
    dense, _ = make(1)
    assert dense.reserve_state(dense.reserve(key(0), ROOT)) is None
    dense.check()


def test_fill_makes_valid_and_unpin_makes_evictable():
    tier, _ = make(2)
    entry = tier.reserve(key(0), ROOT)
    tier.fill(entry)
    tier.check()
    assert tier.get(key(0)) is entry and tier.usage()["pages"] == {"total": 2, "free": 1, "cached": 0, "in_use": 1}
    tier.unpin(entry)
    tier.check()
    assert tier.usage()["pages"] == {"total": 2, "free": 1, "cached": 1, "in_use": 0}
    with pytest.raises(ValueError, match="unpin of an unpinned entry"):
        tier.unpin(entry)


def test_a_dense_tier_evicts_leaves_least_recently_used_chain_first():
    """Chain A (0-1-2) then chain B (3-4); each eviction takes a leaf, so A goes from its deep end first."""
    tier, _ = make(5)
    store(tier, [0, 1, 2])
    store(tier, [3, 4])
    order = []
    for new in range(10, 15):
        tier.reserve(key(new), ROOT)
        order += [i for i in (0, 1, 2, 3, 4) if key(i) not in tier.entries and i not in order]
    assert order == [2, 1, 0, 4, 3]
    assert tier.counters.evicted_pages == 5
    tier.check()


def test_commit_order_no_longer_makes_a_first_page_the_victim():
    """The old LRU unpinned a multi-page store first page first, so page 0 went first and the
    rest of its chain became unreachable; now only leaves go."""
    tier, _ = make(4)
    new = [tier.reserve(key(i), key(i - 1) if i else ROOT) for i in range(3)]
    for entry in new:
        tier.fill(entry)
    for entry in new:  # first page first, as the old commit did
        tier.unpin(entry)
    tier.reserve(key(9), ROOT)
    tier.reserve(key(10), ROOT)
    tier.check()
    assert held(tier) == [0, 1, 9, 10]


def test_touch_makes_a_chain_recent():
    tier, _ = make(5)
    store(tier, [0, 1, 2])
    store(tier, [3, 4])
    tier.touch(tier.entries[key(2)])  # a hit on chain A's leaf
    order = []
    for new in range(10, 15):
        tier.reserve(key(new), ROOT)
        order += [i for i in (0, 1, 2, 3, 4) if key(i) not in tier.entries and i not in order]
    assert order == [4, 3, 2, 1, 0]


def test_a_shared_prefix_stays_while_a_chain_below_it_does():
    """0-1-2 and 0-1-3 share pages 0 and 1: they go only after both tails."""
    tier, _ = make(4)
    store(tier, [0, 1, 2])
    store(tier, [0, 1, 3])
    order = []
    for new in range(10, 14):
        tier.reserve(key(new), ROOT)
        order += [i for i in (0, 1, 2, 3) if key(i) not in tier.entries and i not in order]
    assert order == [2, 3, 1, 0]


def test_pins_nest_and_a_pinned_entry_is_never_evicted():
    tier, _ = make(2)
    e0, e1 = store(tier, [0]) + store(tier, [1])
    tier.pin(e0)
    tier.pin(e0)
    tier.unpin(e0)
    assert e0.pins == 1 and tier.reserve(key(2), ROOT).page == e1.page  # e1 goes, e0 stays
    assert tier.reserve(key(3), ROOT) is None
    tier.check()
    assert tier.get(key(0)) is e0


def test_a_hybrid_eviction_gives_up_a_checkpoint_and_the_pages_back_to_the_one_before():
    """Chain 0..5, checkpoints after pages 2 and 5; a checkpoint takes one unit (k = 1)."""
    tier, _ = make(8, 1)
    store(tier, [0, 1, 2, 3, 4, 5], checkpoints={2, 5})
    assert [(tier.entries[key(i)].page, tier.entries[key(i)].state) for i in (2, 5)] == [(2, 3), (6, 7)]
    assert tier.free_pages == 0
    assert tier.reserve(key(9), ROOT).page == 4  # the most recently freed unit first
    tier.check()
    assert held(tier) == [0, 1, 2, 9]  # page 5's checkpoint went, and with it pages 5, 4, 3
    assert (tier.counters.evicted_states, tier.counters.evicted_pages) == (1, 3)
    assert tier.free_pages == 3 and tier.entries[key(2)].checkpoint == 3


def test_hybrid_pages_beyond_the_deepest_checkpoint_are_pruned_at_rest():
    tier, _ = make(6, 1)
    store(tier, [0, 1, 2], checkpoints={1})
    assert held(tier) == [0, 1] and tier.counters.pruned_pages == 1  # page 2 served no hit
    store(tier, [0, 1, 2, 3])  # no checkpoint at all past page 1
    assert held(tier) == [0, 1] and tier.counters.pruned_pages == 3
    store(tier, [4, 5])
    assert held(tier) == [0, 1]
    tier.check()


def test_losing_its_checkpoint_prunes_a_leaf_but_not_a_page_others_need():
    tier, _ = make(8, 1)
    store(tier, [0, 1, 2], checkpoints={1, 2})
    store(tier, [0, 1, 3], checkpoints={3})
    e1 = tier.entries[key(1)]
    tier.pin(e1)
    tier.drop_state(e1)  # page 1 keeps two chains below it
    tier.unpin(e1)
    tier.check()
    assert held(tier) == [0, 1, 2, 3] and e1.state is None
    e2 = tier.entries[key(2)]
    tier.pin(e2)
    tier.drop_state(e2)
    tier.unpin(e2)
    assert held(tier) == [0, 1, 3] and tier.counters.pruned_pages == 1
    tier.check()


def test_a_chain_with_a_hole_is_dropped_when_it_comes_to_rest():
    tier, _ = make(6, 1)
    a, b = tier.reserve(key(0), ROOT), tier.reserve(key(1), key(0))
    assert tier.reserve_state(b) is not None
    tier.fill(b)
    tier.drop(a)  # the copy of page 0 failed: page 1 now follows a hole
    tier.unpin(b)
    tier.check()
    assert tier.entries == {} and tier.counters.pruned_pages == 1


def test_a_page_that_came_without_its_parent_is_kept():
    """A disk read past the device's hit: the device (or the disk) holds its prefix."""
    tier, _ = make(4, 1)
    e5 = tier.reserve(key(5), key(4))  # page 4 is not in the CPU tier
    tier.reserve_state(e5)
    tier.fill(e5)
    tier.unpin(e5)
    tier.check()
    assert held(tier) == [5] and not e5.anchored and tier.coverage() == (1, 0)  # held, not reachable from here
    store(tier, [3, 4, 5], checkpoints={5}, upto=2)  # its prefix arrives: page 5 is reachable now
    assert held(tier) == [3, 4, 5] and tier.coverage() == (3, 3)


def scattered(tier: CpuTier) -> None:
    """Four blocks of three units. A (pages 0, 1 + checkpoint) and B (page 2 + checkpoint) fill blocks 0-2;
    C (page 3) opens block 3 and its checkpoint evicts A, which leaves block 0 with B's page alone:

        block 0 [ -  -  B2 ]   block 1 [ ckpt C ]   block 2 [ ckpt B ]   block 3 [ C3 -  - ]
    """
    store(tier, [0, 1], checkpoints={1})
    store(tier, [2], checkpoints={2})
    assert [tier.entries[key(i)].page for i in (0, 1, 2)] == [0, 1, 2]
    assert [tier.entries[key(i)].state for i in (1, 2)] == [1, 2]
    store(tier, [3], checkpoints={3})
    assert held(tier) == [2, 3] and tier.counters.evicted_states == 1 and tier.counters.evicted_pages == 2
    assert (tier.entries[key(3)].page, tier.entries[key(3)].state) == (9, 1)
    assert (tier.free_pages, tier.free_states) == (4, 0)


def test_compaction_moves_pages_out_of_a_block_for_a_checkpoint():
    tier, moves = make(12, 3)
    scattered(tier)
    store(tier, [4], checkpoints={4})  # page 4 fills unit 10; its checkpoint needs a whole block
    assert moves == [(2, 11)]  # block 0's only page moves to block 3's last free unit
    assert tier.entries[key(2)].page == 11 and tier.entries[key(4)].page == 10
    assert tier.entries[key(4)].state == 0
    assert held(tier) == [2, 3, 4] and tier.counters.moved_pages == 1 and tier.counters.evicted_states == 1
    tier.check()


def test_compaction_never_moves_a_pinned_page_and_evicts_instead():
    tier, moves = make(12, 3)
    scattered(tier)
    tier.pin(tier.entries[key(2)])  # a load of B is in flight
    store(tier, [4], checkpoints={4})
    assert moves == [] and held(tier) == [2, 4]  # C, the least recently used unpinned chain, went
    assert tier.entries[key(2)].page == 2 and tier.entries[key(4)].state == 1
    tier.check()


def test_make_room_fails_when_everything_left_is_pinned():
    tier, moves = make(6, 3)
    a = tier.reserve(key(0), ROOT)
    assert tier.reserve_state(a) == 1 and not tier.make_room(1, 1) and tier.make_room(2)
    assert tier.make_room(0, 0) and moves == []
    tier.check()


def test_reserve_state_needs_a_pinned_entry_without_a_state():
    tier, _ = make(4, 1)
    store(tier, [0, 1], checkpoints={1})
    with pytest.raises(ValueError, match="already has a state"):
        tier.reserve_state(tier.entries[key(1)])
    with pytest.raises(ValueError, match="needs the entry pinned"):
        tier.reserve_state(tier.entries[key(0)])
    tier.check()


def test_a_state_reserved_for_a_valid_page_is_usable_only_once_filled():
    tier, _ = make(4, 1)
    store(tier, [0, 1], checkpoints={1})
    entry = tier.entries[key(0)]
    with pytest.raises(ValueError, match="no state entry to fill"):
        tier.fill_state(entry)
    tier.pin(entry)
    assert tier.reserve_state(entry) == 3 and entry.checkpoint is None
    tier.fill_state(entry)
    assert entry.checkpoint == 3
    tier.unpin(entry)
    tier.check()
    assert tier.usage()["states"] == {"total": 2, "free": 0, "cached": 2, "in_use": 0}


def test_drop_frees_page_and_state_and_a_late_unpin_changes_nothing():
    tier, _ = make(2, 1)
    entry = tier.reserve(key(0), ROOT)
    tier.reserve_state(entry)
    tier.drop(entry)
    tier.check()
    assert tier.entries == {} and (tier.free_pages, tier.free_states) == (2, 2)
    tier.unpin(entry)
    new = tier.reserve(key(0), ROOT)
    tier.check()
    assert tier.entries[key(0)] is new and new.pins == 1


def test_flush_drops_what_no_pin_holds_at_or_below():
    tier, _ = make(8, 1)
    store(tier, [0, 1, 2], checkpoints={2})
    store(tier, [3, 4], checkpoints={4})
    tier.pin(tier.entries[key(4)])  # its chain (3, 4) stays
    reserved = tier.reserve(key(5), key(2))  # a store in flight below page 2
    assert tier.flush() == (0, 0)  # 0, 1, 2 are above the reservation: nothing is a free leaf
    tier.drop(reserved)
    tier.check()
    assert tier.flush() == (3, 1)
    assert held(tier) == [3, 4] and tier.usage()["pages"]["in_use"] == 1
    tier.check()


def test_usage_totals_follow_the_mix_of_pages_and_checkpoints():
    tier, _ = make(6, 2)
    assert tier.usage() == {"pages": {"total": 6, "free": 6, "cached": 0, "in_use": 0},
                            "states": {"total": 3, "free": 3, "cached": 0, "in_use": 0}}
    store(tier, [0, 1], checkpoints={1})
    tier.pin(tier.entries[key(1)])
    assert tier.usage() == {"pages": {"total": 4, "free": 2, "cached": 1, "in_use": 1},
                            "states": {"total": 2, "free": 1, "cached": 0, "in_use": 1}}
    for pool in tier.usage().values():
        assert pool["total"] == pool["free"] + pool["cached"] + pool["in_use"]
    tier.check()


def test_coverage_counts_held_pages_and_those_a_hit_could_reach():
    tier, _ = make(8, 1)
    store(tier, [0, 1, 2], checkpoints={2})
    assert tier.coverage() == (3, 3)
    reserved = [tier.reserve(key(3), key(2)), tier.reserve(key(4), key(3))]
    assert tier.coverage() == (3, 3)  # reserved pages are not there yet
    tier.reserve_state(reserved[1])
    for entry in reserved:
        tier.fill(entry)
    assert tier.coverage() == (5, 5)
    dense, _ = make(3)
    store(dense, [0, 1])
    assert dense.coverage() == (2, 2)


def test_check_names_a_broken_book():
    tier, _ = make(2)
    entry = store(tier, [0])[0]
    entry.pins = 1
    with pytest.raises(AssertionError, match="evictable is stale"):
        tier.check()
    entry.pins = 0
    tier.slab._free_blocks.append(entry.page)
    with pytest.raises(AssertionError, match="units unbalanced"):
        tier.check()
