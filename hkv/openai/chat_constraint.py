"""What a chat's rendered prompt adds to its constraint (protocol.py's second stage, before tokenization):
a forced tool call's grammar (hkv/openai/tool_grammar.py), or the request's structured output placed after
the reasoning the prompt opened, when a reasoning parser will split that reasoning out."""

from __future__ import annotations

import dataclasses

from hkv.ipc.messages import Constraint
from hkv.openai.chat_output import prompt_opens_reasoning
from hkv.openai.protocol import ChatRequest, Options, ProtocolError, not_too_deep
from hkv.openai.structured import ConstraintError, after_reasoning, check
from hkv.openai.tool_grammar import forced_call_grammar
from hkv.openai.tools import ToolError


@not_too_deep
def constrain_chat(req: ChatRequest, prompt: str, tool_parser: str | None, reasoning_parser: str | None) -> Options:
    """The request's options with the constraint its rendered `prompt` calls for; ProtocolError (400) for a
    forced call the server cannot read or a schema its format cannot carry."""
    opened = prompt_opens_reasoning(prompt)
    options = req.options
    try:
        if req.tools.choice == "required":
            if tool_parser is None:
                raise ProtocolError(400, "this server reads no tool calls from answers (--tool-call-parser)",
                                    "tool_choice")
            grammar = forced_call_grammar(req.tools, tool_parser, opened)
            return dataclasses.replace(options, constraint=check(Constraint("lark", grammar), "tools"))
        if options.constraint is not None and opened and reasoning_parser is not None:
            return dataclasses.replace(options, constraint=check(after_reasoning(options.constraint), None))
    except (ToolError, ConstraintError) as exc:
        raise ProtocolError(400, str(exc), exc.param) from None
    return options
