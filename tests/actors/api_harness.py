"""The api actor in-process, on a free loopback port, against a fake router over real ZeroMQ links."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import aiohttp
import openai

from hkv.actors.api import serve
from hkv.config import HkvConfig
from hkv.ipc.process import ActorContext
from tests.actors.actor_config import make_cfg
from tests.actors.fake_router import FakeRouter
from tests.openai.tokenizer_fixture import tiny_tokenizer


@dataclass
class Harness:
    url: str
    router: FakeRouter
    ctx: ActorContext
    task: asyncio.Task
    http: aiohttp.ClientSession

    async def post(self, path: str, body: dict, **headers: str) -> tuple[int, dict]:
        async with self.http.post(self.url + path, json=body, headers=headers) as resp:
            return resp.status, await resp.json(content_type=None)

    async def sse(self, path: str, body: dict) -> list[dict]:
        """Every `data:` event of a streamed response, [DONE] last (as the string "[DONE]")."""
        events = []
        async with self.http.post(self.url + path, json={**body, "stream": True}) as resp:
            assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
            async for line in resp.content:
                if line.startswith(b"data: "):
                    data = line[6:].strip()
                    events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
        assert events[-1] == "[DONE]"
        return events

    def client(self, api_key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=20)


async def _wait_ready(status_r: int, task: asyncio.Task) -> str:
    """Read the actor's {"ready": {"url": ...}} status line."""
    os.set_blocking(status_r, False)
    async with asyncio.timeout(10):
        while True:
            if task.done():
                task.result()
                raise AssertionError("serve returned before it was ready")
            with contextlib.suppress(BlockingIOError):
                return json.loads(os.read(status_r, 4096).splitlines()[0])["ready"]["url"]
            await asyncio.sleep(0.01)


async def _wait_admitting(http: aiohttp.ClientSession, url: str) -> None:
    """/ready turns 200 once the router's first EngineState arrived."""
    async with asyncio.timeout(10):
        while True:
            async with http.get(url + "/ready") as resp:
                if resp.status == 200:
                    return
            await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def running(edit: Callable[[HkvConfig], HkvConfig] | None = None, **server: object) -> AsyncIterator[Harness]:
    """The api serving `make_cfg(**server)` (changed by `edit`) in this process, until the block ends."""
    run_dir = tempfile.mkdtemp(prefix="hkv-api-")  # short: ipc paths are limited to ~100 bytes
    cfg = make_cfg(run_dir, **server)
    if edit is not None:
        cfg = edit(cfg)
    status_r, status_w = os.pipe()
    try:
        async with FakeRouter(cfg, tiny_tokenizer()) as router, aiohttp.ClientSession() as http:
            ctx = ActorContext(name="api", rank=0, status_fd=status_w)
            task = asyncio.create_task(serve(cfg, ctx))
            try:
                url = await _wait_ready(status_r, task)
                await _wait_admitting(http, url)
                yield Harness(url, router, ctx, task, http)
            finally:
                ctx.request_stop("test over")
                await asyncio.wait_for(task, 15)
    finally:
        os.close(status_r)
        os.close(status_w)
        shutil.rmtree(run_dir, ignore_errors=True)
