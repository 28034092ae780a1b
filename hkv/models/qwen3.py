"""Qwen3 dense (model_type "qwen3", Qwen3ForCausalLM) in pure torch over paged KV.

Every model family exposes the same interface to the loader and the runner:

    Family.config_class.from_hf(hf_config_dict) -> frozen config with
        vocab_size, max_position_embeddings, ...
    Family(cfg)                                  parameters named as in the HF checkpoint
    .load_weights(named_tensors)                 copies HF-named tensors in; raises WeightLoadError
    .kv_layout(num_pages, page_size, dtype, device) -> KVLayout, and .layer_map (model -> storage layer)
    .state_layout(...)                           None for dense models
    .forward(batch, kv, state=None)              fp32 logits [S, vocab] for batch.logits_indices

Names: T new tokens in the batch, S tokens whose logits are returned, H hidden
size, Hq query heads, Hkv KV heads, D head dim.
The attention layers call `hkv_kernels.dispatch.paged_attention` on their
storage layer's K/V, which runs the pure-torch reference
(hkv_kernels/paged_attention/reference.py) for CPU tensors and the Triton
kernel for CUDA ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hkv.models import parallel
from hkv.models.batch import ForwardBatch
from hkv.storage.kv_pool import KVLayout, KVPool
from hkv_kernels import dispatch


class WeightLoadError(ValueError):
    """A checkpoint's tensors do not match the model's parameters (missing, unexpected or mis-shaped)."""


def default_rope_theta(d: dict) -> float:
    """rope_theta of a default (unscaled) rope; refuses every other rope type.

    Reads transformers 5's `rope_parameters` or the legacy `rope_scaling` / `rope_theta` keys.
    """
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"rope type {rope_type!r} is not supported (only the default rope is)")
    return float(params.get("rope_theta", d.get("rope_theta", 10000.0)))


@dataclass(frozen=True)
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    attention_bias: bool

    @classmethod
    def from_hf(cls, d: dict) -> "Qwen3Config":
        """Parse a Qwen3 config.json dict; raises ValueError for variants this model does not run."""
        if d.get("model_type", "qwen3") != "qwen3":
            raise ValueError(f"Qwen3Config.from_hf got model_type {d.get('model_type')!r}, expected 'qwen3'")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {d['hidden_act']!r} is not supported (only silu)")
        layer_types = d.get("layer_types") or []
        if d.get("use_sliding_window") or any(t != "full_attention" for t in layer_types):
            raise ValueError("sliding-window attention layers are not supported for qwen3")
        heads = d["num_attention_heads"]
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            max_position_embeddings=d["max_position_embeddings"],
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=default_rope_theta(d),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
        )


class RMSNorm(nn.Module):
    """Qwen3's RMSNorm: normalize in fp32, cast back, then scale by `weight` (initialized to ones)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual add fused in (dispatch.rms_norm)."""
        return dispatch.rms_norm(x, self.weight, self.eps, plus_one=False, residual=residual)


