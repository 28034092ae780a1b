"""Issue 2, acceptance 2: greedy output through real processes equals transformers'.

Six concurrent greedy requests (prompts of 5 to 700 tokens, chunked prefill of
256 tokens) are checked teacher-forced and margin-aware; streaming text equals
non-streaming text, through aiohttp and through the `openai` package.
"""

from __future__ import annotations

import asyncio
import json
import random

import aiohttp
import openai
import pytest

from tests.reference import assert_greedy_parity

pytestmark = pytest.mark.e2e
PROMPT_LENS = [5, 64, 129, 300, 517, 700]
MAX_TOKENS = 24


async def _complete(session, url, body):
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def _stream_text(session, url, path, body) -> tuple[str, list[int], dict | None]:
    text, token_ids, usage = [], [], None
    async with session.post(f"{url}{path}", json={**body, "stream": True}) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                text.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
                token_ids += choice.get("token_ids") or []
    return "".join(text), token_ids, usage


def test_concurrent_greedy_requests_match_transformers(qwen3_server, qwen3_reference):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1536) for _ in range(n)] for n in PROMPT_LENS]

    async def run():
        async with aiohttp.ClientSession() as session:
            bodies = [
                {"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True, "ignore_eos": True}
                for p in prompts
            ]
            return await asyncio.gather(*(_complete(session, qwen3_server.url, b) for b in bodies))

    results = asyncio.run(run())
    for prompt, result in zip(prompts, results):
        choice = result["choices"][0]
        assert len(choice["token_ids"]) == MAX_TOKENS
        assert result["usage"]["prompt_tokens"] == len(prompt)
        assert result["usage"]["completion_tokens"] == MAX_TOKENS
        assert_greedy_parity(qwen3_reference, prompt, choice["token_ids"])


def test_streaming_equals_non_streaming(qwen3_server, qwen3_reference):
    body = {"prompt": "The quick brown fox", "max_tokens": 40, "temperature": 0, "return_token_ids": True}

    async def run():
        async with aiohttp.ClientSession() as session:
            whole = await _complete(session, qwen3_server.url, body)
            streamed = await _stream_text(
                session, qwen3_server.url, "/v1/completions", {**body, "stream_options": {"include_usage": True}}
            )
            return whole, streamed

    whole, (text, token_ids, usage) = asyncio.run(run())
    choice = whole["choices"][0]
    assert text == choice["text"]
    assert token_ids == choice["token_ids"]
    assert usage == whole["usage"]
    assert_greedy_parity(qwen3_reference, _prompt_ids(qwen3_server, body["prompt"]), choice["token_ids"])


def _prompt_ids(server, text):
    from hkv.models.tokenizer import Tokenizer

    return Tokenizer.from_folder(server_model_dir(server)).encode(text)


def server_model_dir(server):
    idx = server.proc.args.index("--model")
    return server.proc.args[idx + 1]


def test_openai_client_stream_equals_non_stream(qwen3_server):
    client = openai.OpenAI(base_url=f"{qwen3_server.url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    whole = client.completions.create(model=model, prompt="Once upon a time", max_tokens=30, temperature=0)
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=model, prompt="Once upon a time", max_tokens=30, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == whole.choices[0].text
    assert whole.usage.completion_tokens > 0

    messages = [{"role": "user", "content": "Say something about caches."}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=30, temperature=0)
    chat_streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model=model, messages=messages, max_tokens=30, temperature=0, stream=True
        )
        if c.choices
    )
    assert chat_streamed == chat.choices[0].message.content
    assert chat.choices[0].finish_reason in ("stop", "length")
