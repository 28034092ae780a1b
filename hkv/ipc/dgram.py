"""The step link (router <-> ranks) over Unix datagram sockets.

Every other link uses ZeroMQ. This one carries one message each way per step
and sits on the critical path of every decode step; ZeroMQ's I/O threads add
a thread wake-up per hop on each side, which on this class of machine costs
0.3-0.4 ms per hop when the peer was idle (docs/benchmarks.md). A Unix
datagram socket is read straight from the event loop (one wake-up), keeps
message boundaries, is reliable on Linux and applies backpressure: a full
receive queue makes the sender wait for writability.

Same interface as hkv/ipc/channel.py's Receiver and Sender; messages are the
same msgspec Structs, decoded against the link's type.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import Generic, TypeVar

import msgspec

from hkv.ipc.channel import Inbox

T = TypeVar("T")
log = logging.getLogger("hkv.ipc")

BUFFER_BYTES = 8 * 1024 * 1024  # socket buffers; one datagram must fit (a plan is tens of KiB)
CONNECT_TIMEOUT_S = 60.0  # a sender may start before its receiver binds (startup only)
SPIN_EARLY_S = 0.0005  # with a due time, start polling this long before it


def _path(address: str) -> str:
    if not address.startswith("ipc://"):
        raise ValueError(f"the step link needs an ipc:// address, got {address}")
    return address[len("ipc://") :]


def _grow_buffer(sock: socket.socket, option: int, force: int) -> None:
    try:
        sock.setsockopt(socket.SOL_SOCKET, force, BUFFER_BYTES)  # root may exceed the sysctl cap
    except OSError:
        sock.setsockopt(socket.SOL_SOCKET, option, BUFFER_BYTES)


class DgramReceiver(Inbox[T]):
    """Binds a datagram socket; the loop's reader callback decodes into a bounded queue.

    spin_s > 0: `get` first polls the socket for up to that long before sleeping,
    for a receiver that expects its next message within that time (a rank right
    after answering a step). It never spins while the queue has a message.
    """

    def __init__(self, address: str, msg_type: type[T], name: str, spin_s: float = 0.0):
        super().__init__(msg_type, name)
        self.spin_s = spin_s
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        _grow_buffer(self._sock, socket.SO_RCVBUF, getattr(socket, "SO_RCVBUFFORCE", socket.SO_RCVBUF))
        self._sock.bind(_path(address))
        self._sock.setblocking(False)

    def _fileno(self) -> int:
        return self._sock.fileno()

    def _read_frame(self) -> bytes | None:
        try:
            return self._sock.recv(BUFFER_BYTES)
        except BlockingIOError:
            return None

    def _close_socket(self) -> None:
        self._sock.close()

    async def get(self, due_in_s: float | None = None) -> T:
        """Wait for the next message.

        due_in_s: when the caller knows roughly when the message will come (a step's
        result), sleep until SPIN_EARLY_S before that, then poll for up to
        spin_s + 2 * SPIN_EARLY_S; a message arriving earlier still wakes it at once.
        """
        if self._queue.empty() and due_in_s is not None and due_in_s > SPIN_EARLY_S:
            try:
                return await self._take(asyncio.wait_for(self._queue.get(), due_in_s - SPIN_EARLY_S))
            except asyncio.TimeoutError:
                self._spin(self.spin_s + 2 * SPIN_EARLY_S)
        elif self._queue.empty() and self.spin_s > 0:
            self._spin(self.spin_s)
        return await self._take(self._queue.get())

    def poll(self) -> T | None:
        """The next message if one is queued or waiting on the socket, else None (never waits)."""
        if self._queue.empty():
            self._read_one()
        return self.get_nowait()

    def _spin(self, seconds: float) -> None:
        deadline = time.perf_counter() + seconds
        while self._queue.empty() and time.perf_counter() < deadline and not self._read_one():
            pass

    async def _take(self, waiting) -> T:
        msg = await waiting
        self._took_one()
        return msg


class DgramSender(Generic[T]):
    """Sends typed messages to one DgramReceiver; waits for room when its queue is full."""

    def __init__(self, address: str, name: str):
        self.name = name
        self._path = _path(address)
        self._encoder = msgspec.msgpack.Encoder()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        _grow_buffer(self._sock, socket.SO_SNDBUF, getattr(socket, "SO_SNDBUFFORCE", socket.SO_SNDBUF))
        self._sock.setblocking(False)
        self._connected = False

    async def _connect(self) -> None:
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while True:
            try:
                self._sock.connect(self._path)
                self._connected = True
                return
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise ConnectionError(f"{self.name}: nobody listens at {self._path}") from None
                await asyncio.sleep(0.01)  # startup only: the receiver has not bound yet

    async def send(self, msg: T) -> None:
        if not self._connected:
            await self._connect()
        data = self._encoder.encode(msg)
        while True:
            try:
                self._sock.send(data)
                return
            except BlockingIOError:
                await self._writable()

    def send_nowait(self, msg: T) -> bool:
        """One attempt, no waiting (shutdown notices): False if the receiver is gone or full."""
        try:
            if not self._connected:
                self._sock.connect(self._path)
                self._connected = True
            self._sock.send(self._encoder.encode(msg))
            return True
        except OSError:
            return False

    async def _writable(self) -> None:
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        loop.add_writer(self._sock.fileno(), lambda: ready.done() or ready.set_result(None))
        try:
            await ready
        finally:
            loop.remove_writer(self._sock.fileno())

    async def aclose(self) -> None:
        self._sock.close()
