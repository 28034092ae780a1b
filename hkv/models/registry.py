"""Which model class runs which HF checkpoint, keyed by config.json's model_type."""

from __future__ import annotations

import importlib

# HF model_type -> "module:Class"; families are imported only when a checkpoint asks for them
FAMILIES: dict[str, str] = {
    "qwen3": "hkv.models.qwen3:Qwen3ForCausalLM",
    "qwen3_5_text": "hkv.models.qwen3_5:Qwen3_5ForCausalLM",
    "qwen3_5": "hkv.models.qwen3_5:Qwen3_5ForCausalLM",
    "qwen3_next": "hkv.models.qwen3_next:Qwen3NextForCausalLM",
    "qwen3_5_moe_text": "hkv.models.qwen3_5_moe:Qwen3_5MoeForCausalLM",
    "qwen3_5_moe": "hkv.models.qwen3_5_moe:Qwen3_5MoeForCausalLM",
}


def resolve_family(hf_config: dict) -> type:
    """The model class for an HF config.json dict; ValueError naming the supported types otherwise."""
    model_type = hf_config.get("model_type")
    target = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if target is None:
        supported = ", ".join(sorted(FAMILIES))
        raise ValueError(f"unsupported model_type {model_type!r} in config.json; supported: {supported}")
    module_name, class_name = target.split(":")
    return getattr(importlib.import_module(module_name), class_name)
