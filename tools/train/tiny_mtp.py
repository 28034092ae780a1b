"""The built-in model's MTP module (one layer), in the layout of published Qwen3.5 / Qwen3-Next checkpoints.

Convention (vLLM's qwen3_next_mtp, DeepSeek-V3's MTP with depth 1): for every
position t of a sequence,

    h_t   = the target's last hidden state at t, AFTER its final norm (model.norm),
            i.e. what the lm_head reads; this is the hidden state vLLM hands its MTP drafter
    e     = pre_fc_norm_embedding(embed_tokens(token_{t+1}))
    x     = fc(cat([e, pre_fc_norm_hidden(h_t)]))              # fc: [hidden, 2 * hidden], embedding first
    x     = layers.0(x)  # a gated full-attention decoder layer over the MTP stream, rope position t
    logit = lm_head(norm(x))                                    # predicts token_{t+2}

The embedding and lm_head are the target's (tied here), so the file holds no
mtp.embed_tokens or mtp.lm_head. Tensor names, prefixed "mtp.": fc.weight,
pre_fc_norm_embedding.weight, pre_fc_norm_hidden.weight, norm.weight and
layers.0.{input_layernorm, post_attention_layernorm}.weight,
layers.0.self_attn.{q,k,v,o}_proj.weight, layers.0.self_attn.{q,k}_norm.weight,
layers.0.mlp.{gate,up,down}_proj.weight. Norms are the family's (1 + w) RMSNorm.
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

PREFIX = "mtp."


class MTPHead(nn.Module):
    """One MTP depth built from transformers' own Qwen3.5 decoder layer (full attention)."""

    def __init__(self, config) -> None:
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        layer_config = copy.deepcopy(config)
        layer_config.layer_types = ["full_attention"]
        layer_config.num_hidden_layers = 1
        # sdpa makes an unmasked call causal; eager would attend to later positions
        layer_config._attn_implementation = "sdpa"
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(hidden, eps=eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(hidden, eps=eps)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(layer_config, 0)])
        self.norm = Qwen3_5RMSNorm(hidden, eps=eps)
        self._init(config.initializer_range)

    def _init(self, std: float) -> None:
        # the target's init: projections N(0, std); the (1 + w) norms start at zero, as constructed
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=std)

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor,
                position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """hidden: [B, T, H] the target's final-norm hidden states at t; next_embeds: [B, T, H] the
        embeddings of token t+1. Returns the MTP hidden states [B, T, H] (after mtp.norm)."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        # no mask: transformers' sdpa path then runs causal attention over the T positions
        x = self.layers[0](x, position_embeddings=position_embeddings, attention_mask=None)
        return self.norm(x)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The module's weights under their checkpoint names (mtp.*)."""
        return {PREFIX + name: tensor for name, tensor in self.state_dict().items()}

    def load_checkpoint_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load the mtp.* tensors of a checkpoint; every one must be there and none extra."""
        own = {name.removeprefix(PREFIX): t for name, t in tensors.items() if name.startswith(PREFIX)}
        self.load_state_dict(own, strict=True)


def rope_positions(model, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of positions 0..T-1 for every row of `hidden` [B, T, H], from the target's rotary."""
    batch, length = hidden.shape[:2]
    # [3, B, T]: the multimodal-rotary layout every transformers 5.x version takes (5.17 needs it; later ones
    # expand a [B, T] to it themselves)
    positions = torch.arange(length, device=hidden.device).view(1, 1, length).expand(3, batch, length)
    return model.model.rotary_emb(hidden, positions)


class WindowOutput(NamedTuple):
    nll: torch.Tensor  # [B, T] fp32, -log p(token t+1) of the target
    mtp_nll: torch.Tensor  # [B, T] fp32, -log p(token t+2) of the MTP head
    hits: torch.Tensor  # [B, T] bool, the target's argmax is token t+1
    mtp_hits: torch.Tensor  # [B, T] bool, the MTP's argmax is token t+2


def window_forward(model, mtp: MTPHead, window: torch.Tensor) -> WindowOutput:
    """Per-token losses of the target and the MTP head over windows [B, T + 2] (teacher forced).

    The target reads window[:, :T] and predicts window[:, 1:T+1]; the MTP reads the
    target's hidden states and window[:, 1:T+1] and predicts window[:, 2:T+2].
    """
    length = window.shape[1] - 2
    inputs, next_tokens, after_next = window[:, :length], window[:, 1:length + 1], window[:, 2:]
    hidden = model.model(input_ids=inputs, use_cache=False).last_hidden_state  # [B, T, H], after model.norm
    logits = model.lm_head(hidden)  # [B, T, V]
    embeds = model.model.embed_tokens(next_tokens)  # [B, T, H]
    mtp_logits = model.lm_head(mtp(hidden, embeds, rope_positions(model, hidden)))  # [B, T, V]
    return WindowOutput(
        nll=_token_nll(logits, next_tokens),
        mtp_nll=_token_nll(mtp_logits, after_next),
        hits=logits.detach().argmax(-1) == next_tokens,
        mtp_hits=mtp_logits.detach().argmax(-1) == after_next,
    )


def _token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[B, T, V] logits, [B, T] targets -> [B, T] cross-entropy in fp32."""
    flat = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
    return flat.view(targets.shape)
