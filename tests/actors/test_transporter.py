"""Transporter without sockets or processes: the byte stream helpers and the prefill side's pull checks (the
decode side's fetch: tests/actors/test_transporter_fetch.py).

A real HostPool over a bytearray holds the bytes; the ROUTER, the peer links and the local channels are
fakes that record what would have been sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import OrderedDict
from types import SimpleNamespace

import pytest

from hkv.actors import transporter as tp
from hkv.actors.transporter import Counters, PeerError, Run, Transporter, _chunks, _receive_into
from hkv.ipc.messages import TierCommit, TierFound, TierLookup, TierRelease, TierReserved
from hkv.ipc import messages, peer_messages
from hkv.ipc.peer_messages import PeerBytes, PeerDone, PeerLookup, PeerPull, PeerRun
from hkv.storage.host_pool import HostLayout, HostPool

FP = bytes(range(16))
PEER = "tcp://127.0.0.1:5"
IDENTITY = b"router-identity-of-the-decode-side"
SENDER = b"decode-0:1:ab"
PAGE = 64  # bytes of a page entry in LAYOUT
STATE = 24  # bytes of a state entry in LAYOUT
LAYOUT = HostLayout(num_pages=8, state_units=1, kv_layers=1, page_size=2, kv_heads=1, head_dim=4,
                    kv_dtype="float32", lin_layers=1, conv_dim=2, conv_width=1, v_heads=1, k_dim=2, v_dim=2)


def key(i: int) -> bytes:
    return bytes([0x50 + i]) + i.to_bytes(15, "little")


def pattern(seed: int, n: int) -> bytes:
    return bytes((seed * 31 + j * 7 + 1) % 251 for j in range(n))


def views_of(sizes: list[int]) -> tuple[list[bytearray], list[memoryview]]:
    buffers = [bytearray(n) for n in sizes]
    return buffers, [memoryview(b) for b in buffers]


def test_the_fixture_layout_has_the_sizes_the_tests_assume():
    assert (LAYOUT.page_bytes, LAYOUT.state_bytes, LAYOUT.num_states) == (PAGE, STATE, 8)


# _chunks: the views' bytes, cut into pieces of at most CHUNK_BYTES


def test_chunks_cut_inside_and_across_views(monkeypatch):
    monkeypatch.setattr(tp, "CHUNK_BYTES", 4)
    views = [memoryview(b"abc"), memoryview(b"defgh"), memoryview(b"ij")]
    assert list(_chunks(views)) == [b"abcd", b"efgh", b"ij"]


def test_a_boundary_on_a_view_end_yields_no_empty_piece(monkeypatch):
    monkeypatch.setattr(tp, "CHUNK_BYTES", 4)
    assert list(_chunks([memoryview(b"abcd"), memoryview(b"efgh")])) == [b"abcd", b"efgh"]
    assert list(_chunks([memoryview(b"ab"), memoryview(b""), memoryview(b"cd")])) == [b"abcd"]
    assert list(_chunks([])) == []
    assert list(_chunks([memoryview(b"")])) == []


def test_a_view_longer_than_several_chunks(monkeypatch):
    monkeypatch.setattr(tp, "CHUNK_BYTES", 3)
    assert list(_chunks([memoryview(b"x"), memoryview(b"0123456789")])) == [b"x01", b"234", b"567", b"89"]


@pytest.mark.parametrize("chunk", [1, 5, 64, 100, 1 << 20])
def test_chunks_concatenate_to_the_input_and_all_but_the_last_are_full(monkeypatch, chunk):
    monkeypatch.setattr(tp, "CHUNK_BYTES", chunk)
    rng = random.Random(chunk)
    sources = [pattern(i, rng.choice([0, 1, 7, 64, 100, 333])) for i in range(12)]
    pieces = list(_chunks([memoryview(bytearray(s)) for s in sources]))
    assert b"".join(pieces) == b"".join(sources)
    assert all(isinstance(p, bytes) and 0 < len(p) <= chunk for p in pieces)
    assert all(len(p) == chunk for p in pieces[:-1])


def test_the_pieces_are_copies_not_views_of_the_pool():
    source = bytearray(b"pinned entry bytes")
    (piece,) = _chunks([memoryview(source)])  # the default CHUNK_BYTES: one piece
    source[:] = bytes(len(source))
    assert piece == b"pinned entry bytes"


def test_the_default_chunk_is_the_wire_bound():
    data = bytes(tp.CHUNK_BYTES + 10)
    assert [len(p) for p in _chunks([memoryview(data)])] == [tp.CHUNK_BYTES, 10]


# _receive_into: the stream, checked, written into the reserved views


def stream(fetch_id: int, data: bytes, cuts: list[int]) -> list[PeerBytes]:
    edges = [0, *cuts, len(data)]
    return [PeerBytes(fetch_id, a, data[a:b], b == len(data)) for a, b in zip(edges, edges[1:])]


async def receive(messages, sizes: list[int]) -> list[bytearray]:
    queue: asyncio.Queue = asyncio.Queue()
    for msg in messages:
        queue.put_nowait(msg)
    buffers, views = views_of(sizes)
    await _receive_into(queue, views)
    assert queue.empty()  # it stops at the last slice
    return buffers


@pytest.mark.parametrize("cuts", [[], [1], [5], [4, 5, 8], [2, 9, 11, 14], list(range(1, 15))])
async def test_a_stream_lands_in_the_views_whatever_the_cuts(cuts):
    data = pattern(3, 15)
    buffers = await receive(stream(1, data, cuts), [5, 3, 7])
    assert [bytes(b) for b in buffers] == [data[:5], data[5:8], data[8:]]


async def test_a_stream_of_real_entry_sizes_in_wire_sized_slices():
    data = pattern(9, 2 * PAGE + STATE)
    buffers = await receive(stream(4, data, list(range(10, len(data), 10))), [PAGE, PAGE, STATE])
    assert b"".join(buffers) == data


async def test_an_empty_slice_before_the_end_is_harmless():
    data = pattern(1, 8)
    messages = [PeerBytes(1, 0, data[:3], False), PeerBytes(1, 3, b"", False), PeerBytes(1, 3, data[3:], True)]
    assert b"".join(await receive(messages, [4, 4])) == data


async def test_a_message_after_the_last_slice_is_left_in_the_queue():
    data = pattern(2, 6)
    queue: asyncio.Queue = asyncio.Queue()
    for msg in [*stream(1, data, [3]), PeerBytes(1, 6, b"late", True)]:
        queue.put_nowait(msg)
    buffers, views = views_of([6])
    await _receive_into(queue, views)
    assert bytes(buffers[0]) == data and queue.qsize() == 1


@pytest.mark.parametrize("messages,why", [
    ([PeerBytes(1, 1, b"abcdefghi", True)], "bytes at 1+9 for a stream at 0 of 10"),  # a gap at the start
    ([PeerBytes(1, 0, b"abcd", False), PeerBytes(1, 3, b"defghij", True)],
     "bytes at 3+7 for a stream at 4 of 10"),  # an overlap
    ([PeerBytes(1, 0, b"abcd", False), PeerBytes(1, 5, b"fghij", True)], "bytes at 5+5 for a stream at 4 of 10"),
    ([PeerBytes(1, 0, b"abcdefghijk", True)], "bytes at 0+11 for a stream at 0 of 10"),  # past the total
    ([PeerBytes(1, 0, b"abcdef", False), PeerBytes(1, 6, b"ghijk", False)], "bytes at 6+5 for a stream at 6 of 10"),
    ([PeerBytes(1, 0, b"abcd", True)], "bytes at 0+4 for a stream at 0 of 10"),  # last too early
    ([PeerBytes(1, 0, b"abcdefghij", False)], "bytes at 0+10 for a stream at 0 of 10"),  # the end without last
    ([PeerRun(1, 0, False, "the run expired")], "the run expired"),
    ([PeerBytes(1, 0, b"abc", False), PeerRun(1, 0, False, "no such run")], "no such run"),
    ([PeerRun(1, 2, True)], "an answer out of turn"),  # a second run where bytes are due
    ([PeerBytes(1, 0, b"abc", False), PeerRun(1, 2, True, "")], "an answer out of turn"),
    ([PeerBytes(1, 0, b"ab", False), PeerLookup(1, "", b"", [], False)], "an answer out of turn"),
])  # fmt: skip
async def test_a_bad_stream_raises_peer_error_saying_why(messages, why):
    with pytest.raises(PeerError) as e:
        await receive(messages, [4, 6])
    assert str(e.value) == why


async def test_nothing_is_written_past_a_rejected_slice():
    buffers, views = views_of([4, 6])
    queue: asyncio.Queue = asyncio.Queue()
    for msg in [PeerBytes(1, 0, b"abcd", False), PeerBytes(1, 4, b"efghijXX", True)]:
        queue.put_nowait(msg)
    with pytest.raises(PeerError):
        await _receive_into(queue, views)
    assert bytes(buffers[0]) == b"abcd" and bytes(buffers[1]) == bytes(6)


# Fakes for the Transporter's edges


class Outbox:
    """A local channel (Sender): what it was given, in order."""

    def __init__(self):
        self.sent: list = []

    async def send(self, msg) -> None:
        self.sent.append(msg)

    def send_nowait(self, msg) -> bool:
        self.sent.append(msg)
        return True


class Wire:
    """A SealedSocket's send: (identity, message) pairs, in order."""

    def __init__(self):
        self.sent: list = []

    async def send(self, msg, identity: bytes | None = None) -> None:
        self.sent.append((identity, msg))

    def close(self) -> None:
        pass


