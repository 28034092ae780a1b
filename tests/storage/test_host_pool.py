"""HostLayout sizing and HostPool views: every torch view aliases exactly its entry's bytes; copy_blocks round trips."""

import pytest
import torch

from hkv.models.mtp import DraftSpec
from hkv.storage.host_pool import HostLayout, HostPool
from hkv.storage.kv_pool import KVLayout, KVPool
from hkv.storage.state_pool import StateLayout, StatePool
from hkv_kernels.dispatch import copy_blocks

KV = KVLayout(num_layers=2, num_pages=6, page_size=2, kv_heads=2, head_dim=4, dtype="float32", device="cpu")
STATE = StateLayout(lin_layers=3, num_slots=4, conv_dim=6, kernel_size=3, v_heads=2, k_dim=3, v_dim=2)
PAGE_BYTES = 2 * 2 * 2 * 2 * 4 * 4  # [2, L, P, H, D] fp32 = 256
CONV_NUMEL, REC_NUMEL = 3 * 6 * 2, 3 * 2 * 3 * 2  # 36 + 36 floats
STATE_BYTES = (CONV_NUMEL + REC_NUMEL) * 4  # 288


def hybrid_layout(units=10) -> HostLayout:
    """`units` page units of 256 bytes; a 288-byte checkpoint takes a block of two."""
    return HostLayout.for_model(KV, STATE, units * PAGE_BYTES)


def pool_of(layout: HostLayout) -> HostPool:
    return HostPool(layout, memoryview(bytearray(layout.nbytes)))


def floats(view) -> torch.Tensor:
    """The fp32 values of a byte view (a copy)."""
    return torch.frombuffer(bytearray(view), dtype=torch.float32)


def test_for_model_makes_one_budget_of_units_in_whole_checkpoint_blocks():
    lay = hybrid_layout(10)
    assert (lay.num_pages, lay.state_units, lay.num_states) == (10, 2, 5)
    assert (lay.kv_layers, lay.page_size, lay.kv_heads, lay.head_dim, lay.kv_dtype) == (2, 2, 2, 4, "float32")
    assert (lay.lin_layers, lay.conv_dim, lay.conv_width, lay.v_heads, lay.k_dim, lay.v_dim) == (3, 6, 2, 2, 3, 2)
    assert lay.kv_shape == (2, 2, 2, 2, 4)
    assert (lay.page_bytes, lay.state_bytes, lay.block_bytes) == (PAGE_BYTES, STATE_BYTES, 2 * PAGE_BYTES)
    assert (lay.conv_numel, lay.recurrent_numel) == (CONV_NUMEL, REC_NUMEL)
    assert lay.nbytes == 10 * PAGE_BYTES
    odd = HostLayout.for_model(KV, STATE, 11 * PAGE_BYTES + 100)
    assert (odd.num_pages, odd.num_states) == (10, 5)  # no half block
    assert HostLayout(**lay.to_dict()) == lay


def test_for_model_fits_the_budget_it_was_given():
    for budget in (0, 255, 256, 511, 512, 1000, 4096, 10**5):
        assert HostLayout.for_model(KV, STATE, budget).nbytes <= budget
        assert HostLayout.for_model(KV, None, budget).nbytes <= budget


def test_a_hybrid_budget_below_one_checkpoint_block_holds_nothing():
    big_state = StateLayout(lin_layers=4, num_slots=1, conv_dim=6, kernel_size=3, v_heads=4, k_dim=8, v_dim=8)
    lay = HostLayout.for_model(KV, big_state, 16 * PAGE_BYTES + 255)  # a 4288-byte checkpoint takes 17 units
    assert (lay.num_pages, lay.num_states, lay.state_units, lay.state_bytes) == (0, 0, 17, 4288)
    roomy = HostLayout.for_model(KV, big_state, 17 * PAGE_BYTES)
    assert (roomy.num_pages, roomy.num_states) == (17, 1)


