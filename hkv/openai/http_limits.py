"""Bounds on what HTTP clients can hold: open connections, and time to send a request.

`BoundedSite` is an aiohttp TCP site whose protocol factory refuses a
connection past `limit` open ones with a one-line 503 and closes it, so idle
or stalled clients cannot hold file descriptors without bound. Time is
bounded by aiohttp's own timer plus the api's body timeout:

    connect / previous response ---- head ---- body ---- handler ---- response
    |<-- keepalive_timeout = request_timeout -->|        (aiohttp closes the connection)
                                   |<-- request_timeout -->|  (the api answers 408 and closes)
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiohttp import web

from hkv.openai.responses import error_body

_REFUSED_BODY = error_body("too many open connections; retry later", "server_error", None, "overloaded")
REFUSED_RESPONSE = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
    + b"Content-Length: " + str(len(_REFUSED_BODY)).encode() + b"\r\n\r\n" + _REFUSED_BODY
)


class _Refused(asyncio.Protocol):
    """A connection past the limit: answered 503 without reading, then closed."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(REFUSED_RESPONSE)
        transport.close()


class BoundedSite(web.BaseSite):
    """A TCP site serving at most `limit` connections at once; `on_refused` is called for each one past it."""

    __slots__ = ("_host", "_port", "_limit", "_fresh", "_on_refused")

    def __init__(self, runner: web.BaseRunner, host: str, port: int, limit: int, on_refused: Callable[[], None]):
        super().__init__(runner)
        self._host = host
        self._port = port
        self._limit = limit
        self._fresh = 0  # handlers made this loop turn: aiohttp counts them once their connection_made runs
        self._on_refused = on_refused

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._protocol, self._host, self._port, backlog=self._backlog,
                                                reuse_address=True)

    def _protocol(self) -> asyncio.BaseProtocol:
        server = self._runner.server
        if len(server.connections) + self._fresh >= self._limit:
            self._on_refused()
            return _Refused()
        if not self._fresh:
            # runs after this turn's accepts, before their connection_made callbacks add them to the count
            asyncio.get_running_loop().call_soon(self._settle)
        self._fresh += 1
        return server()

    def _settle(self) -> None:
        self._fresh = 0


class InFlight:
    """Generation handlers running, and a bounded wait for none (draining): the api's and the pd master's."""

    def __init__(self) -> None:
        self.count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.count += 1
        self._idle.clear()

    def leave(self) -> None:
        self.count -= 1
        if self.count == 0:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """True once none runs, False when `timeout` seconds pass first."""
        try:
            async with asyncio.timeout(timeout):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True