def make_transporter(stall_s: float = 0.0) -> Transporter:
    """What Transporter.__init__ builds, minus sockets, channels and the stats block."""
    t = Transporter.__new__(Transporter)
    t.cfg = SimpleNamespace(server=SimpleNamespace(pd_stall_pull_s=stall_s))
    t.layout = LAYOUT
    t.fingerprint = FP
    t.host = HostPool(LAYOUT, memoryview(bytearray(LAYOUT.nbytes)))
    t.timeout = 30.0
    t.server = Wire()
    t.to_cache = Outbox()
    t.to_router = Outbox()
    t.changed = asyncio.Event()
    t.ids = iter(range(1000, 2000))
    t.asks = {}
    t.runs = {}
    t.links = OrderedDict()
    t.fetch_slots = asyncio.Semaphore(4)
    t.counters = Counters()
    return t


def fill(t: Transporter, pages: dict[int, int], states: dict[int, int]) -> None:
    """Write a recognisable pattern into page entries and state entries (entry -> seed)."""
    for entry, seed in pages.items():
        t.host.page_view(entry)[:] = pattern(seed, PAGE)
    for entry, seed in states.items():
        t.host.state_view(entry)[:] = pattern(seed, STATE)


# The prefill side: serve_pull checks the pull against the pinned run before reading a byte