def test_for_model_dense_has_no_state():
    lay = HostLayout.for_model(KV, None, 5 * PAGE_BYTES + 100)
    assert (lay.num_pages, lay.state_units, lay.num_states, lay.lin_layers, lay.state_bytes) == (5, 0, 0, 0, 0)
    assert lay.nbytes == 5 * PAGE_BYTES
    assert lay.descriptor == "kv:2x2x2x2x4:float32"


def test_a_layout_must_hold_its_checkpoints_in_whole_blocks():
    fields = hybrid_layout(10).to_dict()
    with pytest.raises(ValueError, match="multiple of state_units"):
        HostLayout(**{**fields, "num_pages": 9})
    with pytest.raises(ValueError, match="cannot hold"):
        HostLayout(**{**fields, "state_units": 1})
    with pytest.raises(ValueError, match="exactly when"):
        HostLayout(**{**fields, "state_units": 0})


def test_for_model_refuses_a_non_fp32_state_pool():
    with pytest.raises(ValueError, match="fp32 states"):
        HostLayout.for_model(KV, StateLayout(**{**STATE.__dict__, "dtype": "bfloat16"}), 10**6)


def test_descriptor_names_the_entry_shape_not_the_counts():
    small, big = hybrid_layout(3), hybrid_layout(30)
    assert small.descriptor == big.descriptor == "kv:2x2x2x2x4:float32|state:conv3x6x2+rec3x2x3x2:float32"
    bf16 = HostLayout.for_model(KVLayout(**{**KV.__dict__, "dtype": "bfloat16"}), STATE, 10**5)
    assert bf16.descriptor != small.descriptor and bf16.page_bytes == PAGE_BYTES // 2


def test_views_have_the_device_pools_axis_order():
    host = pool_of(hybrid_layout(10))
    assert host.k.shape == host.v.shape == (2, 10, 2, 2, 4)  # [L, N, P, H, D]
    assert host.conv.shape == (3, 5, 6, 2) and host.recurrent.shape == (3, 5, 2, 3, 2)
    assert host.k.dtype == torch.float32 and host.conv.dtype == host.recurrent.dtype == torch.float32
    assert host.pages.shape == (10, 2, 2, 2, 2, 4)


def test_k_and_v_alias_exactly_their_page_entry_bytes():
    host = pool_of(hybrid_layout(10))
    before = bytes(host.buffer)
    k = torch.arange(16, dtype=torch.float32).view(2, 2, 4) + 1  # [P, H, D]
    host.k[1, 3] = k
    host.v[0, 3] = -k
    entry = floats(host.page_view(3)).view(2, 2, 2, 2, 4)  # [K|V, L, P, H, D]
    assert torch.equal(entry[0, 1], k) and torch.equal(entry[1, 0], -k)
    assert not entry[0, 0].any() and not entry[1, 1].any()
    after = bytes(host.buffer)
    changed = [i for i in range(len(after)) if after[i] != before[i]]
    assert 3 * PAGE_BYTES <= min(changed) and max(changed) < 4 * PAGE_BYTES


def test_writing_a_page_view_shows_through_k_and_v():
    host = pool_of(hybrid_layout(10))
    values = torch.arange(64, dtype=torch.float32)
    host.page_view(7)[:] = values.numpy().tobytes()
    entry = values.view(2, 2, 2, 2, 4)
    assert torch.equal(host.k[:, 7], entry[0]) and torch.equal(host.v[:, 7], entry[1])
    assert not host.k[:, 6].any() and not host.k[:, 8].any()


