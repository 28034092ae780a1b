"""The api actor in-process, on a free loopback port, against a fake router over real ZeroMQ links."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import openai
import pytest

from hkv.config import KeyHash
from hkv.ipc.messages import Constraint
from hkv.models.loader import describe_model
from tests.actors.api_harness import Harness, running
from tests.actors.fake_router import EOS_AFTER, SCRIPT
from tests.openai.malformed_cases import MALFORMED_CASES
from tests.openai.tokenizer_fixture import tiny_dense_folder, tiny_tokenizer

pytestmark = pytest.mark.timeout(60)

API_KEY = "sekret-key"


@pytest.fixture
async def api() -> AsyncIterator[Harness]:
    async with running() as harness:
        yield harness


def _expected_greedy(max_tokens: int) -> str:
    tok = tiny_tokenizer()
    ids = tok.encode(SCRIPT)
    return tok.decode([ids[i % len(ids)] for i in range(max_tokens)])


def _stream_text(events: list, index: int = 0, chat: bool = False) -> str:
    parts = []
    for e in events[:-1]:
        for c in e["choices"]:
            if c["index"] == index:
                parts.append(c["delta"].get("content", "") if chat else c["text"])
    return "".join(parts)


async def test_malformed_cases_get_4xx_and_server_keeps_serving(api):
    for case in MALFORMED_CASES:
        async with api.http.request(
            case.method, api.url + case.path, data=case.body_bytes(), headers=case.request_headers()
        ) as resp:
            body = await resp.json(content_type=None)
        assert resp.status == case.status, (case.name, body)
        error = body["error"]
        assert isinstance(error["message"], str) and error["message"], case.name
        assert set(error) == {"message", "type", "param", "code"}, case.name
    status, body = await api.post("/v1/completions", {"prompt": "Hello", "max_tokens": 5, "temperature": 0})
    assert status == 200 and body["choices"][0]["text"] == _expected_greedy(5)
    async with api.http.get(api.url + "/metrics") as resp:
        metrics = await resp.text()
    counts = [line for line in metrics.splitlines() if line.startswith("hkv_requests_total")]
    assert [line for line in counts if 'status="5' in line and "/ready" not in line] == []  # never a 5xx
    assert api.router.generated[-1].prompt_ids == tiny_tokenizer().encode("Hello", add_special_tokens=True)
    assert len(api.router.generated) == 1  # nothing malformed was queued


async def test_error_bodies_are_openai_json(api):
    async with api.http.get(api.url + "/v1/completions") as resp:
        assert resp.status == 405 and resp.content_type == "application/json"
        assert "POST" in resp.headers["Allow"]
    status, body = await api.post("/v1/completions", {"prompt": "hi", "model": "gpt-9"})
    assert status == 404 and body["error"]["code"] == "model_not_found" and body["error"]["param"] == "model"


async def test_completion_non_streaming_shape(api):
    body = {"prompt": "Hello", "max_tokens": 6, "temperature": 0, "return_token_ids": True, "model": "tiny-dense"}
    status, out = await api.post("/v1/completions", body)
    assert status == 200
    assert out["object"] == "text_completion" and out["id"].startswith("cmpl-") and out["model"] == "tiny-dense"
    choice = out["choices"][0]
    assert choice["text"] == _expected_greedy(6) and choice["finish_reason"] == "length" and choice["index"] == 0
    assert tiny_tokenizer().decode(choice["token_ids"]) == choice["text"]
    prompt_len = len(tiny_tokenizer().encode("Hello", add_special_tokens=True))
    assert out["usage"] == {
        "prompt_tokens": prompt_len,
        "completion_tokens": 6,
        "total_tokens": prompt_len + 6,
        "prompt_tokens_details": {"cached_tokens": 0},
        "cache": {"gpu": 0, "cpu": 0, "disk": 0, "peer": 0},
        "choices_cached_tokens": [0],
    }


async def test_cached_tokens_reported(api):
    body = {"prompt": [5, 6, 7, 8, 9, 10], "max_tokens": 2}
    await api.post("/v1/completions", body)
    _, out = await api.post("/v1/completions", body)
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 3
    assert out["usage"]["cache"]["gpu"] == 3


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_streaming_text_equals_non_streaming(api, path):
    chat = path.endswith("chat/completions")
    body = {"max_tokens": 30, "temperature": 0, "return_token_ids": True}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "Hello"})
    _, full = await api.post(path, body)
    events = await api.sse(path, {**body, "stream_options": {"include_usage": True}})
    text = full["choices"][0]["message"]["content"] if chat else full["choices"][0]["text"]
    assert text == _expected_greedy(30)
    assert _stream_text(events, chat=chat) == text
    streamed_ids = [t for e in events[:-2] for c in e["choices"] for t in c.get("token_ids", [])]
    assert streamed_ids == full["choices"][0]["token_ids"]
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 30
    assert all(e["usage"] is None for e in events[:-2])
    assert events[-3]["choices"][0]["finish_reason"] == "length"
    if chat:
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert full["object"] == "chat.completion" and events[0]["object"] == "chat.completion.chunk"


async def test_openai_client_completions(api):
    client = api.client()
    full = await asyncio.to_thread(
        client.completions.create, model="tiny-dense", prompt="Hello", max_tokens=12, temperature=0
    )
    assert full.choices[0].text == _expected_greedy(12) and full.usage.completion_tokens == 12

    def stream() -> tuple[str, object]:
        chunks = list(client.completions.create(
            model="tiny-dense", prompt="Hello", max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True},
        ))
        return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage

    text, usage = await asyncio.to_thread(stream)
    assert text == full.choices[0].text and usage.total_tokens == full.usage.total_tokens


async def test_openai_client_chat(api):
    client = api.client()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    full = await asyncio.to_thread(
        client.chat.completions.create, model="tiny-dense", messages=messages, max_tokens=9, temperature=0
    )
    assert full.choices[0].message.content == _expected_greedy(9) and full.choices[0].message.role == "assistant"

    def stream() -> str:
        chunks = client.chat.completions.create(
            model="tiny-dense", messages=messages, max_tokens=9, temperature=0, stream=True
        )
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    assert await asyncio.to_thread(stream) == full.choices[0].message.content
    models = await asyncio.to_thread(client.models.list)
    assert [m.id for m in models.data] == ["tiny-dense"]


async def test_n_choices_have_own_indices_and_seeds(api):
    body = {"prompt": "Hello", "max_tokens": 4, "n": 2, "temperature": 0.8, "seed": 10}
    _, full = await api.post("/v1/completions", body)
    assert [c["index"] for c in full["choices"]] == [0, 1]
    assert full["choices"][0]["text"] != full["choices"][1]["text"]
    assert [g.sampling.seed for g in api.router.generated] == [10, 11]
    assert full["usage"]["completion_tokens"] == 8
    assert full["usage"]["prompt_tokens"] == len(tiny_tokenizer().encode("Hello"))  # a shared prompt counts once
    assert full["usage"]["choices_cached_tokens"] == [0, 0]
    events = await api.sse("/v1/completions", body)
    assert {_stream_text(events, i) for i in (0, 1)} == {c["text"] for c in full["choices"]}


async def test_batched_prompts_with_n(api):
    _, full = await api.post("/v1/completions", {"prompt": ["a", "b"], "n": 2, "max_tokens": 2})
    assert sorted(c["index"] for c in full["choices"]) == [0, 1, 2, 3]
    assert len(api.router.generated) == 4


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_string_cuts_text_and_aborts(api, stream):
    body = {"prompt": "Hello", "max_tokens": 40, "temperature": 0, "stop": ["STOP", "zzz"], "return_token_ids": True}
    if stream:
        events = await api.sse("/v1/completions", body)
        text = _stream_text(events)
        assert events[-2]["choices"][0]["finish_reason"] == "stop"
    else:
        _, full = await api.post("/v1/completions", body)
        text = full["choices"][0]["text"]
        assert full["choices"][0]["finish_reason"] == "stop"
        assert tiny_tokenizer().decode(full["choices"][0]["token_ids"]).endswith("STOP")
    assert text == SCRIPT[: SCRIPT.index("STOP")]
    await api.router.wait_for(lambda: api.router.aborted == [api.router.generated[-1].req_id])


async def test_eos_from_router_finishes_with_stop(api):
    _, full = await api.post("/v1/completions", {"prompt": "EOS please", "max_tokens": 20, "temperature": 0})
    assert full["choices"][0]["finish_reason"] == "stop"
    assert full["choices"][0]["text"] == _expected_greedy(EOS_AFTER)  # the EOS token prints nothing
    assert full["usage"]["completion_tokens"] == EOS_AFTER + 1


async def test_logprobs_shapes(api):
    _, out = await api.post("/v1/completions", {"prompt": "Hello", "max_tokens": 3, "logprobs": 2})
    lp = out["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 3
    assert lp["token_logprobs"] == [-0.5] * 3 and all(len(t) >= 2 for t in lp["top_logprobs"])
    assert api.router.generated[-1].sampling.logprobs == 2
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True, "top_logprobs": 1}
    _, chat = await api.post("/v1/chat/completions", body)
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and set(content[0]) == {"token", "logprob", "bytes", "top_logprobs"}
    assert len(content[0]["top_logprobs"]) == 1


async def test_client_disconnect_aborts_stream(api):
    api.router.step_s = 0.02
    body = {"prompt": "Hello", "max_tokens": 500, "stream": True}
    async with api.http.post(api.url + "/v1/completions", json=body) as resp:
        await resp.content.readline()  # the first event arrived: the sequence runs
    req_id = api.router.generated[-1].req_id
    await api.router.wait_for(lambda: req_id in api.router.aborted)


async def test_client_disconnect_aborts_non_streaming(api):
    api.router.step_s = 0.02
    request = asyncio.create_task(api.post("/v1/completions", {"prompt": "Hello", "max_tokens": 500}))
    await api.router.wait_for(lambda: api.router.running)
    request.cancel()
    await asyncio.gather(request, return_exceptions=True)
    req_id = api.router.generated[-1].req_id
    await api.router.wait_for(lambda: req_id in api.router.aborted)


async def test_api_key_required():
    async with running(api_key=KeyHash.of(API_KEY)) as api:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            status, body = await api.post("/v1/completions", {"prompt": "hi", "max_tokens": 1}, **headers)
            assert status == 401 and body["error"]["code"] == "invalid_api_key"
        body = {"prompt": "hi", "max_tokens": 1}
        status, _ = await api.post("/v1/completions", body, Authorization=f"Bearer {API_KEY}")
        assert status == 200
        with pytest.raises(openai.AuthenticationError):
            await asyncio.to_thread(api.client("wrong").models.list)
        assert len((await asyncio.to_thread(api.client(API_KEY).models.list)).data) == 1
        async with api.http.get(api.url + "/health") as resp:
            assert resp.status == 200  # probes stay open


async def test_probes_follow_router_state(api):
    async def status(path: str) -> int:
        async with api.http.get(api.url + path) as resp:
            return resp.status

    assert (await status("/health"), await status("/ready")) == (200, 200)
    await api.router.send_state(ready=False)
    await asyncio.sleep(0.05)
    assert (await status("/health"), await status("/ready")) == (200, 503)
    code, body = await api.post("/v1/completions", {"prompt": "hi"})
    assert code == 503 and body["error"]["code"] == "not_ready"
    await api.router.send_state(ready=True)
    await asyncio.sleep(0.05)
    assert await status("/ready") == 200


async def test_engine_death_fails_in_flight_and_health(api):
    api.router.step_s = 0.05
    request = asyncio.create_task(api.post("/v1/completions", {"prompt": "Hello", "max_tokens": 500}))
    await api.router.wait_for(lambda: api.router.running)
    await api.router.send_state(ready=False, alive=False)
    code, body = await asyncio.wait_for(request, 5)
    assert code == 503 and body["error"]["type"] == "server_error" and body["error"]["code"] == "engine_failed"
    async with api.http.get(api.url + "/health") as resp:
        assert resp.status == 503


async def test_engine_death_mid_stream_sends_error_event(api):
    api.router.step_s = 0.05

    async def read_all() -> list:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 500}
        return await api.sse("/v1/chat/completions", body)

    request = asyncio.create_task(read_all())
    await api.router.wait_for(lambda: api.router.running)
    await api.router.send_state(ready=False, alive=False)
    events = await asyncio.wait_for(request, 5)
    assert events[-3]["choices"][0]["finish_reason"] == "error"
    assert events[-2]["error"]["type"] == "server_error" and "engine failed" in events[-2]["error"]["message"]


async def test_openai_client_raises_on_stream_error_event(api):
    api.router.step_s = 0.05

    def consume() -> Exception | None:
        try:
            list(api.client().completions.create(model="tiny-dense", prompt="x", max_tokens=500, stream=True))
        except openai.APIError as exc:
            return exc
        return None

    request = asyncio.create_task(asyncio.to_thread(consume))
    await api.router.wait_for(lambda: api.router.running)
    await api.router.send_state(ready=False, alive=False)
    error = await asyncio.wait_for(request, 10)
    assert error is not None and "engine failed" in str(error)


async def test_overload_gets_429():
    async with running() as api:
        api.router.step_s = 0.05
        body = {"prompt": "Hello", "max_tokens": 500, "n": 16}
        requests = [asyncio.create_task(api.post("/v1/completions", body)) for _ in range(4)]
        await api.router.wait_for(lambda: len(api.router.running) == 64)
        status, out = await api.post("/v1/completions", {"prompt": "Hello", "max_tokens": 1})
        assert status == 429 and out["error"]["code"] == "overloaded"
        for r in requests:
            r.cancel()
        await asyncio.gather(*requests, return_exceptions=True)


async def test_drain_refuses_new_and_finishes_in_flight():
    async with running() as api:
        api.router.step_s = 0.01
        body = {"prompt": "Hello", "max_tokens": 40, "temperature": 0}
        in_flight = asyncio.create_task(api.post("/v1/completions", body))
        await api.router.wait_for(lambda: api.router.running)
        api.ctx.request_stop("SIGTERM")
        await asyncio.sleep(0.02)
        status, body = await api.post("/v1/completions", {"prompt": "hi", "max_tokens": 1})
        assert status == 503 and body["error"]["code"] == "draining"
        async with api.http.get(api.url + "/ready") as resp:
            assert resp.status == 503
        status, body = await in_flight
        assert status == 200 and body["choices"][0]["text"] == _expected_greedy(40)
        await asyncio.wait_for(api.task, 5)  # serve returns once drained


async def test_drain_timeout_aborts_stragglers():
    async with running(drain_timeout_s=0.2) as api:
        api.router.step_s = 0.05
        in_flight = asyncio.create_task(api.post("/v1/completions", {"prompt": "Hello", "max_tokens": 1000}))
        await api.router.wait_for(lambda: api.router.running)
        api.ctx.request_stop("SIGTERM")
        status, body = await asyncio.wait_for(in_flight, 5)
        assert status == 200 and body["choices"][0]["finish_reason"] == "abort"
        await asyncio.wait_for(api.task, 5)
        await api.router.wait_for(lambda: api.router.aborted)


async def test_models_metrics_and_flush(api):
    async with api.http.get(api.url + "/v1/models") as resp:
        models = await resp.json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny-dense"
    await api.post("/v1/completions", {"prompt": "Hello", "max_tokens": 3})
    async with api.http.get(api.url + "/metrics") as resp:
        text = await resp.text()
    assert resp.content_type == "text/plain"
    for name in (
        'hkv_requests_total{endpoint="/v1/completions",status="200"} 1.0',
        "hkv_generation_tokens_total 3.0",
        "hkv_time_to_first_token_seconds_count 1.0",
        "hkv_time_per_output_token_seconds_count 1.0",
        'hkv_malformed_messages_total{link="api_in"} 0.0',
        "hkv_requests_in_flight 0.0",
        "hkv_engine_ready 1.0",
    ):
        assert name in text, name
    status, body = await api.post("/cache/flush", {})
    assert status == 200 and body == {"flushed": True, "pages": 3, "checkpoints": 1, "cpu_pages": 0, "disk_files": 0}


async def test_a_prefill_for_a_peer_asks_a_device_hold_only_for_one_prompt():
    """A prefill answer's ticket names one device hold: a request of several prompts takes the CPU path and
    must not leave holds nobody names (they would sit on the device until they expire)."""
    async with running(mode="prefill") as api:
        pd = {"hkv_pd": {"prefill": True}, "max_tokens": 1, "temperature": 0}
        status, _ = await api.post("/v1/completions", {"prompt": "Hello there", **pd})
        assert status == 200
        one = api.router.generated[-1]
        assert one.for_peer and one.device_hold
        status, _ = await api.post("/v1/completions", {"prompt": ["Hello there", "General Kenobi"], **pd})
        assert status == 200
        two = api.router.generated[-2:]
        assert all(g.for_peer and not g.device_hold for g in two) and len({g.req_id for g in two}) == 2
        status, _ = await api.post("/v1/completions", {"prompt": "Hello there", "max_tokens": 1})
        assert status == 200 and not api.router.generated[-1].for_peer and not api.router.generated[-1].device_hold


async def test_sampling_fields_and_constraints_reach_the_router():
    async with running(tool_call_parser="hermes") as api:
        status, _ = await api.post("/v1/completions", {
            "prompt": "Hi", "max_tokens": 2, "min_p": 0.2, "presence_penalty": 1, "frequency_penalty": -1,
            "repetition_penalty": 1.1, "logit_bias": {"5": -100}, "guided_regex": "[ab]+"})
        s = api.router.generated[-1].sampling
        assert status == 200 and (s.min_p, s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (
            0.2, 1.0, -1.0, 1.1)
        assert s.logit_bias == {5: -100.0} and s.constraint == Constraint("regex", "[ab]+")
        tool = {"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "integer"}}}}}
        body = {"messages": [{"role": "user", "content": "x"}], "tools": [tool], "max_tokens": 2, "n": 2,
                "tool_choice": {"type": "function", "function": {"name": "f"}}}
        status, _ = await api.post("/v1/chat/completions", body)
        constraints = [g.sampling.constraint for g in api.router.generated[-2:]]
        assert status == 200 and constraints[0] == constraints[1] and constraints[0].kind == "lark"
        assert constraints[0].spec.startswith('start: call\ncall: call_0\ncall_0: "<tool_call>\\n{\\"name\\": \\"f\\"')
        status, error = await api.post("/v1/chat/completions", {**body, "tool_choice": {
            "type": "function", "function": {"name": "g"}}})
        assert status == 400 and error["error"]["param"] == "tool_choice.function.name"
        async with api.http.get(api.url + "/v1/models") as resp:
            card = (await resp.json())["data"][0]
        assert card["vocab_size"] == describe_model(tiny_dense_folder()).vocab_size and card["max_model_len"] == 4096