def pinned(t: Transporter, fetch_id: int = 7, entries=(1, 3, 4), state_entry: int | None = 6) -> tuple:
    key = (SENDER, fetch_id)
    t.runs[key] = Run(IDENTITY, 1 << 48, list(entries), state_entry, deadline=1e18)
    fill(t, {e: 10 + e for e in entries}, {} if state_entry is None else {state_entry: 99})
    return key


REFUSED = "no such run, or a pull outside it"


@pytest.mark.parametrize("wanted,state", [
    ([3], False),  # past the run's 3 pages
    ([0, 1, 2, 3], True),
    ([-1], False),
    ([-1, 0], False),
    ([1, 0], False),  # unordered
    ([0, 2, 1], True),
    ([1, 1], False),  # repeated
    ([], False),  # asks for nothing
])  # fmt: skip
async def test_a_pull_outside_the_run_is_refused_with_no_bytes(wanted, state):
    t = make_transporter()
    key = pinned(t)
    await t.serve_pull(IDENTITY, key, PeerPull(7, wanted, state))
    assert t.server.sent == [(IDENTITY, PeerRun(7, 0, False, REFUSED))]
    assert (t.counters.pages_sent, t.counters.bytes_sent) == (0, 0)
    assert key in t.runs  # a bad pull does not unpin: PeerDone or the timeout does


async def test_the_state_of_a_run_without_one_is_refused():
    t = make_transporter()
    key = pinned(t, state_entry=None)
    await t.serve_pull(IDENTITY, key, PeerPull(7, [0], True))
    assert t.server.sent == [(IDENTITY, PeerRun(7, 0, False, REFUSED))]


@pytest.mark.parametrize("key", [(SENDER, 8), (b"another-sender", 7)])
async def test_a_pull_for_an_unknown_fetch_is_refused(key):
    t = make_transporter()
    pinned(t)
    await t.serve_pull(IDENTITY, key, PeerPull(key[1], [0], False))
    assert t.server.sent == [(IDENTITY, PeerRun(key[1], 0, False, REFUSED))]


async def test_a_pull_while_the_lookup_is_still_out_is_refused():
    t = make_transporter()
    key = (SENDER, 7)
    t.runs[key] = Run(IDENTITY, 1 << 48, [], None, deadline=1e18)  # serve_lookup's placeholder
    await t.serve_pull(IDENTITY, key, PeerPull(7, [0], False))
    assert t.server.sent == [(IDENTITY, PeerRun(7, 0, False, REFUSED))]


