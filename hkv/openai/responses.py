"""OpenAI response bodies: errors, non-streaming responses and SSE chunks.

`CompletionFormat` and `ChatFormat` share one interface so the api's
streaming and collecting loops do not care which endpoint they serve:
`start_frames()`, `chunk(update)`, `usage_frame(usage)`, `response(gen)`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

import msgspec

from hkv.ipc.messages import TopLogprob
from hkv.openai.chat_output import ToolCallDelta, merge_tool_calls
from hkv.openai.detok import Decoder
from hkv.openai.generation import ChoiceState, ChoiceUpdate, Generation

DONE_FRAME = b"data: [DONE]\n\n"


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> bytes:
    return msgspec.json.encode({"error": {"message": message, "type": error_type, "param": param, "code": code}})


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


def error_frame(message: str, error_type: str) -> bytes:
    """An error event inside an SSE stream (the status line is already sent); OpenAI clients raise on it."""
    return b"data: " + error_body(message, error_type) + b"\n\n"


def _token_text(tokenizer: Decoder, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


class LogprobFormatter:
    """Logprobs in OpenAI's legacy completions shape and in the chat shape."""

    def __init__(self, tokenizer: Decoder):
        self._tokenizer = tokenizer

    def completion(
        self, ids: Sequence[int], logprobs: Sequence[float], tops: Sequence[list[TopLogprob]], offset: int
    ) -> dict[str, Any]:
        """{"tokens", "token_logprobs", "top_logprobs", "text_offset"}; offset: chars before ids[0]."""
        tokens = [_token_text(self._tokenizer, t) for t in ids]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        top_maps = []
        for token, logprob, alternatives in zip(tokens, logprobs, tops):
            entry = {_token_text(self._tokenizer, alt.token_id): alt.logprob for alt in alternatives}
            entry.setdefault(token, logprob)
            top_maps.append(entry)
        return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": top_maps, "text_offset": offsets}

    def chat(self, ids: Sequence[int], logprobs: Sequence[float], tops: Sequence[list[TopLogprob]]) -> dict[str, Any]:
        """{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}], "refusal": None}."""
        content = []
        for token_id, logprob, alternatives in zip(ids, logprobs, tops):
            entry = self._chat_entry(token_id, logprob)
            entry["top_logprobs"] = [self._chat_entry(alt.token_id, alt.logprob) for alt in alternatives]
            content.append(entry)
        return {"content": content, "refusal": None}

    def _chat_entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = _token_text(self._tokenizer, token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


class _Format:
    """Fields shared by both endpoints' bodies."""

    object_full: str
    object_chunk: str
    id_prefix: str

    def __init__(self, model: str, tokenizer: Decoder, return_token_ids: bool, include_usage: bool):
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.return_token_ids = return_token_ids
        self.include_usage = include_usage
        self.logprobs = LogprobFormatter(tokenizer)

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def _chunk_frame(self, choice: dict[str, Any]) -> bytes:
        body = self._envelope(self.object_chunk, [choice])
        if self.include_usage:
            body["usage"] = None  # OpenAI sends null usage on every chunk but the last
        return sse(body)

    def _worth_sending(self, update: ChoiceUpdate) -> bool:
        """Tokens that printed nothing yet (half a character) only matter to token-level clients."""
        if update.text or update.reasoning or update.tool_calls or update.finish_reason is not None:
            return True
        return bool(update.token_ids) and (self.return_token_ids or update.logprobs is not None)

    def usage_frame(self, usage: dict[str, Any]) -> bytes:
        body = self._envelope(self.object_chunk, [])
        body["usage"] = usage
        return sse(body)

    def response(self, gen: Generation) -> bytes:
        body = self._envelope(self.object_full, [self._full_choice(c) for c in gen.choices])
        body["usage"] = gen.usage()
        return msgspec.json.encode(body)

    def start_frames(self, gen: Generation) -> bytes:
        return b""

    def _full_choice(self, choice: ChoiceState) -> dict[str, Any]:
        raise NotImplementedError

    def chunk(self, update: ChoiceUpdate) -> bytes:
        raise NotImplementedError


class CompletionFormat(_Format):
    object_full = object_chunk = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, model: str, tokenizer: Decoder, return_token_ids: bool, include_usage: bool):
        super().__init__(model, tokenizer, return_token_ids, include_usage)
        self._offsets: dict[int, int] = {}  # choice index -> token text streamed so far (text_offset)

    def _full_choice(self, choice: ChoiceState) -> dict[str, Any]:
        out: dict[str, Any] = {
            "index": choice.index,
            "text": choice.output_text,
            "logprobs": None,
            "finish_reason": choice.finish_reason,
        }
        if choice.want_logprobs:
            out["logprobs"] = self.logprobs.completion(choice.token_ids, choice.logprobs, choice.top_logprobs, 0)
        if self.return_token_ids:
            out["token_ids"] = choice.token_ids
        return out

    def chunk(self, update: ChoiceUpdate) -> bytes:
        if not self._worth_sending(update):
            return b""
        out: dict[str, Any] = {
            "index": update.index,
            "text": update.text,
            "logprobs": None,
            "finish_reason": update.finish_reason,
        }
        if update.logprobs is not None and update.top_logprobs is not None:
            offset = self._offsets.get(update.index, 0)
            out["logprobs"] = self.logprobs.completion(update.token_ids, update.logprobs, update.top_logprobs, offset)
            self._offsets[update.index] = offset + sum(len(t) for t in out["logprobs"]["tokens"])
        if self.return_token_ids:
            out["token_ids"] = update.token_ids
        return self._chunk_frame(out)


