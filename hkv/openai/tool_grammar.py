"""A forced tool call as a grammar: with `tool_choice` "required" or a named function the answer is tool
call(s) in the format the server's tool-call parser reads (hkv/openai/chat_output.py), each call's
arguments kept to its function's `parameters` schema, then EOS (hkv/engine/grammar.py enforces it).

    hermes        <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>
    qwen3_coder   <tool_call>\\n<function=f>\\n<parameter=p>\\nvalue\\n</parameter>\\n...</function>\\n</tool_call>

"required" allows one call, or one or more (a newline apart) with parallel_tool_calls; a named function
exactly one call of it. When the rendered prompt opens a reasoning block, the reasoning text up to
`</think>` and the newlines after it come first. JSON is compact, as hkv/engine/grammar.py writes it.

hermes arguments are JSON of the whole `parameters` schema (its own root, so its `$ref`s resolve).
qwen3_coder writes one `<parameter=p>` block per property, in the schema's order, the required ones
always; each value is what the parser makes of it: JSON of the property's schema when its `type` is
one the parser decodes (integer, number, boolean, object, array, null), else text up to `</parameter>`
(one of its strings when it has a string `enum` or `const`). A schema without `properties` takes any
parameters, as text.
"""

from __future__ import annotations

import json
from typing import Any

from hkv.openai.structured import REASONING_RULES, json_rule
from hkv.openai.tools import ChatTools, ToolError

JSON_TYPES = ("integer", "number", "boolean", "object", "array", "null")  # what qwen3_coder's parser decodes
MAX_PARAM_NAME = 256  # characters of a <parameter=...> name the parser reads
CODER_RULES = ("text[lazy]: /(.|\\n)*<\\/parameter>/", "PARAM_NAME: /[A-Za-z0-9_.\\-]{1,64}/")


def _literal(text: str) -> str:
    """A Lark string literal of `text`."""
    return json.dumps(text, ensure_ascii=False)


def forced_call_grammar(tools: ChatTools, parser: str, opened: bool) -> str:
    """The Lark grammar of the calls `tools` forces, in `parser`'s format ("hermes" or "qwen3_coder");
    `opened`: the prompt ends inside a think block. Raises ToolError for a schema the format cannot carry."""
    names = [tools.forced] if tools.forced is not None else list(tools.schemas)
    write = _hermes_call if parser == "hermes" else _coder_call
    rules = ["call: " + " | ".join(f"call_{i}" for i in range(len(names)))]
    for i, name in enumerate(names):
        rules += write(f"call_{i}", name, tools.schemas[name])
    calls = 'call ("\\n" call)*' if tools.parallel and tools.forced is None else "call"
    start = f"start: reasoning NEWLINES? {calls}" if opened else f"start: {calls}"
    extra = (REASONING_RULES if opened else ()) + (CODER_RULES if parser == "qwen3_coder" else ())
    return "\n".join([start, *rules, *extra]) + "\n"


def _object_schema(name: str, parameters: dict) -> dict:
    """`parameters` as the schema of an arguments object (an untyped schema is taken to be one)."""
    kind = parameters.get("type", "object")
    if kind != "object":
        raise ToolError("tools", f"function {name!r} has `parameters` of type {kind!r}: a forced call's "
                                 f"arguments are a JSON object")
    return {**parameters, "type": "object"}


def _hermes_call(rule: str, name: str, parameters: dict) -> list[str]:
    head = _literal(f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": ')
    return [f'{rule}: {head} {rule}_args "}}\\n</tool_call>"',
            f"{rule}_args: {json_rule(_object_schema(name, parameters))}"]


def _coder_call(rule: str, name: str, parameters: dict) -> list[str]:
    schema = _object_schema(name, parameters)
    properties = schema.get("properties")
    if isinstance(properties, dict) and properties:
        body, rules = _coder_params(rule, name, schema, properties)
    else:
        body, rules = f"{rule}_any*", [f'{rule}_any: "<parameter=" PARAM_NAME ">\\n" text "\\n"']
    head = _literal(f"<tool_call>\n<function={name}>\n")
    return [f'{rule}: {head} {body} "</function>\\n</tool_call>"', *rules]


def _coder_params(rule: str, name: str, schema: dict, properties: dict) -> tuple[str, list[str]]:
    """The parameter blocks of a function with properties: (its body's expansion, their rules)."""
    listed = schema.get("required")
    required = {r for r in listed if isinstance(r, str)} if isinstance(listed, list) else set()
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}  # what property `$ref`s point at
    parts, rules = [], []
    for j, (param, prop) in enumerate(properties.items()):
        _check_param_name(name, param)
        parts.append(f"{rule}_{j}" + ("" if param in required else "?"))
        rules.append(f"{rule}_{j}: " + _literal(f"<parameter={param}>\n") + " " + _coder_value(prop, defs))
    return " ".join(parts), rules


def _check_param_name(function: str, param: str) -> None:
    """The parser reads `<parameter=NAME>` with NAME free of '>' and newlines, and strips it."""
    if not param or len(param) > MAX_PARAM_NAME or param != param.strip() or ">" in param or "\n" in param:
        raise ToolError("tools", f"function {function!r} has a property {param!r} that a qwen3_coder "
                                 f"<parameter=...> tag cannot name")


def _coder_value(prop: Any, defs: dict) -> str:
    """The grammar of one parameter's value and the block's end."""
    prop = prop if isinstance(prop, dict) else {}
    if prop.get("type") in JSON_TYPES:
        return f'{json_rule({**prop, **defs})} "\\n</parameter>\\n"'
    choices = prop["enum"] if "enum" in prop else [prop["const"]] if "const" in prop else None
    if choices and all(isinstance(c, str) for c in choices):
        return "(" + " | ".join(_literal(c) for c in choices) + ') "\\n</parameter>\\n"'
    return 'text "\\n"'
