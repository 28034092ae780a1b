"""Qwen3.5 text model (`qwen3_5_text`, and the composite `qwen3_5` checkpoint) in pure torch.

Hybrid decoder: most layers are Gated DeltaNet linear attention (state in a
StatePool slot), every few layers is gated full attention (K/V in a KVPool).
Numerics follow transformers' modeling_qwen3_5 (the reference):

- RMSNorm is Gemma-style, x * rsqrt(mean(x^2) + eps) * (1 + w), in fp32;
  the GDN output norm is a plain-weight gated RMSNorm (norm, then * silu(z)).
- Attention: q_proj yields query and an output gate per head; q/k RMSNorm per
  head; partial rotary (the first head_dim * partial_rotary_factor dims);
  output * sigmoid(gate). transformers' interleaved mrope gets three equal
  position rows for text, which reduces exactly to 1-D rope on `positions`.
- GDN: conv over q|k|v (silu), l2norm q/k, q scaled by Dk^-0.5,
  g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b).

State contract: a linear layer reads and overwrites
`state.conv/recurrent[state.layer_map[layer], batch.state_slots[b]]` for
every sequence b. A fresh sequence (kv_len == q_len) must arrive with a
zeroed slot: the caller zeroes it (StatePool.zero_slot), the model never does.
Prefill chunks (q_len > 1) take the chunked delta rule, decode (q_len == 1)
the recurrent one; a prompt split into chunks anywhere gives the unsplit
result up to float rounding.

Kernels: every op of the forward (norms with the residual add, attention prep
and paged attention with its gate, conv, gates + delta rule, gated norm,
SiLU-and-mul) goes through `hkv_kernels.dispatch` on raw tensors and the step's
KernelMeta: the pure-torch references (hkv_kernels/<op>/reference.py) for CPU
tensors, the Triton / fla-core kernels for CUDA ones (docs/kernels.md), with
projections of the same input fused into one GEMM on CUDA (FusedLinear). The
glue around them (which pool layer and slots a layer reads) lives here.

Names: T new tokens in the batch, S rows whose logits are returned, Hq / Hkv
attention heads, D head dim, rot rotary dims, C conv channels, Hk / Hv and
Dk / Dv linear-attention key / value heads and head dims.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
from torch import nn

from hkv.models import parallel
from hkv.models.batch import ForwardBatch
from hkv.models.moe import ExpertStacker
from hkv.models.qwen3 import Qwen3MLP as MLP  # the same SwiGLU MLP; qwen3_next imports it from here
from hkv.models.qwen3 import FusedLinear, Rotary, default_rope_theta, fuse_projections, load_params
from hkv.storage.kv_pool import KVLayout, KVPool
from hkv.storage.state_pool import StateLayout, StatePool
from hkv_kernels import dispatch

log = logging.getLogger("hkv.models")


def text_section(d: dict) -> tuple[dict, bool]:
    """The text config of an HF config.json and whether its word embeddings are tied.

    The composite `qwen3_5` keeps the text model under `text_config`; its tying
    flag is the top-level one (what transformers' ForConditionalGeneration reads).
    """
    if d.get("text_config") is not None:
        text = d["text_config"]
        return text, bool(d.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    return d, bool(d.get("tie_word_embeddings", False))


def layer_types_of(text: dict, num_layers: int) -> tuple[str, ...]:
    """`layer_types`, or transformers' fallback: every `full_attention_interval`-th layer is full attention."""
    if text.get("layer_types"):
        types = tuple(text["layer_types"])[:num_layers]
    else:
        interval = text.get("full_attention_interval", 4)
        types = tuple("linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers))
    if set(types) - {"linear_attention", "full_attention"} or len(types) != num_layers:
        raise ValueError(f"layer_types must name {num_layers} layers as linear/full_attention, got {types}")
    return types


@dataclass(frozen=True)
class Qwen3_5Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    attention_bias: bool
    tie_word_embeddings: bool
    linear_conv_kernel_dim: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    layer_types: tuple[str, ...]
    rope_theta: float
    partial_rotary_factor: float

    model_types: ClassVar[tuple[str, ...]] = ("qwen3_5_text", "qwen3_5")
    # transformers' Qwen3_5TextConfig defaults, for keys a config.json leaves out
    hf_defaults: ClassVar[dict[str, Any]] = dict(
        vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
        num_attention_heads=16, num_key_value_heads=4, head_dim=256, max_position_embeddings=32768,
        rms_norm_eps=1e-6, attention_bias=False, linear_conv_kernel_dim=4, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
    )

    @classmethod
    def from_hf(cls, d: dict) -> "Qwen3_5Config":
        """Parse an HF config.json dict; ValueError for variants this model does not run."""
        if d.get("model_type") not in cls.model_types:
            raise ValueError(f"{cls.__name__}.from_hf got model_type {d.get('model_type')!r}, "
                             f"expected one of {cls.model_types}")
        text, tied = text_section(d)
        if text.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {text['hidden_act']!r} is not supported (only silu)")
        num_layers = text.get("num_hidden_layers", cls.hf_defaults["num_hidden_layers"])
        rope = text.get("rope_parameters") or {}
        derived = dict(
            layer_types=layer_types_of(text, num_layers),
            rope_theta=default_rope_theta(text),
            # 0.25 is transformers' backward-compatible default for both hybrid families
            partial_rotary_factor=float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))),
            tie_word_embeddings=tied,
        )
        values = {}
        for f in fields(cls):
            if f.name in derived:
                values[f.name] = derived[f.name]
            elif text.get(f.name) is not None:
                # JSON lists become tuples so the frozen config stays hashable
                value = text[f.name]
                values[f.name] = tuple(value) if isinstance(value, list) else value
            else:
                values[f.name] = cls.hf_defaults[f.name]
        return cls(**values)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def conv_dim(self) -> int:
        """GDN conv channels: q and k (key heads), then v (value heads)."""
        key_dim = self.linear_num_key_heads * self.linear_key_head_dim
        return 2 * key_dim + self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


