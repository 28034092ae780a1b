"""PeerSend / PeerRecv plan ops (ModelRunner._pair_transfer) between a prefill and a decode runner in this process,
over gloo (the NCCL path's code on CPU): pages and the checkpoint arrive, the ends come back in StepResult's
`transfers`, and a bad op is reported as a failed transfer instead of failing the step."""

from __future__ import annotations

import time
import types

import pytest
import torch

from hkv.cache.types import PeerRecv, PeerSend
from hkv.engine.model_runner import ModelRunner
from hkv.engine.pair_transfers import PairTransfers
from hkv.ipc.messages import TransferDone

pytestmark = pytest.mark.timeout(60)


def _runner(seed: int | None, hybrid: bool = True) -> ModelRunner:
    gen = torch.Generator().manual_seed(seed or 0)
    fill = (lambda *shape: torch.randn(*shape, generator=gen)) if seed is not None else torch.zeros
    kv = fill(4, 30, 2, 2, 4).to(torch.bfloat16)
    runner = ModelRunner.__new__(ModelRunner)
    runner.kv = types.SimpleNamespace(layers_view=lambda: kv, num_pages=30)
    runner.state = types.SimpleNamespace(conv=fill(2, 4, 3, 5), recurrent=fill(2, 4, 2, 4, 4)) if hybrid else None
    pools = [kv] + ([runner.state.conv, runner.state.recurrent] if hybrid else [])
    runner.pair = PairTransfers(pools, "gloo", "127.0.0.1", 10.0)
    runner._refused, runner._handed = [], set()
    return runner


def _results(runner: ModelRunner, n: int) -> list[TransferDone]:
    got, deadline = [], time.monotonic() + 30
    while len(got) < n and time.monotonic() < deadline:
        got += runner._transfers()
        time.sleep(0.01)
    return got


@pytest.mark.parametrize("hybrid", [True, False])
def test_a_prompt_moves_between_two_runners_and_ends_in_their_results(hybrid):
    prefill, decode = _runner(1, hybrid), _runner(None, hybrid)
    src, dst = [3, 4, 5, 9, 10], [20, 21, 22, 0, 1]
    slots = (2, 1) if hybrid else (None, None)
    prefix = decode.pair.new_prefix()
    try:
        decode._pair_transfer(PeerRecv(7, "prefill-transporter", prefix, src, dst, *slots))
        prefill._pair_transfer(PeerSend(7, decode.pair.address, prefix, src, dst, *slots))
        assert _results(decode, 1) == [TransferDone(7, True, None)]
        assert _results(prefill, 1) == [TransferDone(7, True, None)]
    finally:
        prefill.pair.close()
        decode.pair.close()
    own, peer = decode.kv.layers_view(), prefill.kv.layers_view()
    assert torch.equal(own[:, dst].view(torch.int16), peer[:, src].view(torch.int16))
    assert not own[:, [p for p in range(30) if p not in dst]].any()
    if hybrid:
        for name in ("conv", "recurrent"):
            assert torch.equal(getattr(decode.state, name)[:, 1], getattr(prefill.state, name)[:, 2])
            assert not getattr(decode.state, name)[:, [0, 2, 3]].any()


def test_a_bad_transfer_op_is_a_failed_transfer_not_a_failed_step():
    decode = _runner(None)
    try:
        for op in (PeerRecv(1, "p", "x", [1, 2], [3], 0, 0),  # unequal page lists
                   PeerRecv(2, "p", "x", [1], [3], None, None),  # a hybrid transfer without its checkpoint
                   PeerRecv(3, "p", "x", [1], [30], 0, 0),  # a page past the pool
                   PeerRecv(4, "p", "", [1], [3], 0, 0)):  # no group named
            decode._pair_transfer(op)
        done = decode._transfers()
    finally:
        decode.pair.close()
    assert [d.transfer_id for d in done] == [1, 2, 3, 4] and not any(d.ok for d in done)
    assert "outside a pool" in done[2].error and "prefix" in done[3].error
    assert not decode.kv.layers_view().any()
    bare = ModelRunner.__new__(ModelRunner)
    bare.pair, bare.state, bare._refused, bare._handed = None, None, [], set()
    bare._pair_transfer(PeerSend(5, "127.0.0.1:1", "x", [0], [0], None, None))
    assert bare._transfers() == [TransferDone(5, False, "this rank has no pair transfers (not a prefill or decode "
                                                         "instance)")]


def test_the_ops_and_their_ends_travel_in_plans_and_results():
    import msgspec

    from hkv.ipc.messages import StepPlan, StepResult

    ops = [PeerSend(1, "127.0.0.1:5000", "ab", [1, 2], [3, 4], 0, 1), PeerRecv(2, "tcp://127.0.0.1:6000", "cd", [1],
                                                                             [2], None, None)]
    plan = msgspec.msgpack.decode(msgspec.msgpack.encode(StepPlan(5, [], [], [], ops)), type=StepPlan)
    assert plan.ops == ops
    result = StepResult(5, [], 0.0, transfers=[TransferDone(1, True), TransferDone(2, False, "why")])
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(result), type=StepResult) == result


def test_a_step_that_fails_before_handing_a_transfer_over_reports_it_failed():
    """An earlier op of the plan raises: the pair ops after it never reach their worker, so the result says so
    (the router would otherwise wait for their end, holding the pages it reserved)."""
    from hkv.cache.types import SaveCheckpoint
    from hkv.ipc.messages import StepPlan

    runner = _runner(None)
    runner.sampling, runner.state_slots, runner.pages = {}, {}, None
    runner.state.copy_slot = lambda src, dst: (_ for _ in ()).throw(RuntimeError("no such slot"))
    refused = PeerRecv(3, "prefill-transporter", "p", [1], [99], 0, 1)  # handed over: refused at once, not queued
    plan = StepPlan(step=1, new=[], chunks=[], freed=[], ops=[refused, SaveCheckpoint(0, 1, 16),
                                                           PeerRecv(4, "prefill-transporter", "p", [1], [3], 0, 2)])
    try:
        result = runner.finish(runner.launch(plan))
    finally:
        runner.pair.close()
    assert result.error == "RuntimeError: no such slot"
    (three, four) = result.transfers
    assert three.transfer_id == 3 and not three.ok and "outside a pool" in three.error
    assert four == TransferDone(4, False, "its step failed first: RuntimeError")
    assert runner._transfers() == []  # each reported once