class ChatFormat(_Format):
    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def start_frames(self, gen: Generation) -> bytes:
        """OpenAI opens every choice with a role-only delta."""
        frames = []
        for choice in gen.choices:
            delta = {"role": "assistant", "content": ""}
            opening = {"index": choice.index, "delta": delta, "logprobs": None, "finish_reason": None}
            frames.append(self._chunk_frame(opening))
        return b"".join(frames)

    def _full_choice(self, choice: ChoiceState) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": choice.output_text}
        if choice.reasoning_text is not None:
            message["reasoning_content"] = choice.reasoning_text
        if choice.tool_calls:
            message["tool_calls"] = merge_tool_calls(choice.tool_calls)
            message["content"] = message["content"] or None  # OpenAI: a turn of calls alone has null content
        out: dict[str, Any] = {
            "index": choice.index,
            "message": message,
            "logprobs": None,
            "finish_reason": choice.finish_reason,
        }
        if choice.want_logprobs:
            out["logprobs"] = self.logprobs.chat(choice.token_ids, choice.logprobs, choice.top_logprobs)
        if self.return_token_ids:
            out["token_ids"] = choice.token_ids
        return out

    def chunk(self, update: ChoiceUpdate) -> bytes:
        if not self._worth_sending(update):
            return b""
        delta: dict[str, Any] = {"content": update.text} if update.text else {}
        if update.reasoning:
            delta["reasoning_content"] = update.reasoning
        if update.tool_calls:
            delta["tool_calls"] = [_tool_call_chunk(c) for c in update.tool_calls]
        out: dict[str, Any] = {
            "index": update.index,
            "delta": delta,
            "logprobs": None,
            "finish_reason": update.finish_reason,
        }
        if update.logprobs is not None and update.top_logprobs is not None:
            out["logprobs"] = self.logprobs.chat(update.token_ids, update.logprobs, update.top_logprobs)
        if self.return_token_ids:
            out["token_ids"] = update.token_ids
        return self._chunk_frame(out)


def _tool_call_chunk(call: ToolCallDelta) -> dict[str, Any]:
    """A streamed tool-call fragment: the first names the call (id, type, function name), the rest only
    carry more of its arguments, as OpenAI streams them."""
    if call.id is None:
        return {"index": call.index, "function": {"arguments": call.arguments}}
    return {"index": call.index, "id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}
