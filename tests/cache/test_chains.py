"""ChainIndex: leaves in usable-prefix order, waiting children, reachable counts, and a random-sequence machine."""

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hkv.cache.chains import ChainIndex

ROOT = b"R" * 16


def key(i: int) -> bytes:
    return bytes([0xA0 + i]) + i.to_bytes(15, "little")


def chain(index: ChainIndex, ids: list[int], checkpoints=()) -> None:
    parent = ROOT
    for i in ids:
        if key(i) not in index:
            index.add(key(i), parent, checkpoint=i in checkpoints)
        parent = key(i)
    index.check()


def drain(index: ChainIndex) -> list[int]:
    """Give up every key in victim order."""
    order = []
    while (k := index.victim()) is not None:
        index.remove(k)
        index.check()
        order.append(int.from_bytes(k[1:], "little"))
    return order


def test_only_leaves_go_least_recently_used_first():
    index = ChainIndex(ROOT, checkpoints=False)
    chain(index, [0, 1, 2])
    chain(index, [3, 4])
    chain(index, [0, 1, 5])  # shares 0 and 1 with the first chain
    assert drain(index) == [2, 4, 3, 5, 1, 0]


def test_touch_moves_a_leaf_back():
    index = ChainIndex(ROOT, checkpoints=False)
    chain(index, [0, 1])
    chain(index, [2])
    index.touch(key(1))
    assert drain(index) == [2, 1, 0]


def test_a_key_used_again_outlives_keys_used_once():
    """LRU-2: a prefix that is hit survives a stream of one-time chains stored after it."""
    index = ChainIndex(ROOT, checkpoints=False)
    chain(index, [0])
    index.touch(key(0))  # hit once
    chain(index, [1])
    chain(index, [2])
    index.touch(key(2))  # hit after 0 was: its use before last (its store) is later than 0's
    chain(index, [3])
    assert drain(index) == [1, 3, 0, 2]


def test_with_checkpoints_a_leaf_without_one_goes_first():
    index = ChainIndex(ROOT, checkpoints=True)
    chain(index, [0, 1, 2], checkpoints={1})  # page 2 lies beyond the chain's deepest checkpoint
    chain(index, [3], checkpoints={3})
    assert drain(index) == [2, 1, 0, 3]


def test_a_key_of_unknown_parent_ranks_by_use_alone():
    index = ChainIndex(ROOT, checkpoints=True)
    index.add(key(0), None)  # a disk file found at start-up
    chain(index, [1, 2], checkpoints={1})
    assert drain(index) == [2, 0, 1]


def test_unevictable_keys_stay():
    index = ChainIndex(ROOT, checkpoints=False)
    chain(index, [0, 1])
    index.set_evictable(key(1), False)
    assert index.victim() is None
    index.set_evictable(key(1), True)
    assert drain(index) == [1, 0]


def test_reachable_counts_rooted_present_keys_above_a_checkpoint():
    index = ChainIndex(ROOT, checkpoints=True)
    chain(index, [0, 1, 2], checkpoints={1})
    assert index.reachable == 2  # page 2 is beyond the deepest checkpoint
    index.set_checkpoint(key(2), True)
    assert index.reachable == 3
    index.add(key(5), key(4), checkpoint=True)  # its parent is not held: it waits
    assert index.reachable == 3 and not index.links[key(5)].rooted
    index.add(key(4), key(2), present=False)
    assert index.reachable == 4 and index.links[key(5)].rooted  # 5 adopted; 4 is not there yet
    index.set_present(key(4))
    assert index.reachable == 5
    index.check()
    index.remove(key(2))  # a hole: 4 and 5 wait for it again
    assert index.reachable == 2 and not index.links[key(4)].rooted
    index.check()


def test_a_parent_learned_later_roots_a_subtree():
    index = ChainIndex(ROOT, checkpoints=True)
    chain(index, [0], checkpoints={0})
    index.add(key(1), None)
    index.add(key(2), key(1), checkpoint=True)
    assert index.reachable == 1
    index.set_parent(key(1), key(0))
    index.set_parent(key(1), key(7))  # a known parent stays
    assert index.reachable == 3 and index.links[key(1)].parent == key(0)
    index.check()


def test_a_loop_is_refused():
    index = ChainIndex(ROOT, checkpoints=False)
    index.add(key(0), None)
    index.add(key(1), key(0))
    index.set_parent(key(0), key(1))  # would make 0 its own ancestor
    assert index.links[key(0)].parent is None
    with pytest.raises(ValueError, match="held already"):
        index.add(key(1), ROOT)
    index.check()


IDS = st.integers(0, 7)


class ChainMachine(RuleBasedStateMachine):
    """Random adds (any parent), removals, checkpoint and pin changes; check() recomputes everything."""

    def __init__(self):
        super().__init__()
        self.index = ChainIndex(ROOT, checkpoints=True)

    @rule(i=IDS, parent=st.one_of(st.none(), st.just(-1), IDS), checkpoint=st.booleans(), present=st.booleans())
    def add(self, i, parent, checkpoint, present):
        if key(i) in self.index:
            return
        p = None if parent is None else ROOT if parent < 0 else key(parent)
        self.index.add(key(i), p, checkpoint=checkpoint, present=present)

    @precondition(lambda self: self.index.links)
    @rule(data=st.data())
    def remove(self, data):
        self.index.remove(data.draw(st.sampled_from(sorted(self.index.links))))

    @precondition(lambda self: self.index.links)
    @rule(data=st.data(), held=st.booleans(), evictable=st.booleans())
    def flags(self, data, held, evictable):
        k = data.draw(st.sampled_from(sorted(self.index.links)))
        self.index.set_checkpoint(k, held)
        self.index.set_evictable(k, evictable)
        self.index.set_present(k)
        self.index.touch(k)

    @precondition(lambda self: self.index.links)
    @rule(data=st.data(), parent=IDS)
    def set_parent(self, data, parent):
        self.index.set_parent(data.draw(st.sampled_from(sorted(self.index.links))), key(parent))

    @rule()
    def evict(self):
        victim = self.index.victim()
        if victim is not None:
            link = self.index.links[victim]
            assert link.evictable and not link.children
            self.index.remove(victim)

    @invariant()
    def books(self):
        self.index.check()


TestChainMachine = ChainMachine.TestCase
TestChainMachine.settings = settings(
    max_examples=100, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
