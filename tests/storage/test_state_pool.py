"""StatePool: slot shapes, byte accounting, copy/zero touching exactly one slot."""

from __future__ import annotations

import pytest
import torch

from hkv.storage.state_pool import StateLayout, StatePool


def _layout(**overrides) -> StateLayout:
    spec = dict(lin_layers=3, num_slots=4, conv_dim=12, kernel_size=4, v_heads=2, k_dim=5, v_dim=3,
                layer_ids=(0, 1, 3))
    return StateLayout(**{**spec, **overrides})


def _filled(layout: StateLayout) -> StatePool:
    pool = StatePool(layout)
    gen = torch.Generator().manual_seed(0)
    pool.conv.copy_(torch.randn(pool.conv.shape, generator=gen))
    pool.recurrent.copy_(torch.randn(pool.recurrent.shape, generator=gen))
    return pool


def test_shapes_layer_map_and_bytes():
    pool = StatePool(_layout())
    assert pool.conv.shape == (3, 4, 12, 3) and pool.recurrent.shape == (3, 4, 2, 5, 3)
    assert pool.conv.dtype == torch.float32 and not pool.conv.any() and not pool.recurrent.any()
    assert pool.layer_map == {0: 0, 1: 1, 3: 2}
    one_slot = pool.conv[:, 0].numel() * 4 + pool.recurrent[:, 0].numel() * 4
    assert pool.bytes_per_slot == one_slot == 3 * (12 * 3 + 2 * 5 * 3) * 4
    assert StatePool(_layout(dtype="bfloat16")).bytes_per_slot == one_slot // 2
    assert StatePool(_layout(layer_ids=())).layer_map == {0: 0, 1: 1, 2: 2}


def test_copy_slot_overwrites_only_dst():
    pool = _filled(_layout())
    before_conv, before_rec = pool.conv.clone(), pool.recurrent.clone()
    pool.copy_slot(1, 3)
    assert torch.equal(pool.conv[:, 3], before_conv[:, 1]) and torch.equal(pool.recurrent[:, 3], before_rec[:, 1])
    for slot in (0, 1, 2):
        assert torch.equal(pool.conv[:, slot], before_conv[:, slot])
        assert torch.equal(pool.recurrent[:, slot], before_rec[:, slot])
    # the copy is not a view: writing the source later leaves the checkpoint intact
    pool.recurrent[:, 1].add_(1.0)
    assert torch.equal(pool.recurrent[:, 3], before_rec[:, 1])
    pool.copy_slot(2, 2)
    assert torch.equal(pool.conv[:, 2], before_conv[:, 2])


def test_zero_slot_only_that_slot():
    pool = _filled(_layout())
    before = pool.conv.clone()
    pool.zero_slot(2)
    assert not pool.conv[:, 2].any() and not pool.recurrent[:, 2].any()
    assert torch.equal(pool.conv[:, [0, 1, 3]], before[:, [0, 1, 3]])


def test_bad_slots_and_layouts_raise():
    pool = StatePool(_layout())
    with pytest.raises(IndexError):
        pool.copy_slot(0, 4)
    with pytest.raises(IndexError):
        pool.zero_slot(-1)
    with pytest.raises(ValueError, match="dtype"):
        _layout(dtype="int8")
    with pytest.raises(ValueError, match="layer_ids"):
        _layout(layer_ids=(0, 1))
    with pytest.raises(ValueError, match="kernel_size"):
        _layout(kernel_size=1)
