"""The sparse MoE block of Qwen3-Next and Qwen3.5-MoE: a softmax top-k router over stacked experts,
plus a shared expert scaled by the sigmoid of its own gate (transformers' Qwen3NextSparseMoeBlock).

Expert weights are stacked per layer, as transformers 5 keeps them in memory:
`experts.gate_up_proj` [E, 2I, H] (expert e's gate rows, then its up rows) and `experts.down_proj`
[E, H, I], expert e at index e (its global id, so expert parallelism can later keep a slice per
rank). A checkpoint saved with those fused names loads by name; the published per-expert layout
(`experts.{e}.{gate,up,down}_proj.weight`) is copied into the stacks by `ExpertStacker` at load.

The forward is graph-safe: routing and the experts run through hkv_kernels.dispatch (transformers'
loop over the hit experts on CPU, the sorted grouped GEMMs on CUDA, no host read). On CUDA the
router, the shared expert's gate and its gate|up projections are one GEMM over x (FusedLinear).

Names: T tokens, H hidden size, E experts, k experts per token, I expert width, Is shared width.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from hkv.models.qwen3 import FusedLinear, WeightLoadError
from hkv_kernels import dispatch

_PER_EXPERT = re.compile(r"^(?P<module>.+\.experts)\.(?P<expert>\d+)\.(?P<part>gate|up|down)_proj\."
                         r"(?P<kind>weight|weight_scale_inv)$")


class Experts(nn.Module):
    """E SwiGLU experts' weights stacked (parameter names as transformers 5's in-memory ones)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    # stacked parameter -> the per-expert tensors (part, kind) that fill it
    STACKED = {"gate_up_proj": (("gate", "weight"), ("up", "weight")), "down_proj": (("down", "weight"),)}

    def part(self, expert: int, part: str, kind: str = "weight") -> torch.Tensor:
        """The slice that checkpoint tensor `experts.{expert}.{part}_proj.{kind}` fills."""
        if kind != "weight":
            raise WeightLoadError(f"experts.{expert}.{part}_proj.{kind}: these experts are not FP8")
        inter = self.intermediate_size
        if part == "gate":
            return self.gate_up_proj[expert, :inter]  # [I, H]
        if part == "up":
            return self.gate_up_proj[expert, inter:]  # [I, H]
        return self.down_proj[expert]  # [H, I]

    def scales(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """FP8 block multipliers for dispatch.moe_experts; None: the weights are in the model dtype."""
        return None


class Fp8Experts(Experts):
    """Experts in block FP8 (hkv/models/fp8.py): float8_e4m3fn stacks and their 128 x 128 multipliers,
    `gate_up_proj_scale_inv` [E, 2 * ceil(I/128), ceil(H/128)] (the gate's blocks, then the up's: each
    half tiled alone, as the published per-expert tensors are) and `down_proj_scale_inv` [E, ceil(H/128),
    ceil(I/128)]."""

    STACKED = {**Experts.STACKED, "gate_up_proj_scale_inv": (("gate", "weight_scale_inv"), ("up", "weight_scale_inv")),
               "down_proj_scale_inv": (("down", "weight_scale_inv"),)}

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__(num_experts, hidden_size, intermediate_size)
        fp8 = torch.float8_e4m3fn
        self.gate_up_proj = nn.Parameter(self.gate_up_proj.to(fp8), requires_grad=False)
        self.down_proj = nn.Parameter(self.down_proj.to(fp8), requires_grad=False)
        blocks_i, blocks_h = -(-intermediate_size // 128), -(-hidden_size // 128)
        self.gate_up_proj_scale_inv = nn.Parameter(torch.empty(num_experts, 2 * blocks_i, blocks_h), requires_grad=False)
        self.down_proj_scale_inv = nn.Parameter(torch.empty(num_experts, blocks_h, blocks_i), requires_grad=False)

    def part(self, expert: int, part: str, kind: str = "weight") -> torch.Tensor:
        if kind == "weight":
            return super().part(expert, part)
        half = self.gate_up_proj_scale_inv.shape[1] // 2
        if part == "gate":
            return self.gate_up_proj_scale_inv[expert, :half]
        if part == "up":
            return self.gate_up_proj_scale_inv[expert, half:]
        return self.down_proj_scale_inv[expert]

    def scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate_up_proj_scale_inv, self.down_proj_scale_inv


class SharedExpert(nn.Module):
    """The shared expert's SwiGLU (`shared_expert.*`); its gate and up projections run inside the
    block's fused projection on CUDA, so it has no FusedLinear of its own."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)


class SparseMoeBlock(nn.Module):
    """Top-k routed experts plus a sigmoid-gated shared expert; `renormalize`: the top-k weights are
    divided by their sum (Qwen3-Next's norm_topk_prob; always for Qwen3.5-MoE)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 shared_intermediate_size: int, renormalize: bool) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be in 1..num_experts ({num_experts})")
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)  # the router
        self.experts = Experts(num_experts, hidden_size, intermediate_size)
        self.shared_expert = SharedExpert(hidden_size, shared_intermediate_size)
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
        shared = self.shared_expert
        self.projections = FusedLinear((self.gate, self.shared_expert_gate, shared.gate_proj, shared.up_proj))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] -> [T, H]."""
        logits, shared_gate, gate, up = self.projections(x)  # [T, E], [T, 1], [T, Is], [T, Is]
        weights, ids = dispatch.moe_route(logits, self.top_k, self.renormalize)  # [T, k] each
        shared = self.shared_expert.down_proj(dispatch.silu_mul(gate, up))  # [T, H]
        return dispatch.moe_experts(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids,
                                    shared, shared_gate, self.experts.scales())


def moe_block(cfg, renormalize: bool) -> SparseMoeBlock:
    """The MoE block of a family config (num_experts, num_experts_per_tok, moe_intermediate_size,
    shared_expert_intermediate_size)."""
    return SparseMoeBlock(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                          cfg.shared_expert_intermediate_size, renormalize)


class ExpertStacker:
    """Copies per-expert checkpoint tensors into the stacked `Experts` parameters of a model.

    `absorb` passes every other tensor on; after the stream is consumed, `complete()` names the
    stacked parameters filled entirely from per-expert tensors and `describe_missing` turns a missing
    stacked parameter into the per-expert names it lacks. Expert indices and shapes are checked
    before anything is written.
    """

    def __init__(self, model: nn.Module) -> None:
        self.experts: dict[str, Experts] = {n: m for n, m in model.named_modules() if isinstance(m, Experts)}
        self.seen: dict[str, set[tuple[int, str, str]]] = {n: set() for n in self.experts}  # (expert, part, kind)

    def absorb(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in named_tensors:
            match = _PER_EXPERT.match(name)
            if match is None or match["module"] not in self.experts:
                yield name, tensor
                continue
            module, expert, part = self.experts[match["module"]], int(match["expert"]), match["part"]
            kind = match["kind"]
            if expert >= module.num_experts:
                raise WeightLoadError(f"weight {name}: expert {expert} out of range (the layer has "
                                      f"{module.num_experts} experts)")
            seen = self.seen[match["module"]]
            if (expert, part, kind) in seen:
                raise WeightLoadError(f"weight {name} appears twice in the checkpoint")
            target = module.part(expert, part, kind)
            if tuple(tensor.shape) != tuple(target.shape):
                raise WeightLoadError(f"weight {name}: checkpoint shape {tuple(tensor.shape)} != model shape "
                                      f"{tuple(target.shape)}")
            with torch.no_grad():
                target.copy_(tensor)
            seen.add((expert, part, kind))

    def complete(self) -> set[str]:
        """Stacked parameter names every one of whose experts came in per-expert tensors."""
        done = set()
        for prefix, module in self.experts.items():
            for param, parts in module.STACKED.items():
                if all((e, *p) in self.seen[prefix] for e in range(module.num_experts) for p in parts):
                    done.add(f"{prefix}.{param}")
        return done

    def touched(self) -> set[str]:
        """Stacked parameter names that at least one per-expert tensor went into."""
        return {f"{prefix}.{param}" for prefix, seen in self.seen.items()
                for param, parts in self.experts[prefix].STACKED.items() if any((p, k) in parts for _, p, k in seen)}

    def describe_missing(self, missing: list[str]) -> list[str]:
        """Missing parameter names, a stacked one replaced by the per-expert tensors it still lacks."""
        out = []
        for name in missing:
            prefix, _, param = name.rpartition(".")
            module = self.experts.get(prefix)
            if module is None or param not in module.STACKED:
                out.append(name)
                continue
            out += [f"{prefix}.{e}.{p}_proj.{k}" for e in range(module.num_experts) for p, k in module.STACKED[param]
                    if (e, p, k) not in self.seen[prefix]]
        return out
