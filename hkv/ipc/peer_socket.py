"""Authenticated ZeroMQ tcp sockets between transporters: every frame sealed, checked before decoding.

    SealedSocket(sock, signer, verifier)
      send(msg, identity)  -> one writer task seals and sends in order (sequences must arrive increasing)
      recv(types)          -> (identity, sender, message); frames that fail any check are dropped and counted

A ROUTER (the prefill side, bound) sees frames as [identity, frame]; a DEALER
(the decode side, connected) as [frame]. Everything that fails (a wrong part
count, a frame over the size bound, a bad tag, a replay, a payload that does
not decode into the expected messages, a frame reflected from this
instance's own sender id) is counted in `rejected[reason]` and never raises
into the caller: garbage, pickle payloads and unauthenticated frames cost a
header check each and change nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

import msgspec
import zmq
import zmq.asyncio

from hkv.ipc.auth import REASONS, Rejected, Signer, Verifier, decode

T = TypeVar("T")
SEND_QUEUE_BOUND = 1024  # frames waiting for the writer task
EXTRA_REASONS = ("parts", "self")  # beyond auth's: a message of the wrong shape, a frame from this instance


class SealedSocket:
    """One zmq socket with its Signer and Verifier; `run_writer` must run for `send` to drain."""

    def __init__(self, sock: zmq.asyncio.Socket, signer: Signer, verifier: Verifier, routed: bool,
                 on_reject: Callable[[], None] = lambda: None):
        self.on_reject = on_reject  # told after each rejected frame (the owner's stats are stale)
        self.sock = sock
        self.signer = signer
        self.verifier = verifier
        self.routed = routed  # ROUTER: frames carry the peer's identity first
        self.rejected: dict[str, int] = dict.fromkeys((*REASONS, *EXTRA_REASONS), 0)
        self._encoder = msgspec.msgpack.Encoder()
        self._out: asyncio.Queue[tuple[bytes | None, bytes]] = asyncio.Queue(maxsize=SEND_QUEUE_BOUND)

    async def send(self, msg: msgspec.Struct, identity: bytes | None = None) -> None:
        await self._out.put((identity, self._encoder.encode(msg)))

    async def run_writer(self) -> None:
        """Seal in queue order and send: a frame's sequence is fixed when it is sealed."""
        while True:
            identity, payload = await self._out.get()
            frame = self.signer.seal(payload)
            await self.sock.send_multipart([identity, frame] if self.routed else [frame], copy=len(frame) < 65536)

    async def recv(self, type_: type[T]) -> tuple[bytes | None, bytes, T]:
        """The next frame that passes every check: (ROUTER identity or None, authenticated sender, message)."""
        while True:
            parts = await self.sock.recv_multipart()
            if len(parts) != (2 if self.routed else 1):
                self.rejected["parts"] += 1
                self.on_reject()
                continue
            identity, frame = (parts[0], parts[1]) if self.routed else (None, parts[0])
            try:
                opened = self.verifier.open(frame)
            except Rejected:
                self.on_reject()  # counted by the verifier
                continue
            if opened.sender == self.signer.sender:
                self.rejected["self"] += 1
                self.on_reject()
                continue
            try:
                return identity, opened.sender, decode(opened, type_)
            except Rejected:
                self.rejected["decode"] += 1
                self.on_reject()

    def counts(self) -> dict[str, int]:
        """Rejected frames by reason (the verifier's and this socket's) and accepted ones."""
        return {**{r: self.verifier.rejected[r] + self.rejected[r] for r in REASONS},
                **{r: self.rejected[r] for r in EXTRA_REASONS}, "accepted": self.verifier.accepted}

    def close(self) -> None:
        self.sock.close(linger=0)


def tcp_socket(zctx: zmq.asyncio.Context, kind: int, max_frame: int) -> zmq.asyncio.Socket:
    """A socket that drops frames over `max_frame` bytes before reading them, and never lingers."""
    sock = zctx.socket(kind)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 1000)
    sock.setsockopt(zmq.RCVHWM, 1000)
    return sock
