"""Chat answers with reasoning and tool calls, whole and streamed: Generation and ChatFormat fed a scripted
answer's tokens in deltas of every size, as the router would send them."""

from __future__ import annotations

import json
import random

import msgspec
import pytest

from hkv.ipc.messages import SamplingParams, TokenDelta
from hkv.openai.chat_output import ChatOutputParser
from hkv.openai.generation import Generation
from hkv.openai.protocol import SequencePlan
from hkv.openai.responses import ChatFormat
from tests.openai.tokenizer_fixture import tiny_tokenizer

SCHEMAS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}
ANSWER = ('<think>\nThe user wants the weather.\n</think>\n\nLet me look that up.\n<tool_call>\n{"name": '
          '"get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>')


def _generation(tok, parser, n: int = 1) -> Generation:
    plans = [SequencePlan(i, 0, SamplingParams(max_tokens=512)) for i in range(n)]
    return Generation(plans, list(range(n)), [[1, 2, 3]], tok, (), False, 0.0, parser)


def _deltas(ids: list[int], rng: random.Random, finish: str):
    cut = sorted({0, len(ids), *(rng.randrange(len(ids)) for _ in range(rng.randrange(1, 12)))})
    spans = list(zip(cut, cut[1:]))
    for i, (a, b) in enumerate(spans):
        yield TokenDelta(0, ids[a:b], None, None, finish if i == len(spans) - 1 else None, 3, 0)


def _stream(tok, ids, parser, seed, finish="stop"):
    """(the whole response body, the streamed chunks' choice 0 entries) for the same deltas."""
    rng = random.Random(seed)
    deltas = list(_deltas(ids, rng, finish))
    whole_gen, stream_gen = _generation(tok, parser), _generation(tok, parser)
    fmt = ChatFormat("m", tok, False, False)
    chunks = []
    for delta in deltas:
        whole_gen.apply(delta)
        update = stream_gen.apply(delta)
        frame = fmt.chunk(update)
        if frame:
            chunks.append(msgspec.json.decode(frame.removeprefix(b"data: "))["choices"][0])
    return msgspec.json.decode(fmt.response(whole_gen))["choices"][0], chunks


@pytest.mark.parametrize("seed", range(6))
def test_reasoning_content_and_a_call_whole_and_streamed(seed):
    tok = tiny_tokenizer()
    ids = tok.encode(ANSWER)
    assert tok.decode(ids) == ANSWER  # the tiny tokenizer spells every character
    factory = (lambda: ChatOutputParser("qwen3", False, "hermes", SCHEMAS))
    whole, chunks = _stream(tok, ids, factory, seed)
    message = whole["message"]
    assert whole["finish_reason"] == "tool_calls" and chunks[-1]["finish_reason"] == "tool_calls"
    assert message["reasoning_content"] == "The user wants the weather."
    assert message["content"] == "Let me look that up."
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}
    deltas = [c["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == message["content"]
    fragments = [t for d in deltas for t in d.get("tool_calls", [])]
    assert fragments[0]["function"]["name"] == "get_weather" and fragments[0]["type"] == "function"
    assert all(f["index"] == 0 for f in fragments) and all("id" not in f for f in fragments[1:])
    assert "".join(f["function"]["arguments"] for f in fragments) == call["function"]["arguments"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 2}


def test_a_cut_off_answer_keeps_its_finish_reason_and_plain_answers_stay_content():
    tok = tiny_tokenizer()
    factory = (lambda: ChatOutputParser(None, False, "hermes", SCHEMAS))
    whole, _ = _stream(tok, tok.encode('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"ci'), factory, 1,
                       finish="length")
    assert whole["finish_reason"] == "length" and whole["message"]["content"] == "Sure."
    assert whole["message"]["tool_calls"][0]["function"]["arguments"] == '{"ci'
    whole, chunks = _stream(tok, tok.encode("Just text, no calls."), factory, 2)
    assert whole["finish_reason"] == "stop" and whole["message"] == {"role": "assistant",
                                                                     "content": "Just text, no calls."}
    assert all("tool_calls" not in c["delta"] for c in chunks)
