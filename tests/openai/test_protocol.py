"""Request validation: typed, frozen requests out, ProtocolError (4xx) for every client mistake."""

from __future__ import annotations

import json
from dataclasses import FrozenInstanceError

import pytest

from hkv.ipc.messages import Constraint
from hkv.openai.protocol import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    ChatMessage,
    ModelLimits,
    ProtocolError,
    decode_body,
    parse_chat,
    parse_completion,
    plan_sequences,
    resolve_max_tokens,
)
from hkv.models.loader import describe_model
from tests.openai.malformed_cases import CHAT, COMPLETIONS, MALFORMED_CASES
from tests.openai.tokenizer_fixture import tiny_dense_folder, tiny_tokenizer

LIMITS = ModelLimits("tiny", frozenset({"/models/tiny"}), vocab_size=100, context_len=64, kv_capacity=48)
USER = [{"role": "user", "content": "hi"}]


def _err(fn, *args) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        fn(*args)
    return info.value


@pytest.mark.parametrize(
    "raw, fragment",
    [
        (b'{"prompt": "\xff"}', "UTF-8"),
        (b'{"prompt": "\\ud800"}', "JSON"),
        (b'{"t": NaN}', "JSON"),
        (b'{"t": 1e999}', "JSON"),
        (b"[1]", "object"),
        (b"", "JSON"),
    ],
)
def test_decode_body_refuses(raw, fragment):
    err = _err(decode_body, raw)
    assert err.status == 400 and fragment in err.message


def test_decode_body_accepts_surrogate_pairs():
    assert decode_body(b'{"prompt": "\\ud83d\\ude00"}') == {"prompt": "😀"}


def test_completion_defaults():
    req = parse_completion({"prompt": "hello", "unknown_field": {"x": 1}}, LIMITS)
    o = req.options
    assert req.prompts == ("hello",)
    assert (o.max_tokens, o.temperature, o.top_p, o.top_k, o.seed, o.n) == (None, 1.0, 1.0, None, None, 1)
    assert (o.stop, o.stream, o.include_usage, o.logprobs, o.return_token_ids, o.ignore_eos) == (
        (), False, False, None, False, False,
    )


def test_requests_are_frozen():
    req = parse_completion({"prompt": "hello"}, LIMITS)
    with pytest.raises(FrozenInstanceError):
        req.options.n = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    "prompt, expected",
    [
        ("abc", ("abc",)),
        (["a", "b"], ("a", "b")),
        ([1, 2, 3], ((1, 2, 3),)),
        ([[1], [2, 99]], ((1,), (2, 99))),
    ],
)
def test_prompt_shapes(prompt, expected):
    assert parse_completion({"prompt": prompt}, LIMITS).prompts == expected


def test_all_options_parsed():
    body = {
        "prompt": "x", "max_tokens": 7, "temperature": 0, "top_p": 0.5, "top_k": 5, "seed": -3,
        "stop": "END", "stream": True, "stream_options": {"include_usage": True}, "n": 3,
        "logprobs": 2, "return_token_ids": True, "ignore_eos": True, "model": "tiny", "echo": False,
    }
    o = parse_completion(body, LIMITS).options
    assert (o.max_tokens, o.temperature, o.top_p, o.top_k, o.seed, o.stop, o.n, o.logprobs) == (
        7, 0.0, 0.5, 5, -3, ("END",), 3, 2,
    )
    assert o.stream and o.include_usage and o.return_token_ids and o.ignore_eos


@pytest.mark.parametrize("top_k, expected", [(-1, None), (None, None), (1, 1), (99, 99), (100, None), (10**6, None)])
def test_top_k_off_values(top_k, expected):
    assert parse_completion({"prompt": "x", "top_k": top_k}, LIMITS).options.top_k == expected


def test_model_alias_and_unknown_model():
    assert parse_completion({"prompt": "x", "model": "/models/tiny"}, LIMITS)
    err = _err(parse_completion, {"prompt": "x", "model": "gpt-4"}, LIMITS)
    assert (err.status, err.code, err.param) == (404, "model_not_found", "model")


