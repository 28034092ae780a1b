"""PairTransfers (hkv/engine/pair_transfers.py) over gloo: this process is the decode rank, spawned processes
are prefill ranks; an mp queue stands in for the control message that names the group's prefix."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from hkv.engine import pair_transfers
from hkv.engine.pair_transfers import PairTransfers, PairTransferError

pytestmark = pytest.mark.timeout(120)

KV = [[(3, 10, 5), (20, 0, 2)], [(1, 2, 1)]]  # per pool: (peer page, own page, pages)
KV2 = [[(30, 15, 4)], [(3, 0, 1)]]
KV3 = [[(0, 25, 1)], [(0, 3, 1)]]


def _pools(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 40, 2, 2, 6, generator=gen).to(torch.bfloat16),  # KV storage layers x pages
            torch.randn(3, 4, 2, 5, 5, generator=gen)]  # recurrent state: layers x slots, fp32


def _prefill(orders: mp.Queue, results: mp.Queue, timeout_s: float) -> None:
    """Send what each order names ((id, address, prefix, runs)); None ends; "die" exits without sending."""
    sender = PairTransfers(_pools(1), "gloo", "127.0.0.1", timeout_s)
    results.put("ready")
    while True:
        order = orders.get()
        if order is None:
            break
        if order == "die":
            return
        sender.send(*order)
        deadline = time.monotonic() + 3 * timeout_s
        done = []
        while not done and time.monotonic() < deadline:
            done = sender.finished()
            time.sleep(0.01)
        results.put(done)
    sender.close()


def _start(timeout_s=5.0):
    ctx = mp.get_context("spawn")
    orders, results = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_prefill, args=(orders, results, timeout_s), daemon=True)
    proc.start()
    assert results.get(timeout=60) == "ready"  # started (a spawn imports torch): its group can form in time
    return proc, orders, results


def _expect(own_before, runs_list):
    peer, expect = _pools(1), [t.clone() for t in own_before]
    for runs in runs_list:
        for i, pool_runs in enumerate(runs):
            for s, d, n in pool_runs:
                expect[i][:, d:d + n] = peer[i][:, s:s + n]
    return expect


def _wait(receiver, ids, timeout_s=30.0):
    done, deadline = {}, time.monotonic() + timeout_s
    while set(done) != set(ids) and time.monotonic() < deadline:
        done.update({t: (ok, why) for t, ok, why in receiver.finished()})
        time.sleep(0.01)
    return done


def test_queued_transfers_arrive_in_order_bit_for_bit_while_the_caller_goes_on():
    own = [torch.zeros_like(t) for t in _pools(1)]
    before = [t.clone() for t in own]
    receiver = PairTransfers(own, "gloo", "127.0.0.1", 5.0)
    proc, orders, results = _start()
    try:
        prefix = receiver.new_prefix()
        for i, runs in ((1, KV), (2, KV2), (3, KV3)):
            receiver.recv(i, "peer-a", prefix, runs)
        assert receiver.finished() == []  # queued: nothing waited for the peer
        for i, runs in ((1, KV), (2, KV2), (3, KV3)):
            orders.put((i, receiver.address, prefix, runs))
        sent = [results.get(timeout=30) for _ in range(3)]
        done = _wait(receiver, [1, 2, 3])
    finally:
        orders.put(None)
        proc.join(20)
        receiver.close()
    assert sent == [[(1, True, None)], [(2, True, None)], [(3, True, None)]]
    assert done == {1: (True, None), 2: (True, None), 3: (True, None)}
    expect = _expect(before, [KV, KV2, KV3])
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(own, expect))


def test_a_peer_that_dies_fails_its_transfers_within_the_timeout_and_a_restarted_one_joins_a_new_group():
    own = [torch.zeros_like(t) for t in _pools(1)]
    before = [t.clone() for t in own]
    receiver = PairTransfers(own, "gloo", "127.0.0.1", 3.0)
    proc, orders, _ = _start(3.0)
    try:
        first = receiver.new_prefix()
        receiver.recv(1, "peer-a", first, KV)
        receiver.recv(2, "peer-a", first, KV2)  # queued for the same group
        orders.put("die")  # the prefill rank is gone before it sends
        started = time.monotonic()
        done = _wait(receiver, [1, 2])
        assert time.monotonic() - started < 15
        assert not done[1][0] and done[2] == (False, "its pair group failed before it ran")
        assert not any(t.any() for t in own)  # nothing was written
        proc.join(20)
        proc, orders, results = _start(3.0)  # the restarted prefill instance
        again = receiver.new_prefix()  # a fresh group
        receiver.recv(3, "peer-a", again, KV3)
        orders.put((3, receiver.address, again, KV3))
        assert results.get(timeout=30) == [(3, True, None)]
        assert _wait(receiver, [3]) == {3: (True, None)}
    finally:
        orders.put(None)
        proc.join(20)
        receiver.close()
    expect = _expect(before, [KV3])
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(own, expect))


def test_a_send_naming_a_failed_group_fails_at_once():
    sender = PairTransfers(_pools(1), "gloo", "127.0.0.1", 1.0)
    try:
        sender.send(1, "127.0.0.1:1", "p1", KV)  # nobody there: the group does not form
        done = _wait(sender, [1])
        assert not done[1][0] and "did not form" in done[1][1]
        started = time.monotonic()
        sender.send(2, "127.0.0.1:1", "p1", KV)
        assert _wait(sender, [2]) == {2: (False, "its pair group failed before it ran")}
        assert time.monotonic() - started < 1.0
    finally:
        sender.close()


def test_bad_transfers_are_refused_before_anything_is_queued(monkeypatch):
    own = [torch.zeros_like(t) for t in _pools(1)]
    receiver = PairTransfers(own, "gloo", "127.0.0.1", 1.0)
    with pytest.raises(PairTransferError, match="outside a pool"):
        receiver.recv(1, "peer-a", "p", [[(0, 38, 3)], []])
    with pytest.raises(PairTransferError, match="run lists"):
        receiver.recv(2, "peer-a", "p", [[(0, 0, 1)]])
    with pytest.raises(PairTransferError, match="prefix"):
        receiver.send(3, "127.0.0.1:1", "", KV)
    monkeypatch.setattr(pair_transfers, "MAX_PEER_WORKERS", 1)
    receiver.recv(4, "peer-a", "p", KV)  # waits for a peer that never comes (its group forms within 1 s, or fails)
    with pytest.raises(PairTransferError, match="peers already"):
        receiver.recv(5, "peer-b", "p", KV)
    receiver.close()
    with pytest.raises(PairTransferError, match="closed"):
        receiver.recv(6, "peer-a", "p", KV)
    done = receiver.finished()
    assert [t for t, _, _ in done] == [4] and not done[0][1]  # the refused ones never reached a worker
    with pytest.raises(ValueError, match="nccl between CUDA pools"):
        PairTransfers(own, "nccl", "127.0.0.1", 1.0)


def test_close_fails_what_is_queued_once_each_and_comes_back_within_the_timeout():
    receiver = PairTransfers([torch.zeros_like(t) for t in _pools(1)], "gloo", "127.0.0.1", 1.0)
    for i in (1, 2, 3):
        receiver.recv(i, "nobody", "p", KV)  # the first waits for a peer that never comes
    started = time.monotonic()
    receiver.close()
    assert time.monotonic() - started < 5
    done = receiver.finished()
    assert sorted(t for t, _, _ in done) == [1, 2, 3] and not any(ok for _, ok, _ in done)
    assert {why for t, _, why in done if t != 1} == {"the pair transfers closed"}
    with pytest.raises(PairTransferError, match="closed"):
        receiver.address  # noqa: B018


def test_a_full_queue_refuses_and_an_idle_worker_retires(monkeypatch):
    monkeypatch.setattr(pair_transfers, "MAX_QUEUED", 2)
    monkeypatch.setattr(pair_transfers, "IDLE_S", 0.3)
    sender = PairTransfers(_pools(1), "gloo", "127.0.0.1", 1.0)
    try:
        sender.send(1, "127.0.0.1:1", "p1", KV)  # nobody there: fails within the timeout
        deadline = time.monotonic() + 10
        while sender._peers["127.0.0.1:1"].jobs.qsize() and time.monotonic() < deadline:
            time.sleep(0.01)  # the worker took it
        sender.send(2, "127.0.0.1:1", "p2", KV)
        sender.send(3, "127.0.0.1:1", "p3", KV)
        with pytest.raises(PairTransferError, match="already wait"):
            sender.send(4, "127.0.0.1:1", "p4", KV)
        done = _wait(sender, [1, 2, 3])
        assert sorted(done) == [1, 2, 3] and not any(ok for ok, _ in done.values())
        deadline = time.monotonic() + 10
        while sender._peers and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not sender._peers  # retired: its place is free for another peer
    finally:
        sender.close()


def test_a_peer_that_never_shows_does_not_hold_up_another_peers_group():
    own = [torch.zeros_like(t) for t in _pools(1)]
    receiver = PairTransfers(own, "gloo", "127.0.0.1", 6.0)
    proc, orders, results = _start(6.0)
    try:
        receiver.recv(1, "never", receiver.new_prefix(), KV)  # waits 6 s for its peer, on the same store
        time.sleep(0.3)
        started = time.monotonic()
        prefix = receiver.new_prefix()
        receiver.recv(2, "peer-b", prefix, KV2)
        orders.put((2, receiver.address, prefix, KV2))
        assert results.get(timeout=30) == [(2, True, None)]
        assert _wait(receiver, [2]) == {2: (True, None)}
        assert time.monotonic() - started < 4.5  # before the other peer's rendezvous gave up
    finally:
        orders.put(None)
        proc.join(20)
        receiver.close()
    assert torch.equal(own[0][:, 15:19].view(torch.int16), _pools(1)[0][:, 30:34].view(torch.int16))
