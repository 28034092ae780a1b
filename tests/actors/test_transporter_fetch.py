"""Transporter, the decode side without sockets: a fetch is a transaction on the CPU tier (commit on success,
roll back on every failure). The fakes are tests/actors/test_transporter.py's."""

from __future__ import annotations

import asyncio

import pytest

from hkv.actors.transporter import Link, PeerError, Transporter
from hkv.ipc.messages import PdFetch, PdFetched, TierCommit, TierReserve, TierReserved
from hkv.ipc.peer_messages import PeerBytes, PeerDone, PeerLookup, PeerPull, PeerRun
from tests.actors.test_transporter import (
    FP, LAYOUT, PAGE, PEER, STATE, Wire, key, make_transporter, pattern, stream, until,
)  # fmt: skip


# The decode side: a fetch is a transaction on the CPU tier


class Fetch:
    """One `_fetch` running against a fake link; the test plays the peer and the cache worker."""

    def __init__(self, t: Transporter, fetch_id: int = 21, pages: int = 3, need_state: bool = True):
        self.t = t
        self.wire = Wire()
        self.link = Link(self.wire)
        t.links[PEER] = self.link
        self.msg = PdFetch(fetch_id, PEER, [key(i) for i in range(pages)], need_state)
        self.task = asyncio.create_task(t._fetch(self.msg))

    async def started(self) -> asyncio.Queue:
        await until(lambda: self.wire.sent)
        return self.link.fetches[self.msg.fetch_id]

    async def reserve(self, answer) -> None:
        await until(lambda: any(isinstance(m, TierReserve) for m in self.t.to_cache.sent))
        self.t.local(answer, tasks=None)

    def peer_sent(self) -> list:
        return [msg for _, msg in self.wire.sent]


async def test_a_fetch_pulls_what_the_tier_lacks_and_commits():
    t = make_transporter()
    fetch = Fetch(t)
    queue = await fetch.started()
    assert fetch.peer_sent() == [PeerLookup(21, LAYOUT.descriptor, FP, fetch.msg.keys, True)]
    queue.put_nowait(PeerRun(21, 3, True))
    await fetch.reserve(TierReserved(1000, [None, 2, 5], 7))  # page 0 is here already
    await until(lambda: len(fetch.wire.sent) == 2)
    assert fetch.peer_sent()[1] == PeerPull(21, [1, 2], True)
    data = pattern(1, PAGE) + pattern(2, PAGE) + pattern(3, STATE)
    for msg in stream(21, data, [30, 100]):
        queue.put_nowait(msg)
    assert await fetch.task == [1, 2]
    assert bytes(t.host.page_view(2)) == pattern(1, PAGE) and bytes(t.host.page_view(5)) == pattern(2, PAGE)
    assert bytes(t.host.state_view(7)) == pattern(3, STATE)
    assert t.to_cache.sent == [TierReserve(1000, fetch.msg.keys, True, to_transporter=True), TierCommit(1000, True)]
    assert fetch.peer_sent()[2:] == [PeerDone(21)]
    assert fetch.link.fetches == {} and t.asks == {}
    assert (t.counters.pages_received, t.counters.bytes_received) == (2, 2 * PAGE + STATE)


async def test_a_run_the_tier_holds_entirely_moves_nothing_and_commits_nothing():
    t = make_transporter()
    fetch = Fetch(t)
    (await fetch.started()).put_nowait(PeerRun(21, 3, True))
    await fetch.reserve(TierReserved(1000, [None, None, None], None))
    assert await fetch.task == []
    assert [type(m) for m in t.to_cache.sent] == [TierReserve]
    assert fetch.peer_sent()[1:] == [PeerDone(21)]


async def test_an_empty_run_moves_nothing_and_reserves_nothing():
    t = make_transporter()
    fetch = Fetch(t)
    (await fetch.started()).put_nowait(PeerRun(21, 0, False))
    assert await fetch.task == []
    assert t.to_cache.sent == [] and fetch.peer_sent()[1:] == [PeerDone(21)]


@pytest.mark.parametrize("run,why", [
    (PeerRun(21, 0, False, "busy"), "busy"),
    (PeerBytes(21, 0, b"x", True), "an answer out of turn"),
    (PeerRun(21, 4, True), "a run of 4 pages for 3 keys"),
    (PeerRun(21, -1, False), "a run of -1 pages for 3 keys"),
    (PeerRun(21, 0, True), "a run of 0 pages for 3 keys"),  # a state with no pages
    (PeerRun(21, 2, False), "a run of 2 pages for 3 keys"),  # hybrid: no checkpoint at its end
])  # fmt: skip
async def test_a_bad_run_fails_before_anything_is_reserved(run, why):
    t = make_transporter()
    fetch = Fetch(t)
    (await fetch.started()).put_nowait(run)
    with pytest.raises(PeerError) as e:
        await fetch.task
    assert str(e.value) == why
    assert t.to_cache.sent == [] and fetch.peer_sent()[1:] == [PeerDone(21)] and fetch.link.fetches == {}