@pytest.mark.parametrize(
    "field, value, param",
    [
        ("max_tokens", True, "max_tokens"),
        ("n", 17, "n"),
        ("n", 1.0, "n"),
        ("temperature", False, "temperature"),
        ("top_p", 0.0, "top_p"),
        ("top_k", -2, "top_k"),
        ("top_k", 0, "top_k"),
        ("seed", 2**63, "seed"),
        ("logprobs", -1, "logprobs"),
        ("stop", ["ok", ""], "stop"),
        ("stop", {"a": 1}, "stop"),
        ("stream", 1, "stream"),
        ("ignore_eos", "true", "ignore_eos"),
        ("return_token_ids", 0, "return_token_ids"),
        ("echo", True, "echo"),
        ("best_of", 2, "best_of"),
        ("logit_bias", {"100": 1}, "logit_bias"),
        ("logit_bias", {"-1": 1}, "logit_bias"),
        ("logit_bias", {"05": 1}, "logit_bias"),
        ("logit_bias", {"a": 1}, "logit_bias"),
        ("logit_bias", {"5": 100.5}, "logit_bias"),
        ("logit_bias", {"5": True}, "logit_bias"),
        ("logit_bias", {"5": "1"}, "logit_bias"),
        ("logit_bias", [5], "logit_bias"),
        ("logit_bias", {str(i): 1 for i in range(301)}, "logit_bias"),
        ("presence_penalty", 2.5, "presence_penalty"),
        ("frequency_penalty", -2.01, "frequency_penalty"),
        ("frequency_penalty", "1", "frequency_penalty"),
        ("repetition_penalty", 0, "repetition_penalty"),
        ("repetition_penalty", 2.1, "repetition_penalty"),
        ("min_p", 1.5, "min_p"),
        ("min_p", -0.1, "min_p"),
        ("response_format", {"type": "xml"}, "response_format.type"),
        ("guided_regex", "a(", "guided_regex"),
        ("tools", [{"type": "function", "function": {"name": "f"}}], "tools"),
        ("tool_choice", "required", "tool_choice"),
        ("stream_options", [], "stream_options"),
    ],
)
def test_completion_field_errors_name_the_param(field, value, param):
    err = _err(parse_completion, {"prompt": "x", "stream": True, field: value}, LIMITS)
    assert (err.status, err.param, err.error_type) == (400, param, "invalid_request_error")


@pytest.mark.parametrize("prompt", [[0, 100], [-1], [[1], [100]], [1, None], [[1], "a"], ["a", ""]])
def test_bad_token_prompts(prompt):
    err = _err(parse_completion, {"prompt": prompt}, LIMITS)
    assert err.status == 400 and err.param == "prompt"


@pytest.mark.parametrize("prompt, pos", [([5, 6, None], 2), ([5, True], 1), ([5, 6.0, 7], 1)])
def test_a_token_that_is_not_an_integer_is_named_by_position(prompt, pos):
    err = _err(parse_completion, {"prompt": prompt}, LIMITS)
    assert (err.status, err.param) == (400, "prompt") and f"position {pos} is not an integer" in err.message


def test_out_of_vocab_message_names_position():
    err = _err(parse_completion, {"prompt": [5, 6, 100]}, LIMITS)
    assert "100" in err.message and "position 2" in err.message


def test_stop_strings_deduplicated():
    assert parse_completion({"prompt": "x", "stop": ["a", "a", "b"]}, LIMITS).options.stop == ("a", "b")


def test_too_many_sequences():
    err = _err(parse_completion, {"prompt": ["x"] * 16, "n": 16}, LIMITS)
    assert err.param == "n"


def test_chat_messages_and_parts():
    body = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None, "tool_calls": []},
            {"role": "tool", "content": "42", "tool_call_id": "x"},
        ],
        "max_completion_tokens": 5,
        "max_tokens": 9,
    }
    req = parse_chat(body, LIMITS)
    assert req.messages == (
        ChatMessage("system", "be brief"),
        ChatMessage("user", "a\nb"),
        ChatMessage("assistant", ""),
        ChatMessage("tool", "42", tool_call_id="x"),
    )
    assert req.options.max_tokens == 5  # max_completion_tokens wins


