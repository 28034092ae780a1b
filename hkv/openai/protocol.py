"""OpenAI request bodies -> typed, validated, frozen requests.

Everything a client can get wrong is caught here, before anything is queued,
and raised as `ProtocolError` (an HTTP 4xx carrying OpenAI's error fields).
Two stages:

1. `parse_completion` / `parse_chat` check the JSON shape, types and ranges
   (no tokenizer needed). JSON null and an absent field mean the same thing;
   unknown fields are ignored because clients send them. A text prompt longer
   than the context could hold in characters (`max_prompt_chars`) is refused
   here, before it costs a tokenization.
   Structured output (response_format, structured_outputs, guided_*) is
   compiled here (hkv/openai/structured.py); tools are read by
   hkv/openai/tools.py.
2. Once a chat is rendered, `constrain_chat` (hkv/openai/chat_constraint.py)
   adds what depends on its prompt: a forced tool call's grammar, or the
   structured output placed after the reasoning the prompt opened. Once the
   prompts are tokenized, `plan_sequences` checks token counts against the
   context length and the KV capacity and fans each prompt out into `n`
   sequences with their own seeds, each with the request's logits processing
   and constraint.

Defaults: `max_tokens` absent means 16 for /v1/completions (as OpenAI does)
and "whatever fits" for /v1/chat/completions, both capped by the room left in
the context and the KV cache.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from hkv.ipc.messages import MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_VALUE, Constraint, SamplingParams
from hkv.openai.structured import ConstraintError, parse_constraint
from hkv.openai.tools import ChatTools, ToolError, json_chars, parse_template_kwargs, parse_tool_calls, parse_tools

MAX_N = 16  # choices per prompt
MAX_PROMPTS = 64  # prompts in one batched /v1/completions request
MAX_SEQUENCES = 128  # n * prompts
MAX_STOPS = 4
MAX_LOGPROBS = 5
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
SEED_MODULUS = 2**63  # seeds handed to the router lie in [0, 2**63)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
ROLES = frozenset({"system", "user", "assistant", "tool"})
_TOKEN_KEY = re.compile(r"^(0|[1-9][0-9]{0,9})$")  # a logit_bias key: a token id in decimal
IMAGE_PARTS = frozenset({"image_url", "image", "input_image"})
AUDIO_PARTS = frozenset({"input_audio", "audio"})


class ProtocolError(Exception):
    """A request the server refuses: HTTP status plus OpenAI's error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    @property
    def error_type(self) -> str:
        return "invalid_request_error" if self.status < 500 else "server_error"


def _bad(param: str | None, message: str, code: str | None = None) -> ProtocolError:
    return ProtocolError(400, message, param, code)


def not_too_deep(parse: Callable) -> Callable:
    """A body nested nearly as deep as the decoder allows can still overflow Python's recursion limit
    when a part of it is written out again (a schema as JSON text, tools through the template): a 400."""

    @functools.wraps(parse)
    def run(*args, **kwargs):
        try:
            return parse(*args, **kwargs)
        except RecursionError:
            raise _bad(None, "the request nests too deeply") from None

    return run


@dataclass(frozen=True)
class ModelLimits:
    """What the served model and the cache allow, read once at startup."""

    model_id: str  # the id clients see in /v1/models and responses
    aliases: frozenset[str]  # other values of `model` we accept (the resolved path)
    vocab_size: int
    context_len: int  # max_position_embeddings
    kv_capacity: int  # device KV cache capacity in tokens (--max-total-tokens)
    # characters of one prompt (a chat: its messages together) that could still fit: the most
    # prompt tokens times the longest token's characters; None when the tokenizer is not known
    max_prompt_chars: int | None = None

    @property
    def max_seq_len(self) -> int:
        """Prompt plus completion tokens one sequence may hold."""
        return min(self.context_len, self.kv_capacity)

    @property
    def max_prompt_tokens(self) -> int:
        """A prompt must leave room for one generated token."""
        return self.max_seq_len - 1

    def accepts_model(self, name: str) -> bool:
        return name == self.model_id or name in self.aliases

    @classmethod
    def of(cls, model_id: str, folder: str, vocab_size: int, context_len: int, kv_capacity: int,
           token_chars: int | None = None) -> "ModelLimits":
        """The limits of the served model (its id, checkpoint folder and description's figures);
        `token_chars`: characters of the tokenizer's longest token, which bounds a prompt's text."""
        aliases = frozenset({str(folder), str(Path(folder).resolve())})
        chars = None if token_chars is None else (min(context_len, kv_capacity) - 1) * token_chars
        return cls(model_id, aliases, vocab_size, context_len, kv_capacity, chars)


