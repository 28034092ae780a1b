"""The pd master in-process, against fake prefill and decode instances on loopback ports (docs/pd.md).

Each fake is a small aiohttp app that records the bodies and headers it was
sent and answers as a test tells it: a one-token prefill, an SSE or JSON
decode, an error, a connection that dies mid-stream, or a stream that never
ends (to see the master close it when its client goes away).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from hkv.actors.pd_master import PdMaster, serve, start_http
from hkv.config import KeyHash
from hkv.ipc.auth import load_secret
from hkv.ipc.pd_ticket import check_ticket
from hkv.ipc.process import ActorContext

pytestmark = pytest.mark.timeout(30)

PROMPT = {"model": "tiny", "prompt": "hello there", "max_tokens": 8, "stop": ["\n"], "n": 1, "logprobs": 2,
          "stream_options": {"include_usage": True}, "echo": False, "best_of": 1, "temperature": 0.0}
CHUNKS = [b'data: {"choices": [{"text": "a"}]}\n\n', b'data: {"choices": [{"text": "b"}]}\n\n',
          b'data: {"choices": [{"text": "c"}]}\n\n', b"data: [DONE]\n\n"]


@dataclass
class Fake:
    """One prefill or decode instance: records what it got, answers as `answer` says."""

    mode: str
    transporter: str = "tcp://127.0.0.1:5555"
    # "ok"; "status": `status` with an error body; "die": two chunks then a dropped connection;
    # "endless": chunks until the peer goes; "gated": a chunk, then the rest once `gate` is set;
    # "hang": no answer until `gate` is set
    answer: str = "ok"
    status: int = 200
    ready_status: int = 200
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    info_calls: int = 0
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    closed: asyncio.Event = field(default_factory=asyncio.Event)  # a stream's handler saw its peer go
    url: str = ""

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_get("/pd/info", self.info)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/v1/models", self.models)
        return app

    async def info(self, request: web.Request) -> web.Response:
        self.info_calls += 1
        return web.json_response({"mode": self.mode, "transporter": self.transporter})

    async def ready(self, request: web.Request) -> web.Response:
        return web.json_response({"ready": self.ready_status == 200}, status=self.ready_status)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "owned_by": self.url}]})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        if self.answer == "hang":
            try:
                await self.gate.wait()
            except asyncio.CancelledError:
                self.closed.set()
                raise
        if self.answer == "status":
            error = {"error": {"message": f"{self.mode} says no", "type": "invalid_request_error", "code": "x"}}
            return web.json_response(error, status=self.status)
        if not body.get("stream"):
            return web.json_response({"object": "text_completion", "choices": [{"text": "abc"}], "by": self.url})
        return await self._stream(request)

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            if self.answer == "die":
                await response.write(CHUNKS[0] + CHUNKS[1])
                await asyncio.sleep(0.05)
                request.transport.abort()
                return response
            if self.answer == "endless":
                while True:
                    await response.write(CHUNKS[0])
                    await asyncio.sleep(0.02)
            for i, chunk in enumerate(CHUNKS):
                await response.write(chunk)
                if i == 0 and self.answer == "gated":
                    await self.gate.wait()
            await response.write_eof()
        except (asyncio.CancelledError, ConnectionResetError):
            self.closed.set()
            raise
        return response


@contextlib.asynccontextmanager
async def serving(*fakes: Fake) -> AsyncIterator[None]:
    """Each fake on a free loopback port (its `url` set), until the block ends."""
    async with contextlib.AsyncExitStack() as stack:
        for fake in fakes:
            runner = web.AppRunner(fake.app(), handler_cancellation=True, shutdown_timeout=0.1)
            await runner.setup()
            stack.push_async_callback(runner.cleanup)
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            fake.url = "http://127.0.0.1:%d" % runner.addresses[0][1]
        yield


@dataclass
class Master:
    url: str
    pd: PdMaster
    http: aiohttp.ClientSession

    async def post(self, body: dict, path: str = "/v1/completions", **headers: str) -> tuple[int, dict]:
        async with self.http.post(self.url + path, json=body, headers=headers) as resp:
            return resp.status, await resp.json(content_type=None)

    async def get(self, path: str) -> tuple[int, str]:
        async with self.http.get(self.url + path) as resp:
            return resp.status, await resp.text()

    async def sse(self, body: dict) -> list[Any]:
        """Every `data:` event of a streamed response, "[DONE]" as the string."""
        events: list[Any] = []
        async with self.http.post(self.url + "/v1/completions", json={**body, "stream": True}) as resp:
            assert resp.status == 200 and resp.content_type == "text/event-stream"
            async for line in resp.content:
                if line.startswith(b"data: "):
                    data = line[6:].strip()
                    events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
        return events

    async def counter(self, name: str, **labels: str) -> float:
        _, text = await self.get("/metrics")
        want = name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"
        values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(want + " ")]
        assert len(values) == 1, f"{want} not in /metrics"
        return values[0]


@pytest.fixture
def secret(tmp_path) -> bytes:
    path = tmp_path / "pd.secret"
    path.write_text(os.urandom(32).hex() + "\n")
    path.chmod(0o600)
    return load_secret(path)


@contextlib.asynccontextmanager
async def running(prefill: list[Fake], decode: list[Fake], secret: bytes, **options: Any) -> AsyncIterator[Master]:
    """A PdMaster over the fakes (served first), on a free loopback port."""
    async with serving(*prefill, *decode), contextlib.AsyncExitStack() as stack:
        upstream = await stack.enter_async_context(aiohttp.ClientSession())
        http = await stack.enter_async_context(aiohttp.ClientSession())
        pd = PdMaster([f.url for f in prefill], [f.url for f in decode], upstream, secret, **options)
        url = await start_http(pd, stack, "127.0.0.1", 0)
        yield Master(url, pd, http)


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return "http://127.0.0.1:%d" % sock.getsockname()[1]


async def test_prefill_gets_one_unstreamed_token_and_decode_the_original_body_with_a_ticket(secret):
    p, d = Fake("prefill", "tcp://127.0.0.1:41234"), Fake("decode")
    async with running([p], [d], secret) as master:
        status, body = await master.post(PROMPT)
        assert status == 200 and body["by"] == d.url
        (sent,) = p.bodies
        assert sent["max_tokens"] == 1 and sent["stream"] is False and sent["hkv_pd"] == {"prefill": True}
        for dropped in ("stop", "n", "logprobs", "stream_options", "echo", "best_of"):
            assert dropped not in sent
        assert sent["prompt"] == PROMPT["prompt"] and sent["temperature"] == 0.0
        (received,) = d.bodies
        ticket = received.pop("hkv_pd")
        assert received == PROMPT
        assert check_ticket(secret, ticket) == "tcp://127.0.0.1:41234"
        assert await master.counter("hkv_pd_requests_total", outcome="ok") == 1


async def test_chat_keeps_its_path_and_loses_max_completion_tokens_at_prefill(secret):
    p, d = Fake("prefill"), Fake("decode")
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5, "top_logprobs": 2}
    async with running([p], [d], secret) as master:
        status, _ = await master.post(chat, "/v1/chat/completions")
        assert status == 200
        assert p.bodies[0] == {"messages": chat["messages"], "max_tokens": 1, "stream": False,
                               "hkv_pd": {"prefill": True}}
        assert {k: v for k, v in d.bodies[0].items() if k != "hkv_pd"} == chat


async def test_a_stream_is_relayed_as_it_arrives_and_ends_with_done(secret):
    p, d = Fake("prefill"), Fake("decode", answer="gated")
    async with running([p], [d], secret) as master:
        async with master.http.post(master.url + "/v1/completions", json={**PROMPT, "stream": True}) as resp:
            assert resp.status == 200 and resp.content_type == "text/event-stream"
            # the first chunk arrives while the instance still holds back the rest: nothing is buffered
            first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 2)
            assert first == CHUNKS[0]
            d.gate.set()
            rest = await resp.content.read()
        assert first + rest == b"".join(CHUNKS)
        assert d.bodies[0]["stream"] is True and p.bodies[0]["stream"] is False


async def test_each_request_takes_the_next_prefill_and_the_next_decode_instance(secret):
    prefills = [Fake("prefill", "tcp://127.0.0.1:1001"), Fake("prefill", "tcp://127.0.0.1:1002")]
    decodes = [Fake("decode"), Fake("decode")]
    async with running(prefills, decodes, secret) as master:
        for _ in range(4):
            assert (await master.post(PROMPT))[0] == 200
        assert [len(f.bodies) for f in (*prefills, *decodes)] == [2, 2, 2, 2]
        # both lists have two entries, so request i pairs prefill i % 2 with decode i % 2
        for decode, prefill in zip(decodes, prefills):
            assert [check_ticket(secret, b["hkv_pd"]) for b in decode.bodies] == [prefill.transporter] * 2
        assert [f.info_calls for f in prefills] == [1, 1]  # the transporter address is cached


async def test_a_prefill_4xx_reaches_the_client_unchanged_and_decode_is_not_called(secret):
    p, d = Fake("prefill", answer="status", status=400), Fake("decode")
    async with running([p], [d], secret) as master:
        status, body = await master.post(PROMPT)
        assert status == 400
        assert body == {"error": {"message": "prefill says no", "type": "invalid_request_error", "code": "x"}}
        assert d.bodies == []
        assert await master.counter("hkv_pd_requests_total", outcome="client_error") == 1


async def test_an_unreachable_prefill_instance_is_a_502_naming_it(secret):
    d = Fake("decode")
    async with serving(d), aiohttp.ClientSession() as upstream, contextlib.AsyncExitStack() as stack:
        gone = closed_port_url()
        pd = PdMaster([gone], [d.url], upstream, secret)
        master = Master(await start_http(pd, stack, "127.0.0.1", 0), pd, upstream)
        status, body = await master.post(PROMPT)
        assert status == 502 and body["error"]["type"] == "server_error"
        assert f"prefill instance {gone} failed" in body["error"]["message"]
        assert d.bodies == []
        assert await master.counter("hkv_pd_requests_total", outcome="prefill_failed") == 1
        assert await master.counter("hkv_pd_instance_failures_total", instance=gone, role="prefill") == 1


async def test_a_prefill_5xx_is_a_502_and_its_transporter_is_asked_again(secret):
    p, d = Fake("prefill", answer="status", status=500), Fake("decode")
    async with running([p], [d], secret) as master:
        status, body = await master.post(PROMPT)
        assert status == 502 and "answered 500: prefill says no" in body["error"]["message"]
        p.answer, p.transporter = "ok", "tcp://127.0.0.1:7777"  # restarted on another port
        assert (await master.post(PROMPT))[0] == 200
        assert p.info_calls == 2 and check_ticket(secret, d.bodies[0]["hkv_pd"]) == "tcp://127.0.0.1:7777"


async def test_a_prefill_instance_in_the_wrong_mode_is_a_502(secret):
    p, d = Fake("normal"), Fake("decode")
    async with running([p], [d], secret) as master:
        status, body = await master.post(PROMPT)
        assert status == 502 and "mode 'normal'" in body["error"]["message"] and p.bodies == []


async def test_a_decode_instance_dying_mid_stream_ends_the_stream_with_an_error_event_and_done(secret):
    p, d = Fake("prefill"), Fake("decode", answer="die")
    async with running([p], [d], secret) as master:
        events = await master.sse(PROMPT)
        assert events[:2] == [{"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]}]
        error = events[2]["error"]
        assert error["type"] == "server_error" and error["code"] == 502 and d.url in error["message"]
        assert events[3:] == ["[DONE]"]
        assert await master.counter("hkv_pd_requests_total", outcome="decode_failed") == 1
        assert await master.counter("hkv_pd_instance_failures_total", instance=d.url, role="decode") == 1


async def test_an_unreachable_decode_instance_is_a_502_naming_it(secret):
    p = Fake("prefill")
    async with serving(p), aiohttp.ClientSession() as upstream, contextlib.AsyncExitStack() as stack:
        gone = closed_port_url()
        pd = PdMaster([p.url], [gone], upstream, secret)
        master = Master(await start_http(pd, stack, "127.0.0.1", 0), pd, upstream)
        status, body = await master.post(PROMPT)
        assert status == 502 and f"decode instance {gone} failed" in body["error"]["message"]
        assert len(p.bodies) == 1
        assert await master.counter("hkv_pd_requests_total", outcome="decode_failed") == 1


async def test_a_decode_4xx_is_relayed_and_a_5xx_is_a_502(secret):
    p, d = Fake("prefill"), Fake("decode", answer="status", status=429)
    async with running([p], [d], secret) as master:
        status, body = await master.post(PROMPT)
        assert status == 429 and body["error"]["message"] == "decode says no"
        d.status = 503
        status, body = await master.post({**PROMPT, "stream": True})
        assert status == 502 and "answered 503: decode says no" in body["error"]["message"]


async def test_a_client_hanging_up_mid_stream_closes_the_decode_request(secret):
    p, d = Fake("prefill"), Fake("decode", answer="endless")
    async with running([p], [d], secret) as master:
        resp = await master.http.post(master.url + "/v1/completions", json={**PROMPT, "stream": True})
        assert await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 2) == CHUNKS[0]
        resp.close()  # drops the connection
        await asyncio.wait_for(d.closed.wait(), 1.0)
        await _counted(master, "aborted", 1)


async def test_a_client_hanging_up_during_prefill_closes_the_prefill_request(secret):
    p, d = Fake("prefill", answer="hang"), Fake("decode")
    async with running([p], [d], secret) as master:
        request = asyncio.create_task(master.post(PROMPT))
        async with asyncio.timeout(2):
            while not p.bodies:
                await asyncio.sleep(0.01)
        request.cancel()  # closes the client's connection
        with contextlib.suppress(asyncio.CancelledError):
            await request
        await asyncio.wait_for(p.closed.wait(), 1.0)
        await _counted(master, "aborted", 1)
        assert d.bodies == []


async def _counted(master: Master, outcome: str, value: float) -> None:
    """Wait until the master counted the request (its handler ends just after the client hung up)."""
    async with asyncio.timeout(2):
        while await master.counter("hkv_pd_requests_total", outcome=outcome) != value:
            await asyncio.sleep(0.01)


async def test_the_api_key_is_checked_and_forwarded(secret):
    p, d = Fake("prefill"), Fake("decode")
    async with running([p], [d], secret, api_key=KeyHash.of("sesame")) as master:
        status, body = await master.post(PROMPT)
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        status, _ = await master.post(PROMPT, Authorization="Bearer wrong")
        assert status == 401 and p.bodies == [] and d.bodies == []
        status, _ = await master.post(PROMPT, Authorization="Bearer sesame")
        assert status == 200
        assert p.headers[0]["Authorization"] == d.headers[0]["Authorization"] == "Bearer sesame"
        async with master.http.get(master.url + "/v1/models") as resp:
            assert resp.status == 401
        assert (await master.get("/health"))[0] == 200  # probes stay open


async def test_ready_needs_a_ready_prefill_and_a_ready_decode_instance(secret):
    p, d = Fake("prefill"), Fake("decode", ready_status=503)
    async with running([p], [d], secret) as master:
        status, text = await master.get("/ready")
        assert status == 503 and json.loads(text)["not_ready"] == [f"decode {d.url}"]
        d.ready_status = 200
        status, text = await master.get("/ready")
        assert status == 200 and json.loads(text)["ready"] is True
        assert await master.get("/health") == (200, '{"status":"ok"}')


async def test_models_come_from_the_first_decode_instance_that_answers(secret):
    p, d = Fake("prefill"), Fake("decode")
    async with serving(p, d), aiohttp.ClientSession() as upstream, contextlib.AsyncExitStack() as stack:
        pd = PdMaster([p.url], [closed_port_url(), d.url], upstream, secret)
        master = Master(await start_http(pd, stack, "127.0.0.1", 0), pd, upstream)
        status, text = await master.get("/v1/models")
        assert status == 200 and json.loads(text)["data"][0]["owned_by"] == d.url


async def test_bodies_too_large_or_not_objects_are_refused_at_the_master(secret):
    p, d = Fake("prefill"), Fake("decode")
    async with running([p], [d], secret, max_body_bytes=1000) as master:
        status, body = await master.post({**PROMPT, "prompt": "x" * 2000})
        assert status == 413 and body["error"]["code"] == "request_too_large"
        async with master.http.post(master.url + "/v1/completions", data=b"[1, 2]") as resp:
            assert resp.status == 400 and (await resp.json())["error"]["type"] == "invalid_request_error"
        async with master.http.post(master.url + "/v1/completions", data=b"{nope") as resp:
            assert resp.status == 400
        assert p.bodies == [] and d.bodies == []
        assert await master.counter("hkv_pd_requests_total", outcome="client_error") == 3


async def _ready_url(status_r: int, task: asyncio.Task) -> str:
    os.set_blocking(status_r, False)
    async with asyncio.timeout(10):
        while True:
            if task.done():
                task.result()
                raise AssertionError("serve returned before it was ready")
            with contextlib.suppress(BlockingIOError):
                return json.loads(os.read(status_r, 4096).splitlines()[0])["ready"]["url"]
            await asyncio.sleep(0.01)


async def test_serve_drains_in_flight_requests_and_refuses_new_ones(tmp_path):
    from tests.actors.actor_config import make_cfg

    secret_file = tmp_path / "pd.secret"
    secret_file.write_text(os.urandom(32).hex())
    secret_file.chmod(0o600)
    p, d = Fake("prefill"), Fake("decode", answer="gated")
    status_r, status_w = os.pipe()
    try:
        async with serving(p, d), aiohttp.ClientSession() as http:
            cfg = make_cfg(tempfile.mkdtemp(dir=tmp_path), mode="pd-master", prefill_urls=(p.url,),
                           decode_urls=(d.url,), secret_file=str(secret_file))
            ctx = ActorContext(name="pd_master", rank=0, status_fd=status_w)
            task = asyncio.create_task(serve(cfg, ctx))
            url = await _ready_url(status_r, task)
            async with http.post(url + "/v1/completions", json={**PROMPT, "stream": True}) as resp:
                assert await resp.content.readuntil(b"\n\n") == CHUNKS[0]
                ctx.request_stop("test")
                await asyncio.sleep(0.05)
                async with http.post(url + "/v1/completions", json=PROMPT) as refused:
                    assert refused.status == 503 and (await refused.json())["error"]["code"] == "draining"
                d.gate.set()
                assert (await resp.content.read()).endswith(b"data: [DONE]\n\n")
            await asyncio.wait_for(task, 5)
    finally:
        os.close(status_r)
        os.close(status_w)
