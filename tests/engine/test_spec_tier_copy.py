"""ModelRunner's tier copies of a drafting state pool: StoreState / LoadState move the linear state and the
drafter's tensors (model dtype on the device, fp32 in the CPU tier) between a state slot and a state entry,
value for value; with W = 0 the paged draft K/V travel with the pages (one more KV layer)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hkv.cache.types import LoadPages, LoadState, StorePages, StoreState
from hkv.engine.model_runner import ModelRunner
from hkv.ipc.messages import StepPlan
from hkv.models.mtp import DraftSpec
from hkv.storage.host_pool import HostLayout, HostPool
from hkv.storage.kv_pool import KVLayout, KVPool
from hkv.storage.state_pool import StateLayout, StatePool

STATE = StateLayout(lin_layers=2, num_slots=5, conv_dim=6, kernel_size=3, v_heads=2, k_dim=3, v_dim=2)
KV = KVLayout(num_layers=1, num_pages=4, page_size=2, kv_heads=2, head_dim=4, dtype="bfloat16", device="cpu")


def _runner(window: int, dtype=torch.bfloat16):
    """A runner over pools only (no model forward): a drafting state pool in `dtype` and its CPU tier."""
    draft = DraftSpec(window, hidden_size=8, kv_heads=2, head_dim=4)
    kv_layout = KVLayout(**{**KV.__dict__, "num_layers": KV.num_layers + (0 if window else 1)})  # W = 0: paged
    kv, state = KVPool(kv_layout), StatePool(STATE, draft, dtype)
    layout = HostLayout.for_model(kv_layout, STATE, 40 * kv_layout.bytes_per_page(), draft)
    host = HostPool(layout, memoryview(bytearray(layout.nbytes)))
    model = SimpleNamespace(cfg=SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, head_dim=4, vocab_size=16))
    table = SimpleNamespace(layout=SimpleNamespace(slots=2))
    return ModelRunner(model, kv, state, table, 2, "cpu", host=host), host


def _ops(runner, *ops) -> None:
    runner._run_cache_ops(StepPlan(step=1, new=[], chunks=[], freed=[], ops=list(ops)))


@pytest.mark.parametrize("window", [4, 0])
def test_store_and_load_state_carry_the_drafters_tensors(window):
    runner, host = _runner(window)
    state = runner.state
    gen = torch.Generator().manual_seed(window)
    for t in (state.conv, state.recurrent, *state.draft_tensors()):
        t.copy_(torch.randn(t.shape, generator=gen))
    saved = [t.clone() for t in (state.conv, state.recurrent)] + [t.clone() for t in state.draft_tensors()]
    assert len(state.draft_tensors()) == len(host.draft_tensors()) == (3 if window else 1)
    _ops(runner, StoreState(src_slot=3, dst_entry=1))
    for dev, side in zip(state.draft_tensors(), host.draft_tensors()):
        assert side.dtype == torch.float32 and torch.equal(side[1], dev[3].float())
        assert not side[0].any() and not side[2:].any()
    lin = state.conv[:, 3].contiguous().numpy().tobytes() + state.recurrent[:, 3].contiguous().numpy().tobytes()
    drafter = b"".join(t[3].float().contiguous().numpy().tobytes() for t in state.draft_tensors())
    assert bytes(host.state_view(1)) == lin + drafter  # the entry's layout: linear state, then the drafter's
    for t in (state.conv, state.recurrent, *state.draft_tensors()):
        t.zero_()
    _ops(runner, LoadState(src_entry=1, dst_slot=0))
    linear, drafter_saved = saved[:2], saved[2:]
    for t, want in zip((state.conv, state.recurrent), linear):  # [lin_layers, slots, ...]
        assert torch.equal(t[:, 0], want[:, 3]) and not t[:, 1:].any()
    for t, want in zip(state.draft_tensors(), drafter_saved):  # [slots, ...]
        assert torch.equal(t[0], want[3]) and not t[1:].any()  # bf16 -> fp32 -> bf16 is exact

def test_paged_draft_kv_travel_with_the_pages():
    runner, host = _runner(0)
    kv = runner.kv
    assert kv.layout.num_layers == 2 and host.layout.kv_layers == 2  # the target's layer and the draft layer
    kv.k.copy_(torch.randn(kv.k.shape))
    kv.v.copy_(torch.randn(kv.v.shape))
    k, v = kv.k.clone(), kv.v.clone()
    _ops(runner, StorePages(src_pages=[2], dst_entries=[5]))
    kv.k.zero_()
    kv.v.zero_()
    _ops(runner, LoadPages(src_entries=[5], dst_pages=[1]))
    assert torch.equal(kv.k[:, 1], k[:, 2]) and torch.equal(kv.v[:, 1], v[:, 2])


def test_a_state_copy_checks_its_indexes_and_the_drafters_parts():
    runner, host = _runner(4)
    with pytest.raises(IndexError, match="out of range"):
        _ops(runner, StoreState(src_slot=5, dst_entry=0))
    with pytest.raises(IndexError, match="out of range"):
        _ops(runner, LoadState(src_entry=host.layout.num_states, dst_slot=0))
    other, _ = _runner(0)
    runner.host = HostPool(other.host.layout, memoryview(bytearray(other.host.layout.nbytes)))  # no ring
    with pytest.raises(ValueError, match="disagree on the drafter"):
        _ops(runner, StoreState(src_slot=0, dst_entry=0))


def test_warm_tier_loads_reads_the_tier_into_scratch_only():
    """The start-up warm-up of the load copies (CUDA ranks) writes only the scratch page and slot, leaves the
    slot zeroed and the tier as it was; without a scratch page (CPU ranks) it does nothing."""
    runner, host = _runner(4, torch.float32)
    assert runner.warm_tier_loads() == 0.0  # a CPU runner has no scratch page
    gen = torch.Generator().manual_seed(9)
    for t in (host.kv_layers, host.conv, host.recurrent):  # views of one space (entries may share bytes)
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))

    def tier_bytes():
        return [t.contiguous().view(torch.uint8).clone() for t in (host.kv_layers, host.conv, host.recurrent)]

    tier_before = tier_bytes()
    kv = runner.kv.layers_view()
    kv.copy_(torch.randn(kv.shape, generator=gen).to(kv.dtype))
    pages_before = kv.clone()
    runner.state.conv.fill_(float("nan"))
    runner.state.recurrent.copy_(torch.randn(runner.state.recurrent.shape, generator=gen))
    recurrent = runner.state.recurrent[:, :4].clone()  # slot 4 is the scratch slot, the pool's last
    runner.scratch = (3, 4)  # what a CUDA rank passes: one page and one slot the router never hands out
    assert runner.warm_tier_loads() >= 0.0
    assert all(torch.equal(t, b) for t, b in zip(tier_bytes(), tier_before))
    as_bytes = lambda t: t.contiguous().view(torch.uint8)  # noqa: E731
    assert torch.equal(as_bytes(kv[:, 3]), as_bytes(host.kv_layers[:, 0]))  # the scratch page took entry 0
    assert torch.equal(as_bytes(kv[:, :3]), as_bytes(pages_before[:, :3]))  # and no other page changed
    assert not runner.state.conv[:, 4].any() and not runner.state.recurrent[:, 4].any()
    assert torch.isnan(runner.state.conv[:, :4]).all() and torch.equal(runner.state.recurrent[:, :4], recurrent)
