"""What a chat model's text means: reasoning, content and tool calls, split as the text streams in.

One `ChatOutputParser` per choice. Each detokenized text delta goes in (`feed`), and a `ParsedDelta`
comes out: the reasoning text, the content text and the tool-call fragments that the delta
completed. Whole responses are the concatenation of the deltas, so streamed and whole answers
agree by construction. A tag split over two deltas is held back until it is decided; `flush` at
the finish releases what is held, as text.

Reasoning (`--reasoning-parser qwen3`): the text between `<think>` and `</think>` is
`reasoning_content`, with the newlines after `</think>` dropped from the content. A block opens
when the rendered prompt ends inside one (Qwen3.5's and Qwen3-Thinking's generation prompts
write `<think>\\n`) or when the output starts with `<think>`. Without a `</think>` the whole
answer is reasoning.

Tool calls, in the formats the Qwen chat templates teach (`--tool-call-parser`):

    hermes        <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>     (Qwen2.5, Qwen3)
    qwen3_coder   <tool_call>\\n<function=f>\\n<parameter=p>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>
                                                                              (Qwen3-Coder, Qwen3.5)

hermes streams the raw text of the arguments value as it arrives (a JSON scanner finds its end);
qwen3_coder emits `{"p": value` per finished parameter and `}` at `</function>`, each value typed
by the tool's JSON schema. A block that never names a function is content.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_PARSERS = ("hermes", "qwen3_coder")
REASONING_PARSERS = ("qwen3",)
_HERMES_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_HEAD_LIMIT = 4096  # characters of a call's head read while looking for its name


@dataclass
class ToolCallDelta:
    """A fragment of one tool call: its index in the choice; id and name on the first fragment."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass
class ParsedDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def add(self, other: "ParsedDelta") -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls += other.tool_calls