@dataclass(frozen=True)
class Options:
    """Generation options shared by both endpoints, already range-checked."""

    max_tokens: int | None  # None: the endpoint's default, resolved per prompt
    temperature: float
    top_p: float
    top_k: int | None  # None keeps every token
    seed: int | None  # None: the api draws one
    stop: tuple[str, ...]
    n: int
    logprobs: int | None  # alternatives per token (0..5); None: no logprobs
    stream: bool
    include_usage: bool
    return_token_ids: bool
    ignore_eos: bool
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    constraint: Constraint | None = None  # structured output, checked to compile (hkv/openai/structured.py)


@dataclass(frozen=True)
class CompletionRequest:
    prompts: tuple[str | tuple[int, ...], ...]  # text or token ids, one per batch entry
    options: Options


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str  # text parts joined with "\n"
    tool_calls: tuple[dict, ...] | None = None  # assistant: its calls, arguments as objects (hkv/openai/tools.py)
    tool_call_id: str | None = None  # tool: the call it answers
    name: str | None = None
    reasoning_content: str | None = None  # assistant: an earlier turn's reasoning, for templates that show it

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it (absent fields left out)."""
        fields = {"role": self.role, "content": self.content, "tool_calls": self.tool_calls,
                  "tool_call_id": self.tool_call_id, "name": self.name, "reasoning_content": self.reasoning_content}
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in fields.items() if v is not None}


@dataclass(frozen=True)
class ChatRequest:
    messages: tuple[ChatMessage, ...]
    options: Options
    tools: ChatTools = field(default_factory=ChatTools)
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # chat_template_kwargs


@dataclass(frozen=True)
class SequencePlan:
    """One GenerateRequest to be: which choice it fills and how it samples."""

    choice: int  # index in the response's `choices`
    prompt_index: int  # which prompt of the request it continues
    sampling: SamplingParams


def decode_body(body: bytes) -> dict[str, Any]:
    """Raw bytes -> JSON object; invalid UTF-8, lone surrogates, NaN and inf are refused."""
    try:
        obj = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError) as exc:  # RecursionError: nesting past the decoder's depth
        try:
            body.decode("utf-8")
        except UnicodeDecodeError:
            raise _bad(None, "request body is not valid UTF-8") from None
        raise _bad(None, f"request body is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise _bad(None, "request body must be a JSON object")
    return obj


def _opt_int(body: dict, name: str, lo: int, hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if type(value) is not int:  # bool is an int subclass but never a count
        raise _bad(name, f"`{name}` must be an integer, got {_json_type(value)}")
    if value < lo or (hi is not None and value > hi):
        bound = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
        raise _bad(name, f"`{name}` must be {bound}, got {value}")
    return value


def _opt_float(body: dict, name: str, lo: float, hi: float, lo_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if type(value) not in (int, float) or not math.isfinite(value):
        raise _bad(name, f"`{name}` must be a finite number, got {_json_type(value)}")
    if value < lo or value > hi or (lo_open and value == lo):
        low = "(" if lo_open else "["
        raise _bad(name, f"`{name}` must be in {low}{lo:g}, {hi:g}], got {value}")
    return float(value)


def _opt_bool(body: dict, name: str) -> bool | None:
    value = body.get(name)
    if value is None or type(value) is bool:
        return value
    raise _bad(name, f"`{name}` must be a boolean, got {_json_type(value)}")


def _json_type(value: Any) -> str:
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}
    return names.get(type(value), type(value).__name__)


def _check_model(body: dict, limits: ModelLimits) -> None:
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise _bad("model", f"`model` must be a string, got {_json_type(model)}")
    if not limits.accepts_model(model):
        raise ProtocolError(404, f"The model `{model}` does not exist.", "model", "model_not_found")


def _refuse_unsupported(body: dict, chat: bool = False) -> None:
    """Fields that change the output; ignoring them would silently give wrong answers."""
    if body.get("echo") not in (None, False):
        raise _bad("echo", "`echo` is not supported")
    if body.get("suffix") not in (None, ""):
        raise _bad("suffix", "`suffix` is not supported")
    if body.get("best_of") not in (None, 1):
        raise _bad("best_of", "`best_of` is not supported")
    if not chat and body.get("tools") not in (None, []):
        raise _bad("tools", "`tools` are a /v1/chat/completions field")
    if not chat and body.get("tool_choice") not in (None, "none", "auto"):
        raise _bad("tool_choice", "`tool_choice` is a /v1/chat/completions field")


def _stops(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or len(value) > MAX_STOPS:
        raise _bad("stop", f"`stop` must be a string or a list of at most {MAX_STOPS} strings")
    for s in value:
        if not isinstance(s, str) or not s:
            raise _bad("stop", "`stop` strings must be non-empty strings")
    return tuple(dict.fromkeys(value))


def _include_usage(body: dict, stream: bool) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict):
        raise _bad("stream_options", "`stream_options` must be an object")
    if not stream:
        raise _bad("stream_options", "`stream_options` is only allowed when `stream` is true")
    return bool(_opt_bool(opts, "include_usage"))


def _top_k(body: dict, vocab_size: int) -> int | None:
    value = body.get("top_k")
    if value is None or value == -1 and type(value) is int:
        return None
    top_k = _opt_int(body, "top_k", 1)
    return None if top_k is None or top_k >= vocab_size else top_k


def _logit_bias(body: dict, vocab_size: int) -> dict[int, float]:
    """`logit_bias`: {"token id": bias}, OpenAI's keys being token ids written as strings."""
    value = body.get("logit_bias")
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise _bad("logit_bias", f"`logit_bias` must be an object of at most {MAX_LOGIT_BIAS} token ids to biases")
    bias = {}
    for key, number in value.items():
        if not _TOKEN_KEY.match(key) or int(key) >= vocab_size:
            raise _bad("logit_bias", f"`logit_bias` key {key!r} is not a token id in [0, {vocab_size})")
        if type(number) not in (int, float) or not -MAX_LOGIT_BIAS_VALUE <= number <= MAX_LOGIT_BIAS_VALUE:
            raise _bad("logit_bias", f"`logit_bias` value of token {key} must be a number in [-{MAX_LOGIT_BIAS_VALUE:g}, "
                                     f"{MAX_LOGIT_BIAS_VALUE:g}], got {number!r}")
        bias[int(key)] = float(number)
    return bias