async def test_a_good_pull_sends_the_exact_bytes_in_order_last_only_on_the_final_slice(monkeypatch):
    monkeypatch.setattr(tp, "CHUNK_BYTES", 50)
    t = make_transporter()
    key = pinned(t, entries=(1, 3, 4), state_entry=6)
    await t.serve_pull(IDENTITY, key, PeerPull(7, [0, 2], True))
    expected = pattern(11, PAGE) + pattern(14, PAGE) + pattern(99, STATE)  # entries 1 and 4, then the state
    assert all(identity == IDENTITY for identity, _ in t.server.sent)
    slices = [msg for _, msg in t.server.sent]
    assert all(isinstance(m, PeerBytes) and m.fetch_id == 7 for m in slices)
    assert [(m.offset, len(m.data), m.last) for m in slices] == [(0, 50, False), (50, 50, False), (100, 50, False),
                                                                 (150, 2, True)]
    assert b"".join(m.data for m in slices) == expected
    assert (t.counters.pages_sent, t.counters.bytes_sent) == (2, 2 * PAGE + STATE)


async def test_a_pull_of_the_state_alone_or_pages_alone():
    t = make_transporter()
    key = pinned(t)
    await t.serve_pull(IDENTITY, key, PeerPull(7, [], True))
    await t.serve_pull(IDENTITY, key, PeerPull(7, [1], False))
    assert [msg for _, msg in t.server.sent] == [PeerBytes(7, 0, pattern(99, STATE), True),
                                                 PeerBytes(7, 0, pattern(13, PAGE), True)]


async def test_a_run_unpinned_during_a_stalled_pull_sends_nothing(monkeypatch):
    t = make_transporter(stall_s=0.01)
    key = pinned(t)
    pull = asyncio.create_task(t.serve_pull(IDENTITY, key, PeerPull(7, [0], False)))
    await asyncio.sleep(0)
    t.unpin(key)
    await pull
    assert t.server.sent == [] and t.to_cache.sent == [TierRelease(1 << 48)]


# The prefill side: serve_peers hands each ask to its step


class PeerFrames(Wire):
    """The ROUTER's SealedSocket: `recv` gives the frames the test queued, then waits forever."""

    def __init__(self, frames: list[tuple[bytes, bytes, object]]):
        super().__init__()
        self.frames = list(frames)
        self.drained = asyncio.Event()

    async def recv(self, type_):
        if self.frames:
            return self.frames.pop(0)
        self.drained.set()
        await asyncio.Event().wait()


@contextlib.asynccontextmanager
async def serving(t: Transporter, frames):
    t.server = PeerFrames(frames)
    task = asyncio.create_task(t.serve_peers())
    await until(lambda: task.done() or t.server.drained.is_set())
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


async def test_serve_peers_refuses_a_bad_pull_and_unpins_on_done():
    t = make_transporter()
    key = pinned(t, fetch_id=7)
    frames = [(IDENTITY, SENDER, PeerPull(7, [5], False)), (IDENTITY, SENDER, PeerDone(7)),
              (IDENTITY, SENDER, PeerDone(8)), (IDENTITY, b"another-sender", PeerDone(7))]
    async with serving(t, frames) as task:
        await until(lambda: t.server.sent)
        assert not task.done()
        assert t.server.sent == [(IDENTITY, PeerRun(7, 0, False, REFUSED))]
        assert key not in t.runs and t.to_cache.sent == [TierRelease(1 << 48)]  # once: unknown dones change nothing


async def test_serve_peers_keys_a_lookup_by_its_authenticated_sender():
    t = make_transporter()
    async with serving(t, [(IDENTITY, SENDER, peer_lookup(fetch_id=9))]) as task:
        await until(lambda: t.to_cache.sent)
        assert not task.done() and list(t.runs) == [(SENDER, 9)]
        assert isinstance(t.to_cache.sent[0], TierLookup) and t.to_cache.sent[0].to_transporter


async def test_serve_peers_forwards_a_peer_release_to_the_router_and_keeps_serving():
    t = make_transporter()
    async with serving(t, [(IDENTITY, SENDER, peer_messages.PeerRelease(5))]) as task:
        assert not task.done()
        assert t.to_router.sent == [messages.PdHoldRelease(5)]


# The prefill side: lookups refused before the cache worker is asked


