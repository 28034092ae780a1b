"""Structured output: the request fields that keep an answer to a schema, a regex or a grammar, read into
one `Constraint` (hkv/ipc/messages.py) that the engine enforces with token masks (hkv/engine/grammar.py).

    response_format      {"type": "text"} | {"type": "json_object"} | {"type": "json_schema", "json_schema":
                         {"name", "schema"?, "strict"?, "description"?}}                         (OpenAI)
    structured_outputs   {"json": schema | "regex": str | "choice": [str] | "grammar": lark
                          | "json_object": true}                                          (vLLM >= 0.12)
    guided_json, guided_regex, guided_choice, guided_grammar                         (vLLM before 0.12)

At most one per request. Each is compiled here, so a bad schema, regex or grammar is a 400 carrying the
compiler's words before anything is queued. A schema is an object or JSON text of one; a grammar is
llguidance's Lark dialect. JSON answers are compact (", " and ": ", no other whitespace); `strict` is
accepted either way and the schema always enforced.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from typing import Any

from hkv.engine.grammar import JSON_OPTIONS, GrammarError, check_constraint
from hkv.ipc.messages import Constraint

MAX_ERROR_CHARS = 600  # of a compiler's message quoted in a 400
MAX_CHOICES = 1024
ANY_OBJECT = {"type": "object"}  # json_object, and a json_schema without `schema`
_SCHEMA_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# the reasoning a prompt opened, up to `</think>`, and the newlines after it (the reasoning parser drops them)
REASONING_RULES = ("reasoning[lazy]: /(.|\\n)*<\\/think>/", "NEWLINES: /\\n+/")
STRUCTURED_OUTPUT_FLAGS = ("disable_fallback", "disable_any_whitespace")  # no effect here: JSON is compact


class ConstraintError(ValueError):
    """A bad structured-output field: `param` names it, the message says why (the api answers 400)."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param


def _type(value: Any) -> str:
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}
    return names.get(type(value), type(value).__name__)


def json_rule(schema: dict) -> str:
    """A Lark `%json` expansion of `schema`, written compactly as hkv/engine/grammar.py writes JSON."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS}, ensure_ascii=False)


def check(constraint: Constraint, param: str | None) -> Constraint:
    """The constraint, once it compiles; ConstraintError naming `param` (None: no one field), with the
    compiler's words, if not."""
    try:
        check_constraint(constraint)  # (llguidance's panics arrive as GrammarError too)
    except GrammarError as exc:
        raise ConstraintError(param, _quoted(param, str(exc))) from None
    return constraint


def _quoted(param: str | None, message: str) -> str:
    cut = message if len(message) <= MAX_ERROR_CHARS else message[:MAX_ERROR_CHARS] + " ..."
    return f"`{param}`: {cut}" if param else cut


def parse_constraint(body: dict) -> Constraint | None:
    """The one constraint the body asks for, compiled; None when it asks for none."""
    found = list(_asked(body))
    if len(found) > 1:
        (first, _), (second, _) = found[:2]
        raise ConstraintError(second, f"`{first}` and `{second}` both constrain the output: give at most one")
    return check(found[0][1], found[0][0]) if found else None


def _asked(body: dict) -> Iterator[tuple[str, Constraint]]:
    """(param, constraint) for every field of the body that constrains the output."""
    if body.get("guided_whitespace_pattern") is not None:
        raise ConstraintError("guided_whitespace_pattern", "`guided_whitespace_pattern` is not supported: JSON "
                                                           "answers are compact")
    response_format = _response_format(body.get("response_format"))
    if response_format is not None:
        yield "response_format", response_format
    for name, read in GUIDED.items():
        if body.get(name) is not None:
            yield name, read(body[name], name)
    if body.get("structured_outputs") is not None:
        yield from _structured_outputs(body["structured_outputs"])