def _constraint(body: dict, ignore_eos: bool) -> Constraint | None:
    """The structured output the body asks for, compiled (hkv/openai/structured.py)."""
    try:
        constraint = parse_constraint(body)
    except ConstraintError as exc:
        raise _bad(exc.param, str(exc)) from None
    if constraint is not None and ignore_eos:
        raise _bad("ignore_eos", "`ignore_eos` cannot go with structured output: a finished grammar allows only EOS")
    return constraint


def _processing(body: dict, vocab_size: int, ignore_eos: bool) -> dict[str, Any]:
    """The Options fields that change the logits before sampling (hkv/ipc/messages.py's SamplingParams)."""
    fields = {"min_p": _opt_float(body, "min_p", 0.0, 1.0),
              "presence_penalty": _opt_float(body, "presence_penalty", -2.0, 2.0),
              "frequency_penalty": _opt_float(body, "frequency_penalty", -2.0, 2.0),
              "repetition_penalty": _opt_float(body, "repetition_penalty", 0.0, 2.0, lo_open=True)}
    return {k: v for k, v in fields.items() if v is not None} | {"logit_bias": _logit_bias(body, vocab_size),
                                                                 "constraint": _constraint(body, ignore_eos)}


def _options(body: dict, limits: ModelLimits, max_tokens: int | None, logprobs: int | None) -> Options:
    stream = bool(_opt_bool(body, "stream"))
    temperature = _opt_float(body, "temperature", 0.0, 2.0)
    top_p = _opt_float(body, "top_p", 0.0, 1.0, lo_open=True)
    seed = _opt_int(body, "seed", INT64_MIN, INT64_MAX)
    ignore_eos = bool(_opt_bool(body, "ignore_eos"))
    return Options(
        max_tokens=max_tokens,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=_top_k(body, limits.vocab_size),
        seed=seed,
        stop=_stops(body),
        n=_opt_int(body, "n", 1, MAX_N) or 1,
        logprobs=logprobs,
        stream=stream,
        include_usage=_include_usage(body, stream),
        return_token_ids=bool(_opt_bool(body, "return_token_ids")),
        ignore_eos=ignore_eos,
        **_processing(body, limits.vocab_size, ignore_eos),
    )


