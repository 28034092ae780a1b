"""hkv/openai/tool_grammar.py: a forced tool call's grammar, walked with random allowed tokens (a random-weight
model under masks), always gives calls that the server's parser reads into arguments valid for the tool."""

from __future__ import annotations

import json
import random

import pytest

from hkv.ipc.messages import Constraint
from hkv.openai.chat_output import ChatOutputParser, merge_tool_calls
from hkv.openai.structured import check
from hkv.openai.tool_grammar import forced_call_grammar
from hkv.openai.tools import ChatTools, ToolError, parse_tools
from tests.openai.grammar_walk import GrammarWalker, conforms

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "unit": {"enum": ["C", "F"]},
    "hourly": {"type": "boolean"}}, "required": ["city", "unit"], "additionalProperties": False}
SEARCH = {"type": "object", "properties": {
    "query": {"type": "string"},
    "filters": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "limit": {"type": "integer"}, "mode": {"$ref": "#/$defs/mode"}},
        "required": ["limit"], "additionalProperties": False}},
    "required": ["query", "filters"], "additionalProperties": False,
    "$defs": {"mode": {"enum": ["fast", "deep"]}}}
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH, "get_time": {}}
TOOLS = [{"type": "function", "function": {"name": n, **({"parameters": s} if s else {})}} for n, s in SCHEMAS.items()]
SEEDS = range(6)


@pytest.fixture(scope="module")
def walker() -> GrammarWalker:
    return GrammarWalker()


def _tools(choice, parallel: bool = True) -> ChatTools:
    return parse_tools({"tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": parallel})


def _answer(walker: GrammarWalker, tools: ChatTools, parser: str, opened: bool, seed: int) -> tuple[str, list]:
    """(content, calls) of one random walk, read by the parser in random pieces as a stream delivers them."""
    constraint = check(Constraint("lark", forced_call_grammar(tools, parser, opened)), "tools")
    text = walker.walk(constraint, seed)
    reader = ChatOutputParser("qwen3", opened, parser, tools.schemas, tools.parallel and tools.forced is None)
    rng = random.Random(seed)
    cuts = sorted({0, len(text), *(rng.randrange(len(text) + 1) for _ in range(8))})
    content, deltas = "", []
    for piece in [text[a:b] for a, b in zip(cuts, cuts[1:])]:
        out = reader.feed(piece)
        content, deltas = content + out.content, deltas + out.tool_calls
    out = reader.flush()
    assert reader.called, text
    return content + out.content, merge_tool_calls(deltas + out.tool_calls)


def _check_calls(calls: list, names: set[str], text_params: bool) -> None:
    for call in calls:
        name, arguments = call["function"]["name"], json.loads(call["function"]["arguments"])
        assert name in names and isinstance(arguments, dict), call
        schema = SCHEMAS[name]
        assert conforms(arguments, schema), (name, arguments)
        if text_params and name == "get_time":  # no properties: any parameters, all text
            assert all(isinstance(v, str) for v in arguments.values()), arguments


@pytest.mark.parametrize("parser", ["hermes", "qwen3_coder"])
@pytest.mark.parametrize("opened", [False, True])
def test_required_gives_one_parsable_valid_call(walker, parser, opened):
    for seed in SEEDS:
        content, calls = _answer(walker, _tools("required", parallel=False), parser, opened, seed)
        assert content == "" and len(calls) == 1, (seed, content, calls)
        _check_calls(calls, set(SCHEMAS), parser == "qwen3_coder")


@pytest.mark.parametrize("parser", ["hermes", "qwen3_coder"])
def test_required_with_parallel_calls_gives_one_or_more(walker, parser):
    counts = []
    for seed in SEEDS:
        content, calls = _answer(walker, _tools("required"), parser, False, seed)
        assert content == "" and calls, (seed, content)
        _check_calls(calls, set(SCHEMAS), parser == "qwen3_coder")
        counts.append(len(calls))
    assert max(counts) > 1, counts  # the walks took the second call somewhere


@pytest.mark.parametrize("parser", ["hermes", "qwen3_coder"])
def test_a_named_function_gives_exactly_one_call_of_it(walker, parser):
    tools = _tools({"type": "function", "function": {"name": "search"}})
    for seed in SEEDS:
        content, calls = _answer(walker, tools, parser, True, seed)
        assert content == "" and [c["function"]["name"] for c in calls] == ["search"], (seed, calls)
        _check_calls(calls, {"search"}, parser == "qwen3_coder")


def test_the_grammar_of_one_named_hermes_call():
    tools = parse_tools({"tools": [TOOLS[0]], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    schema = json.dumps({**WEATHER, "x-guidance": {"whitespace_flexible": False, "item_separator": ", ",
                                                   "key_separator": ": "}})
    assert forced_call_grammar(tools, "hermes", opened=False) == (
        "start: call\n"
        "call: call_0\n"
        'call_0: "<tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": " call_0_args "}\\n</tool_call>"\n'
        f"call_0_args: %json {schema}\n")


def test_the_grammar_of_qwen3_coder_parameters_follows_the_parser():
    tools = parse_tools({"tools": [TOOLS[0]], "tool_choice": "required", "parallel_tool_calls": False})
    compact = '"x-guidance": {"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}'
    assert forced_call_grammar(tools, "qwen3_coder", opened=True) == (
        "start: reasoning NEWLINES? call\n"
        "call: call_0\n"
        'call_0: "<tool_call>\\n<function=get_weather>\\n" call_0_0 call_0_1? call_0_2 call_0_3? '
        '"</function>\\n</tool_call>"\n'
        'call_0_0: "<parameter=city>\\n" text "\\n"\n'
        f'call_0_1: "<parameter=days>\\n" %json {{"type": "integer", {compact}}} "\\n</parameter>\\n"\n'
        'call_0_2: "<parameter=unit>\\n" ("C" | "F") "\\n</parameter>\\n"\n'
        f'call_0_3: "<parameter=hourly>\\n" %json {{"type": "boolean", {compact}}} "\\n</parameter>\\n"\n'
        "reasoning[lazy]: /(.|\\n)*<\\/think>/\n"
        "NEWLINES: /\\n+/\n"
        "text[lazy]: /(.|\\n)*<\\/parameter>/\n"
        "PARAM_NAME: /[A-Za-z0-9_.\\-]{1,64}/\n")


@pytest.mark.parametrize("parser, parameters, says", [
    ("hermes", {"type": "array"}, "of type 'array'"),
    ("qwen3_coder", {"type": "array"}, "of type 'array'"),
    ("qwen3_coder", {"properties": {"a>b": {"type": "string"}}}, "cannot name"),
    ("qwen3_coder", {"properties": {" a": {"type": "string"}}}, "cannot name"),
    ("qwen3_coder", {"properties": {"a\nb": {"type": "string"}}}, "cannot name"),
])
def test_schemas_a_format_cannot_carry_are_tool_errors(parser, parameters, says):
    tools = parse_tools({"tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}],
                         "tool_choice": "required"})
    with pytest.raises(ToolError) as exc:
        forced_call_grammar(tools, parser, opened=False)
    assert exc.value.param == "tools" and says in str(exc.value)
