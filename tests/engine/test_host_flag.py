"""hkv/engine/host_flag.py: the release order of flag values (CPU), and on a GPU the flag itself: a stream
waits until another thread sets it, and what runs after the wait sees the bytes written before the flag."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from hkv.engine.host_flag import MASK32, FlagSequence, supported


def test_values_pass_in_order_even_when_released_out_of_order():
    stores: list[int] = []
    seq = FlagSequence(stores.append)
    values = [seq.take() for _ in range(4)]
    assert values == [1, 2, 3, 4] and seq.outstanding == 4
    seq.release(2)  # a launch that failed after queueing its wait: 1's step still waits for its masks
    assert stores == []
    seq.release(1)
    assert stores == [2] and seq.outstanding == 2
    seq.release(2)  # twice, or a value already passed: nothing moves
    seq.release(4)
    assert stores == [2]
    seq.release(3)
    assert stores == [2, 4] and seq.outstanding == 0


def test_release_all_lets_every_queued_wait_pass_once():
    stores: list[int] = []
    seq = FlagSequence(stores.append)
    for _ in range(3):
        seq.take()
    seq.release(1)
    seq.release_all()
    seq.release_all()
    seq.release(3)  # a fill that ends after the shutdown's release
    assert stores == [1, 3] and seq.outstanding == 0
    assert seq.take() == 4  # later values go on from there
    seq.release(99)  # never handed out: ignored
    assert stores == [1, 3]


def test_supported_says_why_not_off_cuda():
    support = supported("cpu")
    assert not support and "not a CUDA device" in support.reason


def _wait_for(event: torch.cuda.Event, what: str, flag, seconds: float = 10.0) -> None:
    """Poll `event` until it is done; past `seconds`, release every wait (so the process can exit) and fail
    saying which wait never passed, instead of blocking in cudaEventSynchronize forever."""
    deadline = time.perf_counter() + seconds
    while not event.query():
        if time.perf_counter() > deadline:
            flag.set(flag.value + 2**30)  # every wait queued here passes: the stream drains
            pytest.fail(f"{what}: the stream did not pass its wait within {seconds} s (flag {flag.value})")
        time.sleep(0.001)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_stream_waits_for_a_flag_another_thread_sets_and_sees_what_was_written_before_it():
    from hkv.engine.host_flag import HostFlag

    device = torch.device("cuda")
    support = supported(device)
    assert support, support.reason
    flag = HostFlag(device)
    assert flag.value == 0
    host = torch.zeros(1024, dtype=torch.int32, pin_memory=True)
    stream = torch.cuda.Stream(device)
    done = torch.cuda.Event()
    # nothing behind the wait allocates or loads a kernel first: a device allocation may synchronize the device
    # (the 2026-12-06 H100 run hung here, the writer not yet started), and so may a lazily loaded kernel
    got = torch.zeros(1024, dtype=torch.int32, device=device)
    doubled = torch.zeros_like(got)
    torch.mul(got, 2, out=doubled)
    torch.cuda.synchronize(device)
    with torch.cuda.stream(stream):
        flag.wait(1, stream)
        got.copy_(host, non_blocking=True)  # the copy engine reads host memory after the wait
        torch.mul(got, 2, out=doubled)
        done.record(stream)

    def writer() -> None:
        time.sleep(0.05)
        host.copy_(torch.arange(1024, dtype=torch.int32))
        flag.set(1)

    started = time.perf_counter()
    thread = threading.Thread(target=writer)
    thread.start()
    time.sleep(0.01)
    assert not done.query()  # still waiting for the flag
    _wait_for(done, "the wait for 1, set by another thread", flag)
    waited = time.perf_counter() - started
    thread.join()
    assert waited >= 0.045, waited
    assert torch.equal(doubled.cpu(), torch.arange(1024, dtype=torch.int32) * 2)
    # the comparison is cyclic: a value past 2**32 wraps and still passes earlier waits
    flag.set(MASK32)
    flag.wait(MASK32 - 5, stream)
    flag.set(MASK32 + 3)
    flag.wait(MASK32 + 2, stream)
    wrapped = torch.cuda.Event()
    wrapped.record(stream)
    _wait_for(wrapped, "the waits across 2**32", flag)
