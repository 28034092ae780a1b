"""hkv/openai/tools.py through parse_chat: tools, tool_choice, tool-call turns and chat_template_kwargs."""

from __future__ import annotations

import dataclasses

import pytest

from hkv.ipc.messages import Constraint
from hkv.openai.chat_constraint import constrain_chat
from hkv.openai.protocol import ProtocolError, parse_chat, parse_completion
from hkv.openai.tool_grammar import forced_call_grammar
from tests.openai.test_protocol import LIMITS

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
USER = {"role": "user", "content": "Weather in Paris?"}


def _parse(**fields):
    return parse_chat({"messages": fields.pop("messages", [USER]), **fields}, LIMITS)


def _refused(param: str, **fields) -> str:
    with pytest.raises(ProtocolError) as exc:
        _parse(**fields)
    assert exc.value.status == 400 and exc.value.param == param, (exc.value.param, str(exc.value))
    return str(exc.value)


def test_tools_and_their_defaults():
    req = _parse(tools=[WEATHER])
    assert req.tools.tools == (WEATHER,) and req.tools.choice == "auto" and req.tools.parallel
    assert req.tools.schemas == {"get_weather": WEATHER["function"]["parameters"]}
    assert _parse().tools.choice == "none"
    assert _parse(tools=[WEATHER], tool_choice="none", parallel_tool_calls=False).tools.parallel is False


def test_required_and_a_named_function():
    required = _parse(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False).tools
    assert (required.choice, required.forced, required.parallel) == ("required", None, False)
    named = _parse(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}).tools
    assert (named.choice, named.forced, named.parallel) == ("required", "get_weather", True)


OPENED = "<|im_start|>assistant\n<think>\n"  # a prompt that opens a reasoning block (Qwen3.5's)
CLOSED = "<|im_start|>assistant\n"


@pytest.mark.parametrize("parser", ["hermes", "qwen3_coder"])
@pytest.mark.parametrize("prompt, opened", [(OPENED, True), (CLOSED, False)])
def test_a_forced_call_is_a_grammar_of_the_parsers_format(parser, prompt, opened):
    req = _parse(tools=[WEATHER], tool_choice="required", temperature=0.5)
    options = constrain_chat(req, prompt, parser, "qwen3")
    assert options.constraint == Constraint("lark", forced_call_grammar(req.tools, parser, opened))
    assert options.constraint.spec.startswith("start: reasoning NEWLINES? call" if opened else "start: call")
    assert options.temperature == 0.5


def test_auto_and_none_are_not_constrained():
    for choice in ("auto", "none"):
        req = _parse(tools=[WEATHER], tool_choice=choice)
        assert constrain_chat(req, OPENED, "hermes", "qwen3") is req.options


@pytest.mark.parametrize("parameters, parser, param, says", [
    ({"type": "object", "properties": {"a": {"type": "foo"}}}, "hermes", "tools", "Invalid type: foo"),
    ({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "foo"}}}}, "qwen3_coder", "tools",
     "Invalid type: foo"),
    ({"type": "string"}, "hermes", "tools", "a JSON object"),
    ({"properties": {"a>": {}}}, "qwen3_coder", "tools", "cannot name"),
])
def test_a_forced_call_the_format_cannot_carry_is_a_400(parameters, parser, param, says):
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    req = _parse(tools=[tool], tool_choice="required")
    with pytest.raises(ProtocolError) as exc:
        constrain_chat(req, CLOSED, parser, None)
    assert (exc.value.status, exc.value.param) == (400, param) and says in exc.value.message


def test_a_forced_call_needs_a_tool_call_parser():
    req = _parse(tools=[WEATHER], tool_choice="required")
    with pytest.raises(ProtocolError) as exc:
        constrain_chat(req, CLOSED, None, None)
    assert exc.value.param == "tool_choice" and "--tool-call-parser" in exc.value.message


def test_a_two_turn_conversation_with_a_call_and_its_result():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [USER, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    req = _parse(messages=messages, tools=[WEATHER])
    assistant, tool = req.messages[1], req.messages[2]
    assert assistant.template_dict() == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert tool.template_dict() == {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "call_1"}


@pytest.mark.parametrize("fields, param, says", [
    (dict(tools={"type": "function"}), "tools", "list"),
    (dict(tools=[{"type": "code_interpreter"}]), "tools[0]", "function"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools[0].function.name", "letters"),
    (dict(tools=[WEATHER, WEATHER]), "tools[1].function.name", "twice"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}]), "tools[0].function.parameters",
     "schema"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_time"}}),
     "tool_choice.function.name", "not in `tools`"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"}), "tool_choice", "naming"),
    (dict(tools=[WEATHER], tool_choice={"type": "tool", "function": {"name": "get_weather"}}), "tool_choice",
     "naming"),
    (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "tool_choice",
     "structured output"),
    (dict(tools=[WEATHER], tool_choice="required", guided_regex="a"), "tool_choice", "structured output"),
    (dict(tools=[WEATHER], tool_choice="required", ignore_eos=True), "ignore_eos", "EOS"),
    (dict(tool_choice="auto"), "tool_choice", "needs `tools`"),
    (dict(tool_choice="required"), "tool_choice", "needs `tools`"),
    (dict(tools=[WEATHER], tool_choice="sometimes"), "tool_choice", "must be"),
    (dict(tools=[WEATHER], parallel_tool_calls="yes"), "parallel_tool_calls", "boolean"),
    (dict(chat_template_kwargs=[1]), "chat_template_kwargs", "object"),
    (dict(chat_template_kwargs={"messages": []}), "chat_template_kwargs", "not allowed"),
    (dict(chat_template_kwargs={"a-b": 1}), "chat_template_kwargs", "not allowed"),
    (dict(messages=[USER, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{nope"}}]}]),
     "messages[1].tool_calls[0].function.arguments", "JSON object"),
    (dict(messages=[USER, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]),
     "messages[1].tool_calls[0].function.arguments", "JSON object"),
    (dict(messages=[{"role": "user", "content": "x", "tool_calls": []}]), "messages[0].tool_calls", "assistant"),
    (dict(messages=[{"role": "tool", "content": "x", "tool_call_id": 7}]), "messages[0].tool_call_id", "string"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_agent_fields_are_400_naming_the_field(fields, param, says):
    assert says in _refused(param, **fields)


def test_template_kwargs_pass_through():
    assert _parse(chat_template_kwargs={"enable_thinking": False}).template_kwargs == {"enable_thinking": False}


def test_tools_count_toward_the_prompt_size_and_stay_off_completions():
    limits = dataclasses.replace(LIMITS, max_prompt_chars=500)
    tool = {"type": "function", "function": {"name": "f", "description": "x" * 480}}
    parse_chat({"messages": [USER], "tools": [tool]}, dataclasses.replace(limits, max_prompt_chars=600))
    with pytest.raises(ProtocolError) as exc:
        parse_chat({"messages": [USER], "tools": [tool]}, limits)
    assert exc.value.code == "context_length_exceeded"
    with pytest.raises(ProtocolError) as exc:
        parse_completion({"prompt": "x", "tools": [WEATHER]}, LIMITS)
    assert exc.value.param == "tools"