class Rotary:
    """Default rope: cos/sin for given positions (not a module, so it holds no weights).

    CPU forwards compute each step's cos/sin; CUDA ones index whole-context tables, built once
    with the same ops (so every value equals the per-step one), from inside the kernels.
    """

    def __init__(self, rot_dim: int, theta: float) -> None:
        self.rot_dim = rot_dim
        self.theta = theta
        # computed on the CPU (even under a meta-device context), like transformers, so every device agrees
        exponents = torch.arange(0, rot_dim, 2, dtype=torch.float, device="cpu") / rot_dim
        self.inv_freq = 1.0 / (theta**exponents)  # [D/2]
        self._per_device: dict[torch.device, torch.Tensor] = {}
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        self.max_positions: int = 0  # table length on CUDA; set by the family from its context length

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int64 -> cos, sin: [T, rot_dim] in `dtype`."""
        inv_freq = self._per_device.get(positions.device)
        if inv_freq is None:
            inv_freq = self._per_device.setdefault(positions.device, self.inv_freq.to(positions.device))
        freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def for_batch(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """What dispatch.attention_prep takes: per-token cos/sin [T, rot] on CPU, the
        [max_positions, rot] tables on CUDA (the kernel indexes them by position)."""
        if not positions.is_cuda:
            return self.cos_sin(positions, dtype)
        key = (positions.device, dtype)
        if key not in self._tables:
            all_positions = torch.arange(self.max_positions, device=positions.device)
            self._tables[key] = tuple(t.contiguous() for t in self.cos_sin(all_positions, dtype))
        return self._tables[key]


class Qwen3Attention(nn.Module):
    def __init__(self, cfg: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.scale = cfg.head_dim**-0.5
        q_dim, kv_dim = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q_dim, cfg.hidden_size, bias=cfg.attention_bias)
        # per-head norms over D, before rope
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qkv = FusedLinear((self.q_proj, self.k_proj, self.v_proj))

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch, kv: KVPool
    ) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv(x)
        s = kv.layer_map[self.layer_idx]
        q = dispatch.attention_prep(
            q.view(T, self.num_heads, self.head_dim), k.view(T, self.num_kv_heads, self.head_dim),
            v.view(T, self.num_kv_heads, self.head_dim), cos, sin, batch.positions, self.q_norm.weight,
            self.k_norm.weight, self.q_norm.eps, False, kv.k[s], kv.v[s], batch.slot_mapping,
            kv_scales=kv.scales(self.layer_idx),
        )  # [T, Hq, D], the new K/V written
        out = dispatch.paged_attention(q, kv.k[s], kv.v[s], batch.page_table, batch.meta, self.scale,
                                       kv_scales=kv.scales(self.layer_idx))  # [T, Hq, D]
        return self.o_proj(out.reshape(T, self.num_heads * self.head_dim))  # [T, H]


class FusedLinear(nn.Module):
    """Several projections of the same input: separate GEMMs, or on CUDA one GEMM per kind of part
    (model-dtype parts together, block-FP8 parts together) over their weights concatenated along
    the output dim (`fuse`), returning the parts' outputs (views) in the parts' order.

    The modules keep their parameters (checkpoint names and loading are unchanged): after
    `fuse`, each weight (bias, FP8 scales) is a view of the concatenated one, so memory is not doubled.
    FP8 parts fuse only when every part but the last has a multiple of 128 output rows, so each
    part's 128-row scale blocks stay whole in the concatenation; otherwise they run apart.
    CPU forwards never fuse, so their GEMMs and results stay exactly as transformers' are.
    """

    def __init__(self, parts: tuple[nn.Module, ...]) -> None:
        super().__init__()
        self.parts = parts  # a plain tuple: the parameters stay registered on their owners only
        self.groups: list[tuple[tuple[int, ...], _FusedWeights]] = []  # (part indices, their fused weights)
        self.splits: list[int] = [p.out_features for p in parts]

    def fuse(self) -> None:
        plain = tuple(i for i, p in enumerate(self.parts) if isinstance(p, nn.Linear))
        fp8 = tuple(i for i in range(len(self.parts)) if i not in plain)
        whole_blocks = all(self.splits[i] % 128 == 0 for i in fp8[:-1])
        groups = [plain] + ([fp8] if whole_blocks else [(i,) for i in fp8])
        with torch.no_grad():
            self.groups = [(g, _FusedWeights([self.parts[i] for i in g])) for g in groups if g]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if not self.groups:
            return tuple(p(x) for p in self.parts)
        outs: list[torch.Tensor | None] = [None] * len(self.parts)
        for indices, fused in self.groups:
            for i, y in zip(indices, fused(x).split([self.splits[i] for i in indices], dim=-1)):
                outs[i] = y
        return tuple(outs)


class _FusedWeights:
    """The concatenated weights (bias, FP8 block scales) of parts of one kind; the parts' parameters
    become views of them."""

    def __init__(self, parts: list[nn.Module]) -> None:
        self.fp8 = hasattr(parts[0], "weight_scale_inv")
        self.weight = torch.cat([p.weight for p in parts])  # [sum(out), in]
        self.scale = torch.cat([p.weight_scale_inv for p in parts]) if self.fp8 else None
        has_bias = [p.bias is not None for p in parts]
        self.bias = torch.cat([p.bias for p in parts]) if all(has_bias) else None
        splits = [p.out_features for p in parts]
        for part, w in zip(parts, self.weight.split(splits)):
            part.weight.data = w
        if self.fp8:
            for part, sc in zip(parts, self.scale.split([-(-n // 128) for n in splits])):
                part.weight_scale_inv.data = sc
        if self.bias is not None:
            for part, b in zip(parts, self.bias.split(splits)):
                part.bias.data = b

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8:
            return dispatch.fp8_linear(x, self.weight, self.scale, self.bias)
        return F.linear(x, self.weight, self.bias)


class Qwen3MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up = FusedLinear((self.gate_proj, self.up_proj))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(dispatch.silu_mul(*self.gate_up(x)))  # [T, H]


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(cfg, layer_idx)
        self.mlp = Qwen3MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
        batch: ForwardBatch, kv: KVPool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output ([T, H]; the embeddings for the first layer, with
        residual None); returns (this MLP's output, the residual stream before it)."""
        h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, cos, sin, batch, kv), residual)
        return self.mlp(h), residual  # [T, H] each


