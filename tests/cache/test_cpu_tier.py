"""CpuTier: exact entry ids, LRU eviction of pages and of states, pins, and a random-sequence machine."""

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hkv.cache.cpu_tier import CpuTier


def key(i: int) -> bytes:
    return bytes([0xC0 + i]) + i.to_bytes(15, "little")


def stored(tier: CpuTier, i: int, state: bool = False):
    """reserve + (reserve_state) + fill + unpin: a valid, evictable entry for key(i)."""
    entry = tier.reserve(key(i))
    assert entry is not None
    tier.check()
    if state:
        assert tier.reserve_state(entry) is not None
        tier.check()
        assert entry.checkpoint is None  # reserved, contents not there yet
    tier.fill(entry)
    tier.check()
    assert entry.checkpoint == entry.state  # fill makes a reserved state valid with its page
    tier.unpin(entry)
    tier.check()
    return entry


def test_entry_counts_must_not_be_negative():
    with pytest.raises(ValueError, match=">= 0"):
        CpuTier(-1, 0)
    with pytest.raises(ValueError, match=">= 0"):
        CpuTier(0, -1)


def test_reserve_hands_out_lowest_ids_first_pinned_and_invalid():
    tier = CpuTier(3, 2)
    entries = [tier.reserve(key(i)) for i in range(3)]
    tier.check()
    assert [e.page for e in entries] == [0, 1, 2]
    for i, e in enumerate(entries):
        assert (e.key, e.pins, e.valid, e.state) == (key(i), 1, False, None)
        assert tier.get(key(i)) is None  # reserved: not readable yet
        assert tier.entries[key(i)] is e
    assert tier.free_pages == 0
    # every entry is reserved: none can be evicted
    assert tier.reserve(key(3)) is None
    tier.check()
    assert key(3) not in tier.entries and tier.counters.evicted_pages == 0


def test_reserve_of_a_present_key_raises():
    tier = CpuTier(2, 0)
    tier.reserve(key(0))
    with pytest.raises(ValueError, match="already in the CPU tier"):
        tier.reserve(key(0))
    tier.check()
    stored(tier, 1)
    with pytest.raises(ValueError, match="already in the CPU tier"):
        tier.reserve(key(1))
    tier.check()


def test_zero_entries_refuse_everything():
    tier = CpuTier(0, 0)
    assert tier.reserve(key(0)) is None
    tier.check()
    tier = CpuTier(1, 0)
    entry = tier.reserve(key(0))
    assert tier.reserve_state(entry) is None
    tier.check()


def test_fill_makes_valid_and_unpin_makes_evictable():
    tier = CpuTier(2, 0)
    entry = tier.reserve(key(0))
    tier.fill(entry)
    tier.check()
    assert tier.get(key(0)) is entry and entry.valid and entry.pins == 1
    assert tier.usage()["pages"] == {"total": 2, "free": 1, "cached": 0, "in_use": 1}
    tier.unpin(entry)
    tier.check()
    assert entry.pins == 0
    assert tier.usage()["pages"] == {"total": 2, "free": 1, "cached": 1, "in_use": 0}


def test_unpin_of_an_unpinned_entry_raises():
    tier = CpuTier(1, 0)
    entry = stored(tier, 0)
    with pytest.raises(ValueError, match="unpin of an unpinned entry"):
        tier.unpin(entry)
    tier.check()


def test_free_list_reuses_the_most_recently_freed_id():
    tier = CpuTier(4, 0)
    a, b = tier.reserve(key(0)), tier.reserve(key(1))
    tier.drop(a)
    tier.check()
    tier.drop(b)
    tier.check()
    assert tier.free_pages == 4
    # freed ids go on top of the free stack: the last one freed comes first
    assert [tier.reserve(key(i)).page for i in (2, 3, 4, 5)] == [1, 0, 2, 3]
    tier.check()


def test_page_eviction_is_least_recently_unpinned_first():
    tier = CpuTier(3, 0)
    for i in range(3):
        stored(tier, i)  # unpinned in order 0, 1, 2
    for new, gone in ((3, 0), (4, 1), (5, 2)):
        entry = tier.reserve(key(new))  # stays reserved: the next reserve must evict an old one
        tier.check()
        assert entry.page == gone  # the evicted entry's page id
        assert key(gone) not in tier.entries and tier.get(key(gone)) is None
        assert all(key(i) in tier.entries for i in range(gone + 1, 3))
    assert tier.counters.evicted_pages == 3
    assert tier.reserve(key(6)) is None  # 3, 4, 5 are reserved
    tier.check()