@pytest.mark.parametrize("reserved", [
    TierReserved(1000, [None, 2], 7),  # one entry short
    TierReserved(1000, [None, 2, LAYOUT.num_pages], 7),
    TierReserved(1000, [None, 2, -1], 7),
    TierReserved(1000, [None, 2, 5], LAYOUT.num_states),
])  # fmt: skip
async def test_a_reservation_out_of_range_is_rolled_back(reserved):
    t = make_transporter()
    fetch = Fetch(t)
    (await fetch.started()).put_nowait(PeerRun(21, 3, True))
    await fetch.reserve(reserved)
    with pytest.raises(PeerError, match="reservation out of range"):
        await fetch.task
    assert t.to_cache.sent[1:] == [TierCommit(1000, False)] and t.counters.malformed == 1
    assert fetch.peer_sent()[1:] == [PeerDone(21)]


async def test_a_state_reserved_for_a_run_without_one_is_rolled_back():
    t = make_transporter()
    fetch = Fetch(t, need_state=False)
    (await fetch.started()).put_nowait(PeerRun(21, 3, False))
    await fetch.reserve(TierReserved(1000, [1, 2, 3], 4))
    with pytest.raises(PeerError):
        await fetch.task
    assert t.to_cache.sent[1:] == [TierCommit(1000, False)]


async def pulling() -> tuple:
    """A fetch past its reservation (pages 1 and 2 of a 3-page run, and the state), waiting for bytes."""
    t = make_transporter()
    fetch = Fetch(t)
    queue = await fetch.started()
    queue.put_nowait(PeerRun(21, 3, True))
    await fetch.reserve(TierReserved(1000, [None, 2, 5], 7))
    await until(lambda: len(fetch.wire.sent) == 2)
    return t, fetch, queue


async def test_a_bad_stream_rolls_the_reservation_back():
    t, fetch, queue = await pulling()
    queue.put_nowait(PeerBytes(21, 0, pattern(1, PAGE), False))
    queue.put_nowait(PeerBytes(21, PAGE + 1, b"skipped a byte", False))
    with pytest.raises(PeerError, match="bytes at 65"):
        await fetch.task
    assert t.to_cache.sent[1:] == [TierCommit(1000, False)]
    assert fetch.peer_sent()[2:] == [PeerDone(21)] and t.counters.pages_received == 0


async def test_a_fetch_cancelled_mid_stream_rolls_back_and_says_done():
    t, fetch, queue = await pulling()
    queue.put_nowait(PeerBytes(21, 0, pattern(1, 10), False))
    await asyncio.sleep(0)
    fetch.task.cancel()  # what wait_for does on --pd-timeout
    with pytest.raises(asyncio.CancelledError):
        await fetch.task
    assert t.to_cache.sent[1:] == [TierCommit(1000, False)]
    assert fetch.peer_sent()[2:] == [PeerDone(21)] and fetch.link.fetches == {}


async def test_a_second_fetch_with_an_id_in_flight_is_refused():
    t = make_transporter()
    first = Fetch(t)
    await first.started()
    with pytest.raises(PeerError, match="fetch id in use"):
        await t._fetch(first.msg)
    assert 21 in first.link.fetches  # the first one's queue is untouched, and its run not released
    assert first.peer_sent() == [PeerLookup(21, LAYOUT.descriptor, FP, first.msg.keys, True)]
    first.task.cancel()


async def test_fetch_answers_the_router_with_the_reason():
    t = make_transporter()
    t.links[PEER] = link = Link(Wire())
    task = asyncio.create_task(t.fetch(PdFetch(30, PEER, [key(0)], False)))
    await until(lambda: 30 in link.fetches)
    link.fetches[30].put_nowait(PeerRun(30, 0, False, "busy"))
    await task
    assert t.to_router.sent == [PdFetched(30, False, [], f"transfer from {PEER} failed: busy")]
    assert (t.counters.fetches_ok, t.counters.fetches_failed) == (0, 1)


async def test_fetch_refuses_a_peer_that_is_not_an_address():
    t = make_transporter()
    await t.fetch(PdFetch(31, "tcp://localhost:5", [key(0)], False))
    ((answer),) = t.to_router.sent
    assert (answer.fetch_id, answer.ok, answer.moved) == (31, False, [])
    assert "tcp://<ip>:<port>" in answer.error and t.links == {}
