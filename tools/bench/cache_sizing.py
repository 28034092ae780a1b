"""Bytes per cached token and per checkpoint for a hybrid model, from its config.json.

Builds the model family on torch's meta device (no weights are allocated) and
asks it for the same KV and state layouts a rank allocates, so the figures are
the ones the server really uses.

    python -m tools.bench.cache_sizing                       # Qwen3.5-9B's published config
    python -m tools.bench.cache_sizing --config path/config.json [--kv-dtype bfloat16] [--budget-gib 8]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from hkv.models.loader import meta_model_of

# Qwen/Qwen3.5-9B config.json, text part (published on the model's card).
QWEN3_5_9B = {
    "model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"], "vocab_size": 248320,
    "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32, "num_attention_heads": 16,
    "num_key_value_heads": 4, "head_dim": 256, "full_attention_interval": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "linear_value_head_dim": 128, "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
}
QWEN3_5_9B["layer_types"] = QWEN3_5_9B["layer_types"] * 8


def sizing(hf_config: dict, kv_dtype: str = "bfloat16", state_dtype: str = "float32",
           page_size: int = 16, budget_gib: float = 8.0) -> dict:
    text_cfg = hf_config.get("text_config", hf_config)
    model = meta_model_of(hf_config)
    kv = model.kv_layout(1, page_size, kv_dtype, "meta")
    state = model.state_layout(1, device="meta", dtype=state_dtype)
    kv_per_token = kv.bytes_per_page() // page_size
    per_checkpoint = state.bytes_per_slot if state is not None else 0
    budget = int(budget_gib * 2**30)
    return {
        "model_type": text_cfg.get("model_type"),
        "full_attention_layers": kv.num_layers,
        "linear_attention_layers": state.lin_layers if state is not None else 0,
        "kv_dtype": kv_dtype,
        "state_dtype": state_dtype,
        "kv_bytes_per_token": kv_per_token,
        "checkpoint_bytes": per_checkpoint,
        "checkpoint_conv_bytes": (state.lin_layers * state.conv_dim * (state.kernel_size - 1)
                                  * torch.empty(0, dtype=state.torch_dtype).element_size()) if state else 0,
        "checkpoint_equals_kv_tokens": per_checkpoint / kv_per_token,
        "budget_gib": budget_gib,
        "checkpoints_in_budget": budget // per_checkpoint if per_checkpoint else None,
        "kv_tokens_in_budget": budget // kv_per_token,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="a config.json (default: Qwen3.5-9B's)")
    p.add_argument("--kv-dtype", default="bfloat16")
    p.add_argument("--state-dtype", default="float32")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--budget-gib", type=float, default=8.0)
    args = p.parse_args(argv)
    hf = json.loads(Path(args.config).read_text()) if args.config else QWEN3_5_9B
    print(json.dumps(sizing(hf, args.kv_dtype, args.state_dtype, args.page_size, args.budget_gib), indent=2))


if __name__ == "__main__":
    main()
