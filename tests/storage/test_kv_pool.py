import pytest
import torch

from hkv.storage.kv_pool import KVLayout, KVPool


def _layout(**overrides) -> KVLayout:
    fields = dict(num_layers=2, num_pages=8, page_size=4, kv_heads=2, head_dim=3, dtype="float32", device="cpu")
    fields.update(overrides)
    return KVLayout(**fields)


def test_layout_shape_and_bytes_per_page():
    lay = _layout(dtype="bfloat16")
    assert lay.shape == (2, 8, 4, 2, 3)
    # K and V, 2 layers, 4 tokens x 2 heads x 3 dims, 2 bytes each
    assert lay.bytes_per_page() == 2 * 2 * 4 * 2 * 3 * 2


def test_layout_rejects_bad_values():
    with pytest.raises(ValueError, match="dtype"):
        _layout(dtype="int8")
    with pytest.raises(ValueError, match="page_size"):
        _layout(page_size=0)


def test_pool_allocates_zeros_with_identity_layer_map():
    pool = KVPool(_layout())
    assert pool.k.shape == (2, 8, 4, 2, 3) and pool.v.shape == (2, 8, 4, 2, 3)
    assert not pool.k.any() and not pool.v.any()
    assert pool.layer_map == {0: 0, 1: 1}
    assert pool.num_slots == 32


def test_write_then_gather_through_shuffled_pages():
    pool = KVPool(_layout(num_layers=2), layer_map={1: 0, 3: 1})
    page_row = torch.tensor([5, 2, 7, 0])  # non-contiguous pages of one sequence
    length = 10  # two full pages and half of a third
    positions = torch.arange(length)
    slots = page_row[positions // 4] * 4 + positions % 4
    k = torch.randn(length, 2, 3)
    v = torch.randn(length, 2, 3)
    pool.write(3, slots, k, v)
    got_k, got_v = pool.gather(3, page_row, length)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    # model layer 3 lives at storage layer 1; storage layer 0 is untouched
    assert not pool.k[0].any()
    assert torch.equal(pool.k[1, 7, 0], k[8])
    # the untouched page 0 and the unwritten half of page 7 stay zero
    assert not pool.k[1, 0].any() and not pool.k[1, 7, 2:].any()


def test_write_in_two_chunks_then_gather_prefix():
    pool = KVPool(_layout(num_layers=1))
    page_row = torch.tensor([6, 1, 3])
    k = torch.randn(9, 2, 3)
    positions = torch.arange(9)
    slots = page_row[positions // 4] * 4 + positions % 4
    pool.write(0, slots[:6], k[:6], k[:6])
    pool.write(0, slots[6:], k[6:], k[6:])
    got_k, _ = pool.gather(0, page_row, 7)
    assert torch.equal(got_k, k[:7])


def test_write_casts_to_pool_dtype():
    pool = KVPool(_layout(num_layers=1, dtype="bfloat16"))
    k = torch.randn(3, 2, 3)
    pool.write(0, torch.tensor([0, 1, 2]), k, k)
    got_k, _ = pool.gather(0, torch.tensor([0]), 3)
    assert got_k.dtype == torch.bfloat16
    assert torch.equal(got_k, k.to(torch.bfloat16))


def test_errors_for_unmapped_layer_bad_map_and_short_row():
    pool = KVPool(_layout(num_layers=2), layer_map={1: 0, 3: 1})
    with pytest.raises(KeyError, match="layer 0"):
        pool.gather(0, torch.tensor([0]), 1)
    with pytest.raises(ValueError, match="layer_map"):
        KVPool(_layout(num_layers=2), layer_map={0: 0, 1: 0})
    with pytest.raises(ValueError, match="need 3"):
        pool.gather(1, torch.tensor([0, 1]), 9)


def test_layer_map_follows_layout_layer_ids():
    pool = KVPool(_layout(num_layers=2, layer_ids=(3, 7)))
    assert pool.layer_map == {3: 0, 7: 1}
    with pytest.raises(ValueError, match="1 layer_ids for 2"):
        _layout(num_layers=2, layer_ids=(3,))
