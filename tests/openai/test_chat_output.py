"""hkv/openai/chat_output.py: reasoning and tool calls split out of a chat answer, the same however the
text is cut into streamed deltas."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hkv.models.tokenizer import tool_call_format as tool_parser_for_template
from hkv.openai.chat_output import ChatOutputParser, merge_tool_calls, prompt_opens_reasoning

SCHEMAS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                            "hourly": {"type": "boolean"},
                                                            "units": {"type": "array"}}},
           "get_time": {"type": "object", "properties": {}}}
HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris \\"centre\\"", '
          '"days": [1, {"x": "}"}]}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
CODER = ("I will look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n"
         "<parameter=days>\n3\n</parameter>\n<parameter=hourly>\ntrue\n</parameter>\n<parameter=units>\n[\"C\"]\n"
         "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>")


def _run(parser: ChatOutputParser, pieces: list[str]) -> tuple[str, str, list[dict]]:
    reasoning, content, calls = "", "", []
    for piece in pieces:
        out = parser.feed(piece)
        reasoning, content, calls = reasoning + out.reasoning, content + out.content, calls + out.tool_calls
    out = parser.flush()
    merged = merge_tool_calls(calls + out.tool_calls)
    for call in merged:
        assert call["id"].startswith("call_")
        call.pop("id")
    return reasoning + out.reasoning, content + out.content, merged


def _pieces(text: str, cuts: list[int]) -> list[str]:
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def test_hermes_calls_and_the_content_before_them():
    reasoning, content, calls = _run(ChatOutputParser(None, False, "hermes", SCHEMAS), [HERMES])
    assert (reasoning, content) == ("", "Let me check.")
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert calls[0]["function"]["arguments"] == '{"city": "Paris \\"centre\\"", "days": [1, {"x": "}"}]}'
    assert json.loads(calls[0]["function"]["arguments"])["days"][1] == {"x": "}"}
    assert calls[1]["function"]["arguments"] == "{}" and calls[1]["type"] == "function"


def test_qwen3_coder_calls_are_typed_by_the_tool_schema():
    _, content, calls = _run(ChatOutputParser(None, False, "qwen3_coder", SCHEMAS), [CODER])
    assert content == "I will look."
    args = json.loads(calls[0]["function"]["arguments"])
    assert args == {"city": "San Francisco", "days": 3, "hourly": True, "units": ["C"]}
    assert calls[0]["function"]["arguments"] == '{"city": "San Francisco", "days": 3, "hourly": true, "units": ["C"]}'
    assert calls[1]["function"] == {"name": "get_time", "arguments": "{}"}


@pytest.mark.parametrize("opened, text, want", [
    (False, "<think>\nfirst, the plan\n</think>\n\nThe answer.", ("first, the plan", "The answer.")),
    (True, "\nplanning\n\n</think>\n\nDone.", ("planning", "Done.")),
    (True, "still thinking, cut off", ("still thinking, cut off", "")),
    (False, "No block at all.", ("", "No block at all.")),
    (False, "  <thin", ("", "  <thin")),
], ids=["output-opens", "prompt-opens", "never-closed", "no-block", "half-a-tag"])
def test_reasoning_split(opened, text, want):
    reasoning, content, calls = _run(ChatOutputParser("qwen3", opened, None, {}), [text])
    assert (reasoning, content) == want and calls == []


def test_reasoning_then_a_call_and_no_parallel_calls():
    text = "<think>\nI need the weather.\n</think>\n\n" + HERMES
    parser = ChatOutputParser("qwen3", False, "hermes", SCHEMAS, parallel=False)
    reasoning, content, calls = _run(parser, [text])
    assert reasoning == "I need the weather." and content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather"] and parser.called


@pytest.mark.parametrize("text", [
    "plain text with <tool_call> that never names anything",
    '<tool_call>{"arguments": {"a": 1}, "name": "get_time"}</tool_call> then text',
    "a < b and <tool_ is not a tag",
], ids=["unnamed", "arguments-first", "lookalike"])
def test_blocks_that_do_not_stream_as_calls(text):
    reasoning, content, calls = _run(ChatOutputParser(None, False, "hermes", SCHEMAS), [text])
    if "arguments-first" in text or '"name"' in text:
        assert calls == [{"type": "function", "function": {"name": "get_time", "arguments": '{"a": 1}'}}]
        assert content == " then text"  # only newlines after a call are dropped
    else:
        assert calls == [] and content == text


def test_formats_are_picked_from_the_template():
    assert tool_parser_for_template("... <tool_call>\\n{\"name\": <function-name>, ...") == "hermes"
    assert tool_parser_for_template("<tool_call>\\n<function=example_function_name>") == "qwen3_coder"
    assert tool_parser_for_template("{{ messages }}") is None and tool_parser_for_template(None) is None
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")


@settings(max_examples=150, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=40),
       case=st.sampled_from(["hermes", "coder", "reasoning"]))
def test_any_cut_into_deltas_gives_the_whole_answer(cuts, case):
    text, args = {
        "hermes": (HERMES, (None, False, "hermes")),
        "coder": (CODER, (None, False, "qwen3_coder")),
        "reasoning": ("<think>\n\nweigh it\n\n</think>\n\n" + HERMES + "\n\nafter", ("qwen3", False, "hermes")),
    }[case]
    whole = _run(ChatOutputParser(*args, SCHEMAS), [text])
    assert _run(ChatOutputParser(*args, SCHEMAS), _pieces(text, cuts)) == whole


PIECES = ["<tool_call>", "</tool_call>", "<think>", "</think>", "\n", " ", "text", '{"name": "get_time", ',
          '"arguments": ', '{"a": [1, "}"]}', "}", "<function=get_weather>", "<parameter=days>", "</parameter>",
          "</function>", "<tool", "<", "7", '"', "\\"]


@settings(max_examples=200, deadline=None)
@given(parts=st.lists(st.sampled_from(PIECES), max_size=30), cuts=st.lists(st.integers(0, 500), max_size=20),
       reasoning=st.booleans(), opened=st.booleans(), tools=st.sampled_from([None, "hermes", "qwen3_coder"]))
def test_arbitrary_text_splits_the_same_however_it_streams(parts, cuts, reasoning, opened, tools):
    text = "".join(parts)
    args = ("qwen3" if reasoning else None, opened, tools, SCHEMAS)
    whole = _run(ChatOutputParser(*args), [text])
    assert _run(ChatOutputParser(*args), _pieces(text, cuts)) == whole
    assert _run(ChatOutputParser(*args), list(text)) == whole  # one character at a time


@pytest.mark.parametrize("param, value, want", [("x", "1e999", '{"x": 1e999}'), ("x", "NaN", '{"x": "NaN"}'),
                                                ("y", "[1E400, 2]", '{"y": [1E400, 2]}')])
def test_qwen3_coder_arguments_stay_json_for_values_python_cannot_round_trip(param, value, want):
    schemas = {"f": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "array"}}}}
    text = f"<tool_call>\n<function=f>\n<parameter={param}>\n{value}\n</parameter>\n</function>\n</tool_call>"
    _, _, calls = _run(ChatOutputParser(None, False, "qwen3_coder", schemas), [text])
    assert calls[0]["function"]["arguments"] == want
