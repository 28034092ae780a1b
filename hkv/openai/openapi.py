"""The OpenAPI 3.0 description served at GET /openapi.json: every route, body and status.

Built once at start from the config (which routes need which key) and the
model's limits (vocabulary, context). Request schemas say what the api
accepts (hkv/openai/protocol.py decides; a body the schema allows may still
be refused with 400, e.g. a prompt longer than the context). Every status a
route can answer is listed; tests/e2e/test_openapi.py runs schemathesis
against a live server to keep it that way.
"""

from __future__ import annotations

from typing import Any

from hkv.config import HkvConfig, KeyHash
from hkv.ipc.messages import MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_VALUE
from hkv.openai.protocol import MAX_LOGPROBS, MAX_N, MAX_PROMPTS, MAX_STOPS, ROLES, ModelLimits
from hkv.openai.structured import MAX_CHOICES, STRUCTURED_OUTPUT_FLAGS
from hkv.openai.tokenize_api import MAX_DETOKENIZE
from hkv.openai.tools import MAX_TOOLS

JSON = "application/json"
ERROR_STATUSES = {
    "400": "invalid input (OpenAI error JSON)",
    "401": "missing or wrong bearer key",
    "404": "unknown model",
    "408": "the request body did not arrive within --request-timeout",
    "413": "the body is larger than the limit",
    "429": "too many sequences in flight",
    "503": "not ready, draining, overloaded, or the engine failed",
}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "nullable": True}


def _error_responses(*codes: str) -> dict[str, Any]:
    return {c: {"description": ERROR_STATUSES[c], "content": {JSON: {"schema": _ref("Error")}}} for c in codes}


def _ok(description: str, schema: dict[str, Any], streams: bool = False) -> dict[str, Any]:
    content: dict[str, Any] = {JSON: {"schema": schema}}
    if streams:
        event = {"type": "object", "required": ["data"], "properties": {
            "data": {"type": "string", "description": "a chunk or an error object as JSON; `[DONE]` last"},
            "event": {"type": "string"}}}
        content["text/event-stream"] = {"schema": event}
    return {"200": {"description": description, "content": content}}


