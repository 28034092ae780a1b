"""Qwen3.5-MoE (`qwen3_5_moe_text`, and the composite `qwen3_5_moe` checkpoint): the Qwen3.5 hybrid
stack with a sparse MoE block on every layer.

Per transformers' modeling_qwen3_5_moe: the GDN mixer, gated attention and norms are Qwen3.5's
(separate in_proj_qkv / z / b / a, hkv.models.qwen3_5); every decoder layer's MLP, the MTP layer's
included, is Qwen3-Next's sparse block (hkv.models.moe) with the top-k probabilities always
renormalised (the config has no norm_topk_prob, decoder_sparse_step or mlp_only_layers, and no
dense intermediate_size). The composite checkpoint keeps the text model under
`model.language_model.` and its config under `text_config`; the vision tower is skipped, as for
`qwen3_5`. Expert weights load from the published per-expert names or transformers 5's fused ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from torch import nn

from hkv.models.moe import moe_block
from hkv.models.qwen3_5 import DecoderLayer, HybridForCausalLM, Qwen3_5Config


@dataclass(frozen=True)
class Qwen3_5MoeConfig(Qwen3_5Config):
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    num_experts_per_tok: int
    num_experts: int

    model_types: ClassVar[tuple[str, ...]] = ("qwen3_5_moe_text", "qwen3_5_moe")
    # transformers' Qwen3_5MoeTextConfig defaults, for keys a config.json leaves out (no dense MLP:
    # intermediate_size is unused)
    hf_defaults: ClassVar[dict[str, Any]] = dict(
        vocab_size=248320, hidden_size=2048, intermediate_size=0, num_hidden_layers=40,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, max_position_embeddings=32768,
        rms_norm_eps=1e-6, attention_bias=False, linear_conv_kernel_dim=4, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
        moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts_per_tok=8, num_experts=256,
    )


class Qwen3_5MoeForCausalLM(HybridForCausalLM):
    """Qwen3.5 hybrid MoE model; loads `qwen3_5_moe_text` and composite `qwen3_5_moe` checkpoints."""

    config_class = Qwen3_5MoeConfig

    def __init__(self, cfg: Qwen3_5MoeConfig) -> None:
        layers = [DecoderLayer(cfg, i, moe_block(cfg, renormalize=True)) for i in range(cfg.num_hidden_layers)]
        super().__init__(cfg, layers)

    def mtp_mlp(self) -> nn.Module:
        """The MTP layer's MLP is a sparse block like every decoder layer's."""
        return moe_block(self.cfg, renormalize=True)