def _json_schema(value: Any, param: str) -> Constraint:
    """A JSON schema given as an object or as JSON text of one."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as exc:  # RecursionError: nesting past the decoder's depth
            raise ConstraintError(param, f"`{param}` is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ConstraintError(param, f"`{param}` must be a JSON schema object (or JSON text of one), "
                                     f"got {_type(value)}")
    return Constraint("json_schema", json.dumps(value, ensure_ascii=False))


def _string(kind: str) -> Callable[[Any, str], Constraint]:
    def read(value: Any, param: str) -> Constraint:
        if not isinstance(value, str):
            raise ConstraintError(param, f"`{param}` must be a string, got {_type(value)}")
        return Constraint(kind, value)

    return read


def _choice(value: Any, param: str) -> Constraint:
    """One of a list of strings, as a grammar of their alternatives."""
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_CHOICES or not all(isinstance(c, str) for c in value):
        raise ConstraintError(param, f"`{param}` must be a list of 1 to {MAX_CHOICES} strings")
    alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(value))
    return Constraint("lark", f"start: {alternatives}\n")


GUIDED = {"guided_json": _json_schema, "guided_regex": _string("regex"), "guided_grammar": _string("lark"),
          "guided_choice": _choice}
STRUCTURED_OUTPUTS = {"json": _json_schema, "regex": _string("regex"), "grammar": _string("lark"), "choice": _choice}


def _response_format(value: Any) -> Constraint | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ConstraintError("response_format", f"`response_format` must be an object, got {_type(value)}")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_schema", json.dumps(ANY_OBJECT))
    if kind == "json_schema":
        return _openai_json_schema(value.get("json_schema"))
    raise ConstraintError("response_format.type", '`response_format.type` must be "text", "json_object" or '
                                                  f'"json_schema", got {kind!r}')


def _openai_json_schema(spec: Any) -> Constraint:
    param = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise ConstraintError(param, f'`{param}` must be an object {{"name": ..., "schema": {{...}}}}')
    name = spec.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.match(name):
        raise ConstraintError(f"{param}.name", f"`{param}.name` is required: 1 to 64 letters, digits, '_' or '-', "
                                               f"got {name!r}")
    for key, kind in (("description", str), ("strict", bool)):
        if spec.get(key) is not None and not isinstance(spec[key], kind):
            raise ConstraintError(f"{param}.{key}", f"`{param}.{key}` must be a {_type(kind())}, "
                                                    f"got {_type(spec[key])}")
    schema = spec.get("schema")
    if schema is not None and not isinstance(schema, dict):
        raise ConstraintError(f"{param}.schema", f"`{param}.schema` must be a JSON schema object, got {_type(schema)}")
    return Constraint("json_schema", json.dumps(ANY_OBJECT if schema is None else schema, ensure_ascii=False))


def _structured_outputs(value: Any) -> Iterator[tuple[str, Constraint]]:
    if not isinstance(value, dict):
        raise ConstraintError("structured_outputs", f"`structured_outputs` must be an object, got {_type(value)}")
    for key, item in value.items():
        param = f"structured_outputs.{key}"
        if item is None:
            continue
        if key in STRUCTURED_OUTPUTS:
            yield param, STRUCTURED_OUTPUTS[key](item, param)
        elif key == "json_object" or key in STRUCTURED_OUTPUT_FLAGS:
            if not isinstance(item, bool):
                raise ConstraintError(param, f"`{param}` must be a boolean, got {_type(item)}")
            if key == "json_object" and item:
                yield param, Constraint("json_schema", json.dumps(ANY_OBJECT))
        else:
            raise ConstraintError(param, f"`{param}` is not supported (hkv reads json, regex, choice, grammar and "
                                         f"json_object)")


def after_reasoning(constraint: Constraint) -> Constraint:
    """`constraint` behind the reasoning a prompt opened: any text up to `</think>`, newlines, then the
    constrained answer, so that a reasoning parser finds the answer in the content."""
    if constraint.kind == "json_schema":
        answer = json_rule(json.loads(constraint.spec))
    elif constraint.kind == "regex":
        import llguidance

        answer = f"/{llguidance.regex_to_lark(constraint.spec, '')}/"
    else:
        answer = "%lark {\n" + constraint.spec + "\n}"
    return Constraint("lark", "\n".join(["start: reasoning NEWLINES? answer", f"answer: {answer}",
                                         *REASONING_RULES]) + "\n")