def test_conv_and_recurrent_alias_exactly_their_state_entry_bytes():
    lay = hybrid_layout(10)
    host = pool_of(lay)
    host.conv[2, 1] = torch.full((6, 2), 3.0)
    host.recurrent[0, 1] = torch.full((2, 3, 2), 5.0)
    view = host.state_view(1)
    assert len(view) == STATE_BYTES
    entry = floats(view)
    conv, rec = entry[:CONV_NUMEL].view(3, 6, 2), entry[CONV_NUMEL:].view(3, 2, 3, 2)
    assert (conv[2] == 3).all() and not conv[:2].any()
    assert (rec[0] == 5).all() and not rec[1:].any()
    # nothing outside state entry 1 (the first bytes of block 1: units 2 and 3) changed
    raw = bytes(host.buffer)
    start = lay.block_bytes
    assert not any(raw[:start]) and not any(raw[start + STATE_BYTES :])
    assert bytes(host.page_view(2)) == raw[start : start + PAGE_BYTES]  # the same bytes as page units 2 and 3
    # and back: bytes written to the entry show through the views
    host.state_view(4)[:] = torch.arange(72, dtype=torch.float32).numpy().tobytes()
    assert torch.equal(host.conv[:, 4].reshape(-1), torch.arange(36, dtype=torch.float32))
    assert torch.equal(host.recurrent[:, 4].reshape(-1), torch.arange(36, 72, dtype=torch.float32))


def test_dense_pool_has_no_state_views():
    lay = HostLayout.for_model(KV, None, 5 * PAGE_BYTES)
    host = pool_of(lay)
    assert host.conv is None and host.recurrent is None and host.k.shape == (2, 5, 2, 2, 4)
    with pytest.raises(IndexError, match="state entry 0 out of range"):
        host.state_view(0)


def test_a_pool_without_entries_has_no_views():
    lay = HostLayout.for_model(KV, STATE, 100)
    host = HostPool(lay, memoryview(bytearray(lay.nbytes)))
    assert host.pages is None and host.k is None and host.conv is None


def test_entry_views_check_their_index():
    host = pool_of(hybrid_layout(10))
    for bad in (-1, 10):
        with pytest.raises(IndexError, match="page entry"):
            host.page_view(bad)
    with pytest.raises(IndexError, match="state entry 5"):
        host.state_view(5)


def test_too_small_a_buffer_raises():
    lay = hybrid_layout(10)
    with pytest.raises(ValueError, match=f"has {lay.nbytes - 1} bytes, the layout needs {lay.nbytes}"):
        HostPool(lay, memoryview(bytearray(lay.nbytes - 1)))
    HostPool(lay, memoryview(bytearray(lay.nbytes + 10)))  # larger is fine (an shm region rounds up)


def test_release_drops_every_view():
    host = pool_of(hybrid_layout(10))
    host.release()
    assert host.pages is None and host.k is None and host.v is None
    assert host.conv is None and host.recurrent is None and host.buffer is None


def test_a_bytearray_buffer_aliases_like_a_memoryview():
    lay = hybrid_layout(10)
    host = HostPool(lay, bytearray(lay.nbytes))
    host.page_view(0)[:4] = b"\x00\x00\x80\x3f"  # 1.0f, as a disk read would write it
    assert host.k[0, 0, 0, 0, 0].item() == 1.0


def test_copy_blocks_moves_kv_pages_to_host_entries_and_back():
    gen = torch.Generator().manual_seed(0)
    kv = KVPool(KV)
    kv.k.copy_(torch.randn(kv.k.shape, generator=gen))
    kv.v.copy_(torch.randn(kv.v.shape, generator=gen))
    original_k, original_v = kv.k.clone(), kv.v.clone()
    host = pool_of(hybrid_layout(10))
    pages, entries = torch.tensor([4, 1, 5]), torch.tensor([0, 9, 3])
    for dev, side in ((kv.k, host.k), (kv.v, host.v)):
        copy_blocks(dev, side, pages, entries)
    for page, entry in zip(pages.tolist(), entries.tolist()):
        want = torch.stack([original_k[:, page], original_v[:, page]])  # [K|V, L, P, H, D]
        assert bytes(host.page_view(entry)) == want.numpy().tobytes()
    assert not host.k[:, [1, 2, 4, 5, 6, 7, 8]].any()
    # back into other device pages
    kv.k.zero_()
    kv.v.zero_()
    for side, dev in ((host.k, kv.k), (host.v, kv.v)):
        copy_blocks(side, dev, entries, torch.tensor([0, 2, 3]))
    for dst, src in ((0, 4), (2, 1), (3, 5)):
        assert torch.equal(kv.k[:, dst], original_k[:, src]) and torch.equal(kv.v[:, dst], original_v[:, src])
    assert not kv.k[:, [1, 4, 5]].any() and not kv.v[:, [1, 4, 5]].any()


