"""The pd master actor: one OpenAI-compatible front over prefill and decode instances (docs/pd.md).

    client --POST /v1/...--> PdMaster --GET /pd/info (cached)------> prefill P
                                      --body, max_tokens 1, -------> prefill P   (answers once its pages
                                        "hkv_pd": {"prefill": true}                 are in its CPU tier)
                                      --body + "hkv_pd": ticket ---> decode D    (pulls the pages from P)
           <---- D's response, relayed chunk by chunk --------------'

Each request takes the next prefill instance and the next decode instance,
round robin, each list on its own. The master does not validate bodies
beyond "a JSON object": the instances do, and their 4xx answers reach the
client unchanged. A failing instance (5xx, unreachable, a broken connection)
becomes a 502 naming it, or, once a stream has started, an SSE error event
and `[DONE]`. A client that hangs up cancels its handler, which closes the
upstream connections at once, so the instances abort its sequences.

On SIGTERM (`ctx.stop`) the master drains: new requests get 503, in-flight
ones finish within `server.drain_timeout_s`, then the server closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest

from hkv.config import HkvConfig, KeyHash
from hkv.ipc.auth import load_secret
from hkv.ipc.pd_ticket import TicketError, check_peer_address, make_ticket
from hkv.ipc.process import ActorContext, run_actor
from hkv.openai.http_limits import BoundedSite, InFlight

log = logging.getLogger("hkv.pd_master")

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
OUTCOMES = ("ok", "client_error", "prefill_failed", "decode_failed", "aborted")
# the client's fields that mean nothing for a one-token, unstreamed prefill (or that would make it fail)
PREFILL_DROPPED = ("stream_options", "logprobs", "top_logprobs", "stop", "n", "max_completion_tokens", "echo",
                   "best_of")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE_FRAME = b"data: [DONE]\n\n"
DONE_TAIL = b"data: [DONE]"
TAIL_BYTES = 64  # bytes of a relayed stream kept to check that it ended with [DONE]

CONNECT_S = 5.0
PREFILL_TIMEOUT = aiohttp.ClientTimeout(total=600.0, connect=CONNECT_S)
# no total: a long generation is fine while bytes keep flowing
DECODE_TIMEOUT = aiohttp.ClientTimeout(total=None, connect=CONNECT_S, sock_read=600.0)
INFO_TIMEOUT = aiohttp.ClientTimeout(total=10.0, connect=CONNECT_S)
MODELS_TIMEOUT = aiohttp.ClientTimeout(total=10.0, connect=CONNECT_S)
READY_TIMEOUT = aiohttp.ClientTimeout(total=1.0)
ABANDON_GRACE_S = 1.0  # the launcher is gone: time left to in-flight requests
LINGER_S = 2.0  # an unread body after the response: read (and drop) it this long before closing
HTTP_ERRORS = {404: ("not found", "not_found"), 405: ("method not allowed", "method_not_allowed")}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_json(message: str, error_type: str, code: str | int | None = None) -> bytes:
    """An OpenAI error body: {"error": {"message", "type", "param", "code"}}."""
    return msgspec.json.encode({"error": {"message": message, "type": error_type, "param": None, "code": code}})


def _error(status: int, message: str, error_type: str, code: str | None = None) -> web.Response:
    return web.Response(status=status, body=error_json(message, error_type, code), content_type="application/json")


def _json(payload: dict[str, Any], status: int = 200) -> web.Response:
    return web.Response(status=status, body=msgspec.json.encode(payload), content_type="application/json")


def _reason(exc: BaseException) -> str:
    """One line about a failed call; timeouts often carry no message of their own."""
    if isinstance(exc, TimeoutError) and not str(exc):
        return "timed out"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _upstream_reason(status: int, content: bytes) -> str:
    """`answered 503: <the instance's error message>`, or the start of its body when that is not OpenAI JSON."""
    message = None
    with contextlib.suppress(msgspec.DecodeError, AttributeError, TypeError):
        message = msgspec.json.decode(content).get("error", {}).get("message")
    if not isinstance(message, str):
        message = content[:200].decode("utf-8", "replace")
    return f"answered {status}: {message}" if message else f"answered {status}"


def _relay(upstream: aiohttp.ClientResponse, content: bytes) -> web.Response:
    """The instance's answer, as it gave it: status, content type, body."""
    content_type = upstream.headers.get("Content-Type", "application/json")
    return web.Response(status=upstream.status, body=content, headers={"Content-Type": content_type})


