"""Tensor parallelism for the model families: shard plans, the sharded config, and the layers that
talk across ranks (torch.distributed: NCCL on CUDA, gloo on CPU; no collective of our own).

A rank of a `--tp N` instance builds its family from `shard_config(cfg, N)` (the per-rank head and
width counts), so every module, KV pool and state pool has the rank's shapes with no change to the
family code; the loader reads only the rank's slices of each checkpoint tensor (`ShardPlan.read`,
safetensors `get_slice`: no rank holds a full copy); `apply_tp` then swaps in the vocab-parallel
embedding and output head and registers the all-reduce after every row-parallel output.

    column-parallel (split the output rows)       row-parallel (split the input columns) + all-reduce
    attention q / k / v (by head)                 attention o_proj
    GDN in_proj_qkv|z|b|a, in_proj_qkvz|ba,       GDN out_proj
      conv1d channels, dt_bias, A_log (by head)
    MLP / shared expert gate, up                  MLP / shared expert down
    MoE experts gate|up (intermediate dim)        MoE experts down (intermediate dim)
    embedding, LM head: vocab rows (padded to N equal parts; the logits are all-gathered)

The all-reduces sit at a layer's mixer output (o_proj / out_proj) and its whole MLP or MoE block
output (the experts' and the shared expert's partial sums add up to the block's). KV heads are
replicated when N exceeds them (rank r keeps KV head r * Hkv // N, the one its query heads use).
The router's replicated and the shared expert's gate are replicated, so every rank routes alike;
expert parallelism would split `experts.*` along dim 0 instead (a rule change here).

Every rank gathers the full logits, so every rank samples the same tokens from the same numbers
(seeded sampling is unchanged by N); rank 0 reports them.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class TPConfigError(ValueError):
    """--tp N does not divide the model's heads or widths."""


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in its tensor-parallel group (torch.distributed, already initialized)."""

    rank: int
    size: int
    group: object = None  # a torch.distributed ProcessGroup; None: the default group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns it."""
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """[S, n] per rank -> [S, N * n], rank r's columns at r * n."""
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


def join_group(rank: int, size: int, device: str, store_path: str, timeout_s: float = 600.0) -> TPGroup:
    """Join the instance's tensor-parallel group: NCCL on CUDA (rank r on GPU r), gloo on CPU; the
    rendezvous is a file store in the instance's private run directory (no port to pick or guard)."""
    import datetime

    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{store_path}",
                            rank=rank, world_size=size, timeout=datetime.timedelta(seconds=timeout_s))
    return TPGroup(rank, size)