def peer_lookup(**changes) -> PeerLookup:
    fields = dict(fetch_id=7, layout=LAYOUT.descriptor, root=FP, keys=[key(0), key(1)], need_state=True)
    return PeerLookup(**{**fields, **changes})


@pytest.mark.parametrize("changes,why", [
    (dict(layout="kv:2x1x4x1x4:float32"), "another model or layout"),
    (dict(layout="kv:2x1x2x1x4:float8_e4m3fn"), "another KV cache dtype (--kv-cache-dtype): the prefill instance "
                                                "stores float32 pages, the decode instance float8_e4m3fn"),
    (dict(root=bytes(16)), "another model or layout"),
    (dict(layout=LAYOUT.descriptor + "|tp2"), "another tensor parallelism (--tp): the decode instance's pages are "
                                              "split over 2 ranks, the prefill instance's over 1"),
    (dict(layout=LAYOUT.descriptor + "|tpx"), "another tensor parallelism (--tp): the decode instance's pages are "
                                              "split over an unreadable number of ranks"),
    (dict(keys=[]), "bad keys"),
    (dict(keys=[key(0), b"short"]), "bad keys"),
    (dict(keys=[key(0)] * (tp.MAX_KEYS + 1)), "bad keys"),
])  # fmt: skip
async def test_a_lookup_that_cannot_be_served_is_answered_at_once(changes, why):
    t = make_transporter()
    await t.serve_lookup(IDENTITY, (SENDER, 7), peer_lookup(**changes))
    ((identity, run),) = t.server.sent
    assert identity == IDENTITY and (run.fetch_id, run.pages, run.state) == (7, 0, False)
    assert run.error.startswith(why)
    assert t.to_cache.sent == [] and t.runs == {}


async def test_a_fetch_id_in_use_or_too_many_runs_is_refused():
    t = make_transporter()
    pinned(t)
    await t.serve_lookup(IDENTITY, (SENDER, 7), peer_lookup())
    for i in range(tp.MAX_RUNS - 1):
        t.runs[(b"other", i)] = Run(b"x", i, [0], None, 1e18)
    await t.serve_lookup(IDENTITY, (SENDER, 8), peer_lookup(fetch_id=8))
    assert [msg.error for _, msg in t.server.sent] == ["fetch id in use", "busy"]
    assert t.to_cache.sent == []


async def until(condition, turns: int = 100) -> None:
    """Let the other tasks run until `condition()` holds (no clock involved)."""
    for _ in range(turns):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("the condition never held")


async def test_a_lookup_pins_the_run_the_cache_worker_found():
    t = make_transporter()
    serve = asyncio.create_task(t.serve_lookup(IDENTITY, (SENDER, 7), peer_lookup()))
    await until(lambda: t.to_cache.sent)
    (ask,) = t.to_cache.sent
    assert ask == TierLookup(1000, 0, [key(0), key(1)], True, None, to_transporter=True)
    t.local(TierFound(1000, 0, [5, 2], [False, False], 3), tasks=None)
    await serve
    assert t.server.sent == [(IDENTITY, PeerRun(7, 2, True))]
    run = t.runs[(SENDER, 7)]
    assert (run.identity, run.lookup_id, run.entries, run.state_entry) == (IDENTITY, 1000, [5, 2], 3)
    t.unpin((SENDER, 7))
    assert t.to_cache.sent[-1] == TierRelease(1000) and t.runs == {}


async def test_a_found_run_out_of_range_is_released_and_answered_as_a_tier_error():
    t = make_transporter()
    serve = asyncio.create_task(t.serve_lookup(IDENTITY, (SENDER, 7), peer_lookup()))
    await until(lambda: t.to_cache.sent)
    t.local(TierFound(1000, 0, [5, LAYOUT.num_pages], [False, False], 3), tasks=None)
    await serve
    assert t.server.sent == [(IDENTITY, PeerRun(7, 0, False, "tier error"))]
    assert t.to_cache.sent[-1] == TierRelease(1000) and t.runs == {} and t.counters.malformed == 1


def test_an_answer_nobody_waits_for_is_given_back():
    t = make_transporter()
    t.local(TierFound(55, 0, [1, 2], [False, False], None), tasks=None)
    t.local(TierReserved(56, [None, 3], None), tasks=None)
    t.local(TierReserved(57, [None, None], None), tasks=None)  # reserved nothing: nothing to give back
    assert t.to_cache.sent == [TierRelease(55), TierCommit(56, False)]
    assert t.counters.malformed == 3