@pytest.mark.parametrize(
    "logprobs, top, expected", [(None, None, None), (False, None, None), (True, None, 0), (True, 3, 3)]
)
def test_chat_logprobs(logprobs, top, expected):
    body = {"messages": USER, "logprobs": logprobs, "top_logprobs": top}
    assert parse_chat(body, LIMITS).options.logprobs == expected


@pytest.mark.parametrize(
    "part, fragment",
    [
        ({"type": "image_url", "image_url": {"url": "x"}}, "images are not supported by this model"),
        ({"type": "input_audio", "input_audio": {}}, "audio is not supported by this model"),
        ({"type": "video"}, "text part"),
        ("just a string", "text part"),
        ({"type": {}, "text": ""}, "text part"),  # schemathesis found this one: it was a 500
    ],
)
def test_chat_non_text_parts(part, fragment):
    err = _err(parse_chat, {"messages": [{"role": "user", "content": [part]}]}, LIMITS)
    assert err.status == 400 and fragment in err.message and err.param == "messages[0].content[0]"


@pytest.mark.parametrize(
    "messages, param",
    [
        (None, "messages"),
        ([], "messages"),
        ("hi", "messages"),
        ([USER[0], 3], "messages[1]"),
        ([{"content": "x"}], "messages[0].role"),
        ([{"role": "root", "content": "x"}], "messages[0].role"),
        ([{"role": 1, "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": {"text": "x"}}], "messages[0].content"),
        ([{"role": "system"}], "messages[0].content"),
    ],
)
def test_chat_message_errors(messages, param):
    err = _err(parse_chat, {"messages": messages}, LIMITS)
    assert (err.status, err.param) == (400, param)


def test_default_max_tokens():
    assert resolve_max_tokens(10, None, LIMITS, COMPLETION_DEFAULT_MAX_TOKENS) == 16
    assert resolve_max_tokens(40, None, LIMITS, COMPLETION_DEFAULT_MAX_TOKENS) == 8  # capped by the KV room
    assert resolve_max_tokens(10, None, LIMITS, None) == 38  # chat: whatever fits


@pytest.mark.parametrize(
    "prompt_len, requested, fragment",
    [
        (0, None, "empty"),
        (64, None, "maximum context length is 64"),
        (48, None, "KV cache holds at most 48"),
        (10, 60, "you requested 70 tokens (10 in the prompt, 60 for the completion)"),
        (10, 40, "needs 50 tokens of KV cache"),
    ],
)
def test_token_count_refusals(prompt_len, requested, fragment):
    err = _err(resolve_max_tokens, prompt_len, requested, LIMITS, 16)
    assert err.status == 400 and fragment in err.message


def test_exact_fit_is_accepted():
    assert resolve_max_tokens(40, 8, LIMITS, 16) == 8


def test_plan_sequences_fans_out_with_seeds():
    req = parse_completion({"prompt": [[1, 2], [3]], "n": 2, "seed": 7, "max_tokens": 3, "temperature": 0.5}, LIMITS)
    plans = plan_sequences([2, 1], req.options, LIMITS, 16, base_seed=1000)
    assert [(p.choice, p.prompt_index, p.sampling.seed) for p in plans] == [(0, 0, 7), (1, 0, 8), (2, 1, 7), (3, 1, 8)]
    assert all(p.sampling.max_tokens == 3 and p.sampling.temperature == 0.5 for p in plans)


