"""A prompt's pages through a pair process group over gloo (hkv/storage/pair_group.py): the code the NCCL path
runs, here between this process (the decode side, rank 1) and a spawned one (the prefill side, rank 0)."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest
import torch

from hkv.storage import pair_group
from hkv.storage.pair_group import PairGroup, PairGroupError, host_rendezvous
from tests.e2e.harness import bound_addresses

pytestmark = pytest.mark.timeout(120)

KV_RUNS = [(3, 10, 5), (20, 0, 2), (9, 30, 1)]  # (peer page, own page, count)
STATE_RUNS = [(2, 1, 1)]  # the checkpoint slot into the live slot


def _pools(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(4, 40, 2, 2, 6, generator=gen).to(torch.bfloat16)  # 4 storage layers, 40 pages
    recurrent = torch.randn(3, 4, 2, 5, 5, generator=gen)  # 3 GDN layers, 4 slots, fp32
    return [kv, recurrent]


def _prefill_side(address: str, prefix: str, message_bytes: int, kv_runs: list, joins: bool, timeout_s: float) -> None:
    pair_group.MAX_MESSAGE_BYTES = message_bytes
    if not joins:
        time.sleep(30)
        return
    group = PairGroup(address, prefix, 0, "gloo", timeout_s, "127.0.0.1")
    try:
        group.send_pages(_pools(1), [kv_runs, STATE_RUNS])
    except PairGroupError:
        pass  # the decode side refused the transfer (the mismatch test): its pages wait out the timeout
    finally:
        time.sleep(0.5)
        group.close()


def _start_prefill(address, prefix, message_bytes=pair_group.MAX_MESSAGE_BYTES, kv_runs=KV_RUNS, joins=True,
                   timeout_s=10.0):
    proc = mp.get_context("spawn").Process(target=_prefill_side, daemon=True,
                                           args=(address, prefix, message_bytes, kv_runs, joins, timeout_s))
    proc.start()
    return proc


@pytest.mark.parametrize("message_bytes", [pair_group.MAX_MESSAGE_BYTES, 1000])  # one message; many, cut anywhere
def test_the_pages_and_the_checkpoint_arrive_bit_for_bit_and_nothing_else_changes(monkeypatch, message_bytes):
    monkeypatch.setattr(pair_group, "MAX_MESSAGE_BYTES", message_bytes)
    store, address = host_rendezvous("127.0.0.1", 10.0)
    proc = _start_prefill(address, "t1", message_bytes)
    own = [torch.zeros_like(t) for t in _pools(1)]
    before = [t.clone() for t in own]
    group = PairGroup(address, "t1", 1, "gloo", 10.0, "127.0.0.1", store=store)
    try:
        # both sides formed (the prefill side now waits in its send): only loopback is bound, store and gloo alike
        addresses = bound_addresses([os.getpid(), proc.pid])
        assert int(address.rsplit(":", 1)[1]) in {int(a.split(":")[1], 16) for a in addresses}, addresses
        assert all(a.split(":")[0] == "0100007F" for a in addresses), addresses
        moved = group.recv_pages(own, [[(s, d, n) for s, d, n in KV_RUNS], STATE_RUNS])
    finally:
        group.close()
        proc.join(20)
    peer = _pools(1)
    expect = [t.clone() for t in before]
    for i, runs in enumerate([KV_RUNS, STATE_RUNS]):
        for s, d, n in runs:
            expect[i][:, d:d + n] = peer[i][:, s:s + n]
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(own, expect))
    kv_block, state_block = 2 * 2 * 6 * 2, 2 * 5 * 5 * 4
    assert moved == 4 * 8 * kv_block + 3 * 1 * state_block


@pytest.mark.parametrize("sent,reserved,match", [
    ([(3, 10, 6)], [(3, 10, 5)], "were reserved"),  # one page more than reserved
    ([(0, 0, 2), (5, 6, 3)], [(0, 0, 3), (5, 6, 2)], "split otherwise"),  # the same bytes and runs, split otherwise
])
def test_a_transfer_that_does_not_match_the_reservation_writes_nothing(sent, reserved, match):
    store, address = host_rendezvous("127.0.0.1", 10.0)
    proc = _start_prefill(address, "t2", kv_runs=sent, timeout_s=3.0)
    own = [torch.zeros_like(t) for t in _pools(1)]
    group = PairGroup(address, "t2", 1, "gloo", 10.0, "127.0.0.1", store=store)
    try:
        with pytest.raises(PairGroupError, match=match):
            group.recv_pages(own, [reserved, STATE_RUNS])
    finally:
        group.close()
        proc.join(20)
    assert not any(t.any() for t in own)


def test_a_peer_that_never_joins_is_an_error_within_the_timeout():
    store, address = host_rendezvous("127.0.0.1", 2.0)
    proc = _start_prefill(address, "t3", joins=False)
    started = time.monotonic()
    try:
        with pytest.raises(PairGroupError, match="did not form"):
            PairGroup(address, "t3", 1, "gloo", 2.0, "127.0.0.1", store=store)
    finally:
        proc.kill()
    assert time.monotonic() - started < 15


def test_runs_outside_the_pools_or_a_bad_pair_are_refused_before_anything_moves():
    own = _pools(2)
    with pytest.raises(IndexError, match="outside a pool"):
        pair_group._parts(own, [[(0, 38, 3)], []], source=False)
    with pytest.raises(ValueError, match="run lists"):
        pair_group._parts(own, [[(0, 0, 1)]], source=False)
    with pytest.raises(ValueError, match="contiguous within a layer"):
        pair_group._parts([own[0][:, ::2]], [[(0, 0, 1)]], source=False)
    with pytest.raises(ValueError, match="ranks 0 and 1"):
        PairGroup("127.0.0.1:1", "x", 2, "gloo", 1.0, "127.0.0.1")