def _is_sse(upstream: aiohttp.ClientResponse) -> bool:
    return upstream.status == 200 and upstream.content_type == "text/event-stream"


class _Answered(Exception):
    """A request ends early with `response`; `outcome` is what /metrics counts it as."""

    def __init__(self, outcome: str, response: web.Response):
        super().__init__(outcome)
        self.outcome = outcome
        self.response = response


class PdMetrics:
    """The master's Prometheus counters, in a registry of their own."""

    def __init__(self, prefill_urls: Sequence[str], decode_urls: Sequence[str]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("hkv_pd_requests", "Generation requests by outcome", ["outcome"], registry=r)
        self.instance_failures = Counter(
            "hkv_pd_instance_failures", "Calls to an instance that failed (5xx, unreachable, broken)",
            ["instance", "role"], registry=r,
        )
        self.refused_connections = Counter(
            "hkv_pd_http_connections_refused", "Connections refused past --max-connections", registry=r
        )
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        for role, urls in (("prefill", prefill_urls), ("decode", decode_urls)):
            for url in urls:
                self.instance_failures.labels(url, role)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class PdMaster:
    """Routes, handlers and drain state of the pd master's HTTP front.

    `session` is the aiohttp client session every upstream call goes through
    (its owner closes it); `secret` signs the decode tickets. Instance URLs
    are `http://host:port`, a trailing slash dropped.
    """

    def __init__(
        self,
        prefill_urls: Sequence[str],
        decode_urls: Sequence[str],
        session: aiohttp.ClientSession,
        secret: bytes,
        *,
        api_key: KeyHash | None = None,
        metrics_key: KeyHash | None = None,
        max_body_bytes: int = 8 * 1024 * 1024,
        request_timeout_s: float = 30.0,
    ):
        if not prefill_urls or not decode_urls:
            raise ValueError("the pd master needs at least one prefill and one decode instance")
        self.prefill_urls = tuple(u.rstrip("/") for u in prefill_urls)
        self.decode_urls = tuple(u.rstrip("/") for u in decode_urls)
        self.session = session
        self.api_key = api_key
        self.metrics_key = metrics_key
        self.max_body_bytes = max_body_bytes
        self.request_timeout_s = request_timeout_s
        self.metrics = PdMetrics(self.prefill_urls, self.decode_urls)
        self.draining = False
        self._secret = secret
        self._next_prefill = itertools.cycle(self.prefill_urls)
        self._next_decode = itertools.cycle(self.decode_urls)
        self._transporters: dict[str, str] = {}  # prefill url -> its transporter's tcp:// address
        self.in_flight = InFlight()  # generation handlers running

    def build_app(self) -> web.Application:
        # aiohttp refuses a body of client_max_size bytes or more: +1 admits exactly max_body_bytes
        app = web.Application(client_max_size=self.max_body_bytes + 1, middlewares=[self._errors, self._auth])
        for path in GENERATION_PATHS:
            app.router.add_post(path, self.generate)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", self.metrics_page)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every failure becomes OpenAI error JSON."""
        try:
            return await handler(request)
        except web.HTTPException as exc:
            message, code = HTTP_ERRORS.get(exc.status, (exc.reason.lower(), None))
            response = _error(exc.status, f"{message}: {request.method} {request.path}", "invalid_request_error",
                              code)
            if "Allow" in exc.headers:
                response.headers["Allow"] = exc.headers["Allow"]
            return response
        except Exception:
            log.exception("unhandled error on %s %s", request.method, request.path)
            return _error(500, "internal server error", "server_error")

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        key = self.api_key if request.path.startswith("/v1/") else None
        if request.path == "/metrics":
            key = self.metrics_key
        if key is not None and not key.admits(request.headers.get("Authorization", "")):
            if request.path in GENERATION_PATHS:
                self.metrics.requests.labels("client_error").inc()
            message = "Invalid or missing key for this route (send Authorization: Bearer <key>)."
            return _error(401, message, "invalid_request_error", "invalid_api_key")
        return await handler(request)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions and /v1/chat/completions: prefill on one instance, decode on another."""
        if self.draining:
            return _error(503, "the server is shutting down", "server_error", "draining")
        self.in_flight.enter()
        try:
            body = await self._read_json(request)
            prefill_url, decode_url = next(self._next_prefill), next(self._next_decode)
            peer = await self._transporter(prefill_url)  # checks the instance's mode once
            # its answer names the transporter too (current even when it restarted since, on another port)
            # and, on CUDA, the device pages it holds for a decode instance on its GPU
            named, device = await self._prefill(request, prefill_url, body)
            peer = self._transporters[prefill_url] = named or peer
            outcome, response = await self._decode(request, decode_url, body, peer, device)
        except _Answered as answered:
            outcome, response = answered.outcome, answered.response
        except asyncio.CancelledError:
            self.metrics.requests.labels("aborted").inc()  # the client went away
            raise
        finally:
            self.in_flight.leave()
        self.metrics.requests.labels(outcome).inc()
        return response

    async def _read_json(self, request: web.Request) -> dict[str, Any]:
        limit = self.max_body_bytes
        too_large = _Answered("client_error", _error(413, f"request body is larger than the limit of {limit} bytes",
                                                     "invalid_request_error", "request_too_large"))
        if request.content_length is not None and request.content_length > limit:
            raise too_large
        try:
            async with asyncio.timeout(self.request_timeout_s):
                content = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise too_large from None
        except TimeoutError:
            message = f"the request body did not arrive within {self.request_timeout_s:g} s"
            response = _error(408, message, "invalid_request_error", "request_timeout")
            response.force_close()  # what the client still sends is not worth reading
            raise _Answered("client_error", response) from None
        try:
            body = msgspec.json.decode(content)
        except msgspec.DecodeError as exc:
            raise _Answered("client_error", _error(400, f"the body is not valid JSON: {exc}",
                                                   "invalid_request_error", "invalid_json")) from None
        if not isinstance(body, dict):
            raise _Answered("client_error", _error(400, "the body must be a JSON object", "invalid_request_error",
                                                   "invalid_json"))
        return body

    def _failed(self, role: str, url: str, reason: str) -> _Answered:
        """Count a failed call to an instance and make the 502 the client gets for it."""
        self.metrics.instance_failures.labels(url, role).inc()
        if role == "prefill":
            self._transporters.pop(url, None)  # it may come back on another port
        message = f"{role} instance {url} failed: {reason}"
        log.warning("%s", message)
        return _Answered(f"{role}_failed", _error(502, message, "server_error", f"{role}_failed"))

    def _headers(self, request: web.Request, content_type: str | None = "application/json") -> dict[str, str]:
        """The upstream call's headers: the client's Authorization passes through (the instances check it too)."""
        headers = {} if content_type is None else {"Content-Type": content_type}
        if "Authorization" in request.headers:
            headers["Authorization"] = request.headers["Authorization"]
        return headers

    async def _transporter(self, url: str) -> str:
        """The prefill instance's transporter address, from its GET /pd/info (cached until a call fails)."""
        address = self._transporters.get(url)
        if address is not None:
            return address
        try:
            async with self.session.get(url + "/pd/info", timeout=INFO_TIMEOUT) as upstream:
                content = await upstream.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self._failed("prefill", url, f"GET /pd/info: {_reason(exc)}") from None
        if upstream.status != 200:
            raise self._failed("prefill", url, f"GET /pd/info {_upstream_reason(upstream.status, content)}")
        try:
            info = msgspec.json.decode(content)
        except msgspec.DecodeError:
            info = None
        if not isinstance(info, dict) or info.get("mode") != "prefill":
            mode = info.get("mode") if isinstance(info, dict) else None
            raise self._failed("prefill", url, f"GET /pd/info says mode {mode!r}, not 'prefill' "
                                               f"(is it started with --mode prefill?)")
        try:
            address = check_peer_address(info.get("transporter"))
        except TicketError:
            raise self._failed("prefill", url, f"GET /pd/info names no usable transporter "
                                               f"({info.get('transporter')!r})") from None
        self._transporters[url] = address
        return address

    async def _prefill(self, request: web.Request, url: str, body: dict[str, Any]) -> tuple[str | None, Any]:
        """Have the prefill instance compute the prompt; once it answered 2xx, the transporter address its
        answer names (`hkv_pd.transporter`, None when it names none) and its device hold (`hkv_pd.device`)."""
        payload = {k: v for k, v in body.items() if k not in PREFILL_DROPPED}
        payload.update(max_tokens=1, stream=False, hkv_pd={"prefill": True})
        try:
            async with self.session.post(url + request.path, data=msgspec.json.encode(payload),
                                         headers=self._headers(request), timeout=PREFILL_TIMEOUT) as upstream:
                content = await upstream.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self._failed("prefill", url, _reason(exc)) from None
        if upstream.status >= 500:
            raise self._failed("prefill", url, _upstream_reason(upstream.status, content))
        if upstream.status >= 400:
            raise _Answered("client_error", _relay(upstream, content))
        try:
            named = msgspec.json.decode(content)["hkv_pd"]
            return check_peer_address(named["transporter"]), named.get("device")
        except (msgspec.DecodeError, KeyError, TypeError, AttributeError, TicketError):
            return None, None

    async def _decode(
        self, request: web.Request, url: str, body: dict[str, Any], peer: str, device: Any = None
    ) -> tuple[str, web.StreamResponse]:
        """Have the decode instance pull the prompt from `peer` and generate; its answer goes to the client."""
        payload = {**body, "hkv_pd": make_ticket(self._secret, peer, device=device)}
        try:
            async with self.session.post(url + request.path, data=msgspec.json.encode(payload),
                                         headers=self._headers(request), timeout=DECODE_TIMEOUT) as upstream:
                try:
                    if _is_sse(upstream):
                        return await self._relay_stream(request, url, upstream)
                    content = await upstream.read()
                except BaseException:
                    upstream.close()  # the instance must see the connection go, to abort the sequences
                    raise
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self._failed("decode", url, _reason(exc)) from None
        if upstream.status >= 500:
            raise self._failed("decode", url, _upstream_reason(upstream.status, content))
        return ("client_error" if upstream.status >= 400 else "ok"), _relay(upstream, content)

    async def _relay_stream(
        self, request: web.Request, url: str, upstream: aiohttp.ClientResponse
    ) -> tuple[str, web.StreamResponse]:
        """Relay an SSE response chunk by chunk; a broken upstream ends it with an error event and [DONE]."""
        content_type = upstream.headers.get("Content-Type", "text/event-stream")
        response = web.StreamResponse(headers={**SSE_HEADERS, "Content-Type": content_type})
        try:
            await response.prepare(request)
            failure = await _pump(upstream, response)
            if failure is not None:
                upstream.close()
                self.metrics.instance_failures.labels(url, "decode").inc()
                message = f"decode instance {url} failed mid-stream: {failure}"
                log.warning("%s", message)
                frame = b"data: " + error_json(message, "server_error", 502) + b"\n\n"
                await response.write(frame + DONE_FRAME)
            await response.write_eof()
        except ConnectionResetError:  # the client went away while we wrote
            upstream.close()
            return "aborted", response
        return ("ok" if failure is None else "decode_failed"), response

    async def models(self, request: web.Request) -> web.Response:
        """GET /v1/models, from the first decode instance that answers."""
        for url in self.decode_urls:
            try:
                async with self.session.get(url + "/v1/models", headers=self._headers(request, None),
                                            timeout=MODELS_TIMEOUT) as upstream:
                    content = await upstream.read()
            except (aiohttp.ClientError, TimeoutError) as exc:
                log.warning("decode instance %s: GET /v1/models: %s", url, _reason(exc))
                continue
            if upstream.status < 500:
                return _relay(upstream, content)
        return _error(502, "no decode instance answered GET /v1/models", "server_error", "decode_failed")

    async def health(self, request: web.Request) -> web.Response:
        return _json({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        """200 while one prefill and one decode instance are ready (their /ready is 200), else 503."""
        urls = (*self.prefill_urls, *self.decode_urls)
        states = await asyncio.gather(*(self._instance_ready(u) for u in urls))
        prefill = dict(zip(self.prefill_urls, states[: len(self.prefill_urls)]))
        decode = dict(zip(self.decode_urls, states[len(self.prefill_urls):]))
        ok = any(prefill.values()) and any(decode.values()) and not self.draining
        not_ready = [f"{role} {url}" for role, states_of in (("prefill", prefill), ("decode", decode))
                     for url, up in states_of.items() if not up]
        return _json({"ready": ok, "draining": self.draining, "prefill": prefill, "decode": decode,
                      "not_ready": not_ready}, 200 if ok else 503)

    async def _instance_ready(self, url: str) -> bool:
        try:
            async with self.session.get(url + "/ready", timeout=READY_TIMEOUT) as upstream:
                return upstream.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def metrics_page(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def drain(self, timeout: float) -> None:
        """Refuse new requests and wait up to `timeout` for those in flight (closing the server cancels the rest)."""
        self.draining = True
        log.info("draining: %d requests in flight", self.in_flight.count)
        if not await self.in_flight.wait_idle(timeout):
            log.warning("drain timed out after %.1fs; cancelling %d requests", timeout, self.in_flight.count)


async def _pump(upstream: aiohttp.ClientResponse, response: web.StreamResponse) -> str | None:
    """Copy the upstream stream to the client as bytes arrive; why it broke, or None once it ended with [DONE].

    Only upstream reads are caught here: a failed write to the client raises (ConnectionResetError).
    """
    tail = b""
    while True:
        try:
            chunk = await upstream.content.readany()
        except (aiohttp.ClientError, TimeoutError) as exc:
            return _reason(exc)
        if not chunk:
            break
        await response.write(chunk)
        tail = (tail + chunk)[-TAIL_BYTES:]
    # a clean end without [DONE] is still a truncation (say, an instance that closed without chunked framing)
    return None if tail.rstrip().endswith(DONE_TAIL) else "the stream ended without [DONE]"


def _site_url(runner: web.AppRunner) -> str:
    host, port = runner.addresses[0][:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def start_http(
    master: PdMaster, stack: contextlib.AsyncExitStack, host: str, port: int, max_connections: int = 1024
) -> str:
    """Listen on host:port (0: a free one); returns the URL. The runner is cleaned up with `stack`."""
    timeout = master.request_timeout_s
    # handler_cancellation: a client that hangs up cancels its handler, which closes the upstream calls;
    # keepalive_timeout: a connection must bring a complete request head this soon, else aiohttp closes it
    runner = web.AppRunner(master.build_app(), handler_cancellation=True, access_log=None, shutdown_timeout=1.0,
                           keepalive_timeout=timeout, lingering_time=min(LINGER_S, timeout))
    await runner.setup()
    stack.push_async_callback(runner.cleanup)
    site = BoundedSite(runner, host, port, max_connections, master.metrics.refused_connections.inc)
    await site.start()
    return _site_url(runner)


async def serve(cfg: HkvConfig, ctx: ActorContext) -> None:
    """Actor body: serve HTTP until ctx.stop, then drain and return."""
    server = cfg.server
    if server.secret_file is None:
        raise ValueError("the pd master needs --secret-file (the secret the decode instances check tickets with)")
    secret = load_secret(server.secret_file)
    async with contextlib.AsyncExitStack() as stack:
        # no pool limit: client connections are bounded by max_connections, each holds at most one upstream call;
        # no cookie jar: nothing an instance sets may travel with another client's request
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), cookie_jar=aiohttp.DummyCookieJar())
        await stack.enter_async_context(session)
        master = PdMaster(server.prefill_urls, server.decode_urls, session, secret, api_key=server.api_key,
                          metrics_key=server.metrics_key, max_body_bytes=server.max_body_bytes,
                          request_timeout_s=server.request_timeout_s)
        url = await start_http(master, stack, server.host, server.port, server.max_connections)
        log.info("pd master on %s: prefill %s, decode %s", url, ", ".join(master.prefill_urls),
                 ", ".join(master.decode_urls))
        ctx.ready(url=url)
        await ctx.stop.wait()
        await master.drain(server.drain_timeout_s if ctx.abandoned is None else ABANDON_GRACE_S)


def main() -> None:
    run_actor("pd_master", serve)


if __name__ == "__main__":
    main()