@not_too_deep
def parse_completion(body: dict[str, Any], limits: ModelLimits) -> CompletionRequest:
    """Validate a /v1/completions body (prompt shapes, ranges, model)."""
    _check_model(body, limits)
    _refuse_unsupported(body)
    prompts = _prompts(body.get("prompt"), limits.vocab_size)
    for prompt in prompts:
        if isinstance(prompt, str):
            _check_text_size(len(prompt), limits)
    max_tokens = _opt_int(body, "max_tokens", 1)
    logprobs = _opt_int(body, "logprobs", 0, MAX_LOGPROBS)
    options = _options(body, limits, max_tokens, logprobs)
    if len(prompts) * options.n > MAX_SEQUENCES:
        raise _bad("n", f"prompts x n must be at most {MAX_SEQUENCES}, got {len(prompts) * options.n}")
    return CompletionRequest(prompts, options)


_PROMPT_SHAPES = "a non-empty string, list of strings, list of token ids or list of lists of token ids"


def _prompts(value: Any, vocab_size: int) -> tuple[str | tuple[int, ...], ...]:
    if value is None:
        raise _bad("prompt", "`prompt` is required")
    if isinstance(value, str):
        return (_text_prompt(value),)
    if not isinstance(value, list) or not value:
        raise _bad("prompt", f"`prompt` must be {_PROMPT_SHAPES}")
    if len(value) > MAX_PROMPTS and not isinstance(value[0], int):
        raise _bad("prompt", f"at most {MAX_PROMPTS} prompts per request")
    if all(isinstance(x, str) for x in value):
        return tuple(_text_prompt(x) for x in value)
    if all(isinstance(x, list) for x in value):
        return tuple(_id_prompt(x, vocab_size) for x in value)
    if type(value[0]) is int:  # a list of ids: _id_prompt checks every element once
        return (_id_prompt(value, vocab_size),)
    raise _bad("prompt", f"`prompt` must be {_PROMPT_SHAPES}")


def _check_text_size(chars: int, limits: ModelLimits) -> None:
    """Refuse text that has more tokens than fit, whatever its tokenization (no token is longer)."""
    if limits.max_prompt_chars is not None and chars > limits.max_prompt_chars:
        raise _bad(
            "prompt",
            f"The prompt has {chars} characters, more than {limits.max_prompt_tokens} tokens of this model "
            f"can hold (at most {limits.max_prompt_chars} characters).",
            "context_length_exceeded",
        )


def _text_prompt(text: str) -> str:
    if not text:
        raise _bad("prompt", "`prompt` must not be empty")
    return text