def test_touch_and_repin_move_an_entry_to_the_recent_end():
    tier = CpuTier(3, 0)
    e0, e1, e2 = (stored(tier, i) for i in range(3))
    tier.touch(e0)  # order: 1, 2, 0
    tier.check()
    tier.pin(e1)
    tier.check()
    tier.unpin(e1)  # order: 2, 0, 1
    tier.check()
    order = []
    for new in (10, 11, 12):
        entry = tier.reserve(key(new))
        tier.check()
        order += [e.key for e in (e0, e1, e2) if e.key not in tier.entries and e.key not in order]
        tier.fill(entry)
        tier.check()
    assert order == [key(2), key(0), key(1)]


def test_touch_of_a_pinned_entry_changes_nothing():
    tier = CpuTier(2, 0)
    e0 = stored(tier, 0)
    stored(tier, 1)
    tier.pin(e0)
    tier.touch(e0)
    tier.check()
    tier.unpin(e0)  # now most recent: 1, 0
    tier.check()
    tier.reserve(key(2))
    tier.check()
    assert key(1) not in tier.entries and tier.entries[key(0)] is e0


def test_pins_nest_and_a_pinned_entry_is_never_evicted():
    tier = CpuTier(2, 0)
    e0, e1 = stored(tier, 0), stored(tier, 1)
    tier.pin(e0)
    tier.pin(e0)
    tier.unpin(e0)
    tier.check()
    assert e0.pins == 1
    assert tier.reserve(key(2)).page == e1.page  # e1 goes, e0 stays
    tier.check()
    assert tier.reserve(key(3)) is None
    tier.check()
    assert tier.entries[key(0)] is e0 and tier.get(key(0)) is e0


def test_reserve_state_needs_a_pinned_entry_without_a_state():
    tier = CpuTier(2, 2)
    entry = stored(tier, 0)
    with pytest.raises(ValueError, match="needs the entry pinned"):
        tier.reserve_state(entry)
    tier.pin(entry)
    assert tier.reserve_state(entry) == 0
    tier.check()
    with pytest.raises(ValueError, match="already has a state"):
        tier.reserve_state(entry)
    tier.unpin(entry)
    tier.check()
    assert tier.usage()["states"] == {"total": 2, "free": 1, "cached": 1, "in_use": 0}


def test_a_state_reserved_for_a_valid_page_is_usable_only_once_filled():
    tier = CpuTier(2, 2)
    entry = stored(tier, 0)
    assert entry.checkpoint is None
    with pytest.raises(ValueError, match="no state entry to fill"):
        tier.fill_state(entry)
    tier.pin(entry)
    assert tier.reserve_state(entry) == 0
    tier.check()
    assert (entry.state, entry.checkpoint) == (0, None)
    tier.fill_state(entry)
    tier.check()
    assert entry.checkpoint == 0
    tier.unpin(entry)
    tier.check()
    assert tier.usage()["states"] == {"total": 2, "free": 1, "cached": 1, "in_use": 0}


def test_losing_a_state_makes_the_checkpoint_unusable():
    tier = CpuTier(3, 1)
    e0 = stored(tier, 0, state=True)
    e1 = tier.reserve(key(1))
    assert tier.reserve_state(e1) == 0  # evicts e0's state
    tier.check()
    assert (e0.state, e0.checkpoint) == (None, None) and e1.checkpoint is None
    tier.drop_state(e1)
    tier.check()
    assert (e1.state, e1.checkpoint) == (None, None)
    tier.reserve_state(e1)
    tier.fill(e1)
    assert e1.checkpoint == 0
    tier.drop(e1)
    tier.check()
    assert (e1.state, e1.checkpoint, e1.valid) == (None, None, False)


def test_state_eviction_is_lru_and_keeps_the_page():
    tier = CpuTier(4, 2)
    e0, e1 = stored(tier, 0, state=True), stored(tier, 1, state=True)
    assert (e0.state, e1.state) == (0, 1)
    tier.touch(e0)  # state order: 1, 0
    e2 = tier.reserve(key(2))
    assert tier.reserve_state(e2) == 1
    tier.check()
    assert e1.state is None and tier.get(key(1)) is e1  # the page stays cached
    assert tier.counters.evicted_states == 1 and tier.counters.evicted_pages == 0
    e3 = tier.reserve(key(3))
    assert tier.reserve_state(e3) == 0
    tier.check()
    assert e0.state is None
    # both states are pinned by reservations now
    tier.pin(e0)
    assert tier.reserve_state(e0) is None
    tier.check()
    tier.unpin(e0)
    tier.check()


def test_page_eviction_frees_its_state_too():
    tier = CpuTier(1, 1)
    stored(tier, 0, state=True)
    e1 = tier.reserve(key(1))
    tier.check()
    assert e1.page == 0 and key(0) not in tier.entries
    assert tier.free_states == 1 and tier.counters.evicted_states == 1 and tier.counters.evicted_pages == 1
    assert tier.reserve_state(e1) == 0
    tier.check()


