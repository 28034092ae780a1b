"""Issue 37 on a live CPU server, through the official `openai` client: tools rendered by a real Qwen3 chat
template (as transformers renders them), a two-turn tool conversation in whole and streamed mode, the
reasoning parser and chat_template_kwargs, /tokenize and /detokenize, forced tool calls, structured
output and the logits-processing fields, and clear 400s naming the field for what is malformed.

The model is the built-in tiny-dense checkpoint with Qwen3's template written beside it: its random
weights call no tools, so what the answers mean (calls, reasoning) is proven on scripted answers in
tests/openai/test_chat_answers.py; here the whole path is served and its shapes checked. The tests named
test_*_constrained_* check what the engine's token masks make of a random model's answers: calls that
parse and JSON that keeps to its schema.
"""

from __future__ import annotations

import json
import shutil
import signal
import urllib.request

import openai
import pytest

from tests.e2e.harness import assert_clean, launch
from tests.openai.grammar_walk import conforms
from tests.openai.qwen_templates import QWEN3_CHAT_TEMPLATE

pytestmark = pytest.mark.e2e
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
TURNS = [{"role": "system", "content": "You help."}, {"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": None, "tool_calls": [CALL]},
         {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]


@pytest.fixture(scope="module")
def qwen3_folder(builtin_dir, tmp_path_factory):
    from hkv.models.tiny import ensure_builtin

    folder = tmp_path_factory.mktemp("qwen3_template") / "model"
    shutil.copytree(ensure_builtin("tiny-dense", builtin_dir), folder)
    (folder / "chat_template.jinja").write_text(QWEN3_CHAT_TEMPLATE, encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def server(qwen3_folder, tmp_path_factory):
    server = launch(["--model", str(qwen3_folder), "--reasoning-parser", "qwen3"], tmp_path_factory.mktemp("log"))
    pids = server.actor_pids()
    yield server
    assert server.stop(signal.SIGTERM) == 0, server.log()
    assert_clean(server, pids)


@pytest.fixture(scope="module")
def client(server):
    """The openai client on the server, with the served model's id."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    client.model_id = client.models.list().data[0].id
    return client


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_tools_and_a_tool_turn_render_as_transformers_renders_them(server, qwen3_folder):
    from transformers import AutoTokenizer

    want = AutoTokenizer.from_pretrained(qwen3_folder).apply_chat_template(
        TURNS, tools=[WEATHER], add_generation_prompt=True, tokenize=False)
    status, got = _post(f"{server.url}/tokenize", {"messages": TURNS, "tools": [WEATHER]})
    assert status == 200, got
    status, text = _post(f"{server.url}/detokenize", {"tokens": got["tokens"]})
    assert status == 200 and text["prompt"] == want
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in want
    assert '<tool_response>\nsunny, 21 C\n</tool_response>' in want
    assert got["count"] == len(got["tokens"]) and got["max_model_len"] > 0
    status, plain = _post(f"{server.url}/tokenize", {"prompt": "Hello there", "add_special_tokens": False})
    assert status == 200 and _post(f"{server.url}/detokenize", {"tokens": plain["tokens"]})[1]["prompt"] == "Hello there"


def test_a_two_turn_tool_conversation_whole_and_streamed(client):
    asked = [{"role": "user", "content": "Weather in Paris?"}]
    first = client.chat.completions.create(model=client.model_id, messages=asked, tools=[WEATHER], max_tokens=12, temperature=0)
    assert first.choices[0].finish_reason in ("stop", "length", "tool_calls")
    answer = client.chat.completions.create(model=client.model_id, messages=TURNS, tools=[WEATHER], max_tokens=12,
                                            temperature=0)
    streamed = list(client.chat.completions.create(model=client.model_id, messages=TURNS, tools=[WEATHER], max_tokens=12,
                                                   temperature=0, stream=True))
    whole = answer.choices[0].message
    deltas = [c.choices[0].delta for c in streamed if c.choices]
    assert "".join(d.content or "" for d in deltas) == (whole.content or "")
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == (
        getattr(whole, "reasoning_content", None) or "")
    assert answer.usage.completion_tokens == 12 and streamed[-1].choices[0].finish_reason == answer.choices[0].finish_reason


def test_reasoning_split_and_template_kwargs(server, client):
    messages = [{"role": "user", "content": "Hi"}]
    off = client.chat.completions.create(model=client.model_id, messages=messages, max_tokens=8, temperature=0,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    # the template closed an empty think block in the prompt: the random model's text is all content
    assert off.choices[0].message.content and getattr(off.choices[0].message, "reasoning_content", None) is None
    status, rendered = _post(f"{server.url}/tokenize", {"messages": messages, "chat_template_kwargs": {
        "enable_thinking": False}})
    text = _post(f"{server.url}/detokenize", {"tokens": rendered["tokens"]})[1]["prompt"]
    assert status == 200 and text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER]},
     "tool_choice.function.name"),
    ({"tool_choice": "required", "tools": [WEATHER], "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0].function.name"),
    ({"chat_template_kwargs": {"messages": 1}}, "chat_template_kwargs"),
    ({"guided_regex": "a("}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name"),
    ({"structured_outputs": {"json": {"type": "foo"}}}, "structured_outputs.json"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 2}, "min_p"),
])
def test_bad_agent_and_sampling_fields_are_400(server, client, body, param):
    status, error = _post(f"{server.url}/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                                 "max_tokens": 2, **body})
    assert status == 400 and error["error"]["param"] == param, error
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=client.model_id, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       extra_body=body)


def test_tools_on_a_model_whose_template_teaches_no_format_are_refused(tmp_path):
    server = launch(["--model", "tiny-dense"], tmp_path)
    pids = server.actor_pids()
    try:
        status, error = _post(f"{server.url}/v1/chat/completions", {
            "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER], "max_tokens": 2})
        assert status == 400 and "--tool-call-parser" in error["error"]["message"]
        status, models = 0, json.loads(urllib.request.urlopen(f"{server.url}/v1/models", timeout=10).read())
        assert models["data"][0]["max_model_len"] > 0 and models["data"][0]["vocab_size"] > 0
        status, error = _post(f"{server.url}/v1/chat/completions", {
            "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER], "tool_choice": "required"})
        assert status == 400 and "--tool-call-parser" in error["error"]["message"]
    finally:
        assert server.stop(signal.SIGTERM) == 0, server.log()
    assert_clean(server, pids)


BOUNDED_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ANSWER = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "size": {"enum": ["small", "large"]},
    "tags": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 3},
    "inner": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}},
    "required": ["name", "size", "tags", "inner"], "additionalProperties": False}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}
PARAMETERS = {"get_weather": BOUNDED_WEATHER["function"]["parameters"], "get_time": TIME["function"]["parameters"]}
# tool_choice, the functions its call may name
FORCED = [("required", {"get_weather", "get_time"}), ({"type": "function", "function": {"name": "get_time"}},
                                                      {"get_time"})]


@pytest.mark.parametrize("tool_choice", [choice for choice, _ in FORCED])
def test_forced_calls_are_served_whole_and_streamed(client, tool_choice):
    asked = dict(model=client.model_id, messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=40,
                 tools=[BOUNDED_WEATHER, TIME], tool_choice=tool_choice, temperature=1.0, seed=5)
    whole = client.chat.completions.create(**asked)
    chunks = list(client.chat.completions.create(**asked, stream=True))
    assert whole.choices[0].finish_reason in ("tool_calls", "length", "stop")
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


@pytest.mark.parametrize("extra", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}},
    {"response_format": {"type": "json_object"}},
    {"structured_outputs": {"regex": "[ab]{1,5}"}},
    {"guided_choice": ["yes", "no"]},
    {"min_p": 0.1, "repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": -0.5,
     "logit_bias": {"5": -100, "7": 3}},
], ids=lambda e: next(iter(e)))
def test_structured_output_and_logits_fields_are_served(client, extra):
    answer = client.chat.completions.create(model=client.model_id, messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=24, temperature=1.0, seed=3, extra_body=extra)
    completion = client.completions.create(model=client.model_id, prompt="Hi", max_tokens=8, seed=3,
                                           extra_body=extra)
    assert answer.choices[0].finish_reason in ("stop", "length") and completion.choices[0].finish_reason in (
        "stop", "length")


@pytest.mark.parametrize("tool_choice, names", FORCED)
def test_forced_calls_constrained_parse_on_a_random_model(client, tool_choice, names):
    """Until the engine applies constraints, a random model's answer is no call and this fails."""
    for seed in range(4):
        asked = dict(model=client.model_id, messages=[{"role": "user", "content": "Weather in Paris?"}],
                     max_tokens=120, tools=[BOUNDED_WEATHER, TIME], tool_choice=tool_choice, temperature=1.0,
                     seed=seed, parallel_tool_calls=False)
        whole = client.chat.completions.create(**asked)
        chunks = list(client.chat.completions.create(**asked, stream=True))
        choice = whole.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
        call = choice.message.tool_calls[0]
        assert call.function.name in names
        assert conforms(json.loads(call.function.arguments), PARAMETERS[call.function.name]), call
        streamed = "".join(tc.function.arguments or "" for c in chunks if c.choices
                           for tc in (c.choices[0].delta.tool_calls or []))
        assert streamed == call.function.arguments


def test_json_schema_constrained_50_of_50_on_a_random_model(client):
    """Until the engine applies constraints, a random model's answers are no JSON and this fails."""
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
    answers = []
    for seed in range(5):
        reply = client.chat.completions.create(model=client.model_id, messages=[{"role": "user", "content": "Go"}],
                                               n=10, max_tokens=160, temperature=1.0, seed=seed, response_format=fmt)
        answers += [c.message.content for c in reply.choices if c.finish_reason == "stop"]
    assert len(answers) == 50 and all(conforms(json.loads(a), ANSWER) for a in answers), answers