def prompt_opens_reasoning(prompt: str) -> bool:
    """The rendered prompt ends inside a `<think>` block: the answer starts as reasoning."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (it may grow into the tag)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def _cut(buffer: str, tag: str) -> tuple[str, str | None, str]:
    """(text before tag, the rest after it or None when absent, text held back as a possible tag start)."""
    at = buffer.find(tag)
    if at >= 0:
        return buffer[:at], buffer[at + len(tag):], ""
    held = _held_prefix(buffer, tag)
    return buffer[: len(buffer) - held], None, buffer[len(buffer) - held:]


class ReasoningSplitter:
    """Qwen3's `<think>...</think>` split of a text stream into (reasoning, content); the newlines
    just inside the block and those between it and the answer are dropped (as Qwen3's template
    strips them when it renders the turn again)."""

    def __init__(self, opened: bool):
        self._state = "lead" if opened else "start"  # start | lead | reasoning | after | content
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        buffer, self._held = self._held + text, ""
        reasoning, content = "", ""
        while buffer:
            if self._state == "start":  # an output that opens its own block
                stripped = buffer.lstrip()
                if stripped.startswith(THINK_OPEN):
                    self._state, buffer = "lead", stripped[len(THINK_OPEN):]
                elif THINK_OPEN.startswith(stripped):
                    self._held = buffer
                    break
                else:
                    self._state = "content"
            elif self._state in ("lead", "after"):  # newlines opening the block, or closing it
                buffer = buffer.lstrip("\n")
                if buffer:
                    self._state = "reasoning" if self._state == "lead" else "content"
            elif self._state == "reasoning":
                before, after, held = _cut(buffer, THINK_CLOSE)
                if after is None:
                    body, newlines = _trailing(before, "\n")
                    reasoning += body
                    self._held = newlines + held
                    break
                reasoning += before.rstrip("\n")
                self._state, buffer = "after", after
            else:
                content, buffer = content + buffer, ""
        return reasoning, content

    def flush(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        return (held, "") if self._state in ("lead", "reasoning") else ("", held)


def _trailing(text: str, chars: str) -> tuple[str, str]:
    """(text without its trailing run of `chars`, that run): the run waits for what follows it."""
    body = text.rstrip(chars)
    return body, text[len(body):]


class _ToolParser:
    """Shared bookkeeping of the tool-call formats: content outside the blocks, call numbering."""

    def __init__(self, schemas: dict[str, dict]):
        self.schemas = schemas  # tool name -> its JSON schema `parameters` (typing qwen3_coder values)
        self.calls = 0
        self._held = ""
        self._after_call = False  # newlines after a call are no content
        self._space = ""  # the whitespace before the open block

    def _in_content(self, buffer: str, out: ParsedDelta) -> str:
        """Text outside the blocks: content, without the whitespace before a call and the newlines after it."""
        if self._after_call:  # the newlines that separate calls
            buffer = buffer.lstrip("\n")
            if not buffer:
                return ""
            self._after_call = False
        before, after, held = _cut(buffer, CALL_OPEN)
        if after is None:
            body, space = _trailing(before, " \t\r\n")
            out.content += body
            self._held = space + held
            return ""
        body = before.rstrip()
        out.content += body
        self._space = before[len(body):]  # given back if the block turns out to be text
        self._open_call()
        return after

    def _close_call(self) -> None:
        self._state, self._after_call = "content", True

    def _flush_content(self, held: str, out: ParsedDelta) -> None:
        if not self._after_call:
            out.content += held

    def feed(self, text: str) -> ParsedDelta:
        """Parse the next text: each state's `_in_<state>` takes what it can and hands back the rest."""
        out = ParsedDelta()
        buffer, self._held = self._held + text, ""
        while buffer:
            buffer = getattr(self, f"_in_{self._state}")(buffer, out)
        return out

    def _in_tail(self, buffer: str, out: ParsedDelta) -> str:
        """After a call's last value: everything up to `</tool_call>` is dropped (a closing brace, newlines)."""
        _, after, self._held = _cut(buffer, CALL_CLOSE)
        if after is None:
            return ""
        self._close_call()
        return after

    def flush(self) -> ParsedDelta:
        """The finish: what is held goes out as content, as does an opened block that never named a function."""
        out, held, self._held = ParsedDelta(), self._held, ""
        if self._state == "content":
            self._flush_content(held, out)
        elif self._state == self.OPENING:
            out.content = self._space + CALL_OPEN + self._opened() + held
        return out

    def _new_call(self, name: str) -> ToolCallDelta:
        call = ToolCallDelta(self.calls, "", id=f"call_{uuid.uuid4().hex[:24]}", name=name)
        self.calls += 1
        return call


class HermesToolParser(_ToolParser):
    """`<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks; arguments streamed raw."""

    OPENING = "head"  # the state of a block whose function is not named yet

    def __init__(self, schemas: dict[str, dict]):
        super().__init__(schemas)
        self._state = "content"  # content | head | args | tail
        self._head = ""
        self._scan = _JsonValueEnd()


    def _opened(self) -> str:
        return self._head

    def _open_call(self) -> None:
        self._state, self._head = "head", ""

    def _in_head(self, buffer: str, out: ParsedDelta) -> str:
        self._head += buffer
        match = _HERMES_HEAD.match(self._head)
        if match is not None:
            out.tool_calls.append(self._new_call(json.loads(f'"{match.group(1)}"')))
            rest, self._state, self._scan = self._head[match.end():], "args", _JsonValueEnd()
            return rest
        closed = self._head.find(CALL_CLOSE)
        if closed >= 0 or len(self._head) > _HEAD_LIMIT:  # not a call hkv can stream: try it whole
            block = self._head[:closed] if closed >= 0 else self._head
            rest = self._head[closed + len(CALL_CLOSE):] if closed >= 0 else ""
            if self._whole_block(block, closed >= 0, out):
                self._close_call()
            else:
                self._state = "content"
            return rest
        return ""

    def _whole_block(self, block: str, closed: bool, out: ParsedDelta) -> bool:
        """A block whose head did not stream (arguments before the name, say): a call if it parses."""
        try:
            call = json.loads(block) if closed else None
        except ValueError:
            call = None
        if isinstance(call, dict) and isinstance(call.get("name"), str) and "arguments" in call:
            delta = self._new_call(call["name"])
            delta.arguments = json.dumps(call["arguments"], ensure_ascii=False)
            out.tool_calls.append(delta)
            return True
        out.content += self._space + CALL_OPEN + block + (CALL_CLOSE if closed else "")
        return False

    def _in_args(self, buffer: str, out: ParsedDelta) -> str:
        if not self._scan.started:  # whitespace before the value is no part of it, however it arrives
            buffer = buffer.lstrip()
            if not buffer:
                return ""
        taken = self._scan.feed(buffer)
        if taken is None:  # the value goes on past this text
            out.tool_calls.append(ToolCallDelta(self.calls - 1, buffer))
            return ""
        if taken:
            out.tool_calls.append(ToolCallDelta(self.calls - 1, buffer[:taken]))
        self._state = "tail"
        return buffer[taken:]