def test_a_pinned_entrys_state_is_never_evicted():
    tier = CpuTier(3, 1)
    e0 = stored(tier, 0, state=True)
    tier.pin(e0)
    e1 = tier.reserve(key(1))
    assert tier.reserve_state(e1) is None
    tier.check()
    assert e0.state == 0
    tier.unpin(e0)
    assert tier.reserve_state(e1) == 0
    tier.check()
    assert e0.state is None


def test_drop_frees_page_and_state_and_forgets_the_key():
    tier = CpuTier(2, 2)
    entry = tier.reserve(key(0))
    tier.reserve_state(entry)
    tier.drop(entry)
    tier.check()
    assert key(0) not in tier.entries and (tier.free_pages, tier.free_states) == (2, 2)
    assert entry.state is None and not entry.valid
    # a later unpin of the dropped entry does not bring it back
    tier.unpin(entry)
    tier.check()
    assert key(0) not in tier.entries


def test_drop_of_a_valid_evictable_entry():
    tier = CpuTier(2, 1)
    entry = stored(tier, 0, state=True)
    tier.drop(entry)
    tier.check()
    assert tier.usage() == {
        "pages": {"total": 2, "free": 2, "cached": 0, "in_use": 0},
        "states": {"total": 1, "free": 1, "cached": 0, "in_use": 0},
    }


def test_unpin_of_a_dropped_entry_leaves_a_new_entry_of_the_same_key_alone():
    tier = CpuTier(2, 0)
    old = tier.reserve(key(0))
    tier.drop(old)
    new = tier.reserve(key(0))
    tier.unpin(old)
    tier.check()
    assert tier.entries[key(0)] is new and new.pins == 1 and not new.valid


def test_drop_state_keeps_the_page():
    tier = CpuTier(2, 2)
    entry = stored(tier, 0)
    tier.pin(entry)
    assert tier.reserve_state(entry) == 0
    tier.drop_state(entry)
    tier.check()
    assert entry.state is None and tier.free_states == 2 and tier.get(key(0)) is entry
    tier.drop_state(entry)  # no state: nothing happens
    tier.check()
    tier.unpin(entry)
    tier.check()
    # on an evictable entry, it leaves the state LRU too
    tier.pin(entry)
    tier.reserve_state(entry)
    tier.unpin(entry)
    tier.drop_state(entry)
    tier.check()
    assert tier.usage()["states"] == {"total": 2, "free": 2, "cached": 0, "in_use": 0}


def test_flush_drops_only_valid_unpinned_entries():
    tier = CpuTier(5, 3)
    stored(tier, 0, state=True)
    stored(tier, 1)
    pinned = stored(tier, 2, state=True)
    tier.pin(pinned)
    reserved = tier.reserve(key(3))
    tier.reserve_state(reserved)
    assert tier.flush() == (2, 1)
    tier.check()
    assert sorted(tier.entries) == [key(2), key(3)]
    assert tier.usage() == {
        "pages": {"total": 5, "free": 3, "cached": 0, "in_use": 2},
        "states": {"total": 3, "free": 1, "cached": 0, "in_use": 2},
    }
    assert tier.flush() == (0, 0)
    tier.check()


def test_usage_counts_reserved_and_pinned_as_in_use():
    tier = CpuTier(4, 2)
    stored(tier, 0, state=True)
    stored(tier, 1)
    tier.pin(tier.get(key(1)))
    tier.reserve(key(2))
    assert tier.usage() == {
        "pages": {"total": 4, "free": 1, "cached": 1, "in_use": 2},
        "states": {"total": 2, "free": 1, "cached": 1, "in_use": 0},
    }
    tier.check()


def test_check_names_a_broken_book():
    tier = CpuTier(2, 0)
    entry = stored(tier, 0)
    tier._free_pages.append(entry.page)
    with pytest.raises(AssertionError, match="page entries unbalanced"):
        tier.check()
    tier._free_pages.pop()
    tier._page_lru.pop(entry.key)
    with pytest.raises(AssertionError, match="page LRU differs"):
        tier.check()


KEYS = st.integers(0, 7)