def test_copy_blocks_skips_out_of_range_pairs_into_the_host_pool():
    kv = KVPool(KV)
    kv.k.fill_(1.0)
    host = pool_of(hybrid_layout(10))
    copy_blocks(kv.k, host.k, torch.tensor([0, 6, -1]), torch.tensor([10, 1, 2]))
    assert not host.k.any()


def test_copy_blocks_moves_state_slots_to_host_entries_and_back():
    gen = torch.Generator().manual_seed(1)
    state = StatePool(STATE)
    state.conv.copy_(torch.randn(state.conv.shape, generator=gen))
    state.recurrent.copy_(torch.randn(state.recurrent.shape, generator=gen))
    conv, rec = state.conv.clone(), state.recurrent.clone()
    host = pool_of(hybrid_layout(10))
    slots, entries = torch.tensor([2, 0]), torch.tensor([1, 4])
    copy_blocks(state.conv, host.conv, slots, entries)
    copy_blocks(state.recurrent, host.recurrent, slots, entries)
    for slot, entry in ((2, 1), (0, 4)):
        want = conv[:, slot].contiguous().numpy().tobytes() + rec[:, slot].contiguous().numpy().tobytes()
        assert bytes(host.state_view(entry)) == want
    assert not host.conv[:, [0, 2, 3]].any() and not host.recurrent[:, [0, 2, 3]].any()
    state.conv.zero_()
    state.recurrent.zero_()
    copy_blocks(host.conv, state.conv, entries, torch.tensor([3, 1]))
    copy_blocks(host.recurrent, state.recurrent, entries, torch.tensor([3, 1]))
    assert torch.equal(state.conv[:, 3], conv[:, 2]) and torch.equal(state.recurrent[:, 3], rec[:, 2])
    assert torch.equal(state.conv[:, 1], conv[:, 0]) and torch.equal(state.recurrent[:, 1], rec[:, 0])
    assert not state.conv[:, [0, 2]].any() and not state.recurrent[:, [0, 2]].any()


# the drafter's part (speculative decoding): hidden 5, a ring of W=3 positions of 2 heads x 4
DRAFT = DraftSpec(window=3, hidden_size=5, kv_heads=2, head_dim=4)
DRAFT_NUMEL = 5 + 2 * 3 * 2 * 4  # mtp_hidden + draft_k + draft_v = 53 floats


def test_the_drafters_part_extends_the_state_entry_and_its_descriptor():
    plain = HostLayout.for_model(KV, STATE, 10 * PAGE_BYTES)
    lay = HostLayout.for_model(KV, STATE, 10 * PAGE_BYTES, DRAFT)
    assert lay.draft_part == (5, 3, 2, 4) and plain.draft_part == (0, 0, 0, 0)
    assert lay.draft_bytes == DRAFT_NUMEL * 4 and plain.draft_bytes == 0
    assert lay.state_bytes == STATE_BYTES + DRAFT_NUMEL * 4  # 500 bytes: still a block of two units
    assert (lay.state_units, lay.num_states) == (2, 5)
    assert lay.descriptor == plain.descriptor + "|draft:hidden5+k3x2x4+v3x2x4:float32"
    paged = HostLayout.for_model(KV, STATE, 10 * PAGE_BYTES, DraftSpec(0, 5, 2, 4))  # W = 0: K/V in pages
    assert paged.draft_part == (5, 0, 0, 0) and paged.state_bytes == STATE_BYTES + 20
    assert paged.descriptor == plain.descriptor + "|draft:hidden5:float32"
    assert len({plain.descriptor, lay.descriptor, paged.descriptor}) == 3
    assert HostLayout(**lay.to_dict()) == lay and HostLayout(**paged.to_dict()) == paged
    big = HostLayout.for_model(KV, STATE, 10 * PAGE_BYTES, DraftSpec(8, 5, 2, 4))  # 288 + 532 bytes: 4 units
    assert (big.state_units, big.num_states, big.num_pages) == (4, 2, 8)


