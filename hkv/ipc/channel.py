"""Typed ZeroMQ channels: one generic class per direction, not one per link.

A `Receiver` binds a PULL socket; the event loop's reader callback decodes
each frame into the link's message type and puts it on a bounded asyncio
queue (`Inbox`, shared with the step link's datagram transport in dgram.py).
Actor logic reads that queue and never touches the socket. A frame that fails to decode is
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
ZERO_COPY_BYTES = 64 * 1024  # below this a copy beats ZeroMQ's zero-copy bookkeeping


class Inbox(Generic[T]):
    """A socket read from the event loop's reader callback into a bounded queue of typed messages.

    Subclasses say how to read one frame without blocking. When the queue is
    full the callback stops reading, so the transport's own buffer fills and
    pushes back on the sender; taking a message resumes reading.
    """

    edge_triggered = False  # the fd signals changes, not readiness: re-check after resuming

    def __init__(self, msg_type: type[T], name: str):
        self.name = name
        self.malformed = 0  # frames dropped because they did not decode
        self._decoder = msgspec.msgpack.Decoder(msg_type)
        self._queue: asyncio.Queue[T] = asyncio.Queue(maxsize=QUEUE_BOUND)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reading = False

    def _fileno(self) -> int:
        raise NotImplementedError

    def _read_frame(self) -> bytes | None:
        """One frame, or None when nothing is waiting."""
        raise NotImplementedError

    def _close_socket(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._resume()

    def _resume(self) -> None:
        if not self._reading and self._loop is not None:
            self._reading = True
            self._loop.add_reader(self._fileno(), self._on_readable)
            if self.edge_triggered:
                self._loop.call_soon(self._on_readable)  # catch what arrived while paused

    def _on_readable(self) -> None:
        while self._reading:
            if self._queue.full():
                self._loop.remove_reader(self._fileno())
                self._reading = False
                return
            if not self._read_one():
                return

    def _read_one(self) -> bool:
        """Read, decode and queue one frame; False when nothing was waiting."""
        while True:
            frame = self._read_frame()
            if frame is None:
                return False
            try:
                self._queue.put_nowait(self._decoder.decode(frame))
                return True
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                self.malformed += 1
                log.warning("%s: dropped a malformed message (%s)", self.name, exc)

    def _took_one(self) -> None:
        if not self._reading:
            self._resume()

    async def get(self) -> T:
        """Wait for the next message."""
        msg = await self._queue.get()
        self._took_one()
        return msg

    def get_nowait(self) -> T | None:
        """The next message if one is queued, else None."""
        try:
            msg = self._queue.get_nowait()
        except asyncio.QueueEmpty:
            return None
        self._took_one()
        return msg

    def drain(self) -> list[T]:
        """Every message queued right now, in order."""
        out = []
        while not self._queue.empty():
            out.append(self._queue.get_nowait())
        self._took_one()
        return out

    def empty(self) -> bool:
        return self._queue.empty()

    async def aclose(self) -> None:
        if self._reading and self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._fileno())
        self._reading = False
        self._close_socket()


class Receiver(Inbox[T]):
    """The receiving end of a ZeroMQ link: a bound PULL socket.

    Read from ZeroMQ's notification fd in the loop's reader callback (no task
    hop, no zmq.asyncio futures); ZeroMQ's high water mark pushes back.
    """

    edge_triggered = True

    def __init__(self, ctx: zmq.Context, address: str, msg_type: type[T], name: str):
        super().__init__(msg_type, name)
        self._sock = zmq.Socket(ctx, zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, SOCKET_HWM)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(address)
        self._fd: int = self._sock.getsockopt(zmq.FD)

    def _fileno(self) -> int:
        return self._fd

    def _read_frame(self) -> bytes | None:
        if not self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            return None
        # Copying small frames is cheaper than zero-copy Frame objects; steps are small.
        return self._sock.recv(zmq.NOBLOCK, copy=True)

    def _close_socket(self) -> None:
        self._sock.close(linger=0)


class Sender(Generic[T]):
    """The sending end of one link: a connected PUSH socket.

    Sends without waiting; only when the peer's high water mark is reached
    does it wait (through a zmq.asyncio shadow of the same socket).
    """

    def __init__(self, ctx: zmq.Context, address: str, name: str):
        self.name = name
        self._encoder = msgspec.msgpack.Encoder()
        self._sock = zmq.Socket(ctx, zmq.PUSH)
        self._sock.setsockopt(zmq.SNDHWM, SOCKET_HWM)
        self._sock.setsockopt(zmq.LINGER, 1000)
        self._sock.connect(address)
        self._shadow: zmq.asyncio.Socket | None = None

    async def send(self, msg: T) -> None:
        data = self._encoder.encode(msg)
        try:
            self._sock.send(data, zmq.NOBLOCK, copy=len(data) < ZERO_COPY_BYTES)
        except zmq.Again:
            if self._shadow is None:
                self._shadow = zmq.asyncio.Socket.shadow(self._sock.underlying)
            await self._shadow.send(data, copy=len(data) < ZERO_COPY_BYTES)

    def send_nowait(self, msg: T) -> bool:
        """Send from synchronous code; False (nothing sent) when the peer's high water mark is reached."""
        data = self._encoder.encode(msg)
        try:
            self._sock.send(data, zmq.NOBLOCK, copy=len(data) < ZERO_COPY_BYTES)
        except zmq.Again:
            return False
        return True

    async def aclose(self) -> None:
        self._sock.close(linger=100)