class _JsonValueEnd:
    """Finds where one JSON value ends in text that arrives in pieces (strings and nesting tracked)."""

    def __init__(self):
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.started = False

    def feed(self, text: str) -> int | None:
        """Characters of `text` that belong to the value, or None when all do and it goes on."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return i + 1
                continue
            if not self.started and ch.isspace():
                continue
            if self.started and self.depth == 0 and (ch in ",}]" or ch.isspace()):  # a bare number or literal
                return i
            self.started = True
            if ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


class Qwen3CoderToolParser(_ToolParser):
    """`<tool_call><function=f><parameter=p>value</parameter>...</function></tool_call>` blocks."""

    OPENING = "call"

    def __init__(self, schemas: dict[str, dict]):
        super().__init__(schemas)
        self._state = "content"  # content | call | function | param | tail
        self._buffer = ""
        self._name = ""
        self._param = ""
        self._params_done = 0


    def _opened(self) -> str:
        return self._buffer

    def _open_call(self) -> None:
        self._state, self._buffer = "call", ""

    def _tag(self, buffer: str, prefix: str) -> tuple[str | None, str]:
        """The name of a `<prefix=NAME>` tag at the buffer's start (after whitespace) and the rest."""
        self._buffer += buffer
        match = re.match(rf"\s*<{prefix}=([^>\n]{{1,256}})>", self._buffer)
        if match is None:
            return None, ""
        rest, self._buffer = self._buffer[match.end():], ""
        return match.group(1).strip(), rest

    def _in_call(self, buffer: str, out: ParsedDelta) -> str:
        name, rest = self._tag(buffer, "function")
        if name is not None:
            out.tool_calls.append(self._new_call(name))
            self._name, self._params_done, self._state = name, 0, "function"
            return rest
        if CALL_CLOSE in self._buffer or len(self._buffer) > _HEAD_LIMIT:  # no function: it was text
            out.content += self._space + CALL_OPEN + self._buffer
            self._state, self._buffer = "content", ""
            self._after_call = False
        return ""

    def _in_function(self, buffer: str, out: ParsedDelta) -> str:
        name, rest = self._tag(buffer, "parameter")
        if name is not None:
            self._param, self._state = name, "param"
            return rest
        end = self._buffer.find("</function>")
        if end >= 0:
            rest = self._buffer[end + len("</function>"):]
            out.tool_calls.append(ToolCallDelta(self.calls - 1, "}" if self._params_done else "{}"))
            self._state, self._buffer = "tail", ""
            return rest
        return ""

    def _in_param(self, buffer: str, out: ParsedDelta) -> str:
        self._buffer += buffer
        end = self._buffer.find("</parameter>")
        if end < 0:
            return ""
        value, rest = self._buffer[:end], self._buffer[end + len("</parameter>"):]
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        lead = "{" if self._params_done == 0 else ", "
        typed = _json_text(_typed_value(value, self.schemas.get(self._name, {}), self._param), value)
        out.tool_calls.append(ToolCallDelta(self.calls - 1, f"{lead}{json.dumps(self._param, ensure_ascii=False)}: "
                                                            f"{typed}"))
        self._params_done += 1
        self._state, self._buffer = "function", ""
        return rest