def _sampling(limits: ModelLimits) -> dict[str, Any]:
    """Fields both generation endpoints take (JSON null means absent)."""
    stop = {"oneOf": [{"type": "string", "minLength": 1},
                      {"type": "array", "maxItems": MAX_STOPS, "items": {"type": "string", "minLength": 1}}]}
    return {
        "model": _nullable({"type": "string", "description": f"`{limits.model_id}`"}),
        "max_tokens": _nullable({"type": "integer", "minimum": 1}),
        "temperature": _nullable({"type": "number", "minimum": 0, "maximum": 2}),
        "top_p": _nullable({"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 1}),
        "top_k": _nullable({"oneOf": [{"type": "integer", "enum": [-1]}, {"type": "integer", "minimum": 1}],
                            "description": "-1 or absent: every token"}),
        "seed": _nullable({"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1}),
        "stop": _nullable(stop),
        "n": _nullable({"type": "integer", "minimum": 1, "maximum": MAX_N}),
        "stream": _nullable({"type": "boolean"}),
        "stream_options": _nullable({"type": "object", "description": "only with `stream: true`",
                                     "properties": {"include_usage": _nullable({"type": "boolean"})}}),
        "return_token_ids": _nullable({"type": "boolean"}),
        "ignore_eos": _nullable({"type": "boolean"}),
        "best_of": _nullable({"type": "integer", "enum": [1]}),
        **_processing(limits),
        **_structured_output(),
    }


def _processing(limits: ModelLimits) -> dict[str, Any]:
    """The fields that change the logits before sampling (applied in the order docs/operations.md gives)."""
    bias = {"type": "number", "minimum": -MAX_LOGIT_BIAS_VALUE, "maximum": MAX_LOGIT_BIAS_VALUE}
    return {
        "min_p": _nullable({"type": "number", "minimum": 0, "maximum": 1, "description": "default 0"}),
        "presence_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2, "description": "default 0"}),
        "frequency_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2, "description": "default 0"}),
        "repetition_penalty": _nullable({"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 2,
                                         "description": "default 1"}),
        "logit_bias": _nullable({"type": "object", "maxProperties": MAX_LOGIT_BIAS, "additionalProperties": bias,
                                 "description": f"token id (decimal text, below {limits.vocab_size}) -> bias "
                                                "added to its logit"}),
    }


def _json_schema_value() -> dict[str, Any]:
    return {"oneOf": [{"type": "object"}, {"type": "string"}], "description": "a JSON schema, or JSON text of one"}


def _structured_output() -> dict[str, Any]:
    """response_format, structured_outputs and guided_* (hkv/openai/structured.py): at most one per request;
    a schema, regex or grammar that does not compile is a 400 with the compiler's message."""
    named = {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}, "description": _nullable({"type": "string"}),
        "schema": _nullable({"type": "object", "description": "absent: any JSON object"}),
        "strict": _nullable({"type": "boolean", "description": "the schema is enforced either way"})}}
    response_format = {"oneOf": [
        {"type": "object", "required": ["type"], "properties": {
            "type": {"type": "string", "enum": ["text", "json_object"]}}},
        {"type": "object", "required": ["type", "json_schema"], "properties": {
            "type": {"type": "string", "enum": ["json_schema"]}, "json_schema": named}}]}
    choice = {"type": "array", "minItems": 1, "maxItems": MAX_CHOICES, "items": {"type": "string"}}
    lark = {"type": "string", "description": "a grammar in llguidance's Lark dialect"}
    outputs = {"json": _nullable(_json_schema_value()), "regex": _nullable({"type": "string"}),
               "choice": _nullable(choice), "grammar": _nullable(lark), "json_object": _nullable({"type": "boolean"}),
               **{flag: _nullable({"type": "boolean"}) for flag in STRUCTURED_OUTPUT_FLAGS}}
    others = _nullable({"type": "string", "enum": [None]})  # keys hkv does not read must be null
    return {
        "response_format": _nullable(response_format),
        "structured_outputs": _nullable({"type": "object", "properties": outputs, "additionalProperties": others,
                                         "description": "vLLM's"}),
        "guided_json": _nullable(_json_schema_value()),
        "guided_regex": _nullable({"type": "string"}),
        "guided_grammar": _nullable(lark),
        "guided_choice": _nullable(choice),
        "guided_whitespace_pattern": _nullable({"type": "string", "enum": [None],
                                                "description": "refused: JSON answers are compact"}),
    }


def _completion_request(limits: ModelLimits) -> dict[str, Any]:
    token = {"type": "integer", "minimum": 0, "maximum": limits.vocab_size - 1}
    ids = {"type": "array", "minItems": 1, "items": token}
    prompt = {"oneOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS, "items": {"type": "string", "minLength": 1}},
        ids,
        {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS, "items": ids},
    ]}
    props = {**_sampling(limits), "prompt": prompt, "tools": _nullable({"type": "array", "maxItems": 0}),
             "logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS}),
             "echo": _nullable({"type": "boolean", "enum": [False]}),
             "suffix": _nullable({"type": "string", "enum": [""]})}
    return {"type": "object", "required": ["prompt"], "properties": props}


_NAME = {"type": "string", "pattern": "^[A-Za-z0-9_.\\-]{1,64}$"}


def _tool_fields() -> dict[str, Any]:
    """tools, tool_choice, parallel_tool_calls and chat_template_kwargs (hkv/openai/tools.py)."""
    function = {"type": "object", "required": ["name"], "properties": {
        "name": _NAME, "description": {"type": "string"}, "strict": {"type": "boolean"},
        "parameters": {"type": "object", "description": "a JSON schema of the arguments"}}}
    tool = {"type": "object", "required": ["type", "function"], "properties": {
        "type": {"type": "string", "enum": ["function"]}, "function": function}}
    return {
        "tools": _nullable({"type": "array", "maxItems": MAX_TOOLS, "items": tool}),
        "tool_choice": _nullable({"oneOf": [
            {"type": "string", "enum": ["auto", "none", "required"]},
            {"type": "object", "required": ["type", "function"], "properties": {
                "type": {"type": "string", "enum": ["function"]},
                "function": {"type": "object", "required": ["name"], "properties": {"name": _NAME}}}}],
            "description": "default auto with tools; \"required\" and a named function force calls (a grammar "
                           "in the server's tool-call format)"}),
        "parallel_tool_calls": _nullable({"type": "boolean"}),
        "chat_template_kwargs": _nullable({"type": "object", "description": "variables for the chat template, "
                                                                           "e.g. {\"enable_thinking\": false}"}),
    }


def _message() -> dict[str, Any]:
    part = {"type": "object", "required": ["type", "text"],
            "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}
    content = {"oneOf": [{"type": "string"}, {"type": "array", "items": part}]}
    call = {"type": "object", "required": ["type", "function"], "properties": {
        "id": _nullable({"type": "string"}), "type": {"type": "string", "enum": ["function"]},
        "function": {"type": "object", "required": ["name"], "properties": {
            "name": _NAME, "arguments": {"oneOf": [{"type": "string"}, {"type": "object"}],
                                         "description": "a JSON object, or JSON text of one"}}}}}
    return {"oneOf": [
        {"type": "object", "required": ["role", "content"], "properties": {
            "role": {"type": "string", "enum": sorted(ROLES - {"assistant", "tool"})}, "content": content}},
        {"type": "object", "required": ["role", "content"], "properties": {
            "role": {"type": "string", "enum": ["tool"]}, "content": content,
            "tool_call_id": _nullable({"type": "string"})}},
        {"type": "object", "required": ["role"], "properties": {
            "role": {"type": "string", "enum": ["assistant"]},
            "content": _nullable({**content, "description": "null: a turn that only called tools"}),
            "reasoning_content": _nullable({"type": "string"}),
            "tool_calls": _nullable({"type": "array", "maxItems": MAX_TOOLS, "items": call})}},
    ]}


def _chat_request(limits: ModelLimits) -> dict[str, Any]:
    props = {**_sampling(limits), **_tool_fields(), "messages": {"type": "array", "minItems": 1, "items": _message()},
             "max_completion_tokens": _nullable({"type": "integer", "minimum": 1}),
             "logprobs": _nullable({"type": "boolean"}),
             "top_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS,
                                        "description": "needs `logprobs: true`"})}
    return {"type": "object", "required": ["messages"], "properties": props}


