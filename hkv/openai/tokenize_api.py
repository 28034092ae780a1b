"""POST /tokenize and POST /detokenize: the served model's tokenizer over HTTP (the api key's routes).

    /tokenize    {"prompt": "text", "add_special_tokens": true}
                 or a chat body {"messages": [...], "tools"?, "chat_template_kwargs"?,
                 "add_generation_prompt": true} rendered by the chat template first
                 -> {"tokens": [ids], "count": n, "max_model_len": m}
    /detokenize  {"tokens": [ids]} -> {"prompt": "text"}

A chat body is checked as /v1/chat/completions checks it; text is size-checked before it is
encoded, and token ids must lie in the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hkv.openai.protocol import ChatRequest, ModelLimits, ProtocolError, parse_chat

MAX_DETOKENIZE = 1 << 20  # ids of one /detokenize body


@dataclass(frozen=True)
class TokenizeRequest:
    text: str | None  # a plain prompt, or None for a chat
    chat: ChatRequest | None
    add_special_tokens: bool
    add_generation_prompt: bool


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if type(value) is not bool:
        raise ProtocolError(400, f"`{name}` must be a boolean", name)
    return value


def parse_tokenize(body: dict[str, Any], limits: ModelLimits) -> TokenizeRequest:
    """A prompt or a chat to tokenize; ProtocolError 400 for anything else."""
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise ProtocolError(400, "give exactly one of `prompt` (a string) and `messages` (a chat)", "prompt")
    if prompt is not None:
        if not isinstance(prompt, str) or not prompt:
            raise ProtocolError(400, "`prompt` must be a non-empty string", "prompt")
        if limits.max_prompt_chars is not None and len(prompt) > limits.max_prompt_chars:
            raise ProtocolError(400, f"`prompt` has more than {limits.max_prompt_chars} characters", "prompt",
                                "context_length_exceeded")
        return TokenizeRequest(prompt, None, _flag(body, "add_special_tokens", True), False)
    chat = parse_chat({"messages": messages, **{k: body[k] for k in ("tools", "tool_choice", "chat_template_kwargs",
                                                                       "model") if k in body}}, limits)
    return TokenizeRequest(None, chat, _flag(body, "add_special_tokens", False),
                           _flag(body, "add_generation_prompt", True))


def parse_detokenize(body: dict[str, Any], vocab_size: int) -> list[int]:
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or len(tokens) > MAX_DETOKENIZE:
        raise ProtocolError(400, f"`tokens` must be a list of at most {MAX_DETOKENIZE} token ids", "tokens")
    for token in tokens:
        if type(token) is not int or not 0 <= token < vocab_size:
            raise ProtocolError(400, f"`tokens` must be integers in [0, {vocab_size}), got {token!r}", "tokens")
    return tokens
