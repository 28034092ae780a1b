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
from hkv.openai.protocol import MAX_LOGPROBS, MAX_N, MAX_PROMPTS, MAX_STOPS, ROLES, ModelLimits

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
        "logit_bias": _nullable({"type": "object", "maxProperties": 0}),
        "presence_penalty": _nullable({"type": "number", "enum": [0]}),
        "frequency_penalty": _nullable({"type": "number", "enum": [0]}),
        "tools": _nullable({"type": "array", "maxItems": 0}),
        "response_format": _nullable({"type": "object", "required": ["type"],
                                      "properties": {"type": {"type": "string", "enum": ["text"]}}}),
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
    props = {**_sampling(limits), "prompt": prompt,
             "logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS}),
             "echo": _nullable({"type": "boolean", "enum": [False]}),
             "suffix": _nullable({"type": "string", "enum": [""]})}
    return {"type": "object", "required": ["prompt"], "properties": props}


def _chat_request(limits: ModelLimits) -> dict[str, Any]:
    part = {"type": "object", "required": ["type", "text"],
            "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}
    content = {"oneOf": [{"type": "string"}, {"type": "array", "items": part}]}
    message = {"oneOf": [
        {"type": "object", "required": ["role", "content"], "properties": {
            "role": {"type": "string", "enum": sorted(ROLES - {"assistant"})}, "content": content}},
        {"type": "object", "required": ["role"], "properties": {
            "role": {"type": "string", "enum": ["assistant"]},
            "content": _nullable({**content, "description": "null: a turn that only called tools"})}},
    ]}
    props = {**_sampling(limits), "messages": {"type": "array", "minItems": 1, "items": message},
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
            "object": {"type": "string"}, "data": {"type": "array", "items": {"type": "object"}}}},
        "Health": {"type": "object", "required": ["status"], "properties": {"status": {"type": "string"}}},
        "Ready": {"type": "object", "required": ["ready", "draining", "engine"], "properties": {
            "ready": {"type": "boolean"}, "draining": {"type": "boolean"},
            "engine": _nullable({"type": "object"})}},
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
