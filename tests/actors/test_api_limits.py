"""Issue 16 at the api, in-process against the fake router: what an abusive client or a dying engine can do.

- item 1: a huge prompt is refused by its size before tokenizing; one that must be
  tokenized goes to the tokenizer process and /health stays fast meanwhile;
- item 2: a stalled request body gets 408 and its connection is closed; connections
  past --max-connections get 503;
- item 3: /ready is 503 while work is pending and no step finishes, or the router is silent;
- item 4: when the engine is gone every stream ends with an error event and [DONE],
  every waiting request gets 503;
- item 8: /cache/flush takes the admin key; /metrics a metrics key when one is set.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import resource
import socket
import time

import pytest

from hkv.config import HkvConfig, KeyHash
from tests.actors.api_harness import running

pytestmark = pytest.mark.timeout(90)


async def _get(api, path: str, **headers: str) -> int:
    async with api.http.get(api.url + path, headers=headers) as resp:
        return resp.status


def _addr(api) -> tuple[str, int]:
    host, port = api.url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


async def _recv_all(sock: socket.socket, timeout: float) -> bytes:
    """Everything the server sends until it closes the connection (or `timeout`)."""
    loop = asyncio.get_running_loop()
    sock.setblocking(False)
    data = b""
    async with asyncio.timeout(timeout):
        while chunk := await loop.sock_recv(sock, 65536):
            data += chunk
    return data


async def test_a_huge_prompt_is_refused_by_its_size_at_once():
    async with running() as api:
        huge = "a" * (8 * 2**20 - 64)
        started = time.monotonic()
        status, body = await api.post("/v1/completions", {"prompt": huge, "max_tokens": 2})
        chat_status, chat = await api.post("/v1/chat/completions",
                                           {"messages": [{"role": "user", "content": huge[: 2**20]}]})
        assert time.monotonic() - started < 2.0
        for code, out in ((status, body), (chat_status, chat)):
            assert code == 400 and out["error"]["code"] == "context_length_exceeded"
            assert "characters" in out["error"]["message"]
        assert api.router.generated == []


def _big_context(cfg: HkvConfig) -> HkvConfig:
    """A model whose context admits a multi-MiB prompt, so the size bound cannot refuse it."""
    spec = dataclasses.replace(cfg.model.spec, max_context=2**24)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, spec=spec),
                               cache=dataclasses.replace(cfg.cache, max_total_tokens=2**24))


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


async def test_a_long_prompt_is_tokenized_off_the_event_loop_and_out_of_its_memory():
    async with running(_big_context) as api:
        text = ("the quick brown fox jumps over the lazy dog. " * 100_000)[: 4 * 2**20]
        rss_before = _rss_mib()
        request = asyncio.create_task(api.post("/v1/completions", {"prompt": text, "max_tokens": 2**25}))
        worst = 0.0
        while not request.done():
            started = time.monotonic()
            assert await _get(api, "/health") == 200
            worst = max(worst, time.monotonic() - started)
            await asyncio.sleep(0.02)
        status, body = request.result()
        # tokenized (the count is in the message), then refused for max_tokens
        assert status == 400 and "tokens" in body["error"]["message"] and body["error"]["param"] == "max_tokens"
        assert worst < 0.5, worst
        assert _rss_mib() - rss_before < 300  # the encoding (~1 GiB in-process) lived in the tokenizer process


async def test_a_stalled_body_gets_408_and_its_connection_closes():
    async with running(request_timeout_s=0.5) as api:
        with socket.create_connection(_addr(api)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"prompt\": ")
            started = time.monotonic()
            answer = await _recv_all(sock, 5.0)
        assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer
        assert time.monotonic() - started < 2.0
        with socket.create_connection(_addr(api)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # half a head, then nothing
            assert await _recv_all(sock, 5.0) == b""  # closed after the request timeout


async def test_connections_past_the_limit_get_503():
    async with running(max_connections=4) as api:
        loop = asyncio.get_running_loop()
        idle = []
        for _ in range(8):
            sock = socket.socket()
            sock.setblocking(False)
            await loop.sock_connect(sock, _addr(api))
            idle.append(sock)
        try:
            answers = []
            for sock in idle:
                try:
                    async with asyncio.timeout(0.3):
                        answers.append(await loop.sock_recv(sock, 4096))
                except TimeoutError:
                    answers.append(None)  # accepted: the server waits for a request
            refused = [a for a in answers if a is not None]
            assert len(refused) >= 4 and all(a.startswith(b"HTTP/1.1 503") for a in refused)
            assert answers.count(None) <= 4
        finally:
            for sock in idle:
                sock.close()
        await asyncio.sleep(0.1)
        status, _ = await api.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 200
        async with api.http.get(api.url + "/metrics") as resp:
            assert f"hkv_http_connections_refused_total {float(len(refused))}" in await resp.text()


async def test_ready_is_503_while_the_engine_makes_no_progress():
    async with running(stall_timeout_s=0.3) as api:
        api.router.step_s = 0.02
        request = asyncio.create_task(api.post("/v1/completions", {"prompt": "Hello", "max_tokens": 400}))
        await api.router.wait_for(lambda: api.router.running)
        api.router.freeze()
        await asyncio.sleep(0.6)
        async with api.http.get(api.url + "/ready") as resp:
            assert resp.status == 503
            assert "no step finished" in (await resp.json())["engine"]["stalled"]
        assert await _get(api, "/health") == 200
        status, body = await api.post("/v1/completions", {"prompt": "hi", "max_tokens": 1})
        assert status == 503 and "not making progress" in body["error"]["message"]
        api.router.thaw()
        await asyncio.sleep(0.3)  # a step and a heartbeat
        assert await _get(api, "/ready") == 200
        api.router.silent = True
        await asyncio.sleep(1.5)  # the stall time plus one heartbeat
        async with api.http.get(api.url + "/ready") as resp:
            assert resp.status == 503 and "not reported" in (await resp.json())["engine"]["stalled"]
        api.router.silent = False
        status, _ = await request
        assert status == 200


async def test_when_the_engine_is_gone_streams_get_an_error_event_and_waiting_requests_503():
    async with running() as api:
        api.router.step_s = 0.05

        async def stream() -> list:
            events = []
            body = {"prompt": "Hello", "max_tokens": 500, "stream": True}
            async with api.http.post(api.url + "/v1/completions", json=body) as resp:
                async for line in resp.content:
                    if line.startswith(b"data: "):
                        data = line[6:].strip()
                        events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
            return events

        streaming = asyncio.create_task(stream())
        waiting = asyncio.create_task(api.post("/v1/completions", {"prompt": "Hello", "max_tokens": 500}))
        await api.router.wait_for(lambda: len(api.router.running) == 2)
        started = time.monotonic()
        api.ctx.abandon("test: an actor died")
        events = await asyncio.wait_for(streaming, 5)
        status, body = await asyncio.wait_for(waiting, 5)
        await asyncio.wait_for(api.task, 5)
        assert time.monotonic() - started < 3.0
        assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "server_error"
        assert "an actor died" in events[-2]["error"]["message"]
        assert status == 503 and body["error"]["code"] == "engine_failed"


async def test_flush_takes_the_admin_key_and_metrics_its_own():
    keys = {"api_key": KeyHash.of("user"), "admin_key": KeyHash.of("admin"), "metrics_key": KeyHash.of("prom")}
    async with running(**keys) as api:
        for key, status in ((None, 401), ("user", 401), ("admin", 200)):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            assert (await api.post("/cache/flush", {}, **headers))[0] == status
        assert await _get(api, "/metrics") == 401
        assert await _get(api, "/metrics", Authorization="Bearer user") == 401
        assert await _get(api, "/metrics", Authorization="Bearer prom") == 200
        for open_path in ("/health", "/ready", "/openapi.json"):
            assert await _get(api, open_path) == 200
        async with api.http.get(api.url + "/openapi.json") as resp:
            doc = await resp.json()
        assert doc["paths"]["/cache/flush"]["post"]["security"] == [{"bearer": []}]
        assert doc["paths"]["/health"]["get"].get("security") is None
    async with running(api_key=KeyHash.of("user")) as api:
        assert (await api.post("/cache/flush", {}, Authorization="Bearer user"))[0] == 200  # no admin key: the api key
        assert await _get(api, "/metrics") == 200  # no metrics key: open


async def test_openapi_lists_every_route_the_app_serves():
    async with running() as api:
        async with api.http.get(api.url + "/openapi.json") as resp:
            doc = await resp.json()
        served = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/ready", "/metrics",
                  "/openapi.json", "/cache/flush", "/pd/info", "/tokenize", "/detokenize"}
        assert set(doc["paths"]) == served
        for path, ops in doc["paths"].items():
            for op in ops.values():
                assert "200" in op["responses"], path
        assert set(doc["paths"]["/v1/completions"]["post"]["responses"]) == {
            "200", "400", "401", "404", "408", "413", "429", "503"}
