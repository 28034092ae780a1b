"""Qwen3-Next (`qwen3_next`): the Qwen3.5 hybrid stack with a fused GDN projection and MoE MLPs.

Shares gated attention, the GDN mixer, norms and the family interface with
hkv.models.qwen3_5; differs (per transformers' modeling_qwen3_next) in:

- GDN projections: in_proj_qkvz / in_proj_ba, grouped per key head
  ([Hk, Dk | Dk | r*Dv | r*Dv] and [Hk, r | r] with r = Hv / Hk), un-grouped
  here into q|k|v conv input, z, b, a;
- MLPs: a sparse MoE block (softmax router, top-k, optional renormalisation
  of the top-k probabilities, plus a shared expert scaled by sigmoid of its
  own gate) on layers with (layer + 1) % decoder_sparse_step == 0 and not in
  mlp_only_layers; a dense MLP elsewhere.

Expert weights keep the checkpoint's per-expert names
(`mlp.experts.{e}.{gate,up,down}_proj.weight`), so loading is by exact name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from hkv.models.qwen3_5 import MLP, DecoderLayer, GatedDeltaNet, HybridForCausalLM, Qwen3_5Config


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


class SparseMoeBlock(nn.Module):
    """Top-k routed experts plus a sigmoid-gated shared expert (reference path: a loop over experts)."""

    def __init__(self, cfg: Qwen3NextConfig) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(cfg.hidden_size, cfg.moe_intermediate_size) for _ in range(cfg.num_experts))
        self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> top-k weights [T, k] (x's dtype) and expert ids [T, k]."""
        logits = self.gate(x)  # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        out = torch.zeros_like(x)  # [T, hidden]
        # ascending expert order, like transformers, so per-token sums add up in the same order
        for expert in torch.unique(experts).tolist():
            tokens, rank = torch.where(experts == expert)
            h = self.experts[expert](x[tokens]) * weights[tokens, rank, None]
            out.index_add_(0, tokens, h.to(out.dtype))
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out + shared


class Qwen3NextForCausalLM(HybridForCausalLM):
    """Qwen3-Next hybrid MoE model (`qwen3_next` checkpoints)."""

    config_class = Qwen3NextConfig
    # the MoE reference loop reads the routing on the host (unique experts), so no CUDA graph
    graph_safe = False

    def mtp_mlp(self) -> nn.Module:
        """Qwen3-Next's MTP layer routes experts like its decoder layers (a dense MLP without experts)."""
        cfg = self.cfg
        return SparseMoeBlock(cfg) if cfg.num_experts > 0 else MLP(cfg.hidden_size, cfg.intermediate_size)

    def __init__(self, cfg: Qwen3NextConfig) -> None:
        layers = []
        for i in range(cfg.num_hidden_layers):
            mlp = SparseMoeBlock(cfg) if cfg.is_sparse(i) else MLP(cfg.hidden_size, cfg.intermediate_size)
            layers.append(DecoderLayer(cfg, i, mlp, gdn_cls=NextGatedDeltaNet))
        super().__init__(cfg, layers)