def leave_group() -> None:
    """Tear the group down at the rank's exit (nothing when none was joined)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


# per-rank counts: config field -> how it divides (KV heads may instead be replicated)
_DIVIDED = ("num_attention_heads", "intermediate_size", "linear_num_key_heads", "linear_num_value_heads",
            "moe_intermediate_size", "shared_expert_intermediate_size")
_LABELS = {"num_attention_heads": "attention heads", "num_key_value_heads": "KV heads",
           "intermediate_size": "MLP width (intermediate_size)", "linear_num_key_heads": "GDN key heads",
           "linear_num_value_heads": "GDN value heads", "moe_intermediate_size": "expert width",
           "shared_expert_intermediate_size": "shared expert width"}


def shard_config(cfg, tp: int):
    """The family config one rank of `tp` builds: heads and widths divided by tp, KV heads divided or
    (tp a multiple of them) one per rank. Raises TPConfigError naming what tp does not divide."""
    if tp == 1:
        return cfg
    changes = {}
    for name in _DIVIDED:
        value = getattr(cfg, name, None)
        if value is None:
            continue
        if value % tp:
            raise TPConfigError(f"--tp {tp} does not divide the model's {value} {_LABELS[name]}")
        changes[name] = value // tp
    kv = cfg.num_key_value_heads
    if kv % tp and tp % kv:
        raise TPConfigError(f"--tp {tp} neither divides the model's {kv} KV heads nor is a multiple of them")
    changes["num_key_value_heads"] = max(1, kv // tp)
    return dataclasses.replace(cfg, **changes)


@dataclass(frozen=True)
class Split:
    """How one checkpoint tensor splits over the ranks, along `dim`.

    kind: "even" (N equal parts), "segments" (each of `sizes` along dim split evenly, the rank's parts
    concatenated: q|k|v of a GDN), "halves" (two equal segments: stacked experts' gate|up), "heads" (`heads` heads of equal rows; replicated when N exceeds
    them), "vocab" (N parts of ceil(V / N) rows, the last padded with zeros), "first" (rank 0 keeps
    the whole tensor, the others zeros: a row-parallel bias is added once).
    """

    kind: str
    dim: int = 0
    sizes: tuple[int, ...] = ()
    heads: int = 0

    def ranges(self, length: int, rank: int, tp: int) -> list[tuple[int, int]]:
        """The [start, stop) ranges along `dim` that rank `rank` of `tp` reads, in order."""
        if self.kind == "vocab":
            per = -(-length // tp)
            return [(min(length, rank * per), min(length, (rank + 1) * per))]
        if self.kind == "heads":
            if length % self.heads:
                raise TPConfigError(f"{length} rows are not {self.heads} heads")
            rows = length // self.heads
            first, count = rank * self.heads // tp, max(1, self.heads // tp)
            return [(first * rows, (first + count) * rows)]
        sizes = {"segments": self.sizes, "halves": (length // 2, length - length // 2)}.get(self.kind, (length,))
        if sum(sizes) != length or any(s % tp for s in sizes):
            raise TPConfigError(f"cannot split {length} along dim {self.dim} into {tp} parts of {sizes}")
        out, offset = [], 0
        for size in sizes:
            part = size // tp
            out.append((offset + rank * part, offset + (rank + 1) * part))
            offset += size
        return out

    def padded_length(self, length: int, tp: int) -> int:
        return -(-length // tp) if self.kind == "vocab" else 0


class ShardPlan:
    """A family's rules: (name regex, Split), the first match wins; a name no rule matches is
    replicated. `read` returns rank `rank`'s part of a tensor from an open safetensors file."""

    def __init__(self, rules: list[tuple[str, Split]], rank: int, tp: int) -> None:
        self.rules = [(re.compile(pattern), split) for pattern, split in rules]
        self.rank, self.tp = rank, tp

    def split_for(self, name: str) -> Split | None:
        if self.tp == 1:
            return None
        return next((split for pattern, split in self.rules if pattern.search(name)), None)

    def read(self, f, name: str) -> torch.Tensor:
        """The rank's slice of tensor `name` of safe_open file `f`, reading only those bytes."""
        split = self.split_for(name)
        if split is None:
            return f.get_tensor(name)
        view = f.get_slice(name)
        shape = list(view.get_shape())
        dim = split.dim % len(shape)
        if split.kind == "first":
            return view[:] if self.rank == 0 else torch.zeros(shape, dtype=view[0:0].dtype)
        lead = (slice(None),) * dim
        parts = [view[lead + (slice(a, b),)] for a, b in split.ranges(shape[dim], self.rank, self.tp)]
        tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
        pad = split.padded_length(shape[dim], self.tp) - tensor.shape[dim]
        if pad > 0:
            widths = [0, 0] * (len(shape) - 1 - dim) + [0, pad]
            tensor = F.pad(tensor, widths)
        return tensor


def attention_rules(cfg) -> list[tuple[str, Split]]:
    """Full attention (Qwen3's and the gated one, whose q_proj rows are [query | gate] per head)."""
    return [
        (r"self_attn\.q_proj\.(weight|bias)$", Split("heads", heads=cfg.num_attention_heads)),
        (r"self_attn\.[kv]_proj\.(weight|bias)$", Split("heads", heads=cfg.num_key_value_heads)),
        (r"self_attn\.o_proj\.weight$", Split("even", dim=1)),
        (r"self_attn\.o_proj\.bias$", Split("first")),
    ]