class CpuTierMachine(RuleBasedStateMachine):
    """Entries the machine holds a pin on must stay put (same page, same state); check() after every step."""

    def __init__(self):
        super().__init__()
        self.tier = CpuTier(4, 2)
        self.mine: dict[bytes, list] = {}  # key -> [entry, pins we hold, page, state]

    def _held(self, reserved: bool | None = None) -> list[bytes]:
        keys = [k for k, (e, pins, _, _) in self.mine.items() if pins]
        if reserved is not None:
            keys = [k for k in keys if (not self.mine[k][0].valid) == reserved]
        return sorted(keys)

    def _stable(self, k: bytes) -> None:
        entry = self.mine[k][0]
        self.mine[k][2:] = [entry.page, entry.state]

    @rule(i=KEYS)
    def reserve(self, i):
        k, tier = key(i), self.tier
        if k in tier.entries:
            with pytest.raises(ValueError):
                tier.reserve(k)
            return
        free, evictable = tier.free_pages, len(tier._page_lru)
        entry = tier.reserve(k)
        if entry is None:
            assert free == 0 and evictable == 0, "reserve refused while an entry could go"
            return
        assert entry.pins == 1 and not entry.valid
        self.mine[k] = [entry, 1, None, None]
        self._stable(k)

    @precondition(lambda self: self._held(reserved=True))
    @rule(data=st.data())
    def fill(self, data):
        k = data.draw(st.sampled_from(self._held(reserved=True)))
        self.tier.fill(self.mine[k][0])

    @precondition(lambda self: self.mine)
    @rule(data=st.data())
    def pin(self, data):
        k = data.draw(st.sampled_from(sorted(self.mine)))
        entry = self.mine[k][0]
        if self.tier.entries.get(k) is not entry or not entry.valid:
            return  # evicted, or someone else's reservation
        self.tier.pin(entry)
        self.mine[k][1] += 1
        self._stable(k)

    @precondition(lambda self: self._held())
    @rule(data=st.data())
    def unpin(self, data):
        k = data.draw(st.sampled_from(self._held()))
        entry = self.mine[k][0]
        self.tier.unpin(entry)
        self.mine[k][1] -= 1
        if not entry.valid and entry.pins == 0:
            self.tier.drop(entry)  # an abandoned reservation is dropped, as the worker does
            del self.mine[k]

    @precondition(lambda self: self._held())
    @rule(data=st.data())
    def touch(self, data):
        self.tier.touch(self.mine[data.draw(st.sampled_from(sorted(self.mine)))][0])

    @precondition(lambda self: self._held())
    @rule(data=st.data())
    def reserve_state(self, data):
        k = data.draw(st.sampled_from(self._held()))
        entry = self.mine[k][0]
        if entry.state is not None:
            return
        free, evictable = self.tier.free_states, len(self.tier._state_lru)
        state = self.tier.reserve_state(entry)
        if state is None:
            assert free == 0 and evictable == 0, "reserve_state refused while a state could go"
        self._stable(k)

    @precondition(lambda self: self._held())
    @rule(data=st.data())
    def fill_state(self, data):
        k = data.draw(st.sampled_from(self._held()))
        entry = self.mine[k][0]
        if entry.state is None or not entry.valid:
            return
        self.tier.fill_state(entry)
        assert entry.checkpoint == entry.state

    @precondition(lambda self: self._held())
    @rule(data=st.data())
    def drop_state(self, data):
        k = data.draw(st.sampled_from(self._held()))
        self.tier.drop_state(self.mine[k][0])
        self._stable(k)

    @precondition(lambda self: self._held())
    @rule(data=st.data())
    def drop(self, data):
        k = data.draw(st.sampled_from(self._held()))
        self.tier.drop(self.mine.pop(k)[0])
        assert k not in self.tier.entries

    @rule()
    def flush(self):
        before = sum(1 for e in self.tier.entries.values() if e.valid and not e.pins)
        pages, _ = self.tier.flush()
        assert pages == before
        assert all(e.pins or not e.valid for e in self.tier.entries.values())

    @invariant()
    def books_balance(self):
        self.tier.check()
        usage = self.tier.usage()
        for kind in ("pages", "states"):
            u = usage[kind]
            assert u["free"] + u["cached"] + u["in_use"] == u["total"], usage

    @invariant()
    def a_checkpoint_is_a_present_state(self):
        for entry in self.tier.entries.values():
            assert entry.checkpoint is None or entry.checkpoint == entry.state
            assert entry.state is not None or not entry.state_valid

    @invariant()
    def pinned_and_reserved_entries_stay(self):
        for k, (entry, pins, page, state) in list(self.mine.items()):
            if pins:
                assert self.tier.entries.get(k) is entry, f"pinned entry {k.hex()} was evicted"
                assert (entry.page, entry.state) == (page, state), "a pinned entry's ids changed"
            elif self.tier.entries.get(k) is not entry:
                del self.mine[k]  # evicted or flushed: fine, it was not pinned

    def teardown(self):
        for k, (entry, pins, _, _) in list(self.mine.items()):
            for _ in range(pins):
                self.tier.unpin(entry)
            if not entry.valid and self.tier.entries.get(k) is entry:
                self.tier.drop(entry)
        self.tier.flush()
        self.tier.check()
        assert self.tier.entries == {} and self.tier.free_pages == 4 and self.tier.free_states == 2


TestCpuTierMachine = CpuTierMachine.TestCase
TestCpuTierMachine.settings = settings(
    max_examples=100, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
