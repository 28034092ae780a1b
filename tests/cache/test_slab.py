"""Slab: exact unit and block ids, open page blocks filled first, empty page blocks freed, room outside a block."""

import pytest

from hkv.cache.slab import Slab


def test_shape_and_bad_arguments():
    slab = Slab(3, 4)
    assert (slab.units, slab.free_units, slab.free_blocks) == (12, 12, 3)
    with pytest.raises(ValueError, match="units_per_block >= 1"):
        Slab(3, 0)
    with pytest.raises(ValueError, match="blocks >= 0"):
        Slab(-1, 2)


def test_pages_fill_an_open_block_before_opening_another():
    slab = Slab(3, 2)
    assert [slab.take_unit() for _ in range(3)] == [0, 1, 2]  # block 0, then block 1
    assert (slab.free_units, slab.free_blocks) == (3, 1)
    assert slab.take_block() == 2 and slab.take_block() is None
    assert slab.take_unit() == 3 and slab.take_unit() is None
    slab.check([0, 1, 2, 3], [2])


def test_a_freed_unit_is_reused_and_an_empty_page_block_becomes_free():
    slab = Slab(2, 3)
    units = [slab.take_unit() for _ in range(4)]  # block 0 full, block 1 holds unit 3
    slab.give_unit(1)
    assert slab.open_blocks() == [(1, 1), (2, 0)] and slab.room_outside(1) == 1
    assert slab.take_unit() == 4  # block 1 was open first
    slab.give_unit(3)
    slab.give_unit(4)
    assert slab.free_blocks == 1 and slab.take_block() == 1
    slab.check([u for u in units if u not in (1, 3)], [1])
    assert slab.used_units(0) == [0, 2]


def test_take_unit_can_avoid_a_block():
    slab = Slab(2, 2)
    slab.take_unit()
    assert slab.take_unit(avoid=0) is None  # never opens a free block for a move
    assert slab.take_unit() == 1


def test_give_block_and_check_name_a_broken_book():
    slab = Slab(2, 2)
    block = slab.take_block()
    slab.give_block(block)
    with pytest.raises(AssertionError, match="holds no checkpoint"):
        slab.give_block(block)
    with pytest.raises(AssertionError, match="is not a used page unit"):
        slab.give_unit(0)
    with pytest.raises(AssertionError, match="checkpoint blocks"):
        slab.check([], [0])
