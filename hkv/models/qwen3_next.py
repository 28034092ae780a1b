"""Qwen3-Next (`qwen3_next`): the Qwen3.5 hybrid stack with a fused GDN projection and MoE MLPs.

Shares gated attention, the GDN mixer, norms and the family interface with
hkv.models.qwen3_5; differs (per transformers' modeling_qwen3_next) in:

- GDN projections: in_proj_qkvz / in_proj_ba, grouped per key head
  ([Hk, Dk | Dk | r*Dv | r*Dv] and [Hk, r | r] with r = Hv / Hk), un-grouped
  here into q|k|v conv input, z, b, a;
- MLPs: a sparse MoE block (hkv.models.moe: softmax router, top-k, optional
  renormalisation of the top-k probabilities, plus a shared expert scaled by
  sigmoid of its own gate) on layers with (layer + 1) % decoder_sparse_step == 0
  and not in mlp_only_layers; a dense MLP elsewhere.

Expert weights are stacked per layer ([E, 2I, H] and [E, H, I]); the published
per-expert names (`mlp.experts.{e}.{gate,up,down}_proj.weight`) and
transformers 5's fused ones (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`)
both load. Routing and experts run on the device, so the model is graph-safe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from hkv.models import parallel
from hkv.models.moe import SparseMoeBlock, moe_block
from hkv.models.qwen3_5 import MLP, DecoderLayer, GatedDeltaNet, HybridForCausalLM, Qwen3_5Config

__all__ = ["NextGatedDeltaNet", "Qwen3NextConfig", "Qwen3NextForCausalLM", "SparseMoeBlock"]


@dataclass(frozen=True)
class Qwen3NextConfig(Qwen3_5Config):
    decoder_sparse_step: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    num_experts_per_tok: int
    num_experts: int
    norm_topk_prob: bool
    mlp_only_layers: tuple[int, ...]

    model_types: ClassVar[tuple[str, ...]] = ("qwen3_next",)
    # transformers' Qwen3NextConfig defaults, for keys a config.json leaves out
    hf_defaults: ClassVar[dict[str, Any]] = dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=48,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, max_position_embeddings=32768,
        rms_norm_eps=1e-6, attention_bias=False, linear_conv_kernel_dim=4, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
        decoder_sparse_step=1, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        num_experts_per_tok=10, num_experts=512, norm_topk_prob=True, mlp_only_layers=(),
    )

    def is_sparse(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` uses the MoE block (transformers' rule)."""
        return (
            layer_idx not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )


class NextGatedDeltaNet(GatedDeltaNet):
    """GDN with Qwen3-Next's fused, per-key-head grouped input projections."""

    def make_projections(self, cfg: Qwen3_5Config) -> None:
        self.in_proj_qkvz = nn.Linear(cfg.hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(cfg.hidden_size, 2 * self.v_heads, bias=False)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> conv input q|k|v [T, C], z [T, Hv, Dv], b [T, Hv], a [T, Hv]."""
        num_tokens = x.shape[0]
        ratio = self.v_heads // self.k_heads  # value heads per key head
        group = ratio * self.v_dim
        qkvz = self.in_proj_qkvz(x).view(num_tokens, self.k_heads, 2 * self.k_dim + 2 * group)
        q, k, v, z = torch.split(qkvz, [self.k_dim, self.k_dim, group, group], dim=-1)  # [T, Hk, *]
        b, a = torch.split(self.in_proj_ba(x).view(num_tokens, self.k_heads, 2 * ratio), [ratio, ratio], dim=-1)
        qkv = torch.cat([t.reshape(num_tokens, -1) for t in (q, k, v)], dim=-1)  # [T, C]
        z = z.reshape(num_tokens, self.v_heads, self.v_dim)
        return qkv, z, b.reshape(num_tokens, self.v_heads), a.reshape(num_tokens, self.v_heads)


class Qwen3NextForCausalLM(HybridForCausalLM):
    """Qwen3-Next hybrid MoE model (`qwen3_next` checkpoints)."""

    config_class = Qwen3NextConfig

    @staticmethod
    def shard_rules(cfg: Qwen3NextConfig) -> list:
        """Tensor parallelism: Qwen3.5's rules with the fused, per-key-head grouped GDN projections."""
        return (parallel.attention_rules(cfg) + parallel.gdn_rules(cfg, fused_projections=True)
                + parallel.mlp_rules() + parallel.vocab_rules())

    def mtp_mlp(self) -> nn.Module:
        """Qwen3-Next's MTP layer routes experts like its decoder layers (a dense MLP without experts)."""
        cfg = self.cfg
        return moe_block(cfg, cfg.norm_topk_prob) if cfg.num_experts > 0 else MLP(cfg.hidden_size,
                                                                                   cfg.intermediate_size)

    def __init__(self, cfg: Qwen3NextConfig) -> None:
        layers = []
        for i in range(cfg.num_hidden_layers):
            if cfg.is_sparse(i):
                mlp = moe_block(cfg, cfg.norm_topk_prob)
            else:
                mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
            layers.append(DecoderLayer(cfg, i, mlp, gdn_cls=NextGatedDeltaNet))
        super().__init__(cfg, layers)