def test_a_drafters_part_must_be_whole():
    fields = HostLayout.for_model(KV, STATE, 10 * PAGE_BYTES, DRAFT).to_dict()
    with pytest.raises(ValueError, match="all > 0"):
        HostLayout(**{**fields, "draft_kv_heads": 0})
    with pytest.raises(ValueError, match="without draft_hidden"):
        HostLayout(**{**fields, "draft_hidden": 0})
    with pytest.raises(ValueError, match="cannot hold"):
        HostLayout(**{**fields, "draft_window": 30})  # 288 + 4 * (5 + 480) bytes > a block of two units
    with pytest.raises(ValueError, match="a dense model has none"):
        HostLayout.for_model(KV, None, 10 * PAGE_BYTES, DRAFT)


def test_the_drafters_views_alias_the_end_of_their_state_entry():
    lay = HostLayout.for_model(KV, STATE, 10 * PAGE_BYTES, DRAFT)
    host = pool_of(lay)
    assert host.mtp_hidden.shape == (5, 5) and host.draft_k.shape == host.draft_v.shape == (5, 3, 2, 4)
    assert [t.dtype for t in host.draft_tensors()] == [torch.float32] * 3
    values = torch.arange(DRAFT_NUMEL + CONV_NUMEL + REC_NUMEL, dtype=torch.float32)
    host.state_view(3)[:] = values.numpy().tobytes()
    start = CONV_NUMEL + REC_NUMEL
    assert torch.equal(host.recurrent[:, 3].reshape(-1), values[CONV_NUMEL:start])
    assert torch.equal(host.mtp_hidden[3], values[start : start + 5])
    assert torch.equal(host.draft_k[3].reshape(-1), values[start + 5 : start + 29])
    assert torch.equal(host.draft_v[3].reshape(-1), values[start + 29 :])
    assert not host.mtp_hidden[[0, 1, 2, 4]].any() and not host.draft_v[[0, 1, 2, 4]].any()
    # and back: the views write exactly their entry's bytes
    host.state_view(3)[:] = bytes(lay.state_bytes)
    before = bytes(host.buffer)
    host.draft_v[1, 2] = torch.full((2, 4), 7.0)
    changed = [i for i, (a, b) in enumerate(zip(before, bytes(host.buffer))) if a != b]
    end = lay.block_bytes + lay.state_bytes
    assert min(changed) >= end - 8 * 4 and max(changed) < end  # the last position of entry 1's V ring
    host.release()
    assert host.mtp_hidden is None and host.draft_k is None and host.draft_tensors() == []


def test_a_paged_drafter_has_only_mtp_hidden_in_the_state_entry():
    host = pool_of(HostLayout.for_model(KV, STATE, 10 * PAGE_BYTES, DraftSpec(0, 5, 2, 4)))
    assert host.mtp_hidden.shape == (5, 5) and host.draft_k is None and host.draft_v is None
    assert len(host.draft_tensors()) == 1
    assert pool_of(hybrid_layout(10)).draft_tensors() == []


