"""hkv/openai/openapi.py: the request schemas describe every field the protocol reads, with its range
(tests/e2e/test_openapi.py fuzzes a live server against the whole document)."""

from __future__ import annotations

from hkv.openai.openapi import openapi_document
from tests.actors.actor_config import make_cfg
from tests.openai.test_protocol import LIMITS

SAMPLING_FIELDS = {"min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                   "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_grammar",
                   "guided_choice", "guided_whitespace_pattern"}


def _schemas(tmp_path) -> dict:
    return openapi_document(make_cfg(str(tmp_path)), LIMITS)["components"]["schemas"]


def test_both_generation_bodies_describe_the_logits_and_structured_output_fields(tmp_path):
    schemas = _schemas(tmp_path)
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        assert SAMPLING_FIELDS <= set(schemas[name]["properties"]), name
    props = schemas["ChatCompletionRequest"]["properties"]
    assert props["repetition_penalty"] == {"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 2,
                                           "description": "default 1", "nullable": True}
    assert props["logit_bias"]["maxProperties"] == 300
    assert props["logit_bias"]["additionalProperties"] == {"type": "number", "minimum": -100.0, "maximum": 100.0}
    choices = props["tool_choice"]["oneOf"]
    assert choices[0]["enum"] == ["auto", "none", "required"] and choices[1]["required"] == ["type", "function"]


def test_the_model_card_names_its_limits(tmp_path):
    model = _schemas(tmp_path)["Model"]
    assert set(model["required"]) == {"id", "object", "created", "owned_by", "max_model_len", "vocab_size"}
