"""Block-quantized FP8 weights in the model families: published FP8 checkpoints and `--quantize fp8`.

A quantized projection keeps its weight in float8_e4m3fn with one fp32 multiplier per 128 x 128 block
(`<module>.weight_scale_inv`, the published name; hkv_kernels/fp8_gemm/reference.py) on the device;
its forward is dispatch.fp8_linear (the dequantizing reference on CPU, the Triton weight-only GEMM
on CUDA). Stacked MoE experts become `Fp8Experts` with their scales stacked alike.

Which modules are FP8:
- a published checkpoint (config.json `quantization_config`, quant_method "fp8"): exactly the
  modules whose `weight_scale_inv` the safetensors hold (the checkpoint is the truth; its
  modules_to_not_convert lists the rest, which keep their dtype);
- `--quantize fp8` of a float checkpoint: every projection but those a published Qwen FP8
  checkpoint leaves out (QUANTIZE_KEEPS: lm_head, the MoE router and shared-expert gate, the GDN a/b
  projections, the MTP fusion fc); embeddings, norms and conv1d are not projections and keep their dtype.

Names here are the model's parameter names: checkpoint names with the composite prefix
`model.language_model.` read as `model.` (as the families' load_weights read them).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from hkv_kernels import dispatch
from hkv_kernels.fp8_gemm.reference import BLOCK, FP8_DTYPE, quantize, scale_shape

SCALE = "weight_scale_inv"
SUPPORTED = "quant_method 'fp8' with weight_block_size [128, 128] and activation_scheme 'dynamic'"
# what --quantize fp8 keeps in the model dtype: the modules Qwen's published FP8 checkpoints leave out
QUANTIZE_KEEPS = re.compile(r"(^|\.)(lm_head|mlp\.gate|shared_expert_gate|in_proj_a|in_proj_b|in_proj_ba|mtp\.fc)$")
_EXPERT_TENSOR = re.compile(r"^(?P<module>.+\.experts)\.(\d+\.(gate|up|down)_proj\.|(gate_up|down)_proj)")


class QuantizationError(ValueError):
    """A quantization_config (or --quantize request) hkv cannot serve."""


def checkpoint_fp8(hf_config: dict) -> bool:
    """Whether config.json declares block FP8 weights; QuantizationError for any quantization hkv
    does not run (naming quant_method)."""
    quant = hf_config.get("quantization_config")
    if not quant:
        return False
    if not isinstance(quant, dict):
        raise QuantizationError("quantization_config is not a JSON object")
    method = quant.get("quant_method")
    if method != "fp8":
        raise QuantizationError(f"quantization_config quant_method {method!r} is not supported (only {SUPPORTED})")
    block = quant.get("weight_block_size")
    scheme = str(quant.get("activation_scheme", "dynamic")).lower()
    fmt = quant.get("scale_fmt", "float")
    if block != [BLOCK, BLOCK] or scheme != "dynamic" or fmt != "float":
        raise QuantizationError(f"quantization_config quant_method 'fp8' with weight_block_size {block!r}, "
                                f"activation_scheme {scheme!r}, scale_fmt {fmt!r} is not supported (only {SUPPORTED})")
    return True


def model_name(checkpoint_name: str) -> str:
    """A checkpoint tensor's name as the model's parameters spell it (the composite prefix dropped)."""
    if checkpoint_name.startswith("model.language_model."):
        return "model." + checkpoint_name.removeprefix("model.language_model.")
    return checkpoint_name


class Fp8Linear(nn.Module):
    """A projection with a block-FP8 weight [out, in] and its multipliers [ceil(out/128), ceil(in/128)]."""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.empty(scale_shape(out_features, in_features),
                                                         dtype=torch.float32), requires_grad=False)
        self.bias = bias  # the replaced Linear's bias parameter (model dtype) or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dispatch.fp8_linear(x, self.weight, self.weight_scale_inv, self.bias)  # [..., out]


@dataclass(frozen=True)
class Fp8Targets:
    linears: frozenset[str]  # nn.Linear module names held in FP8
    experts: frozenset[str]  # Experts module names held in FP8

    def quantizes(self, name: str) -> str | None:
        """For a float checkpoint tensor's (model) name: the module it makes FP8 ('linear' or 'experts'), or None."""
        if name.endswith(".weight") and name.removesuffix(".weight") in self.linears:
            return "linear"
        match = _EXPERT_TENSOR.match(name)
        if match and match["module"] in self.experts and not name.endswith("scale_inv"):
            return "experts"
        return None


