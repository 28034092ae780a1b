"""SealedSocket over a real ROUTER/DEALER pair on loopback tcp: delivery, order, and every rejected frame."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import msgspec
import pytest
import zmq
import zmq.asyncio

from hkv.ipc.auth import REASONS, Signer, Verifier
from hkv.ipc.peer_messages import (
    MAX_FRAME_PAYLOAD, PeerAnswer, PeerAsk, PeerBytes, PeerDone, PeerLookup, PeerPull, PeerRun,
)  # fmt: skip
from hkv.ipc.peer_socket import EXTRA_REASONS, SealedSocket, tcp_socket

SECRET = bytes(range(32))
OTHER_SECRET = bytes(range(1, 33))
PREFILL = b"prefill-0:1:aa"
DECODE = b"decode-0:2:bb"
DEALER_ID = b"dealer-routing-id"
INTRUDER = b"intruder"  # hand-sealed frames: a sender of its own, so its sequences meet no real Signer's
WAIT_S = 5.0  # a frame on loopback arrives in microseconds; this only bounds a broken test


@dataclass
class Pair:
    zctx: zmq.asyncio.Context
    server: SealedSocket  # the prefill side's bound ROUTER
    client: SealedSocket  # the decode side's connected DEALER
    rejects: dict[str, int]  # on_reject calls per side

    async def to_server(self, *parts: bytes) -> None:
        """Raw parts from the DEALER, past its Signer (the ROUTER prepends the identity)."""
        await self.client.sock.send_multipart(list(parts))

    async def to_client(self, *parts: bytes) -> None:
        await self.server.sock.send_multipart([DEALER_ID, *parts])


def lookup(fetch_id: int) -> PeerLookup:
    return PeerLookup(fetch_id, "layout-v1", bytes(16), [bytes([i]) * 16 for i in range(3)], True)


def sealed(msg, sender: bytes = INTRUDER, secret: bytes = SECRET, first: int = 1) -> bytes:
    payload = msg if isinstance(msg, bytes) else msgspec.msgpack.encode(msg)
    return Signer(secret, sender, first=first).seal(payload)


async def recv(sock: SealedSocket, type_):
    return await asyncio.wait_for(sock.recv(type_), WAIT_S)


def zero_counts(**nonzero) -> dict[str, int]:
    return {**dict.fromkeys((*REASONS, *EXTRA_REASONS, "accepted"), 0), **nonzero}


@pytest.fixture
async def pair():
    zctx = zmq.asyncio.Context()
    rejects = {"server": 0, "client": 0}

    def counter(side):
        def bump():
            rejects[side] += 1
        return bump

    router = tcp_socket(zctx, zmq.ROUTER, MAX_FRAME_PAYLOAD + 1024)
    router.bind("tcp://127.0.0.1:*")
    address = router.getsockopt_string(zmq.LAST_ENDPOINT)
    dealer = tcp_socket(zctx, zmq.DEALER, MAX_FRAME_PAYLOAD + 1024)
    dealer.setsockopt(zmq.ROUTING_ID, DEALER_ID)
    dealer.connect(address)
    server = SealedSocket(router, Signer(SECRET, PREFILL), Verifier(SECRET, max_payload=MAX_FRAME_PAYLOAD),
                          routed=True, on_reject=counter("server"))
    client = SealedSocket(dealer, Signer(SECRET, DECODE), Verifier(SECRET, max_payload=MAX_FRAME_PAYLOAD),
                          routed=False, on_reject=counter("client"))
    writers = [asyncio.create_task(server.run_writer()), asyncio.create_task(client.run_writer())]
    # The ROUTER drops frames for an identity it has not met: one exchange first, then counts from zero.
    await client.send(PeerDone(0))
    assert (await recv(server, PeerAsk))[2] == PeerDone(0)
    server.verifier.accepted = 0
    yield Pair(zctx, server, client, rejects)
    for task in writers:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    server.close()
    client.close()
    zctx.term()


# Delivery


async def test_a_lookup_arrives_with_the_dealer_identity_and_sender_and_the_answer_goes_back(pair):
    await pair.client.send(lookup(7))
    identity, sender, msg = await recv(pair.server, PeerAsk)
    assert identity == DEALER_ID and sender == DECODE
    assert msg == lookup(7) and isinstance(msg, PeerLookup)
    await pair.server.send(PeerRun(7, 3, True), identity)
    assert await recv(pair.client, PeerAnswer) == (None, PREFILL, PeerRun(7, 3, True))
    assert pair.server.counts() == zero_counts(accepted=1)
    assert pair.client.counts() == zero_counts(accepted=1)
    assert pair.rejects == {"server": 0, "client": 0}


async def test_every_union_member_decodes_as_itself(pair):
    asks = [lookup(1), PeerPull(1, [0, 2], True), PeerDone(1)]
    for msg in asks:
        await pair.client.send(msg)
    assert [(await recv(pair.server, PeerAsk))[2] for _ in asks] == asks
    answers = [PeerRun(1, 0, False, "busy"), PeerBytes(1, 0, b"\x00\xff" * 10, False), PeerBytes(1, 20, b"", True)]
    for msg in answers:
        await pair.server.send(msg, DEALER_ID)
    assert [(await recv(pair.client, PeerAnswer))[2] for _ in answers] == answers


async def test_two_hundred_frames_keep_their_order_and_none_is_a_replay(pair):
    for i in range(200):
        await pair.client.send(PeerDone(i))
    got = [(await recv(pair.server, PeerAsk))[2].fetch_id for _ in range(200)]
    assert got == list(range(200))
    for i in range(200):
        await pair.server.send(PeerBytes(5, i, bytes([i % 256]) * 100, i == 199), DEALER_ID)
    got = [(await recv(pair.client, PeerAnswer))[2].offset for _ in range(200)]
    assert got == list(range(200))
    assert pair.server.counts() == zero_counts(accepted=200)
    assert pair.client.counts() == zero_counts(accepted=200)


async def test_a_large_bytes_frame_passes_the_size_bound(pair):
    data = bytes(range(256)) * (1 << 14)  # 4 MiB, a full chunk: sent without a copy
    await pair.server.send(PeerBytes(9, 0, data, True), DEALER_ID)
    _, _, msg = await recv(pair.client, PeerAnswer)
    assert msg.data == data and msg.last


# Rejected frames: each dropped, counted under its reason, and the next good frame still arrives


@pytest.mark.parametrize("reason,parts", [
    ("short", [b"garbage"]),
    ("magic", [b"\x80\x04\x95" + b"pickle, not a frame" * 4]),
    ("tag", [sealed(PeerDone(1), secret=OTHER_SECRET)]),
    ("decode", [sealed(PeerRun(1, 2, False))]),  # an answer where an ask is due
    ("decode", [sealed(b"\xc1")]),
    ("self", [sealed(PeerDone(1), sender=PREFILL)]),  # reflected back to the server's own id
    ("parts", [sealed(PeerDone(1)), b"extra"]),  # [identity, frame, extra] at the ROUTER
    ("parts", [b"", sealed(PeerDone(1))]),
])  # fmt: skip
async def test_a_bad_frame_at_the_router_is_dropped_counted_and_skipped(pair, reason, parts):
    await pair.to_server(*parts)
    await pair.client.send(PeerDone(42))
    assert await recv(pair.server, PeerAsk) == (DEALER_ID, DECODE, PeerDone(42))
    accepted = 1 + (reason in ("decode", "self"))  # those frames verified before they were refused
    assert pair.server.counts() == zero_counts(**{reason: 1}, accepted=accepted)
    assert pair.rejects == {"server": 1, "client": 0}


async def test_a_replayed_frame_is_dropped_after_its_first_copy_is_taken(pair):
    frame = sealed(PeerDone(3))
    await pair.to_server(frame)
    await pair.to_server(frame)
    await pair.client.send(PeerDone(4))
    assert await recv(pair.server, PeerAsk) == (DEALER_ID, INTRUDER, PeerDone(3))
    assert await recv(pair.server, PeerAsk) == (DEALER_ID, DECODE, PeerDone(4))
    assert pair.server.counts() == zero_counts(replay=1, accepted=2)
    assert pair.rejects["server"] == 1


async def test_an_older_sequence_of_the_same_sender_is_a_replay(pair):
    await pair.client.send(PeerDone(1))
    await pair.client.send(PeerDone(2))  # the client's Signer has used sequences 1 (the fixture's), 2 and 3
    assert [(await recv(pair.server, PeerAsk))[2].fetch_id for _ in range(2)] == [1, 2]
    await pair.to_server(sealed(PeerDone(66), sender=DECODE, first=3))
    await pair.client.send(PeerDone(3))
    assert await recv(pair.server, PeerAsk) == (DEALER_ID, DECODE, PeerDone(3))
    assert pair.server.counts() == zero_counts(replay=1, accepted=3)


async def test_an_oversized_payload_is_refused_before_it_is_hashed(pair):
    pair.server.verifier.max_payload = 64
    await pair.to_server(sealed(PeerPull(1, list(range(40)), False)))
    await pair.client.send(PeerDone(5))
    assert (await recv(pair.server, PeerAsk))[2] == PeerDone(5)
    assert pair.server.counts() == zero_counts(too_large=1, accepted=1)


async def test_one_on_reject_call_per_rejected_frame_and_each_reason_counted(pair):
    bad = [
        [b"x"],  # short
        [sealed(PeerDone(1), secret=OTHER_SECRET)],  # tag
        [sealed(PeerRun(1, 0, False))],  # decode
        [sealed(PeerDone(1), sender=PREFILL)],  # self
        [sealed(PeerDone(1)), b"more"],  # parts
    ]
    for parts in bad:
        await pair.to_server(*parts)
        await pair.to_server(*parts)  # each twice: the second copy of a sealed frame is also a replay
    await pair.client.send(PeerDone(8))
    assert (await recv(pair.server, PeerAsk))[2] == PeerDone(8)
    # decode and self: the first copy verified (then refused), the second is a replay
    assert pair.server.counts() == zero_counts(short=2, tag=2, decode=1, self=1, replay=2, parts=2, accepted=3)
    assert pair.rejects == {"server": 10, "client": 0}


@pytest.mark.parametrize("reason,parts", [
    ("short", [b"?"]),
    ("tag", [sealed(PeerBytes(1, 0, b"x", True), secret=OTHER_SECRET)]),
    ("decode", [sealed(PeerPull(1, [0], False))]),  # an ask where an answer is due
    ("self", [sealed(PeerRun(1, 1, False), sender=DECODE)]),
    ("parts", [sealed(PeerRun(1, 1, False)), b"extra"]),
])  # fmt: skip
async def test_a_bad_frame_at_the_dealer_is_dropped_counted_and_skipped(pair, reason, parts):
    await pair.to_client(*parts)
    await pair.server.send(PeerRun(11, 2, True), DEALER_ID)
    assert await recv(pair.client, PeerAnswer) == (None, PREFILL, PeerRun(11, 2, True))
    accepted = 1 + (reason in ("decode", "self"))
    assert pair.client.counts() == zero_counts(**{reason: 1}, accepted=accepted)
    assert pair.rejects == {"server": 0, "client": 1}


def test_counts_name_every_reason_once():
    verifier = Verifier(SECRET)
    sock = SealedSocket(None, Signer(SECRET, PREFILL), verifier, routed=True)
    verifier.rejected["decode"] = 2
    sock.rejected["decode"] = 3
    sock.rejected["self"] = 1
    assert sock.counts() == zero_counts(decode=5, self=1)
