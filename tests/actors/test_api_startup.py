"""The api while the ranks start: /health answers, /ready and generation requests say what they do
(the launcher's `startup` block, hkv/ipc/startup.py), and both turn normal once the router admits."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time

import aiohttp
import pytest

from hkv.actors.api import serve
from hkv.ipc import startup
from hkv.ipc.process import ActorContext
from hkv.ipc.shm import ShmRegion
from hkv.ipc.startup import StartupBlock, StartupProgress
from tests.actors.actor_config import make_cfg
from tests.actors.fake_router import FakeRouter
from tests.e2e.harness import free_port
from tests.openai.tokenizer_fixture import tiny_tokenizer
from tests.shm_helpers import fresh_instance

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def instance():
    yield from fresh_instance("apistart")


async def _get(http: aiohttp.ClientSession, url: str) -> tuple[int, dict]:
    async with http.get(url) as resp:
        return resp.status, await resp.json(content_type=None)


async def _until(http: aiohttp.ClientSession, url: str, status: int) -> dict:
    async with asyncio.timeout(20):
        while True:
            with_status = None
            try:
                with_status = await _get(http, url)
            except aiohttp.ClientConnectionError:
                pass  # not listening yet
            if with_status is not None and with_status[0] == status:
                return with_status[1]
            await asyncio.sleep(0.02)


async def test_probes_and_requests_during_start_up(instance):
    run_dir = tempfile.mkdtemp(prefix="hkv-api-")
    cfg = make_cfg(run_dir, name=instance, port=free_port())
    url = f"http://127.0.0.1:{cfg.server.port}"
    region = ShmRegion.create(instance, startup.REGION, startup.NBYTES, writer="launcher")
    startup.write(region.payload, StartupBlock(StartupProgress("capturing decode graphs", 5, 12, "graphs", 1.0,
                                                               actor="rank0"), began_at=time.monotonic() - 1.0))
    status_r, status_w = os.pipe()
    ctx = ActorContext(name="api", rank=0, status_fd=status_w)
    task = asyncio.create_task(serve(cfg, ctx))
    try:
        async with aiohttp.ClientSession() as http:
            assert await _until(http, url + "/health", 200) == {"status": "ok"}
            body = await _until(http, url + "/ready", 503)
            assert body["starting"] is True and body["engine"] is None and body["draining"] is False
            assert body["phase"].startswith("rank0: capturing decode graphs (5/12 graphs, ")
            async with http.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}) as resp:
                refused = await resp.json()
            assert resp.status == 503 and refused["error"]["code"] == "not_ready"
            assert "the server is starting (rank0: capturing decode graphs (5/12 graphs" in refused["error"]["message"]
            async with FakeRouter(cfg, tiny_tokenizer()):  # the router reports that it admits
                body = await _until(http, url + "/ready", 200)
                assert (body["ready"], body["starting"], body["phase"]) == (True, False, None)
    finally:
        ctx.request_stop("test over")
        await asyncio.wait_for(task, 15)
        region.close()
        os.close(status_r)
        os.close(status_w)
        shutil.rmtree(run_dir, ignore_errors=True)
