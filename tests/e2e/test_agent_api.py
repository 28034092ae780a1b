"""Issue 37 on live CPU servers, through the official `openai` client: tools rendered by real Qwen chat
templates (as transformers renders them), two-turn tool conversations in whole and streamed mode in both
tool-call formats, the reasoning parser and chat_template_kwargs, /tokenize and /detokenize, forced tool
calls, structured output and the logits-processing fields, and clear 400s naming the field for what is
malformed.

The models are the built-in tiny-dense checkpoint with a Qwen chat template written beside it: Qwen3's
(hermes calls, a prompt that opens no think block) or a Qwen3.5-style one (XML calls, a prompt that
opens one), and for JSON schemas the trained tiny-hybrid as well. Random weights call no tools and
write no tags by themselves, so the answers are steered: a forced call is a grammar (tool_choice
"required"), a scripted answer is a regex whose only match is the script, and a logit bias on a token
spelling `</think>` lets the random model close the think block a Qwen3.5 prompt opens. Tests named
test_*_constrained_* check what the engine's token masks make of sampled answers: calls that parse and
JSON that keeps to its schema. Those named *_with_qwen_tags_as_added_tokens serve a tokenizer that
carries the tags as added tokens that are not special, as Qwen's tokenizers do: the grammars must take
those tokens for the text they spell.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import urllib.request
from pathlib import Path

import jsonschema_rs
import openai
import pytest

from tests.e2e.harness import assert_clean, launch
from tests.openai.grammar_walk import conforms
from tests.openai.qwen_templates import QWEN3_5_CHAT_TEMPLATE, QWEN3_CHAT_TEMPLATE

pytestmark = pytest.mark.e2e
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
TURNS = [{"role": "system", "content": "You help."}, {"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": None, "tool_calls": [CALL]},
         {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
# values a random model ends in both formats: the XML format writes a free string as text up to
# `</parameter>`, which a random model never writes; an enum or a bounded integer ends
FORECAST = {"type": "function", "function": {
    "name": "get_forecast", "description": "The forecast of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
BOUNDED_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}
PARAMETERS = {"get_weather": BOUNDED_WEATHER["function"]["parameters"], "get_time": TIME["function"]["parameters"]}
# tool_choice, the functions its call may name
FORCED = [("required", {"get_weather", "get_time"}), ({"type": "function", "function": {"name": "get_time"}},
                                                      {"get_time"})]
ANSWER = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "size": {"enum": ["small", "large"]},
    "tags": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 3},
    "inner": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}},
    "required": ["name", "size", "tags", "inner"], "additionalProperties": False}
QWEN_TAGS = ("<tool_call>", "</tool_call>", "<think>", "</think>")  # added tokens of Qwen3's and Qwen3.5's tokenizers
THINK_BIAS = 5.0  # on the `</think>` token: a random model closes its reasoning within a few tokens


def _tiny_dense(builtin_dir: Path, folder: Path, template: str) -> Path:
    """A copy of the built-in tiny-dense checkpoint with `template` as its chat template."""
    from hkv.models.tiny import ensure_builtin

    shutil.copytree(ensure_builtin("tiny-dense", builtin_dir), folder)
    (folder / "chat_template.jinja").write_text(template, encoding="utf-8")
    return folder


def _grow_vocabulary(folder: Path, tokens: tuple[str, ...], added: bool) -> list[int]:
    """Give the checkpoint in `folder` new tokens, with embedding rows of their own, and return their ids.
    added: as added tokens that are no special tokens (how Qwen's tokenizers carry their tags), which the
    tokenizer splits out of text; else as BPE vocabulary entries no merge reaches: only the model writes
    them."""
    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    ids = list(range(config["vocab_size"], config["vocab_size"] + len(tokens)))
    if added:
        spec["added_tokens"] += [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                                  "normalized": False, "special": False} for i, t in zip(ids, tokens)]
    else:
        spec["model"]["vocab"].update(zip(tokens, ids))
    (folder / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    weights = load_file(folder / "model.safetensors")
    embed = weights["model.embed_tokens.weight"]  # tied: the output rows too
    rows = torch.randn(len(tokens), embed.shape[1], generator=torch.Generator().manual_seed(37)) * 0.02
    weights["model.embed_tokens.weight"] = torch.cat([embed, rows.to(embed.dtype)])
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    config["vocab_size"] = ids[-1] + 1
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return ids


def _serve(args: list[str], tmp_path_factory):
    """A module's server: launched, yielded, then stopped and checked clean."""
    server = launch(args, tmp_path_factory.mktemp("log"))
    pids = server.actor_pids()
    yield server
    assert server.stop(signal.SIGTERM) == 0, server.log()
    assert_clean(server, pids)


def _client(server) -> openai.OpenAI:
    """The openai client on the server, with the served model's id and the server's url."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    client.model_id = client.models.list().data[0].id
    client.server_url = server.url
    return client


@pytest.fixture(scope="module")
def qwen3_folder(builtin_dir, tmp_path_factory):
    return _tiny_dense(builtin_dir, tmp_path_factory.mktemp("qwen3_template") / "model", QWEN3_CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def server(qwen3_folder, tmp_path_factory):
    yield from _serve(["--model", str(qwen3_folder), "--reasoning-parser", "qwen3", "--grammar-threads", "2"],
                      tmp_path_factory)


@pytest.fixture(scope="module")
def client(server):
    return _client(server)


@pytest.fixture(scope="module")
def qwen3_5_folder(builtin_dir, tmp_path_factory):
    """tiny-dense with the Qwen3.5-style template, and `</think>` one token of its vocabulary, so that a
    logit bias lets the random model close the think block the prompt opens."""
    folder = _tiny_dense(builtin_dir, tmp_path_factory.mktemp("qwen3_5_template") / "model", QWEN3_5_CHAT_TEMPLATE)
    _grow_vocabulary(folder, ("</think>",), added=False)
    return folder


@pytest.fixture(scope="module")
def xml_server(qwen3_5_folder, tmp_path_factory):
    """No --tool-call-parser: the template's `<function=` picks qwen3_coder."""
    yield from _serve(["--model", str(qwen3_5_folder), "--reasoning-parser", "qwen3"], tmp_path_factory)


@pytest.fixture(scope="module")
def xml_client(xml_server, qwen3_5_folder):
    client = _client(xml_server)
    client.think_close = json.loads((qwen3_5_folder / "tokenizer.json").read_text())["model"]["vocab"]["</think>"]
    return client


@pytest.fixture(scope="module")
def trained_client(tmp_path_factory):
    """The trained built-in model, the server's default."""
    for server in _serve(["--model", "tiny-hybrid"], tmp_path_factory):
        yield _client(server)


@pytest.fixture(scope="module")
def tagged_client(builtin_dir, tmp_path_factory):
    """tiny-dense with Qwen3's template and Qwen's tags as added tokens, as Qwen3's tokenizer has them."""
    folder = _tiny_dense(builtin_dir, tmp_path_factory.mktemp("tagged") / "model", QWEN3_CHAT_TEMPLATE)
    _grow_vocabulary(folder, QWEN_TAGS, added=True)
    for server in _serve(["--model", str(folder), "--reasoning-parser", "qwen3"], tmp_path_factory):
        yield _client(server)


def _grammar_metrics(url: str) -> dict[str, float]:
    """The server's hkv_engine_grammar_* counters and hkv_engine_steps_total, from its /metrics text."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    return {m[1]: float(m[3]) for m in re.finditer(r"^(hkv_engine_(grammar_\w+|steps)_total) (\S+)$", text, re.M)}


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _rendered(url: str, body: dict) -> str:
    """The prompt text the server renders for a chat body (/tokenize, then /detokenize)."""
    status, got = _post(f"{url}/tokenize", body)
    assert status == 200, got
    status, text = _post(f"{url}/detokenize", {"tokens": got["tokens"]})
    assert status == 200, text
    return text["prompt"]


def _fields(choice) -> dict:
    """What a whole choice says: content, reasoning, calls (name, arguments) and finish reason."""
    message = choice.message
    return {"content": message.content or "", "reasoning": getattr(message, "reasoning_content", None) or "",
            "calls": [(c.function.name, c.function.arguments) for c in message.tool_calls or []],
            "finish": choice.finish_reason}


def _joined(chunks) -> tuple[dict, list]:
    """What the streamed chunks say, joined as `_fields` reads a whole choice; and the call fragments."""
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    fragments = [f for d in deltas for f in d.tool_calls or []]
    calls: dict[int, tuple[str, str]] = {}
    for f in fragments:
        name, arguments = calls.get(f.index, (f.function.name, ""))
        calls[f.index] = (name, arguments + (f.function.arguments or ""))
    (finish,) = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return {"content": "".join(d.content or "" for d in deltas),
            "reasoning": "".join(getattr(d, "reasoning_content", None) or "" for d in deltas),
            "calls": [calls[i] for i in sorted(calls)], "finish": finish}, fragments


def _whole_and_streamed(client, **asked):
    """The whole answer's choice, checked to say what the streamed answer to the same request says, and
    the streamed call fragments, checked to name each call (id, type, name) in its first fragment only."""
    whole = client.chat.completions.create(model=client.model_id, **asked).choices[0]
    streamed, fragments = _joined(list(client.chat.completions.create(model=client.model_id, **asked, stream=True)))
    assert streamed == _fields(whole), (streamed, whole)
    calls = whole.message.tool_calls or []
    assert all(c.id.startswith("call_") and c.type == "function" for c in calls)
    assert len({c.id for c in calls}) == len(calls)
    firsts = {}
    for f in fragments:
        if f.index in firsts:
            assert f.id is None and f.function.name is None, f
        else:
            firsts[f.index] = f
            assert f.id.startswith("call_") and f.type == "function" and f.function.name, f
    assert sorted(firsts) == list(range(len(calls))) and len({f.id for f in firsts.values()}) == len(calls)
    return whole, fragments


def _output_text(client, choice) -> str:
    """A choice's output as the model wrote it (its token ids, asked with `return_token_ids`), without the
    EOS token that ended it (no stop strings are asked for: an answer that did not run out ended so)."""
    ids = choice.token_ids if choice.finish_reason == "length" else choice.token_ids[:-1]
    status, text = _post(f"{client.server_url}/detokenize", {"tokens": ids})
    assert status == 200, text
    return text["prompt"]


def _hermes_call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def _xml_call(name: str, arguments: dict) -> str:
    params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                     for k, v in arguments.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def _with_object_arguments(messages: list[dict]) -> list[dict]:
    """The messages with tool-call arguments as objects, as transformers users pass them to Qwen3.5's
    template (it iterates them) and as hkv hands them to the template."""
    def call(c):
        return {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}

    return [{**m, "tool_calls": [call(c) for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]


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


# tool-call format -> its client's and folder's fixtures, turn 1's sampling and turn 2's template kwargs.
# Qwen3's prompt opens no think block: the forced call is greedy. The Qwen3.5-style prompt opens one,
# which the random model closes when `</think>` is favoured: the seeded sample reasons a few tokens, then
# calls; turn 2 closes the block in its prompt (enable_thinking false) so that the answer is content.
FORMATS = {
    "hermes": ("client", "qwen3_folder", lambda client: {"temperature": 0.0}, {}),
    "qwen3_coder": ("xml_client", "qwen3_5_folder",
                    lambda client: {"temperature": 1.0, "seed": 0, "logit_bias": {str(client.think_close): THINK_BIAS}},
                    {"enable_thinking": False}),
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_two_turn_tool_conversation_whole_and_streamed(request, fmt):
    from transformers import AutoTokenizer

    client_fixture, folder_fixture, sampling, kwargs = FORMATS[fmt]
    client = request.getfixturevalue(client_fixture)
    asked = [{"role": "user", "content": "Weather in Paris?"}]
    first, _ = _whole_and_streamed(client, messages=asked, tools=[FORECAST], tool_choice="required",
                                   parallel_tool_calls=False, max_tokens=160, extra_body={"return_token_ids": True},
                                   **sampling(client))
    (call,) = first.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert first.finish_reason == "tool_calls" and call.function.name == "get_forecast"
    assert first.message.content is None
    assert jsonschema_rs.validator_for(FORECAST["function"]["parameters"]).is_valid(arguments), arguments
    reasoning = getattr(first.message, "reasoning_content", None)
    written = _output_text(client, first)
    if fmt == "hermes":  # the answer is the call
        history = _hermes_call("get_forecast", call.function.arguments)
        assert reasoning is None and written == history
    else:  # the reasoning the prompt opened, closed, then the call
        written_call = _xml_call("get_forecast", arguments)
        assert reasoning and "</think>" not in reasoning
        assert re.fullmatch(rf"\n*{re.escape(reasoning)}\n*</think>\n*{re.escape(written_call)}", written), written
        history = "<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" + written_call  # as turn 2 renders it

    turns = [*asked, first.message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    want = AutoTokenizer.from_pretrained(request.getfixturevalue(folder_fixture)).apply_chat_template(
        _with_object_arguments(turns), tools=[FORECAST], add_generation_prompt=True, tokenize=False, **kwargs)
    rendered = _rendered(client.server_url, {"messages": turns, "tools": [FORECAST], "chat_template_kwargs": kwargs})
    assert rendered == want
    assert f"<|im_start|>assistant\n{history}<|im_end|>\n<|im_start|>user\n<tool_response>\nsunny, 21 C\n" \
           f"</tool_response><|im_end|>\n<|im_start|>assistant\n" in want
    answer, _ = _whole_and_streamed(client, messages=turns, tools=[FORECAST], max_tokens=12, temperature=0,
                                    extra_body={"chat_template_kwargs": kwargs})
    assert answer.finish_reason in ("stop", "length") and answer.message.content
    assert answer.message.tool_calls is None and getattr(answer.message, "reasoning_content", None) is None


def test_a_turn_whose_prompt_opens_a_think_block_answers_in_reasoning(xml_client):
    """No `</think>`: what the random model writes after the Qwen3.5-style prompt is all reasoning."""
    asked = [{"role": "user", "content": "Hi"}]
    assert _rendered(xml_client.server_url, {"messages": asked}).endswith("<|im_start|>assistant\n<think>\n")
    answer, _ = _whole_and_streamed(xml_client, messages=asked, max_tokens=8, temperature=0,
                                    extra_body={"return_token_ids": True})
    assert answer.finish_reason == "length" and answer.message.content == ""
    assert answer.message.reasoning_content == _output_text(xml_client, answer).lstrip("\n")


def test_reasoning_split_and_template_kwargs(server, client):
    messages = [{"role": "user", "content": "Hi"}]
    off = client.chat.completions.create(model=client.model_id, messages=messages, max_tokens=8, temperature=0,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    # the template closed an empty think block in the prompt: the random model's text is all content
    assert off.choices[0].message.content and getattr(off.choices[0].message, "reasoning_content", None) is None
    text = _rendered(server.url, {"messages": messages, "chat_template_kwargs": {"enable_thinking": False}})
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


SCRIPT = "<think>\nI should look up the weather.\n</think>\n\nLet me check."
SCRIPTED_CALLS = (SCRIPT + "\n" + _hermes_call("get_weather", '{"city": "Paris"}') + "\n"
                  + _hermes_call("get_time", "{}"))


@pytest.mark.parametrize("field", ["structured_outputs", "guided_regex"])
def test_a_scripted_answer_splits_into_reasoning_and_content(client, field):
    """The regex's only match is the script; Qwen3's prompt opens no think block, so the constraint is
    the request's as it is, and the answer opens its own block."""
    asked = [{"role": "user", "content": "Weather in Paris?"}]
    assert _rendered(client.server_url, {"messages": asked}).endswith("<|im_start|>assistant\n")
    regex = re.escape(SCRIPT)
    constraint = {"structured_outputs": {"regex": regex}} if field == "structured_outputs" else {"guided_regex": regex}
    # sampled: the script comes out in the tokens the model picks among those that spell it
    answer, _ = _whole_and_streamed(client, messages=asked, max_tokens=64, temperature=1.0, seed=1,
                                    extra_body={**constraint, "return_token_ids": True})
    assert _output_text(client, answer) == SCRIPT
    assert (answer.finish_reason, answer.message.reasoning_content, answer.message.content) == (
        "stop", "I should look up the weather.", "Let me check.")


def test_scripted_calls_after_reasoning_whole_and_streamed(client):
    asked = [{"role": "user", "content": "Weather and time in Paris?"}]
    answer, fragments = _whole_and_streamed(client, messages=asked, tools=[WEATHER, TIME], tool_choice="auto",
                                            max_tokens=256, temperature=1.0, seed=2,
                                            extra_body={"guided_regex": re.escape(SCRIPTED_CALLS)})
    assert _fields(answer) == {"content": "Let me check.", "reasoning": "I should look up the weather.",
                               "calls": [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")],
                               "finish": "tool_calls"}
    assert [(f.index, f.function.name) for f in fragments if f.id] == [(0, "get_weather"), (1, "get_time")]


def test_a_scripted_xml_call_after_the_reasoning_the_prompt_opened(xml_client):
    """The prompt opens a think block: the script's constraint starts after the (free) reasoning."""
    script = "Let me check.\n" + _xml_call("get_forecast", {"city": "Paris", "days": 2})
    answer, _ = _whole_and_streamed(xml_client, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                    tools=[FORECAST], max_tokens=160, temperature=1.0, seed=0,
                                    logit_bias={str(xml_client.think_close): THINK_BIAS},
                                    extra_body={"guided_regex": re.escape(script)})
    fields = _fields(answer)
    assert fields.pop("reasoning") and fields == {"content": "Let me check.", "finish": "tool_calls",
                                                  "calls": [("get_forecast", '{"city": "Paris", "days": 2}')]}


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
        choice, _ = _whole_and_streamed(client, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                        max_tokens=120, tools=[BOUNDED_WEATHER, TIME], tool_choice=tool_choice,
                                        temperature=1.0, seed=seed, parallel_tool_calls=False)
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
        call = choice.message.tool_calls[0]
        assert call.function.name in names
        schema = PARAMETERS[call.function.name]
        assert jsonschema_rs.validator_for(schema).is_valid(json.loads(call.function.arguments)), call


@pytest.mark.parametrize("model", ["random", "trained"])
def test_json_schema_constrained_50_of_50(request, model):
    """Until the engine applies constraints, the answers are no JSON and this fails; bounded strings,
    arrays and integers let every answer end within max_tokens."""
    client = request.getfixturevalue("client" if model == "random" else "trained_client")
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
    valid = jsonschema_rs.validator_for(ANSWER)
    choices = []
    before = _grammar_metrics(client.server_url)
    tokens = 0
    for seed in range(5):
        answer = client.chat.completions.create(
            model=client.model_id, messages=[{"role": "user", "content": "Describe a list as JSON."}], n=10,
            max_tokens=160, temperature=1.0, seed=seed, response_format=fmt)
        choices += answer.choices
        tokens += answer.usage.completion_tokens
    assert [c.finish_reason for c in choices] == ["stop"] * 50
    answers = [json.loads(c.message.content) for c in choices]
    assert all(valid.is_valid(a) and conforms(a, ANSWER) for a in answers), answers
    # the ranks counted the mask fills: every answer's tokens but the EOS after its grammar ended were live rows
    after = _grammar_metrics(client.server_url)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta["hkv_engine_grammar_steps_total"] > 0 and delta["hkv_engine_grammar_mask_seconds_total"] > 0, delta
    assert delta["hkv_engine_grammar_steps_total"] <= delta["hkv_engine_steps_total"], delta
    # each answer is more than 5 tokens of JSON; its last token (EOS, once the grammar is done) was no live row
    assert 50 * 5 <= delta["hkv_engine_grammar_rows_total"] <= tokens - 50, (delta, tokens)
    assert delta["hkv_engine_grammar_wait_seconds_total"] == 0.0, delta  # on CPU a step samples at once
    # the mask cache (on by default) keyed the states inside "name" (maxLength 8); 50 answers of one schema
    # meet the same states again, and a keyed fill is a hit or a miss, never more than the rows filled
    hits, misses = delta["hkv_engine_grammar_mask_cache_hits_total"], delta["hkv_engine_grammar_mask_cache_misses_total"]
    assert hits > 0 and misses > 0 and hits + misses <= delta["hkv_engine_grammar_rows_total"], delta


# Qwen3's and Qwen3.5's tokenizers carry their tags as added tokens that are no special tokens. llguidance
# (hkv/engine/grammar.py's LLTokenizer from tokenizer.json) takes every added token for a special one, yet
# where a grammar forces the tag's text it allows just that token, then refuses it on consume.
def _tag_ids(client) -> dict[str, int]:
    """The added tokens' ids (the tokens past the checkpoint's base vocabulary)."""
    status, got = _post(f"{client.base_url}".removesuffix("/v1/") + "/tokenize",
                        {"prompt": "".join(QWEN_TAGS), "add_special_tokens": False})
    assert status == 200 and got["count"] == len(QWEN_TAGS), got
    return dict(zip(QWEN_TAGS, got["tokens"]))


def test_a_forced_call_with_qwen_tags_as_added_tokens(tagged_client):
    """Qwen's tokenizers carry the tags as added tokens that are not special: a forced call writes them as those
    tokens (llguidance's own reader took every added token for a special one, and a forced call ended at its first
    tag)."""
    answer, _ = _whole_and_streamed(tagged_client, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                    tools=[FORECAST], tool_choice="required", parallel_tool_calls=False,
                                    max_tokens=80, temperature=0, extra_body={"return_token_ids": True})
    assert answer.finish_reason == "tool_calls" and answer.message.tool_calls[0].function.name == "get_forecast", answer
    tags = _tag_ids(tagged_client)
    ids = answer.model_extra["token_ids"]
    assert ids[0] == tags["<tool_call>"] and tags["</tool_call>"] in ids, ids


def test_a_scripted_answer_with_qwen_tags_as_added_tokens(tagged_client):
    answer, _ = _whole_and_streamed(tagged_client, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                    tools=[WEATHER, TIME], max_tokens=120, temperature=0,
                                    extra_body={"guided_regex": re.escape(SCRIPTED_CALLS), "return_token_ids": True})
    tags = _tag_ids(tagged_client)
    assert [t for t in answer.model_extra["token_ids"] if t in tags.values()] == [
        tags["<think>"], tags["</think>"], tags["<tool_call>"], tags["</tool_call>"], tags["<tool_call>"],
        tags["</tool_call>"]]
    assert _fields(answer) == {"content": "Let me check.", "reasoning": "I should look up the weather.",
                               "calls": [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")],
                               "finish": "tool_calls"}, answer
