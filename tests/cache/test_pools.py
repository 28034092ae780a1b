import pytest

from hkv.cache import CapacityError, PagePool, SlotPool


def test_fresh_pool_hands_out_lowest_ids_first():
    pool = PagePool(6, page_size=4)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(1) == [3]
    assert pool.free_count == 2
    assert pool.free_ids() == [4, 5]


def test_freed_ids_come_back_first_in_the_order_they_were_freed():
    pool = SlotPool("state_slots", 8)
    pool.allocate(5)
    pool.free([3, 1])
    assert pool.free_ids() == [3, 1, 5, 6, 7]
    assert pool.allocate(3) == [3, 1, 5]


def test_allocation_is_all_or_nothing():
    pool = PagePool(4, page_size=1)
    pool.allocate(2)
    before = pool.free_ids()
    with pytest.raises(CapacityError) as err:
        pool.allocate(3)
    assert (err.value.resource, err.value.needed, err.value.free) == ("pages", 3, 2)
    assert pool.free_ids() == before
    assert pool.allocate(0) == []


def test_unallocate_and_unfree_restore_the_hand_out_order_exactly():
    pool = PagePool(8, page_size=2)
    pool.allocate(4)
    pool.free([2, 0])
    before = pool.free_ids()  # [2, 0, 4, 5, 6, 7]
    ids = pool.allocate(4)  # two from the stack, two fresh
    assert ids == [2, 0, 4, 5]
    pool.unallocate(ids)
    assert pool.free_ids() == before
    pool.free([1, 3])
    pool.unfree([1, 3])
    assert pool.free_ids() == before
    assert pool.allocate(6) == before


def test_unfree_refuses_an_out_of_order_undo():
    pool = PagePool(4, page_size=1)
    pool.allocate(3)
    pool.free([0, 1])
    with pytest.raises(AssertionError):
        pool.unfree([1, 0])


def test_check_catches_a_double_free():
    pool = PagePool(4, page_size=1)
    pool.allocate(2)
    assert pool.check() == {2, 3}
    pool.free([1, 1])
    with pytest.raises(AssertionError, match="free twice"):
        pool.check()


def test_pages_for_rounds_up():
    pool = PagePool(4, page_size=16)
    assert [pool.pages_for(n) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]