def _schemas(limits: ModelLimits) -> dict[str, Any]:
    nullable_str = _nullable({"type": "string"})
    usage = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"], "properties": {
        k: {"type": "integer"} for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}
    generated = {"type": "object", "required": ["id", "object", "created", "model", "choices"], "properties": {
        "id": {"type": "string"}, "object": {"type": "string"}, "created": {"type": "integer"},
        "model": {"type": "string"}, "choices": {"type": "array", "items": {"type": "object"}}, "usage": usage}}
    return {
        "Error": {"type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["message", "type", "param", "code"],
            "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                           "param": nullable_str, "code": nullable_str}}}},
        "CompletionRequest": _completion_request(limits),
        "ChatCompletionRequest": _chat_request(limits),
        "Generation": generated,
        "ModelList": {"type": "object", "required": ["object", "data"], "properties": {
            "object": {"type": "string"}, "data": {"type": "array", "items": _ref("Model")}}},
        "Model": {"type": "object", "required": ["id", "object", "created", "owned_by", "max_model_len",
                                                 "vocab_size"], "properties": {
            "id": {"type": "string"}, "object": {"type": "string"}, "created": {"type": "integer"},
            "owned_by": {"type": "string"},
            "max_model_len": {"type": "integer", "description": "prompt plus completion tokens of one sequence"},
            "vocab_size": {"type": "integer", "description": "hkv's: token ids (logit_bias keys) lie below it"}}},
        "Health": {"type": "object", "required": ["status"], "properties": {"status": {"type": "string"}}},
        "Ready": {"type": "object", "required": ["ready", "draining", "engine"], "properties": {
            "ready": {"type": "boolean"}, "draining": {"type": "boolean"},
            "engine": _nullable({"type": "object"}),
            "starting": {"type": "boolean", "description": "the ranks are still starting"},
            "phase": _nullable({"type": "string", "description": "while starting: what they do, and how far"})}},
        "TokenizeRequest": {"oneOf": [
            {"type": "object", "required": ["prompt"], "properties": {
                "prompt": {"type": "string", "minLength": 1}, "add_special_tokens": _nullable({"type": "boolean"})}},
            {"type": "object", "required": ["messages"], "properties": {
                "messages": {"type": "array", "minItems": 1, "items": _message()},
                "add_special_tokens": _nullable({"type": "boolean"}),
                "add_generation_prompt": _nullable({"type": "boolean"}),
                **_tool_fields()}}]},
        "Tokens": {"type": "object", "required": ["tokens", "count", "max_model_len"], "properties": {
            "tokens": {"type": "array", "items": {"type": "integer"}}, "count": {"type": "integer"},
            "max_model_len": {"type": "integer"}}},
        "DetokenizeRequest": {"type": "object", "required": ["tokens"], "properties": {"tokens": {
            "type": "array", "maxItems": MAX_DETOKENIZE,
            "items": {"type": "integer", "minimum": 0, "maximum": limits.vocab_size - 1}}}},
        "Text": {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
        "CacheFlushed": {"type": "object", "required": ["flushed"], "properties": {
            k: {"type": "integer"} for k in ("pages", "checkpoints", "cpu_pages", "disk_files")} | {
            "flushed": {"type": "boolean"}}},
    }


def _security(key: KeyHash | None) -> list[dict[str, list]]:
    return [{"bearer": []}] if key is not None else []


def _probe(schema: str, down: str) -> dict[str, Any]:
    return {**_ok("up", _ref(schema)), "503": {"description": down, "content": {JSON: {"schema": _ref(schema)}}}}


def _generation_op(summary: str, schema: str, security: list) -> dict[str, Any]:
    body = {"required": True, "content": {JSON: {"schema": _ref(schema)}}}
    responses = {**_ok("the generation; an SSE stream with `stream: true`", _ref("Generation"), streams=True),
                 **_error_responses("400", "401", "404", "408", "413", "429", "503")}
    return {"post": {"summary": summary, "security": security, "requestBody": body, "responses": responses}}


def _get(summary: str, ok: dict[str, Any], *errors: str, security: list | None = None) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "responses": {**ok, **_error_responses(*errors)}}
    if security is not None:
        op["security"] = security
    return {"get": op}


def _post(summary: str, schema: str, ok: dict[str, Any], security: list) -> dict[str, Any]:
    body = {"required": True, "content": {JSON: {"schema": _ref(schema)}}}
    return {"post": {"summary": summary, "security": security, "requestBody": body,
                     "responses": {**ok, **_error_responses("400", "401", "404", "408", "413", "503")}}}


def openapi_document(cfg: HkvConfig, limits: ModelLimits) -> dict[str, Any]:
    """The description of this server's routes, as configured."""
    server = cfg.server
    api, admin, metrics = _security(server.api_key), _security(server.admin_key or server.api_key), _security(
        server.metrics_key)
    text = {"200": {"description": "Prometheus text", "content": {"text/plain": {"schema": {"type": "string"}}}}}
    paths = {
        "/v1/completions": _generation_op("Text completion (OpenAI)", "CompletionRequest", api),
        "/v1/chat/completions": _generation_op("Chat completion (OpenAI)", "ChatCompletionRequest", api),
        "/v1/models": _get("The served model", _ok("one model", _ref("ModelList")), "401", security=api),
        "/health": _get("Liveness: 503 once the engine is dead", _probe("Health", "the engine is dead")),
        "/ready": _get("Readiness: 503 when the engine cannot admit or makes no progress",
                       _probe("Ready", "not ready, draining, or no progress with work pending")),
        "/metrics": _get("Prometheus metrics (hkv_*)", text, *(("401",) if metrics else ()), security=metrics),
        "/openapi.json": _get("This description", _ok("OpenAPI 3.0", {"type": "object"})),
        "/pd/info": _get("Prefill/decode: this instance's mode and transporter address (docs/pd.md)",
                         _ok("mode and transporter", {"type": "object", "properties": {
                             "mode": {"type": "string", "enum": ["normal", "prefill", "decode", "pd-master"]},
                             "transporter": {"type": "string", "nullable": True}}})),
        "/tokenize": _post("Token ids of a prompt, or of a chat as its template renders it", "TokenizeRequest",
                           _ok("the ids", _ref("Tokens")), api),
        "/detokenize": _post("The text of token ids", "DetokenizeRequest", _ok("the text", _ref("Text")), api),
        "/cache/flush": {"post": {"summary": "Drop unreferenced cache entries on every tier (admin)",
                                  "security": admin,
                                  "responses": {**_ok("what was freed", _ref("CacheFlushed")),
                                                **_error_responses("401", "503")}}},
    }
    return {
        "openapi": "3.0.3",
        "info": {"title": "hkv", "version": "1", "description": f"OpenAI-compatible server of {limits.model_id}"},
        "paths": paths,
        "components": {"schemas": _schemas(limits),
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