def _json_text(value: Any, text: str) -> str:
    """`value` as JSON; a number past a float's range (`1e999`, valid JSON) keeps the text it was written as."""
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except ValueError:
        return text.strip()


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _typed_value(text: str, schema: dict, param: str) -> Any:
    """A qwen3_coder parameter's text as the JSON type its tool's schema gives it (a string otherwise)."""
    props = schema.get("properties") if isinstance(schema, dict) else None
    kind = props.get(param, {}).get("type") if isinstance(props, dict) and isinstance(props.get(param), dict) else None
    if kind in ("integer", "number", "boolean", "object", "array", "null"):
        try:
            value = json.loads(text.strip(), parse_constant=_no_constant)  # NaN and Infinity are no JSON
        except (ValueError, RecursionError):  # RecursionError: nesting past the decoder's depth
            return text
        wanted = {"integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list,
                  "null": type(None)}[kind]
        if isinstance(value, wanted) and not (kind in ("integer", "number") and isinstance(value, bool)):
            return value
    return text


class ChatOutputParser:
    """Reasoning first, then tool calls in what is left; either part optional.

    reasoning: a REASONING_PARSERS name or None; opened: the prompt ends inside a think block;
    tools: a TOOL_PARSERS name or None; schemas: tool name -> parameters schema; parallel: whether
    calls after the first are kept (parallel_tool_calls).
    """

    def __init__(self, reasoning: str | None, opened: bool, tools: str | None, schemas: dict[str, dict],
                 parallel: bool = True):
        self._splitter = ReasoningSplitter(opened) if reasoning == "qwen3" else None
        parsers = {"hermes": HermesToolParser, "qwen3_coder": Qwen3CoderToolParser}
        self._tools = parsers[tools](schemas) if tools is not None else None
        self._parallel = parallel
        self.called = False  # a tool call was emitted (the finish reason becomes "tool_calls")

    def feed(self, text: str) -> ParsedDelta:
        return self._step(text, final=False)

    def flush(self) -> ParsedDelta:
        return self._step("", final=True)

    def _step(self, text: str, final: bool) -> ParsedDelta:
        out = ParsedDelta()
        if self._splitter is not None:
            out.reasoning, text = self._splitter.flush() if final else self._splitter.feed(text)
        if self._tools is None:
            out.content = text
            return out
        parsed = self._tools.feed(text)
        if final:
            parsed.add(self._tools.flush())
        out.content = parsed.content
        out.tool_calls = [c for c in parsed.tool_calls if self._parallel or c.index == 0]
        self.called = self.called or bool(out.tool_calls)
        return out


def merge_tool_calls(deltas: Iterable[ToolCallDelta]) -> list[dict[str, Any]]:
    """Whole-response tool calls (OpenAI's message.tool_calls) from a choice's fragments."""
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        call = calls.setdefault(d.index, {"id": d.id, "type": "function", "function": {"name": d.name,
                                                                                      "arguments": ""}})
        call["function"]["arguments"] += d.arguments
    return [calls[i] for i in sorted(calls)]


def chat_parser(req, prompt: str, tool_parser: str | None, reasoning_parser: str | None
                ) -> Callable[[], ChatOutputParser] | None:
    """A parser factory for one chat request's choices (hkv.openai.protocol.ChatRequest), or None when its
    answers are plain content: tools with tool_choice "auto" or "required" are parsed with `tool_parser`
    (a named function: its one call), and the reasoning split runs when the server has a reasoning parser."""
    tools = tool_parser if req.tools.choice in ("auto", "required") and req.tools.tools else None
    if tools is None and reasoning_parser is None:
        return None
    opened = prompt_opens_reasoning(prompt)
    parallel = req.tools.parallel and req.tools.forced is None
    return lambda: ChatOutputParser(reasoning_parser, opened, tools, req.tools.schemas, parallel)
