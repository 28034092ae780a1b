"""Chat request fields for agents: `tools`, `tool_choice`, `parallel_tool_calls`, the turns that carry
tool calls and results, and `chat_template_kwargs`. Checked here; rendered by the chat template.

    tools                 [{"type": "function", "function": {"name", "description"?, "parameters"?}}]
    tool_choice           "auto" (default with tools) | "none" (default without) | "required" (the answer is
                          tool calls) | {"type": "function", "function": {"name": f}} (one call of f); the
                          last two are forced by a grammar (hkv/openai/tool_grammar.py)
    parallel_tool_calls   false: only the answer's first call is returned ("required": only one is allowed)
    messages[i]           assistant: "tool_calls" [{"id", "type": "function", "function": {"name",
                          "arguments": a JSON object as text}}]; tool: "tool_call_id", "content"
    chat_template_kwargs  variables for the template, e.g. {"enable_thinking": false}

Tool-call arguments reach the template as objects (Qwen3.5's template iterates them; Qwen3's
serialises them either way), as transformers and vLLM pass them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_KWARG = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
RESERVED_KWARGS = frozenset({"messages", "tools", "add_generation_prompt"})


class ToolError(ValueError):
    """A bad agent field: `param` names it, the message says why (the api answers 400)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ChatTools:
    """The request's tools as the template renders them, and what the answer may do with them."""

    tools: tuple[dict, ...] = ()  # OpenAI tool objects, checked
    choice: str = "none"  # "auto", "required": calls in the answer are parsed out; "none": all text is content
    parallel: bool = True  # parallel_tool_calls
    forced: str | None = None  # tool_choice named this function: the answer is one call of it (choice "required")
    schemas: dict[str, dict] = field(default_factory=dict)  # function name -> its `parameters` schema


def _type(value: Any) -> str:
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}
    return names.get(type(value), type(value).__name__)


def _function(tool: Any, param: str) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise ToolError(param, f'`{param}` must be {{"type": "function", "function": {{...}}}}')
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ToolError(f"{param}.function.name", f"`{param}.function.name` must be 1 to 64 letters, digits, "
                                                  f"'_', '.' or '-', got {name!r}")
    if not isinstance(function.get("description", ""), str):
        raise ToolError(f"{param}.function.description", f"`{param}.function.description` must be a string")
    parameters = function.get("parameters", {})
    if not isinstance(parameters, dict):
        raise ToolError(f"{param}.function.parameters",
                        f"`{param}.function.parameters` must be a JSON schema object, got {_type(parameters)}")
    if not isinstance(function.get("strict", False), bool):
        raise ToolError(f"{param}.function.strict", f"`{param}.function.strict` must be a boolean")
    return function


def parse_tools(body: dict) -> ChatTools:
    """The request's tools, tool_choice and parallel_tool_calls; raises ToolError."""
    tools = body.get("tools")
    if tools is None:
        tools = []
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ToolError("tools", f"`tools` must be a list of at most {MAX_TOOLS} tools")
    schemas: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        function = _function(tool, f"tools[{i}]")
        if function["name"] in schemas:
            raise ToolError(f"tools[{i}].function.name", f"tool name {function['name']!r} appears twice")
        schemas[function["name"]] = function.get("parameters", {})
    choice, forced = _choice(body.get("tool_choice"), schemas)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool) and parallel is not None:
        raise ToolError("parallel_tool_calls", f"`parallel_tool_calls` must be a boolean, got {_type(parallel)}")
    return ChatTools(tuple(tools), choice, parallel is not False, forced, schemas)


def _choice(choice: Any, schemas: dict[str, dict]) -> tuple[str, str | None]:
    """tool_choice as (choice, the function it names or None)."""
    if choice is None:
        return ("auto" if schemas else "none"), None
    if isinstance(choice, dict):
        return "required", _named(choice, schemas)
    if choice not in ("auto", "none", "required"):
        raise ToolError("tool_choice", f"`tool_choice` must be \"auto\", \"none\", \"required\" or "
                                       f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {choice!r}")
    if choice != "none" and not schemas:
        raise ToolError("tool_choice", f"`tool_choice` \"{choice}\" needs `tools`")
    return choice, None


def _named(choice: dict, schemas: dict[str, dict]) -> str:
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise ToolError("tool_choice", '`tool_choice` naming a function must be {"type": "function", "function": '
                                       '{"name": ...}}')
    if name not in schemas:
        raise ToolError("tool_choice.function.name", f"`tool_choice` names {name!r}, which is not in `tools` "
                                                     f"({sorted(schemas) or 'none given'})")
    return name


def parse_tool_calls(value: Any, param: str) -> tuple[dict, ...] | None:
    """An assistant turn's `tool_calls`, with each call's arguments decoded into an object."""
    if value is None or value == []:
        return None
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise ToolError(param, f"`{param}` must be a list of at most {MAX_TOOLS} tool calls")
    calls = []
    for i, call in enumerate(value):
        where = f"{param}[{i}]"
        function = _function(call, where)
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                raise ToolError(f"{where}.function.arguments",
                                f"`{where}.function.arguments` must be a JSON object as text") from None
        if not isinstance(arguments, dict):
            raise ToolError(f"{where}.function.arguments", f"`{where}.function.arguments` must be a JSON object")
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise ToolError(f"{where}.id", f"`{where}.id` must be a string")
        calls.append({"id": call_id, "type": "function",
                      "function": {"name": function["name"], "arguments": arguments}})
    return tuple(calls)


def parse_template_kwargs(body: dict) -> dict[str, Any]:
    """`chat_template_kwargs`: identifier keys, JSON values, none of the variables hkv sets itself."""
    value = body.get("chat_template_kwargs")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ToolError("chat_template_kwargs", f"`chat_template_kwargs` must be an object, got {_type(value)}")
    for key in value:
        if not _KWARG.match(key) or key in RESERVED_KWARGS:
            raise ToolError("chat_template_kwargs", f"`chat_template_kwargs` key {key!r} is not allowed: keys are "
                                                    f"identifiers other than {sorted(RESERVED_KWARGS)}")
    return dict(value)


def json_chars(value: Any) -> int:
    """Characters of a value as JSON: what it adds to the rendered prompt, at most (size checks)."""
    return len(json.dumps(value, ensure_ascii=False)) if value else 0