def mlp_rules() -> list[tuple[str, Split]]:
    """SwiGLU MLPs: the dense one, the shared expert, per-expert tensors and the stacked experts."""
    return [
        (r"\.(gate|up)_proj\.weight$", Split("even", dim=0)),
        (r"\.down_proj\.weight$", Split("even", dim=1)),
        (r"experts\.gate_up_proj$", Split("halves", dim=1)),
        (r"experts\.down_proj$", Split("even", dim=2)),
    ]


def gdn_rules(cfg, fused_projections: bool) -> list[tuple[str, Split]]:
    """Gated DeltaNet: conv channels q|k|v by head; projections by head (Qwen3-Next's in_proj_qkvz and
    in_proj_ba are grouped per key head, so an even split of their rows is one by key head)."""
    key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    value_dim = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    qkv = Split("segments", dim=0, sizes=(key_dim, key_dim, value_dim))
    names = r"(in_proj_qkvz|in_proj_ba)" if fused_projections else r"(in_proj_z|in_proj_b|in_proj_a)"
    return [
        (r"linear_attn\.conv1d\.weight$", qkv),
        (r"linear_attn\.in_proj_qkv\.weight$", qkv),
        (rf"linear_attn\.{names}\.weight$", Split("even", dim=0)),
        (r"linear_attn\.(dt_bias|A_log)$", Split("even", dim=0)),
        (r"linear_attn\.out_proj\.weight$", Split("even", dim=1)),
    ]


def vocab_rules() -> list[tuple[str, Split]]:
    return [(r"(embed_tokens|lm_head)\.weight$", Split("vocab", dim=0))]


# modules whose output is a partial sum on each rank (row-parallel): all-reduced by a forward hook
_REDUCED = re.compile(r"(^|\.)(self_attn\.o_proj|linear_attn\.out_proj|layers\.\d+\.mlp)$")


class VocabParallelEmbedding(nn.Embedding):
    """Rank r's rows [r * n, (r + 1) * n) of the embedding (n = ceil(V / N)); ids outside give zeros,
    and the all-reduce adds the one rank's row to N - 1 exact zeros (bit-equal to a full lookup)."""

    def __init__(self, rows: int, dim: int, tp: TPGroup) -> None:
        super().__init__(rows, dim)
        self.tp, self.start = tp, tp.rank * rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.num_embeddings)
        out = F.embedding(torch.where(inside, local, torch.zeros_like(local)), self.weight)  # [T, H]
        return self.tp.all_reduce(out * inside[:, None].to(out.dtype))


def apply_tp(model: nn.Module, tp: TPGroup, vocab_size: int) -> None:
    """On a family built from shard_config (on the meta device, before its weights are allocated):
    swap in the vocab-parallel embedding and output head, all-reduce every row-parallel output."""
    model.tp = tp
    rows = -(-vocab_size // tp.size)
    hidden = model.model.embed_tokens.embedding_dim
    model.model.embed_tokens = VocabParallelEmbedding(rows, hidden, tp)
    if model.lm_head is not None:
        model.lm_head = nn.Linear(hidden, rows, bias=False)
    for name, module in model.named_modules():
        if _REDUCED.search(name):
            module.register_forward_hook(lambda _module, _args, output: tp.all_reduce(output))


def lm_logits(model: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """fp32 logits [S, vocab] of final-norm hidden states h [S, hidden]: the output head (the tied
    embedding without lm_head); under TP each rank's vocab rows, all-gathered and unpadded."""
    weight = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    logits = F.linear(h, weight).float()  # [S, vocab] (this rank's rows under TP)
    tp = getattr(model, "tp", None)
    if tp is None:
        return logits
    return tp.gather_columns(logits)[:, : model.cfg.vocab_size]