def test_drafter_state_round_trips_between_a_bf16_state_pool_and_the_fp32_entry():
    """What ModelRunner._copy_state does for the drafter's tensors (plain copy_, converting dtypes)."""
    gen = torch.Generator().manual_seed(2)
    state = StatePool(STATE, DRAFT, torch.bfloat16)
    for t in state.draft_tensors():
        t.copy_(torch.randn(t.shape, generator=gen))
    saved = [t.clone() for t in state.draft_tensors()]
    host = pool_of(HostLayout.for_model(KV, STATE, 10 * PAGE_BYTES, DRAFT))
    for dev, side in zip(state.draft_tensors(), host.draft_tensors()):
        side[4].copy_(dev[1])
    for dev in state.draft_tensors():
        dev.zero_()
    for dev, side in zip(state.draft_tensors(), host.draft_tensors()):
        dev[2].copy_(side[4])
    for dev, want in zip(state.draft_tensors(), saved):
        assert torch.equal(dev[2], want[1])  # bf16 -> fp32 -> bf16 is exact
        assert not dev[[0, 1, 3]].any()


def test_tp_entries_hold_every_rank_shard_side_by_side():
    """--tp 2: an entry is rank 0's shard then rank 1's; each rank's views see only its own bytes."""
    lay = HostLayout.for_model(KV, STATE, 8 * 2 * PAGE_BYTES, tp=2)
    assert (lay.page_bytes, lay.state_bytes) == (2 * PAGE_BYTES, 2 * STATE_BYTES)
    assert lay.descriptor.endswith("|tp2") and "tp" not in HostLayout.for_model(KV, STATE, 10**4).descriptor
    buffer = bytearray(lay.nbytes)
    ranks = [HostPool(lay, memoryview(buffer), rank) for rank in range(2)]
    for rank, pool in enumerate(ranks):
        pool.k[:, 5].fill_(rank + 1)  # unit 5; state entry 1 is units 2-3
        pool.recurrent[:, 1].fill_(rank + 5)
    page = torch.frombuffer(ranks[0].page_view(5), dtype=torch.float32).view(2, -1)  # [rank, its floats]
    assert page[0, : page.shape[1] // 2].eq(1).all() and page[1, : page.shape[1] // 2].eq(2).all()
    assert page[:, page.shape[1] // 2 :].eq(0).all()  # V untouched
    state = torch.frombuffer(ranks[1].state_view(1), dtype=torch.float32).view(2, -1)
    assert state[0, CONV_NUMEL:].eq(5).all() and state[1, CONV_NUMEL:].eq(6).all() and not state[:, :CONV_NUMEL].any()
    with pytest.raises(ValueError, match="rank 2 out of range"):
        HostPool(lay, memoryview(buffer), 2)


@pytest.mark.parametrize("descriptor,tp", [
    ("kv:2x1x4x1x4:float32", 1),
    ("kv:2x1x4x1x4:float32|state:conv1x2x3+rec1x1x2x2:float32|tp2", 2),
    ("kv:2x1x4x1x4:float32|tp16", 16),
    ("kv:2x1x4x1x4:float32|tp1", None),  # a layout of one rank names no tp part
    ("kv:2x1x4x1x4:float32|tp0", None),
    ("kv:2x1x4x1x4:float32|tp", None),
    ("kv:2x1x4x1x4:float32|tp2|tp2", None),
    ("kv:2x1x4x1x4:float32|tp9999999", None),
])  # fmt: skip
def test_tp_of_reads_the_descriptors_tp_part(descriptor, tp):
    from hkv.storage.host_pool import tp_of

    assert tp_of(descriptor) == tp


def test_tp_of_reads_what_the_descriptor_writes():
    from hkv.storage.host_pool import tp_of

    for tp in (1, 2, 4):
        layout = HostLayout(num_pages=1, state_units=0, kv_layers=1, page_size=2, kv_heads=1, head_dim=4,
                            kv_dtype="float32", tp=tp)
        assert tp_of(layout.descriptor) == tp
