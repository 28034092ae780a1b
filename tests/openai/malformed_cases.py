"""Malformed requests as data: each must get its 4xx with OpenAI error JSON, never a 5xx.

Reused by tests/actors/test_api.py (in-process server) and the end-to-end tests.
Bodies are raw bytes when JSON cannot express the mistake (bad UTF-8, NaN,
lone surrogates), else JSON values. No case names a model, except the one
about an unknown model; no case depends on a particular vocabulary or context
length beyond "a million tokens is too many" and "10**9 is not a token id".
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
HUGE_BODY_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class MalformedCase:
    name: str
    path: str
    body: bytes | Any  # raw bytes are sent as they are; anything else as JSON
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    method: str = "POST"

    def body_bytes(self) -> bytes:
        if isinstance(self.body, bytes):
            return self.body
        return json.dumps(self.body).encode()

    def request_headers(self) -> dict[str, str]:
        return {"Content-Type": "application/json", **self.headers}


def _chat(messages: Any, **extra: Any) -> dict[str, Any]:
    return {"messages": messages, "max_tokens": 4, **extra}


def _completion(prompt: Any, **extra: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": 4, **extra}


_USER = [{"role": "user", "content": "hi"}]

MALFORMED_CASES: list[MalformedCase] = [
    MalformedCase("truncated json", COMPLETIONS, b'{"prompt": "hi", ', 400),
    MalformedCase("empty body", COMPLETIONS, b"", 400),
    MalformedCase("json array body", COMPLETIONS, [1, 2, 3], 400),
    MalformedCase("json string body", CHAT, "hello", 400),
    MalformedCase("invalid utf-8", COMPLETIONS, b'{"prompt": "caf\xe9 \xff\xfe"}', 400),
    MalformedCase("lone surrogate", COMPLETIONS, b'{"prompt": "abc \\ud800 def"}', 400),
    MalformedCase("lone low surrogate in chat", CHAT, b'{"messages": [{"role": "user", "content": "\\udc00"}]}', 400),
    MalformedCase("NaN temperature", COMPLETIONS, b'{"prompt": "hi", "temperature": NaN}', 400),
    MalformedCase("infinite top_p", COMPLETIONS, b'{"prompt": "hi", "top_p": 1e999}', 400),
    MalformedCase("64 MB body", COMPLETIONS, b'{"prompt": "' + b"a" * HUGE_BODY_BYTES + b'"}', 413),
    MalformedCase("missing prompt", COMPLETIONS, {"max_tokens": 4}, 400),
    MalformedCase("prompt is a number", COMPLETIONS, _completion(5), 400),
    MalformedCase("empty prompt string", COMPLETIONS, _completion(""), 400),
    MalformedCase("empty prompt list", COMPLETIONS, _completion([]), 400),
    MalformedCase("empty inner token list", COMPLETIONS, _completion([[]]), 400),
    MalformedCase("mixed prompt list", COMPLETIONS, _completion(["a", 1]), 400),
    MalformedCase("bool token id", COMPLETIONS, _completion([1, True, 2]), 400),
    MalformedCase("float token id", COMPLETIONS, _completion([1, 2.0]), 400),
    MalformedCase("token id out of vocab", COMPLETIONS, _completion([1, 10**9]), 400),
    MalformedCase("negative token id", COMPLETIONS, _completion([1, -1]), 400),
    MalformedCase("over-long prompt", COMPLETIONS, _completion([1] * 1_000_000), 400),
    MalformedCase("max_tokens beyond context", COMPLETIONS, _completion("hi", max_tokens=10**9), 400),
    MalformedCase("bool max_tokens", COMPLETIONS, _completion("hi", max_tokens=True), 400),
    MalformedCase("string max_tokens", COMPLETIONS, _completion("hi", max_tokens="4"), 400),
    MalformedCase("float max_tokens", COMPLETIONS, _completion("hi", max_tokens=3.5), 400),
    MalformedCase("zero max_tokens", COMPLETIONS, _completion("hi", max_tokens=0), 400),
    MalformedCase("negative max_tokens", CHAT, _chat(_USER, max_tokens=-3), 400),
    MalformedCase("temperature too high", COMPLETIONS, _completion("hi", temperature=2.5), 400),
    MalformedCase("negative temperature", CHAT, _chat(_USER, temperature=-0.1), 400),
    MalformedCase("string temperature", COMPLETIONS, _completion("hi", temperature="hot"), 400),
    MalformedCase("top_p zero", COMPLETIONS, _completion("hi", top_p=0), 400),
    MalformedCase("top_p above one", CHAT, _chat(_USER, top_p=1.5), 400),
    MalformedCase("top_k zero", COMPLETIONS, _completion("hi", top_k=0), 400),
    MalformedCase("n zero", COMPLETIONS, _completion("hi", n=0), 400),
    MalformedCase("n huge", CHAT, _chat(_USER, n=1000), 400),
    MalformedCase("bool seed", COMPLETIONS, _completion("hi", seed=False), 400),
    MalformedCase("string seed", COMPLETIONS, _completion("hi", seed="abc"), 400),
    MalformedCase("stream not a bool", COMPLETIONS, _completion("hi", stream="yes"), 400),
    MalformedCase("stream_options without stream", CHAT, _chat(_USER, stream_options={"include_usage": True}), 400),
    MalformedCase("empty stop string", COMPLETIONS, _completion("hi", stop=""), 400),
    MalformedCase("five stop strings", COMPLETIONS, _completion("hi", stop=["a", "b", "c", "d", "e"]), 400),
    MalformedCase("stop not a string", CHAT, _chat(_USER, stop=[1]), 400),
    MalformedCase("logprobs too many", COMPLETIONS, _completion("hi", logprobs=6), 400),
    MalformedCase("logprobs bool in completions", COMPLETIONS, _completion("hi", logprobs=True), 400),
    MalformedCase("top_logprobs without logprobs", CHAT, _chat(_USER, top_logprobs=2), 400),
    MalformedCase("top_logprobs too many", CHAT, _chat(_USER, logprobs=True, top_logprobs=6), 400),
    MalformedCase("echo unsupported", COMPLETIONS, _completion("hi", echo=True), 400),
    MalformedCase("model not a string", COMPLETIONS, _completion("hi", model=7), 400),
    MalformedCase("unknown model", COMPLETIONS, _completion("hi", model="no-such-model"), 404),
    MalformedCase("missing messages", CHAT, {"max_tokens": 4}, 400),
    MalformedCase("messages not a list", CHAT, _chat({"role": "user", "content": "hi"}), 400),
    MalformedCase("empty messages", CHAT, _chat([]), 400),
    MalformedCase("message not an object", CHAT, _chat(["hi"]), 400),
    MalformedCase("missing role", CHAT, _chat([{"content": "hi"}]), 400),
    MalformedCase("bad role", CHAT, _chat([{"role": "wizard", "content": "hi"}]), 400),
    MalformedCase("content is a number", CHAT, _chat([{"role": "user", "content": 5}]), 400),
    MalformedCase("missing user content", CHAT, _chat([{"role": "user"}]), 400),
    MalformedCase(
        "image part",
        CHAT,
        _chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]),
        400,
    ),
    MalformedCase("text part without text", CHAT, _chat([{"role": "user", "content": [{"type": "text"}]}]), 400),
    MalformedCase("unknown route", "/v1/nope", _completion("hi"), 404),
    MalformedCase("GET on a POST route", COMPLETIONS, b"", 405, method="GET"),
]
