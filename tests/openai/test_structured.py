"""hkv/openai/structured.py through parse_chat / parse_completion: response_format, structured_outputs and
guided_* as one compiled Constraint, and a clear 400 naming the field for everything else."""

from __future__ import annotations

import json

import pytest

from hkv.ipc.messages import Constraint
from hkv.openai.chat_constraint import constrain_chat
from hkv.openai.protocol import ProtocolError, parse_chat, parse_completion
from hkv.openai.structured import MAX_ERROR_CHARS, after_reasoning
from tests.openai.grammar_walk import GrammarWalker, conforms
from tests.openai.test_protocol import LIMITS

USER = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8}, "size": {"enum": ["S", "L"]},
    "tags": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
    "required": ["name", "size"], "additionalProperties": False}
OBJECT = Constraint("json_schema", '{"type": "object"}')
AS_SCHEMA = Constraint("json_schema", json.dumps(SCHEMA))


def _constraint(**fields) -> Constraint | None:
    chat = parse_chat({"messages": USER, **fields}, LIMITS).options.constraint
    assert parse_completion({"prompt": "x", **fields}, LIMITS).options.constraint == chat
    return chat


def _refused(param: str, **fields) -> str:
    for parse, body in ((parse_chat, {"messages": USER}), (parse_completion, {"prompt": "x"})):
        with pytest.raises(ProtocolError) as exc:
            parse({**body, **fields}, LIMITS)
        assert (exc.value.status, exc.value.param) == (400, param), (exc.value.param, exc.value.message)
    return exc.value.message


@pytest.mark.parametrize("fields, want", [
    (dict(), None),
    (dict(response_format={"type": "text"}), None),
    (dict(response_format={"type": "json_object"}), OBJECT),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}), AS_SCHEMA),
    (dict(response_format={"type": "json_schema", "json_schema": {
        "name": "x-1", "schema": SCHEMA, "strict": False, "description": "a thing"}}), AS_SCHEMA),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "strict": None}}), OBJECT),
    (dict(guided_json=SCHEMA), AS_SCHEMA),
    (dict(guided_json=json.dumps(SCHEMA)), AS_SCHEMA),
    (dict(guided_regex="[ab]{2}\\d"), Constraint("regex", "[ab]{2}\\d")),
    (dict(guided_grammar='start: "x"+'), Constraint("lark", 'start: "x"+')),
    (dict(guided_choice=["yes", 'n"o', "yes"]), Constraint("lark", 'start: "yes" | "n\\"o"\n')),
    (dict(structured_outputs={"json": SCHEMA}), AS_SCHEMA),
    (dict(structured_outputs={"regex": "a+", "disable_any_whitespace": True, "disable_fallback": False}),
     Constraint("regex", "a+")),
    (dict(structured_outputs={"json_object": True}), OBJECT),
    (dict(structured_outputs={"json_object": False, "grammar": None}), None),
    (dict(structured_outputs={"choice": ["a"]}), Constraint("lark", 'start: "a"\n')),
], ids=lambda v: json.dumps(v)[:60] if isinstance(v, dict) else None)
def test_each_field_becomes_one_constraint(fields, want):
    assert _constraint(**fields) == want