class RMSNorm(nn.Module):
    """Gemma-style RMSNorm: weight stored zero-centred and applied as (1 + w), all in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual add fused in (dispatch.rms_norm)."""
        return dispatch.rms_norm(x, self.weight, self.eps, plus_one=True, residual=residual)


class GatedRMSNorm(nn.Module):
    """The GDN output norm (transformers' Qwen3_5RMSNormGated): RMSNorm(x) * weight, then * silu(gate).

    The weight is plain (ones-initialised), not Gemma's 1 + w.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate: [T, H, D] -> [T, H, D] in x's dtype."""
        return dispatch.gated_rms_norm(x, gate, self.weight, self.eps)


class GatedAttention(nn.Module):
    """Full attention with per-head q/k RMSNorm, partial rope and a sigmoid output gate."""

    def __init__(self, cfg: Qwen3_5Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        # q_proj yields query and gate per head, [Hq, 2 * D] with the query first
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim * 2, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.scale = self.head_dim**-0.5
        self.qkv = FusedLinear((self.q_proj, self.k_proj, self.v_proj))

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch, kv: KVPool
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        query_gate, k, v = self.qkv(x)
        query, gate = query_gate.view(num_tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        s = kv.layer_map[self.layer_idx]
        q = dispatch.attention_prep(
            query, k.view(num_tokens, self.kv_heads, self.head_dim), v.view(num_tokens, self.kv_heads, self.head_dim),
            cos, sin, batch.positions, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, True,
            kv.k[s], kv.v[s], batch.slot_mapping, kv_scales=kv.scales(self.layer_idx),
        )  # [T, Hq, D], the new K/V written
        out = dispatch.paged_attention(
            q, kv.k[s], kv.v[s], batch.page_table, batch.meta, self.scale, gate=gate,
            kv_scales=kv.scales(self.layer_idx),
        )  # [T, Hq, D], already times sigmoid(gate)
        return self.o_proj(out.reshape(num_tokens, -1))


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet linear attention over a ragged batch, state carried in StatePool slots.

    The projection layout is Qwen3.5's (separate in_proj_qkv / z / b / a);
    other families override `make_projections` and `project`.
    """

    def __init__(self, cfg: Qwen3_5Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.k_heads, self.v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.k_dim, self.v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.k_heads * self.k_dim, self.v_heads * self.v_dim
        kernel = cfg.linear_conv_kernel_dim
        # a weight holder named like transformers' (conv1d.weight: [C, 1, K]); never called as a module
        self.conv1d = nn.Conv1d(cfg.conv_dim, cfg.conv_dim, kernel, groups=cfg.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.v_heads))
        self.norm = GatedRMSNorm(self.v_dim, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, cfg.hidden_size, bias=False)
        self.make_projections(cfg)

    def make_projections(self, cfg: Qwen3_5Config) -> None:
        self.in_proj_qkv = nn.Linear(cfg.hidden_size, cfg.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(cfg.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(cfg.hidden_size, self.v_heads, bias=False)
        self.in_proj_a = nn.Linear(cfg.hidden_size, self.v_heads, bias=False)
        self.in_proj = FusedLinear((self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a))

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> conv input q|k|v [T, C], z [T, Hv, Dv], b [T, Hv], a [T, Hv] (views of
        one GEMM's output on CUDA)."""
        qkv, z, b, a = self.in_proj(x)
        return qkv, z.view(x.shape[0], self.v_heads, self.v_dim), b, a

    def mix(
        self, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch: ForwardBatch, state: StatePool
    ) -> torch.Tensor:
        """Conv, split, gates and delta rule of every sequence, from and overwriting its state slot.

        qkv: [T, C] conv inputs q|k|v; a, b: [T, Hv] the gate projections. Reads and writes
        state.conv/recurrent[state.layer_map[layer], batch.state_slots[b]]; with in-chunk
        checkpoints (batch.checkpoints) it also writes the conv and recurrent states there.
        Returns core: [T, Hv, Dv] in qkv's dtype.
        """
        s = state.layer_map[self.layer_idx]
        slots, num_tokens, checkpoints = batch.state_slots, qkv.shape[0], batch.checkpoints
        if checkpoints is not None:  # from the conv inputs, before anything may reuse their memory
            dispatch.conv_checkpoints(qkv, state.conv[s], checkpoints)
        conv_out = dispatch.causal_conv1d(qkv, state.conv[s], self.conv1d.weight[:, 0], slots, batch.meta,
                                          keep_slots=batch.keep_slots)  # [T, C]
        q, k, v = torch.split(conv_out, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(num_tokens, self.k_heads, self.k_dim)  # [T, Hk, Dk]
        k = k.reshape(num_tokens, self.k_heads, self.k_dim)  # [T, Hk, Dk]
        v = v.reshape(num_tokens, self.v_heads, self.v_dim)  # [T, Hv, Dv]
        return dispatch.gated_delta_rule(
            q, k, v, a, b, (self.A_log, self.dt_bias), state.recurrent[s], slots, batch.meta,
            keep_slots=batch.keep_slots, checkpoints=checkpoints,
        )

    def forward(self, x: torch.Tensor, batch: ForwardBatch, state: StatePool) -> torch.Tensor:
        qkv, z, b, a = self.project(x)
        core = self.mix(qkv, a, b, batch, state)  # [T, Hv, Dv]
        core = self.norm(core, z)
        return self.out_proj(core.reshape(x.shape[0], -1))


class DecoderLayer(nn.Module):
    """Pre-norm block: token mixer (GDN or gated attention), then the MLP the family passes in."""

    def __init__(self, cfg: Qwen3_5Config, layer_idx: int, mlp: nn.Module, gdn_cls: type = GatedDeltaNet) -> None:
        super().__init__()
        self.is_linear = cfg.layer_types[layer_idx] == "linear_attention"
        if self.is_linear:
            self.linear_attn = gdn_cls(cfg, layer_idx)
        else:
            self.self_attn = GatedAttention(cfg, layer_idx)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
        batch: ForwardBatch, kv: KVPool, state: StatePool | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output ([T, hidden]; the embeddings for the first layer, with
        residual None); returns (this MLP's output, the residual stream before it)."""
        h, residual = self.input_layernorm(x, residual)
        if self.is_linear:
            h = self.linear_attn(h, batch, state)
        else:
            h = self.self_attn(h, cos, sin, batch, kv)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual  # [T, hidden] each


class HybridModel(nn.Module):
    """The decoder stack; named `model` inside the causal LM so parameter names equal HF's."""

    def __init__(self, cfg: Qwen3_5Config, layers: list[DecoderLayer]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class HybridForCausalLM(nn.Module):
    """The family interface shared by the hybrid models; subclasses pass in their layers."""

    config_class: ClassVar[type] = Qwen3_5Config

    def __init__(self, cfg: Qwen3_5Config, layers: list[DecoderLayer]) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = HybridModel(cfg, layers)
        # tied checkpoints reuse the embedding matrix as the output projection
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg.rotary_dim, cfg.rope_theta)
        self.rotary.max_positions = cfg.max_position_embeddings
        self.mtp = None  # the MTP drafter (hkv.models.mtp), built by enable_mtp before loading

    def mtp_mlp(self) -> nn.Module:
        """The MLP of the MTP layer (the family's dense one here)."""
        return MLP(self.cfg.hidden_size, self.cfg.intermediate_size)

    def enable_mtp(self) -> None:
        """Build the MTP module, so load_weights reads `mtp.*` instead of skipping it."""
        from hkv.models.mtp import MTPModule

        self.mtp = MTPModule(self.cfg, self.mtp_mlp())

    def forward(self, batch: ForwardBatch, kv: KVPool, state: StatePool | None = None,
                hidden_out: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """fp32 logits [S, vocab] of the rows batch.logits_indices; writes K/V pages and state slots.
        hidden_out: also return every token's final-norm hidden state [T, hidden] (the drafter's input)."""
        if self.cfg.linear_layers and (state is None or batch.state_slots is None):
            raise ValueError("a hybrid model needs a StatePool and batch.state_slots")
        x = self.model.embed_tokens(batch.input_ids)  # [T, hidden]
        cos, sin = self.rotary.for_batch(batch.positions, x.dtype)
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, cos, sin, batch, kv, state)
        # the final norm is per token, so only the rows we return need it
        rows = batch.logits_indices
        if hidden_out:
            hidden, _ = self.model.norm(x, residual)  # [T, hidden]
            return parallel.lm_logits(self, hidden[rows]), hidden
        h, _ = self.model.norm(x[rows], residual[rows])  # [S, hidden]
        return parallel.lm_logits(self, h)  # [S, vocab]

    @staticmethod
    def shard_rules(cfg: Qwen3_5Config) -> list:
        """Tensor parallelism: how each checkpoint tensor splits over the ranks (hkv/models/parallel.py)."""
        return (parallel.attention_rules(cfg) + parallel.gdn_rules(cfg, fused_projections=False)
                + parallel.mlp_rules() + parallel.vocab_rules())

    def prepare_for_device(self) -> None:
        """After loading, on CUDA: one GEMM per group of projections of the same input."""
        fuse_projections(self)

    @property
    def layer_map(self) -> dict[int, int]:
        """Model layer -> KV storage layer; only full-attention layers store K/V."""
        return {layer: i for i, layer in enumerate(self.cfg.full_layers)}

    def kv_layout(self, num_pages: int, page_size: int, dtype: str, device: str) -> KVLayout:
        cfg = self.cfg
        return KVLayout(
            num_layers=len(cfg.full_layers), num_pages=num_pages, page_size=page_size,
            kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, dtype=dtype, device=device,
        )

    def state_layout(self, num_slots: int, device: str = "cpu", *, dtype: str = "float32") -> StateLayout:
        """Layout of a StatePool for these linear layers; StatePool(layout).layer_map maps model layers.

        dtype is keyword-only: the dense family's state_layout takes (num_slots, dtype, device).
        """
        cfg = self.cfg
        return StateLayout(
            lin_layers=len(cfg.linear_layers), num_slots=num_slots, conv_dim=cfg.conv_dim,
            kernel_size=cfg.linear_conv_kernel_dim, v_heads=cfg.linear_num_value_heads,
            k_dim=cfg.linear_key_head_dim, v_dim=cfg.linear_value_head_dim,
            layer_ids=cfg.linear_layers, dtype=dtype, device=device,
        )

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in; raises WeightLoadError on missing, unexpected or mis-shaped ones.

        Accepts the text layout (`model.*`, `lm_head.*`) and the composite one
        (`model.language_model.*`). `mtp.*` (the MTP head) is read into `self.mtp` after
        enable_mtp and skipped otherwise; `model.visual.*` (the vision tower) is skipped; each
        skip logs one line.
        """
        skipped = {"model.visual.": 0} if self.mtp is not None else {"mtp.": 0, "model.visual.": 0}
        tied = self.cfg.tie_word_embeddings

        def skip(name: str) -> bool:
            # a tied checkpoint may still carry a copy of the embedding as lm_head
            return tied and name == "lm_head.weight"

        def renamed() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in named_tensors:
                prefix = next((p for p in skipped if name.startswith(p)), None)
                if prefix is not None:
                    skipped[prefix] += 1
                    continue
                if name.startswith("model.language_model."):
                    name = "model." + name.removeprefix("model.language_model.")
                yield name, tensor

        stacker = ExpertStacker(self)  # MoE families: per-expert tensors into the stacked experts
        load_params(self, stacker.absorb(renamed()), skip, stacker)
        if skipped.get("mtp."):
            log.info("ignoring %d MTP weights (mtp.*): speculative decoding is off", skipped["mtp."])
        if skipped["model.visual."]:
            log.info("ignoring %d vision weights (model.visual.*): hkv serves text only", skipped["model.visual."])


class Qwen3_5ForCausalLM(HybridForCausalLM):
    """Qwen3.5 hybrid text model; loads `qwen3_5_text` and composite `qwen3_5` checkpoints."""

    config_class = Qwen3_5Config

    def __init__(self, cfg: Qwen3_5Config) -> None:
        layers = [
            DecoderLayer(cfg, i, MLP(cfg.hidden_size, cfg.intermediate_size)) for i in range(cfg.num_hidden_layers)
        ]
        super().__init__(cfg, layers)
