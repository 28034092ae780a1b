"""Write a float checkpoint's block-FP8 twin in the layout Qwen publishes its `-FP8` checkpoints in:
each quantized projection's `weight` in float8_e4m3fn with its `weight_scale_inv` (fp32, one multiplier
per 128 x 128 block), per-expert tensors alike, and config.json's

    "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                            "activation_scheme": "dynamic", "fmt": "e4m3", "modules_to_not_convert": [...]}

The modules quantized are those `hkv-launch --quantize fp8` quantizes (hkv/models/fp8.py
QUANTIZE_KEEPS names the ones left out), with the same bytes.

    python -m tools.fp8_checkpoint SRC_DIR OUT_DIR

(tools/bench/make_bench_model.py --fp8 writes the benchmark models this way directly.)
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from hkv.models.fp8 import Fp8Targets, model_name, quantize_stream, quantize_targets
from hkv.models.loader import find_weight_shards, iter_tensors, meta_model_of, read_hf_config
from hkv_kernels.fp8_gemm.reference import BLOCK


def fp8_targets(hf_config: dict, tensor_names: Iterable[str]) -> tuple[Fp8Targets, list[str]]:
    """(what --quantize fp8 quantizes in this checkpoint, the checkpoint-side names of the projections it
    leaves in their dtype: modules_to_not_convert). An MTP head's projections count when the names hold one."""
    names = list(tensor_names)
    model = meta_model_of(hf_config)
    if any(n.startswith("mtp.") for n in names) and hasattr(model, "enable_mtp"):
        with torch.device("meta"):
            model.enable_mtp()
    targets = quantize_targets(model)
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    kept = sorted({n.removesuffix(".weight") for n in names if n.endswith(".weight")
                   and model_name(n.removesuffix(".weight")) in linears - targets.linears})
    return targets, kept


def quantization_config(kept: list[str]) -> dict:
    """config.json's quantization_config of a published block-FP8 checkpoint."""
    return {"quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK], "activation_scheme": "dynamic",
            "fmt": "e4m3", "modules_to_not_convert": kept}


def fp8_tensors(named: Iterable[tuple[str, torch.Tensor]], targets: Fp8Targets) -> Iterator[tuple[str, torch.Tensor]]:
    """The published FP8 layout's tensors of a float checkpoint's stream (quantize_stream's output)."""
    return quantize_stream(named, targets)


def write_fp8_copy(src: Path, dst: Path) -> dict:
    """Convert the float checkpoint folder src into its FP8 twin at dst (created; must not exist): the
    weights in one model.safetensors, every other file copied. Returns the new config.json."""
    from safetensors.torch import save_file

    hf_config = read_hf_config(src)
    shards = find_weight_shards(src)
    targets, kept = fp8_targets(hf_config, (n for s in shards for n in s.tensor_names))
    dst.mkdir(parents=True)
    for path in src.iterdir():
        if path.is_file() and not path.name.endswith(".safetensors") and path.name != "model.safetensors.index.json":
            shutil.copy(path, dst / path.name)
    tensors = {name: t.contiguous() for name, t in fp8_tensors(iter_tensors(shards, lambda: None), targets)}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = {**hf_config, "quantization_config": quantization_config(kept)}
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return config


def write_dequantized_copy(src: Path, dst: Path, dtype: torch.dtype = torch.float32) -> None:
    """The reverse, for tests and references: an FP8 checkpoint folder's weights dequantized
    (hkv_kernels/fp8_gemm/reference.dequantize, exact in fp32) into a plain `dtype` checkpoint at dst,
    without quantization_config, so transformers (or hkv's float path) runs the very weights the FP8
    model runs. Small checkpoints only: every tensor is held in memory at once."""
    from safetensors.torch import save_file

    from hkv.models.fp8 import scale_name
    from hkv_kernels.fp8_gemm.reference import FP8_DTYPE, dequantize

    hf_config = read_hf_config(src)
    tensors = dict(iter_tensors(find_weight_shards(src), lambda: None, fp8=True))
    out = {}
    for name, tensor in tensors.items():
        if name.endswith("scale_inv"):
            continue
        if tensor.dtype == FP8_DTYPE:
            scale = tensors[scale_name(name)]
            if name.endswith("gate_up_proj"):  # stacked experts: the halves are tiled apart
                half = scale.shape[-2] // 2
                gate, up = tensor.chunk(2, dim=-2)
                tensor = torch.cat([dequantize(gate, scale[..., :half, :], dtype),
                                    dequantize(up, scale[..., half:, :], dtype)], dim=-2)
            else:
                tensor = dequantize(tensor, scale, dtype)
        out[name] = tensor.to(dtype).contiguous()
    dst.mkdir(parents=True)
    for path in src.iterdir():
        if path.is_file() and not path.name.endswith(".safetensors") and path.name != "model.safetensors.index.json":
            shutil.copy(path, dst / path.name)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = {k: v for k, v in hf_config.items() if k != "quantization_config"}
    config["dtype"] = str(dtype).removeprefix("torch.")
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.fp8_checkpoint", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", type=Path, help="a float (bf16/fp16/fp32) HF checkpoint folder")
    p.add_argument("out", type=Path, help="the FP8 checkpoint folder to write (must not exist)")
    args = p.parse_args(argv)
    if args.out.exists():
        p.error(f"{args.out} exists")
    try:
        write_fp8_copy(args.src, args.out)
    except ValueError as exc:
        p.error(str(exc))
    print(f"{args.out}: block-FP8 checkpoint written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