class Qwen3Model(nn.Module):
    """The decoder stack; named `model` inside the causal LM so parameter names equal HF's."""

    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def load_params(
    module: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]], skip: Callable[[str], bool],
    stacker=None,
) -> None:
    """Copy checkpoint tensors onto `module`'s parameters by exact name (cast to each parameter's dtype/device).

    Names for which `skip(name)` is true are ignored. stacker: an hkv.models.moe.ExpertStacker whose
    `absorb` the stream went through (its per-expert tensors fill stacked parameters). Raises
    WeightLoadError naming missing, unexpected, duplicated or mis-shaped tensors; every parameter
    must be loaded exactly once.
    """
    params = dict(module.named_parameters())
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in named_tensors:
        if skip(name):
            continue
        param = params.get(name)
        if param is None:
            unexpected.append(name)
            continue
        if name in loaded:
            raise WeightLoadError(f"weight {name} appears twice in the checkpoint")
        if tuple(tensor.shape) != tuple(param.shape):
            raise WeightLoadError(
                f"weight {name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(tensor)
        loaded.add(name)
    if stacker is not None:
        both = loaded & stacker.touched()
        if both:
            raise WeightLoadError(f"weight {sorted(both)[0]} comes both fused and as per-expert tensors")
        loaded |= stacker.complete()
    missing = sorted(set(params) - loaded)
    if stacker is not None:
        missing = stacker.describe_missing(missing)
    if missing or unexpected:
        raise WeightLoadError(
            f"checkpoint does not match the model: {len(missing)} missing {missing[:5]}, "
            f"{len(unexpected)} unexpected {sorted(unexpected)[:5]}"
        )


def fuse_projections(model: nn.Module) -> None:
    """Fuse every FusedLinear of a model on CUDA (CPU models keep separate GEMMs)."""
    if next(model.parameters()).device.type != "cuda":
        return
    for module in model.modules():
        if isinstance(module, FusedLinear):
            module.fuse()


class Qwen3ForCausalLM(nn.Module):
    config_class = Qwen3Config

    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Qwen3Model(cfg)
        # tied checkpoints reuse the embedding matrix as the output projection
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)
        self.rotary.max_positions = cfg.max_position_embeddings

    @property
    def layer_map(self) -> dict[int, int]:
        """Model layer -> KV storage layer: every Qwen3 layer is full attention."""
        return {i: i for i in range(self.cfg.num_hidden_layers)}

    def kv_layout(self, num_pages: int, page_size: int, dtype: str, device: str) -> KVLayout:
        cfg = self.cfg
        return KVLayout(
            num_layers=cfg.num_hidden_layers,
            num_pages=num_pages,
            page_size=page_size,
            kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            dtype=dtype,
            device=device,
            layer_ids=tuple(range(cfg.num_hidden_layers)),
        )

    def state_layout(self, num_slots: int = 0, device: str = "cpu", dtype: str = "float32") -> None:
        """Dense models keep no linear-attention state."""
        return None

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors (model.embed_tokens.weight, model.layers.N..., lm_head.weight) in."""
        tied = self.cfg.tie_word_embeddings

        def skip(name: str) -> bool:
            # rope tables are recomputed; a tied checkpoint may still carry a copy of the embedding
            return name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight")

        load_params(self, named_tensors, skip)

    def forward(self, batch: ForwardBatch, kv: KVPool, state: object = None) -> torch.Tensor:
        """fp32 logits [S, vocab] of the rows batch.logits_indices; writes the new tokens' K/V into `kv`."""
        x = self.model.embed_tokens(batch.input_ids)  # [T, H]
        cos, sin = self.rotary.for_batch(batch.positions, x.dtype)
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, cos, sin, batch, kv)
        # the final norm is per token, so only the rows we return need it
        rows = batch.logits_indices
        h, _ = self.model.norm(x[rows], residual[rows])  # [S, H]
        return parallel.lm_logits(self, h)  # [S, vocab]

    @staticmethod
    def shard_rules(cfg: Qwen3Config) -> list:
        """Tensor parallelism: how each checkpoint tensor splits over the ranks (hkv/models/parallel.py)."""
        return parallel.attention_rules(cfg) + parallel.mlp_rules() + parallel.vocab_rules()

    def prepare_for_device(self) -> None:
        """After loading, on CUDA: one GEMM per group of projections of the same input."""
        fuse_projections(self)