def checkpoint_targets(model: nn.Module, tensor_names: Iterable[str]) -> Fp8Targets:
    """The model's modules an FP8 checkpoint stores in FP8: those with `weight_scale_inv` tensors
    (modules the model lacks, such as a vision tower or an MTP head it does not load, are left out)."""
    modules = dict(model.named_modules())
    linears, experts = set(), set()
    for name in map(model_name, tensor_names):
        match = _EXPERT_TENSOR.match(name)
        if match and name.endswith("scale_inv") and match["module"] in modules:
            experts.add(match["module"])
        elif name.endswith("." + SCALE) and isinstance(modules.get(name.removesuffix("." + SCALE)), nn.Linear):
            linears.add(name.removesuffix("." + SCALE))
    return Fp8Targets(frozenset(linears), frozenset(experts))


def quantize_targets(model: nn.Module) -> Fp8Targets:
    """What --quantize fp8 makes FP8: every Linear but QUANTIZE_KEEPS, and every stacked Experts."""
    from hkv.models.moe import Experts

    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear) and not QUANTIZE_KEEPS.search(n)}
    experts = {n for n, m in model.named_modules() if isinstance(m, Experts)}
    return Fp8Targets(frozenset(linears), frozenset(experts))


def convert_to_fp8(model: nn.Module, targets: Fp8Targets) -> None:
    """Replace the target modules (on the meta device, before allocation) by their FP8 forms; the
    FusedLinear groups that held them are pointed at the replacements."""
    from hkv.models.moe import Experts, Fp8Experts
    from hkv.models.qwen3 import FusedLinear

    replaced: dict[int, nn.Module] = {}
    for name in sorted(targets.linears | targets.experts):
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, attr)
        with torch.device("meta"):  # allocated later, with the rest, by to_empty
            if name in targets.experts:
                assert isinstance(old, Experts)
                new = Fp8Experts(old.num_experts, old.gate_up_proj.shape[2], old.intermediate_size)
            else:
                assert isinstance(old, nn.Linear)
                new = Fp8Linear(old.in_features, old.out_features, old.bias)
        setattr(parent, attr, new)
        replaced[id(old)] = new
    for module in model.modules():
        if isinstance(module, FusedLinear):
            module.parts = tuple(replaced.get(id(p), p) for p in module.parts)


def quantize_stream(named_tensors: Iterable[tuple[str, torch.Tensor]], targets: Fp8Targets
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """--quantize fp8: a float checkpoint's tensors with each target weight replaced by its FP8 bytes
    and followed by its `weight_scale_inv` (a stacked gate|up tensor's halves are tiled apart)."""
    for name, tensor in named_tensors:
        kind = targets.quantizes(model_name(name))
        if kind is None:
            yield name, tensor
            continue
        if name.endswith("gate_up_proj"):  # stacked experts [E, 2I, H]: gate and up are tiled apart
            gate, up = tensor.chunk(2, dim=-2)
            (qg, sg), (qu, su) = quantize(gate), quantize(up)
            yield name, torch.cat([qg, qu], dim=-2)
            yield scale_name(name), torch.cat([sg, su], dim=-2)
            continue
        q, scale = quantize(tensor)
        yield name, q
        yield scale_name(name), scale


def scale_name(weight_name: str) -> str:
    """The multipliers' tensor name of an FP8 weight: `<module>.weight_scale_inv` (published), or for a
    stacked experts tensor `<experts>.gate_up_proj_scale_inv` / `down_proj_scale_inv` (Fp8Experts)."""
    if weight_name.endswith(".weight"):
        return weight_name.removesuffix("weight") + SCALE
    return weight_name + "_scale_inv"


def fp8_weight_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of FP8 weights and their scales, bytes of every other parameter) of a loaded model."""
    fp8 = other = 0
    for name, param in model.named_parameters():
        size = param.numel() * param.element_size()
        if param.dtype == FP8_DTYPE or name.endswith("scale_inv"):
            fp8 += size
        else:
            other += size
    return fp8, other
