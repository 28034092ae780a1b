"""Typed ZeroMQ channels: one generic class per direction, not one per link.

A `Receiver` binds a PULL socket; an I/O task decodes each frame into the
link's message type and puts it on a bounded asyncio queue. Actor logic reads
that queue and never touches the socket. A frame that fails to decode is
dropped, logged and counted; the actor keeps running.

A `Sender` connects a PUSH socket and encodes typed messages. ZeroMQ's high
water mark bounds what waits in the socket.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Generic, TypeVar

import msgspec
import zmq
import zmq.asyncio

T = TypeVar("T")
log = logging.getLogger("hkv.ipc")

# Bounds: messages waiting in one socket, and decoded ones waiting for the actor.
SOCKET_HWM = 10_000
QUEUE_BOUND = 10_000
MAX_FRAME_BYTES = 64 * 1024 * 1024


class Receiver(Generic[T]):
    """The receiving end of one link: a bound PULL socket feeding a bounded queue."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, msg_type: type[T], name: str):
        self.name = name
        self.malformed = 0  # frames dropped because they did not decode
        self._decoder = msgspec.msgpack.Decoder(msg_type)
        self._queue: asyncio.Queue[T] = asyncio.Queue(maxsize=QUEUE_BOUND)
        self._sock = ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, SOCKET_HWM)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(address)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._pump(), name=f"recv:{self.name}")

    async def _pump(self) -> None:
        while True:
            frame = await self._sock.recv(copy=False)
            try:
                msg = self._decoder.decode(frame.buffer)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                self.malformed += 1
                log.warning("%s: dropped a malformed message (%s)", self.name, exc)
                continue
            await self._queue.put(msg)

    async def get(self) -> T:
        """Wait for the next message."""
        return await self._queue.get()

    def get_nowait(self) -> T | None:
        """The next message if one is queued, else None."""
        try:
            return self._queue.get_nowait()
        except asyncio.QueueEmpty:
            return None

    def drain(self) -> list[T]:
        """Every message queued right now, in order."""
        out = []
        while not self._queue.empty():
            out.append(self._queue.get_nowait())
        return out

    def empty(self) -> bool:
        return self._queue.empty()

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._sock.close(linger=0)


class Sender(Generic[T]):
    """The sending end of one link: a connected PUSH socket."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, name: str):
        self.name = name
        self._encoder = msgspec.msgpack.Encoder()
        self._sock = ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.SNDHWM, SOCKET_HWM)
        self._sock.setsockopt(zmq.LINGER, 1000)
        self._sock.connect(address)

    async def send(self, msg: T) -> None:
        await self._sock.send(self._encoder.encode(msg), copy=False)

    async def aclose(self) -> None:
        self._sock.close(linger=100)