@pytest.mark.parametrize("fields, param, says", [
    (dict(response_format="json"), "response_format", "an object"),
    (dict(response_format={"type": "yaml"}), "response_format.type", "got 'yaml'"),
    (dict(response_format={"type": "json_schema"}), "response_format.json_schema", "an object"),
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}}),
     "response_format.json_schema.name", "is required"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "a b"}}),
     "response_format.json_schema.name", "letters"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}}),
     "response_format.json_schema.strict", "boolean"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "description": 1}}),
     "response_format.json_schema.description", "string"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": []}}),
     "response_format.json_schema.schema", "object"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}),
     "response_format", "Invalid type: foo"),
    (dict(guided_json={"required": "é" * 100}), "guided_json", "failed in llguidance"),  # llguidance panics
    (dict(guided_json="{nope"), "guided_json", "not JSON"),
    (dict(guided_json="[" * 5000), "guided_json", "recursion"),
    (dict(guided_json="[1]"), "guided_json", "got array"),
    (dict(guided_json=5), "guided_json", "got integer"),
    (dict(guided_regex="a("), "guided_regex", "unclosed group"),
    (dict(guided_regex=["a"]), "guided_regex", "a string"),
    (dict(guided_grammar="start: nothing"), "guided_grammar", 'unknown name: "nothing"'),
    (dict(guided_choice=[]), "guided_choice", "1 to"),
    (dict(guided_choice=["a", 1]), "guided_choice", "strings"),
    (dict(guided_whitespace_pattern=" "), "guided_whitespace_pattern", "compact"),
    (dict(structured_outputs=["json"]), "structured_outputs", "an object"),
    (dict(structured_outputs={"whitespace_pattern": " "}), "structured_outputs.whitespace_pattern", "not supported"),
    (dict(structured_outputs={"structural_tag": "{}"}), "structured_outputs.structural_tag", "not supported"),
    (dict(structured_outputs={"json_object": 1}), "structured_outputs.json_object", "boolean"),
    (dict(structured_outputs={"disable_fallback": "no"}), "structured_outputs.disable_fallback", "boolean"),
    (dict(structured_outputs={"regex": "a", "choice": ["a"]}), "structured_outputs.choice", "at most one"),
    (dict(response_format={"type": "json_object"}, guided_regex="a"), "guided_regex", "at most one"),
    (dict(guided_json=SCHEMA, structured_outputs={"json": SCHEMA}), "structured_outputs.json", "at most one"),
], ids=lambda v: json.dumps(v)[:60] if isinstance(v, dict) else None)
def test_bad_fields_are_400_naming_the_field(fields, param, says):
    assert says in _refused(param, **fields)


def test_a_long_compiler_message_is_cut():
    message = _refused("guided_regex", guided_regex="(" + "a" * 5000)
    assert message.startswith("`guided_regex`: ") and message.endswith(" ...")
    assert len(message) == len("`guided_regex`: ") + MAX_ERROR_CHARS + len(" ...")


OPENED = "<|im_start|>assistant\n<think>\n"


@pytest.mark.parametrize("prompt, reasoning_parser, behind", [
    (OPENED, "qwen3", True), (OPENED, None, False), ("<|im_start|>assistant\n", "qwen3", False)])
def test_structured_output_follows_the_reasoning_the_prompt_opened(prompt, reasoning_parser, behind):
    req = parse_chat({"messages": USER, "response_format": {"type": "json_object"}}, LIMITS)
    constraint = constrain_chat(req, prompt, None, reasoning_parser).constraint
    assert constraint == (after_reasoning(OBJECT) if behind else OBJECT)


@pytest.fixture(scope="module")
def walker() -> GrammarWalker:
    return GrammarWalker()


def test_json_after_reasoning_is_the_schemas_json_once_the_reasoning_ends(walker):
    for seed in range(5):
        text = walker.walk(after_reasoning(AS_SCHEMA), seed)
        reasoning, answer = text.split("</think>", 1)
        assert conforms(json.loads(answer.lstrip("\n")), SCHEMA), text
        assert answer.lstrip("\n") == json.dumps(json.loads(answer.lstrip("\n")))  # compact, as json.dumps writes


@pytest.mark.parametrize("constraint, fits", [
    (Constraint("regex", "[ab]{2}/[0-9]+"), lambda s: len(s) > 3 and s[:2] in ("aa", "ab", "ba", "bb")
     and s[2] == "/" and s[3:].isdigit()),
    (Constraint("lark", 'start: "x" NUM ("," NUM)*\nNUM: /[0-9]+/\n'), lambda s: s[0] == "x" and all(
        p.isdigit() for p in s[1:].split(","))),
])
def test_a_regex_or_grammar_after_reasoning(walker, constraint, fits):
    for seed in range(5):
        text = walker.walk(after_reasoning(constraint), seed)
        answer = text.split("</think>", 1)[1].lstrip("\n")
        assert fits(answer), text


def test_a_schema_nested_past_the_recursion_limit_is_a_400():
    schema: dict = {"type": "integer"}
    for _ in range(2000):  # deeper than the decoder lets through; json.dumps would overflow
        schema = {"type": "object", "properties": {"a": schema}}
    message = _refused(None, guided_json=schema)
    assert message == "the request nests too deeply"
