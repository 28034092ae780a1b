"""Issue 2, acceptance 5: malformed requests against real processes get a 4xx
with an OpenAI error body, and the server keeps serving."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.openai.malformed_cases import MALFORMED_CASES

pytestmark = pytest.mark.e2e


async def _send(session, url, case):
    async with session.request(case.method, url + case.path, data=case.body_bytes(),
                               headers=case.request_headers()) as resp:
        body = await resp.json(content_type=None)
        return resp.status, body


def test_malformed_requests_get_4xx_and_the_server_keeps_serving(qwen3_server):
    assert len({c.name for c in MALFORMED_CASES}) >= 20

    async def run():
        async with aiohttp.ClientSession() as session:
            outcomes = []
            for case in MALFORMED_CASES:
                outcomes.append((case, *await _send(session, qwen3_server.url, case)))
            async with session.post(qwen3_server.url + "/v1/completions",
                                    json={"prompt": "still alive?", "max_tokens": 4, "temperature": 0}) as resp:
                healthy = (resp.status, await resp.json())
            async with session.get(qwen3_server.url + "/health") as resp:
                health = resp.status
            return outcomes, healthy, health

    outcomes, healthy, health = asyncio.run(run())
    for case, status, body in outcomes:
        assert status == case.status, f"{case.name}: got {status} {body}"
        assert 400 <= status < 500
        assert isinstance(body, dict) and isinstance(body.get("error"), dict), f"{case.name}: {body}"
        assert body["error"].get("message"), case.name
    assert healthy[0] == 200 and healthy[1]["usage"]["completion_tokens"] == 4
    assert health == 200
    assert qwen3_server.proc.poll() is None
