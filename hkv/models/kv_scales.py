"""The KV cache scales a checkpoint may carry for FP8 KV pages (--kv-cache-dtype fp8_e4m3).

FP8 checkpoints quantized with a KV cache scheme (vLLM's, ModelOpt's, llm-compressor's) carry one
scalar per attention layer for K and one for V, named as vLLM reads them
(model_executor/model_loader/weight_utils.py `maybe_remap_kv_scale_name`):

    model.layers.N.self_attn.k_scale / .v_scale           (also under self_attn.attn.)
    model.layers.N.self_attn.k_proj.k_scale / v_proj.v_scale
    model.layers.N.self_attn.kv_scale                      (older: one scale for both)

`model.language_model.layers.N` (composite checkpoints) is the same layer. A layer without scales
uses 1.0. The MTP layer's scales (`mtp.layers.N...`) are read and dropped: the paged draft layer's
pages use 1.0. The scales are taken out of the tensor stream before the model's own loader sees it,
so a model that does not serve FP8 KV still loads such a checkpoint.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable, Iterator

import torch

log = logging.getLogger("hkv.models")

_NAME = re.compile(r"^(model\.(?:language_model\.)?layers|mtp\.layers)\.(\d+)\.self_attn\."
                   r"(?:attn\.|k_proj\.(?=k_scale$)|v_proj\.(?=v_scale$))?(k_scale|v_scale|kv_scale)$")


class KVScaleError(ValueError):
    """A KV scale tensor is not one finite positive number, or names no attention layer."""


class KVScaleReader:
    """Takes the KV scale tensors out of a (name, tensor) stream: `absorb` yields everything else;
    afterwards `scales(full_layers)` gives model layer -> (K scale, V scale)."""

    def __init__(self) -> None:
        self.found: dict[int, dict[str, float]] = {}  # model layer -> {"k_scale"|"v_scale"|"kv_scale": value}
        self.dropped: int = 0  # the MTP layer's scales

    def absorb(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in named_tensors:
            match = _NAME.match(name)
            if match is None:
                yield name, tensor
                continue
            value = _scalar(name, tensor)
            if match.group(1) == "mtp.layers":
                self.dropped += 1
                continue
            entry = self.found.setdefault(int(match.group(2)), {})
            if match.group(3) in entry:
                raise KVScaleError(f"{name}: a second {match.group(3)} for layer {match.group(2)}")
            entry[match.group(3)] = value

    def scales(self, full_layers: Iterable[int]) -> dict[int, tuple[float, float]]:
        """Model layer -> (K scale, V scale) for the layers the checkpoint gives scales; raises
        KVScaleError for scales of a layer that is not full attention."""
        full = set(full_layers)
        stray = sorted(set(self.found) - full)
        if stray:
            raise KVScaleError(f"KV scales for layer {stray[0]}, which is not a full-attention layer")
        if self.dropped:
            log.info("ignoring %d KV scales of the MTP layer: its paged draft K/V use 1.0", self.dropped)
        out = {}
        for layer, entry in self.found.items():
            both = entry.get("kv_scale", 1.0)
            out[layer] = (entry.get("k_scale", both), entry.get("v_scale", both))
        return out


def _scalar(name: str, tensor: torch.Tensor) -> float:
    if tensor.numel() != 1:
        raise KVScaleError(f"{name}: a KV scale is one number, the checkpoint has shape {tuple(tensor.shape)}")
    value = float(tensor.reshape(()).float())
    if not (math.isfinite(value) and value > 0):
        raise KVScaleError(f"{name}: a KV scale must be finite and positive, got {value}")
    return value