def test_penalties_min_p_and_logit_bias_are_parsed_and_planned():
    body = {"prompt": "x", "n": 2, "min_p": 0.1, "presence_penalty": -2, "frequency_penalty": 1.5,
            "repetition_penalty": 1.2, "logit_bias": {"0": -100, "99": 2.5, "7": 0}}
    o = parse_completion(body, LIMITS).options
    assert (o.min_p, o.presence_penalty, o.frequency_penalty, o.repetition_penalty) == (0.1, -2.0, 1.5, 1.2)
    assert o.logit_bias == {0: -100.0, 99: 2.5, 7: 0.0}
    for plan in plan_sequences([1], o, LIMITS, 16, base_seed=0):
        s = plan.sampling
        assert (s.min_p, s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.1, -2.0, 1.5, 1.2)
        assert s.logit_bias == {0: -100.0, 99: 2.5, 7: 0.0} and s.constraint is None


def test_processing_defaults_leave_the_logits_alone():
    chat = parse_chat({"messages": USER, "presence_penalty": None, "logit_bias": {}}, LIMITS).options
    (plan,) = plan_sequences([1], chat, LIMITS, None, base_seed=0)
    assert (chat.min_p, chat.presence_penalty, chat.frequency_penalty, chat.repetition_penalty) == (0, 0, 0, 1)
    assert not plan.sampling.processed


def test_structured_output_reaches_every_sequence():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    o = parse_chat({"messages": USER, "n": 3, "response_format": {
        "type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}}}, LIMITS).options
    plans = plan_sequences([1], o, LIMITS, None, base_seed=0)
    assert [p.sampling.constraint for p in plans] == [Constraint("json_schema", json.dumps(schema))] * 3


def test_structured_output_refuses_ignore_eos():
    err = _err(parse_completion, {"prompt": "x", "guided_regex": "[ab]+", "ignore_eos": True}, LIMITS)
    assert (err.status, err.param) == (400, "ignore_eos") and "only EOS" in err.message


def test_plan_sequences_draws_seed_and_wraps_negative():
    req = parse_completion({"prompt": "x", "n": 2}, LIMITS)
    assert [p.sampling.seed for p in plan_sequences([1], req.options, LIMITS, 16, base_seed=5)] == [5, 6]
    req = parse_completion({"prompt": "x", "n": 2, "seed": -1}, LIMITS)
    assert [p.sampling.seed for p in plan_sequences([1], req.options, LIMITS, 16, base_seed=5)] == [2**63 - 1, 0]


def test_limits_of_the_served_model(tmp_path):
    limits = ModelLimits.of("m", str(tmp_path), vocab_size=77, context_len=9, kv_capacity=100)
    assert (limits.vocab_size, limits.context_len, limits.max_seq_len) == (77, 9, 9)
    assert limits.accepts_model(str(tmp_path)) and limits.accepts_model("m") and not limits.accepts_model("x")
    assert ModelLimits.of("m", str(tmp_path), 5, context_len=1000, kv_capacity=100).max_seq_len == 100


def _validate_like_the_api(case, limits, tokenizer):
    """decode -> parse -> tokenize -> plan, as the api does before queueing."""
    body = decode_body(case.body_bytes())
    if case.path == COMPLETIONS:
        req = parse_completion(body, limits)
        prompts = [list(p) if isinstance(p, tuple) else tokenizer.encode(p) for p in req.prompts]
        plan_sequences([len(p) for p in prompts], req.options, limits, COMPLETION_DEFAULT_MAX_TOKENS, 0)
    else:
        req = parse_chat(body, limits)
        text = tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in req.messages])
        plan_sequences([len(tokenizer.encode(text))], req.options, limits, None, 0)


PROTOCOL_CASES = [
    c for c in MALFORMED_CASES if c.path in (COMPLETIONS, CHAT) and c.method == "POST" and c.status != 413
]


@pytest.mark.parametrize("case", PROTOCOL_CASES, ids=lambda c: c.name)
def test_malformed_cases_raise_protocol_errors(case):
    folder = tiny_dense_folder()
    spec = describe_model(folder)
    limits = ModelLimits.of("tiny-dense", str(folder), spec.vocab_size, spec.max_context, kv_capacity=4096)
    err = _err(_validate_like_the_api, case, limits, tiny_tokenizer())
    assert err.status == case.status
    assert err.message