def _only_ints(values: list) -> bool:
    """Every element's type is int (not bool, not float): one pass in C, a token-id prompt's
    validation cost (2,176 ids: about 25 us, where a Python loop took about 80 us per pass)."""
    return set(map(type, values)) == {int}


def _id_prompt(ids: list, vocab_size: int) -> tuple[int, ...]:
    if not ids:
        raise _bad("prompt", "`prompt` must not be empty")
    if not _only_ints(ids):
        pos = next(i for i, token in enumerate(ids) if type(token) is not int)
        raise _bad("prompt", f"`prompt` token at position {pos} is not an integer")
    if min(ids) < 0 or max(ids) >= vocab_size:
        pos, token = next((i, t) for i, t in enumerate(ids) if not 0 <= t < vocab_size)
        raise _bad("prompt", f"token id {token} at position {pos} is outside the vocabulary [0, {vocab_size})")
    return tuple(ids)


@not_too_deep
def parse_chat(body: dict[str, Any], limits: ModelLimits) -> ChatRequest:
    """Validate a /v1/chat/completions body (messages, ranges, model)."""
    _check_model(body, limits)
    _refuse_unsupported(body, chat=True)
    try:
        messages = _messages(body.get("messages"))
        tools = parse_tools(body)
        template_kwargs = parse_template_kwargs(body)
    except ToolError as exc:
        raise _bad(exc.param, str(exc)) from None
    calls = [m.tool_calls for m in messages if m.tool_calls]
    _check_text_size(sum(len(m.content) for m in messages) + json_chars(list(tools.tools)) + json_chars(calls)
                     + json_chars(template_kwargs), limits)
    max_tokens = _opt_int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _opt_int(body, "max_tokens", 1)
    want_logprobs = bool(_opt_bool(body, "logprobs"))
    top = _opt_int(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and not want_logprobs:
        raise _bad("top_logprobs", "`top_logprobs` requires `logprobs` to be true")
    options = _options(body, limits, max_tokens, (top or 0) if want_logprobs else None)
    if tools.choice == "required":
        _check_forced_call(options)
    return ChatRequest(messages, options, tools, template_kwargs)


def _check_forced_call(options: Options) -> None:
    """A forced tool call is a grammar of its own: no second constraint, and EOS must end it."""
    if options.constraint is not None:
        raise _bad("tool_choice", "`tool_choice` \"required\" or a named function cannot go with structured "
                                  "output (response_format, structured_outputs, guided_*): the answer is tool calls")
    if options.ignore_eos:
        raise _bad("ignore_eos", "`ignore_eos` cannot go with `tool_choice` \"required\" or a named function: "
                                 "the calls end with EOS")


def _messages(value: Any) -> tuple[ChatMessage, ...]:
    if not isinstance(value, list) or not value:
        raise _bad("messages", "`messages` must be a non-empty list")
    return tuple(_message(m, i) for i, m in enumerate(value))


def _message(message: Any, index: int) -> ChatMessage:
    param = f"messages[{index}]"
    if not isinstance(message, dict):
        raise _bad(param, f"`{param}` must be an object")
    role = message.get("role")
    if role is None:
        raise _bad(f"{param}.role", f"`{param}.role` is required")
    if not isinstance(role, str) or role not in ROLES:
        raise _bad(f"{param}.role", f"`{param}.role` must be one of {sorted(ROLES)}, got {role!r}")
    extra = {}
    for key in ("tool_call_id", "name", "reasoning_content"):
        value = message.get(key)
        if value is not None and not isinstance(value, str):
            raise _bad(f"{param}.{key}", f"`{param}.{key}` must be a string, got {_json_type(value)}")
        extra[key] = value
    if role == "assistant":
        extra["tool_calls"] = parse_tool_calls(message.get("tool_calls"), f"{param}.tool_calls")
    elif message.get("tool_calls") is not None:
        raise _bad(f"{param}.tool_calls", f"`{param}.tool_calls` belongs to assistant messages")
    return ChatMessage(role, _content(message.get("content"), role, f"{param}.content"), **extra)


def _content(value: Any, role: str, param: str) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        if role == "assistant":  # an assistant turn that only called tools
            return ""
        raise _bad(param, f"`{param}` is required")
    if not isinstance(value, list):
        raise _bad(param, f"`{param}` must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        kind = kind if isinstance(kind, str) else None  # a list or object `type` is no part (and unhashable)
        if kind in IMAGE_PARTS:
            raise _bad(f"{param}[{j}]", "images are not supported by this model")
        if kind in AUDIO_PARTS:
            raise _bad(f"{param}[{j}]", "audio is not supported by this model")
        if kind != "text" or not isinstance(part.get("text"), str):
            raise _bad(f"{param}[{j}]", f"`{param}[{j}]` must be a text part {{\"type\": \"text\", \"text\": ...}}")
        texts.append(part["text"])
    return "\n".join(texts)


def check_prompt_len(prompt_len: int, limits: ModelLimits) -> None:
    """Refuse a prompt of `prompt_len` tokens that can never run."""
    if prompt_len == 0:
        raise _bad("prompt", "the prompt is empty after tokenization")
    if prompt_len >= limits.context_len:
        raise _bad(
            "prompt",
            f"This model's maximum context length is {limits.context_len} tokens, "
            f"but the prompt has {prompt_len} tokens.",
            "context_length_exceeded",
        )
    if prompt_len >= limits.kv_capacity:
        raise _bad(
            "prompt",
            f"The prompt has {prompt_len} tokens but the KV cache holds at most "
            f"{limits.kv_capacity} tokens (--max-total-tokens); it can never run.",
            "context_length_exceeded",
        )


def resolve_max_tokens(prompt_len: int, requested: int | None, limits: ModelLimits, default_cap: int | None) -> int:
    """Completion budget for one prompt; refuses prompts that can never run."""
    param = "prompt" if requested is None else "max_tokens"
    check_prompt_len(prompt_len, limits)
    if requested is None:
        room = limits.max_seq_len - prompt_len
        return room if default_cap is None else min(default_cap, room)
    total = prompt_len + requested
    if total > limits.context_len:
        raise _bad(
            param,
            f"This model's maximum context length is {limits.context_len} tokens. However, you requested "
            f"{total} tokens ({prompt_len} in the prompt, {requested} for the completion). "
            "Please reduce the prompt or the completion length.",
            "context_length_exceeded",
        )
    if total > limits.kv_capacity:
        raise _bad(
            param,
            f"The request needs {total} tokens of KV cache ({prompt_len} in the prompt, {requested} for "
            f"the completion) but the server holds at most {limits.kv_capacity} (--max-total-tokens).",
            "context_length_exceeded",
        )
    return requested


def plan_sequences(
    prompt_lens: Sequence[int], options: Options, limits: ModelLimits, default_cap: int | None, base_seed: int
) -> list[SequencePlan]:
    """Fan each prompt out into `n` sequences; choice i of a prompt samples with seed + i."""
    seed = options.seed if options.seed is not None else base_seed
    plans = []
    for p, prompt_len in enumerate(prompt_lens):
        max_tokens = resolve_max_tokens(prompt_len, options.max_tokens, limits, default_cap)
        for i in range(options.n):
            sampling = SamplingParams(
                max_tokens=max_tokens,
                temperature=options.temperature,
                top_p=options.top_p,
                top_k=options.top_k,
                seed=(seed + i) % SEED_MODULUS,
                ignore_eos=options.ignore_eos,
                logprobs=options.logprobs,
                min_p=options.min_p,
                presence_penalty=options.presence_penalty,
                frequency_penalty=options.frequency_penalty,
                repetition_penalty=options.repetition_penalty,
                logit_bias=options.logit_bias,
                constraint=options.constraint,
            )
            plans.append(SequencePlan(choice=p * options.n + i, prompt_index=p, sampling=sampling))
    return plans
