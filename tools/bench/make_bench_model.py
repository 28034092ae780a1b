"""The benchmark model: a 1.99 B-parameter Qwen3.5-like hybrid with random bf16 weights, so every number
in docs/benchmarks.md is measured on the same model.

    python -m tools.bench.make_bench_model OUT_DIR [--seed 0] [--layers 24] [--hidden-size 2048] ...

`qwen3_5_text`, 24 layers (18 Gated DeltaNet + 6 gated full attention, every
4th layer full), hidden 2048, MLP 6144, 16 query / 2 KV heads of 256, GDN 16
key / 32 value heads of 128, vocab 151,936, tied embeddings, partial rope
(0.25), plus one MTP layer (mtp.*, 73 M parameters: random, so its drafts are
almost never accepted; --spec-tokens measures the machinery's cost with it). Weights are drawn per tensor from a generator seeded by the seed and
the tensor's name (the same bytes on every machine), one tensor at a time into
safetensors shards of about --shard-gb, so memory stays near one shard. The
folder also gets hkv's built-in tiny tokenizer and chat template: ids past its
1,536 tokens decode to nothing, which a benchmark counting token ids does not mind.

The shrinking flags (--layers, --hidden-size, --intermediate-size,
--vocab-size) exist for tests; the head layout stays the benchmark model's.

    python -m tools.bench.make_bench_model OUT_DIR --moe [--layers 4] [--experts 512] ...

`--moe` writes the MoE benchmark model instead: `qwen3_next` with Qwen3-Next-80B-A3B's layer
shapes (hidden 2048; 512 experts of width 512, top-10, renormalised; a shared expert of 512 with
its sigmoid gate; the GDN and attention heads above; every 4th layer full attention; untied
embeddings, vocab 151,936), experts in the published per-expert layout
(`mlp.experts.{e}.{gate,up,down}_proj.weight`). Its layer count is a flag (default 4: 3 GDN + 1
attention, 7.21 B parameters, 14.4 GB in bf16); it has no MTP layer. --experts,
--experts-per-token, --moe-intermediate-size and --shared-expert-intermediate-size shrink it for tests.

    python -m tools.bench.make_bench_model OUT_DIR --preset qwen3.5-27b

`--preset qwen3.5-27b` writes the large-layer benchmark model: `qwen3_5_text` with Qwen3.5-27B's layer
shapes and 16 layers (12 GDN + 4 gated attention): hidden 5120, MLP 17408, 24 query / 4 KV heads of 256,
GDN 16 key / 48 value heads of 128, vocab 248,320, untied embeddings, one MTP layer; 8.63 B parameters
(17.3 GB in bf16) besides the MTP layer's. The shrinking flags apply to it as to the default model.

    python -m tools.bench.make_bench_model OUT_DIR --fp8 [--moe | --preset ...]

`--fp8` writes any of them block-quantized as Qwen publishes its `-FP8` checkpoints: the same bf16
draws, each projection `--quantize fp8` quantizes stored as float8_e4m3fn with a `weight_scale_inv`
per 128 x 128 block (experts per expert), config.json's quantization_config listing the modules left
in bf16 (lm_head, routers and shared-expert gates, GDN a/b projections, the MTP fc).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer
from tqdm import tqdm

from hkv.models.fp8 import quantize_stream
from hkv.models.tiny import ENDOFTEXT, IM_END, SPECIAL_TOKENS, build_tokenizer, qwen3_5_text_config, tokenizer_config
from tools.fp8_checkpoint import fp8_targets, quantization_config

FULL_ATTENTION_INTERVAL = 4
DEFAULTS = dict(layers=24, hidden_size=2048, intermediate_size=6144, vocab_size=151_936)
# --moe: Qwen3-Next-80B-A3B's shapes, 4 layers (intermediate_size is its dense MLP's, unused: every layer is sparse)
MOE_DEFAULTS = dict(layers=4, hidden_size=2048, intermediate_size=5120, vocab_size=151_936, experts=512,
                    experts_per_token=10, moe_intermediate_size=512, shared_expert_intermediate_size=512)
# --preset: (DEFAULTS overrides, config.json overrides) of a named shape
PRESETS = {
    "qwen3.5-27b": (dict(layers=16, hidden_size=5120, intermediate_size=17_408, vocab_size=248_320),
                    {"num_attention_heads": 24, "num_key_value_heads": 4, "linear_num_value_heads": 48,
                     "tie_word_embeddings": False}),
}
STD = 0.02  # projections and embeddings, transformers' initializer_range
BYTES_PER_PARAM = 2  # bf16


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one clear line, exit 2
        print(f"make_bench_model: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def bench_config(layers: int, hidden_size: int, intermediate_size: int, vocab_size: int,
                 eot: int, im_end: int, overrides: dict | None = None) -> dict:
    """config.json of the benchmark model (the full-size one with DEFAULTS); overrides: a preset's keys."""
    config = qwen3_5_text_config(vocab_size, eot, im_end, **{
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": layers,
        "layer_types": ["linear_attention" if (i + 1) % FULL_ATTENTION_INTERVAL else "full_attention"
                        for i in range(layers)],
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "max_position_embeddings": 262_144,
        # as released Qwen3.5 configs write it; text-only positions make mrope plain partial rope
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                            "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        "tie_word_embeddings": True,
        "initializer_range": STD,
        "mtp_num_hidden_layers": 1,  # one MTP layer (mtp.*), as released Qwen3.5 checkpoints have: --spec-tokens
    })
    return {**config, **(overrides or {})}


def moe_bench_config(layers: int, hidden_size: int, intermediate_size: int, vocab_size: int, experts: int,
                     experts_per_token: int, moe_intermediate_size: int, shared_expert_intermediate_size: int,
                     eot: int, im_end: int) -> dict:
    """config.json of the MoE benchmark model (Qwen3-Next-80B-A3B's layer shapes with MOE_DEFAULTS)."""
    config = bench_config(layers, hidden_size, intermediate_size, vocab_size, eot, im_end)
    for key in ("mtp_num_hidden_layers", "architectures"):
        config.pop(key)
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25}
    return {**config, "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
            "tie_word_embeddings": False, "num_experts": experts, "num_experts_per_tok": experts_per_token,
            "moe_intermediate_size": moe_intermediate_size,
            "shared_expert_intermediate_size": shared_expert_intermediate_size, "norm_topk_prob": True,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "full_attention_interval": FULL_ATTENTION_INTERVAL}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    init: str  # "normal" (std STD), "zeros" (Qwen3.5 RMSNorm: applied as 1 + w), "ones", "a_log", "dt_bias"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _attention_specs(p: str, cfg: dict) -> list[TensorSpec]:
    h, d = cfg["hidden_size"], cfg["head_dim"]
    q_dim, kv_dim = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    a = p + "self_attn."
    return [TensorSpec(a + "q_proj.weight", (2 * q_dim, h), "normal"),  # query and output gate
            TensorSpec(a + "k_proj.weight", (kv_dim, h), "normal"),
            TensorSpec(a + "v_proj.weight", (kv_dim, h), "normal"),
            TensorSpec(a + "o_proj.weight", (h, q_dim), "normal"),
            TensorSpec(a + "q_norm.weight", (d,), "zeros"),
            TensorSpec(a + "k_norm.weight", (d,), "zeros")]


def _gdn_specs(p: str, cfg: dict) -> list[TensorSpec]:
    h, hv = cfg["hidden_size"], cfg["linear_num_value_heads"]
    key_dim = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
    value_dim = hv * cfg["linear_value_head_dim"]
    conv_dim = 2 * key_dim + value_dim
    a = p + "linear_attn."
    return [TensorSpec(a + "in_proj_qkv.weight", (conv_dim, h), "normal"),
            TensorSpec(a + "in_proj_z.weight", (value_dim, h), "normal"),
            TensorSpec(a + "in_proj_b.weight", (hv, h), "normal"),
            TensorSpec(a + "in_proj_a.weight", (hv, h), "normal"),
            TensorSpec(a + "conv1d.weight", (conv_dim, 1, cfg["linear_conv_kernel_dim"]), "normal"),
            TensorSpec(a + "dt_bias", (hv,), "dt_bias"),
            TensorSpec(a + "A_log", (hv,), "a_log"),
            TensorSpec(a + "norm.weight", (cfg["linear_value_head_dim"],), "ones"),  # gated norm: plain weight
            TensorSpec(a + "out_proj.weight", (h, value_dim), "normal")]


def _next_gdn_specs(p: str, cfg: dict) -> list[TensorSpec]:
    """Qwen3-Next's GDN: the fused in_proj_qkvz / in_proj_ba in place of Qwen3.5's four projections."""
    h, hv = cfg["hidden_size"], cfg["linear_num_value_heads"]
    key_dim = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
    value_dim = hv * cfg["linear_value_head_dim"]
    specs = [s for s in _gdn_specs(p, cfg) if ".in_proj_" not in s.name]
    return [TensorSpec(p + "linear_attn.in_proj_qkvz.weight", (2 * key_dim + 2 * value_dim, h), "normal"),
            TensorSpec(p + "linear_attn.in_proj_ba.weight", (2 * hv, h), "normal"), *specs]


def _mlp_specs(p: str, cfg: dict) -> list[TensorSpec]:
    """A dense SwiGLU MLP, or with num_experts the sparse block in the published per-expert layout."""
    h = cfg["hidden_size"]

    def swiglu(q: str, inter: int) -> list[TensorSpec]:
        return [TensorSpec(q + "gate_proj.weight", (inter, h), "normal"),
                TensorSpec(q + "up_proj.weight", (inter, h), "normal"),
                TensorSpec(q + "down_proj.weight", (h, inter), "normal")]

    if not cfg.get("num_experts"):
        return swiglu(p + "mlp.", cfg["intermediate_size"])
    specs = [TensorSpec(p + "mlp.gate.weight", (cfg["num_experts"], h), "normal")]
    for e in range(cfg["num_experts"]):
        specs += swiglu(f"{p}mlp.experts.{e}.", cfg["moe_intermediate_size"])
    return specs + swiglu(p + "mlp.shared_expert.", cfg["shared_expert_intermediate_size"]) + [
        TensorSpec(p + "mlp.shared_expert_gate.weight", (1, h), "normal")]


def tensor_specs(cfg: dict) -> list[TensorSpec]:
    """Every tensor of the checkpoint in file order (tied: no lm_head)."""
    h = cfg["hidden_size"]
    gdn = _next_gdn_specs if cfg["model_type"] == "qwen3_next" else _gdn_specs
    specs = [TensorSpec("model.embed_tokens.weight", (cfg["vocab_size"], h), "normal")]
    for i, layer_type in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}."
        specs.append(TensorSpec(p + "input_layernorm.weight", (h,), "zeros"))
        specs += gdn(p, cfg) if layer_type == "linear_attention" else _attention_specs(p, cfg)
        specs.append(TensorSpec(p + "post_attention_layernorm.weight", (h,), "zeros"))
        specs += _mlp_specs(p, cfg)
    specs.append(TensorSpec("model.norm.weight", (h,), "zeros"))
    if not cfg["tie_word_embeddings"]:
        specs.append(TensorSpec("lm_head.weight", (cfg["vocab_size"], h), "normal"))
    return specs + _mtp_specs(cfg)


def _mtp_specs(cfg: dict) -> list[TensorSpec]:
    """The MTP module in the published layout: fc, two input norms, gated-attention decoder layers, norm."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    specs = [TensorSpec("mtp.fc.weight", (h, 2 * h), "normal"),
             TensorSpec("mtp.pre_fc_norm_embedding.weight", (h,), "zeros"),
             TensorSpec("mtp.pre_fc_norm_hidden.weight", (h,), "zeros")]
    for i in range(cfg.get("mtp_num_hidden_layers", 0)):
        p = f"mtp.layers.{i}."
        specs += [TensorSpec(p + "input_layernorm.weight", (h,), "zeros"), *_attention_specs(p, cfg),
                  TensorSpec(p + "post_attention_layernorm.weight", (h,), "zeros"),
                  TensorSpec(p + "mlp.gate_proj.weight", (inter, h), "normal"),
                  TensorSpec(p + "mlp.up_proj.weight", (inter, h), "normal"),
                  TensorSpec(p + "mlp.down_proj.weight", (h, inter), "normal")]
    specs.append(TensorSpec("mtp.norm.weight", (h,), "zeros"))
    return specs if cfg.get("mtp_num_hidden_layers", 0) else []


def parameter_count(cfg: dict) -> int:
    """The target's parameters (the MTP module's apart: mtp_parameter_count)."""
    return sum(spec.numel for spec in tensor_specs(cfg) if not spec.name.startswith("mtp."))


def mtp_parameter_count(cfg: dict) -> int:
    return sum(spec.numel for spec in _mtp_specs(cfg))


def make_tensor(spec: TensorSpec, seed: int) -> torch.Tensor:
    """The bf16 tensor of spec, from its own generator (seed and name), so tensors do not depend on each other."""
    gen = torch.Generator(device="cpu").manual_seed(zlib.crc32(f"bench-{seed}/{spec.name}".encode()))
    if spec.init == "normal":
        values = torch.empty(spec.shape, dtype=torch.float32).normal_(0.0, STD, generator=gen)
    elif spec.init == "zeros":
        values = torch.zeros(spec.shape)
    elif spec.init in ("ones", "dt_bias"):  # transformers initialises dt_bias to ones
        values = torch.ones(spec.shape)
    else:  # A = exp(A_log) uniform in [0.01, 16], as transformers' Qwen3.5 init
        values = torch.empty(spec.shape, dtype=torch.float32).uniform_(0.01, 16.0, generator=gen).log_()
    return values.to(torch.bfloat16)


def plan_shards(specs: list[TensorSpec], shard_bytes: int) -> list[list[TensorSpec]]:
    """Consecutive tensors grouped into shards of at most shard_bytes (a bigger tensor gets one alone)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = spec.numel * BYTES_PER_PARAM
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_weights(out_dir: Path, specs: list[TensorSpec], seed: int, shard_bytes: int, progress: bool,
                  fp8=None) -> None:
    """Sharded bf16 safetensors plus model.safetensors.index.json; one shard in memory at a time.
    fp8: an hkv.models.fp8.Fp8Targets: those weights are written block-quantized (the published layout)."""
    shards = plan_shards(specs, shard_bytes)
    weight_map = {}
    bar = tqdm(total=sum(s.numel for s in specs), unit="param", unit_scale=True, desc="weights",
               file=sys.stderr, disable=not progress)
    # tensors of a shard are drawn on every core (torch releases the GIL); each from its own generator
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        for number, shard in enumerate(shards, start=1):
            file_name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
            tensors = {}
            drawn = ((spec.name, t) for spec, t in zip(shard, pool.map(lambda spec: make_tensor(spec, seed), shard)))
            for name, tensor in (drawn if fp8 is None else quantize_stream(drawn, fp8)):
                tensors[name] = tensor
                weight_map[name] = file_name
            bar.update(sum(spec.numel for spec in shard))
            save_file(tensors, str(out_dir / file_name), metadata={"format": "pt"})
            del tensors
    bar.close()
    total = sum((out_dir / f).stat().st_size for f in set(weight_map.values()))
    _write_json(out_dir / "model.safetensors.index.json", {"metadata": {"total_size": total},
                                                            "weight_map": weight_map})


def load_tokenizer(path: Path | None) -> Tokenizer:
    """The built-in tiny tokenizer, or a tokenizer.json that has its special tokens (a benchmark that
    needs a large vocabulary, structured output's masks say, brings one: tools/bench/bench_grammar.py trains one)."""
    if path is None:
        return build_tokenizer()
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises its own Exception type for a bad file
        raise ValueError(f"--tokenizer {path}: not a tokenizers JSON file ({exc})") from None
    missing = [t for t in SPECIAL_TOKENS if tok.token_to_id(t) is None]
    if missing:
        raise ValueError(f"--tokenizer {path}: lacks the special tokens {missing}")
    return tok


def write_bench_model(out_dir: Path, seed: int = 0, shard_gb: float = 2.0, progress: bool = True,
                      moe: bool = False, tokenizer: Path | None = None, preset: str | None = None,
                      fp8: bool = False, **dims: int) -> dict:
    """Write the benchmark model (moe: the MoE one; preset: a PRESETS shape) into out_dir (created; must be
    empty); dims override DEFAULTS (MOE_DEFAULTS, the preset's); tokenizer: a tokenizer.json to ship instead of
    the built-in one; fp8: its block-FP8 variant in the published layout (tools/fp8_checkpoint.py: the
    projections --quantize fp8 quantizes, from the same bf16 draws). Returns its config."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} is not empty")
    tok = load_tokenizer(tokenizer)
    eot, im_end = tok.token_to_id(ENDOFTEXT), tok.token_to_id(IM_END)
    if moe:
        config = moe_bench_config(**{**MOE_DEFAULTS, **dims}, eot=eot, im_end=im_end)
    else:
        preset_dims, overrides = PRESETS[preset] if preset else ({}, {})
        config = bench_config(**{**DEFAULTS, **preset_dims, **dims}, eot=eot, im_end=im_end, overrides=overrides)
    if config["vocab_size"] < tok.get_vocab_size(with_added_tokens=True):
        raise ValueError(f"vocab_size {config['vocab_size']} is below the tokenizer's "
                         f"{tok.get_vocab_size(with_added_tokens=True)} tokens")
    tok.save(str(out_dir / "tokenizer.json"), pretty=True)
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config(tok))
    _write_json(out_dir / "generation_config.json",
                {"bos_token_id": eot, "eos_token_id": [im_end, eot], "pad_token_id": eot})
    specs = tensor_specs(config)
    targets = None
    if fp8:
        targets, kept = fp8_targets(config, [spec.name for spec in specs])
        config = {**config, "quantization_config": quantization_config(kept)}
    _write_json(out_dir / "config.json", config)
    write_weights(out_dir, specs, seed, int(shard_gb * 1e9), progress, targets)
    return config


def main(argv: list[str] | None = None) -> int:
    p = _Parser(prog="python -m tools.bench.make_bench_model", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", type=Path, help="folder to write (created; must be empty)")
    p.add_argument("--seed", type=int, default=0, help="weight seed (default: 0)")
    p.add_argument("--moe", action="store_true",
                   help="the MoE benchmark model (qwen3_next, Qwen3-Next-80B-A3B's layer shapes) instead")
    for key in MOE_DEFAULTS:
        dense, moe = DEFAULTS.get(key), MOE_DEFAULTS[key]
        default = f"{dense}, with --moe {moe}" if dense is not None and dense != moe else str(moe)
        p.add_argument(f"--{key.replace('_', '-')}", type=int, default=None,
                       help=f"{key.replace('_', ' ')}; smaller only for tests{'' if dense else ' (--moe)'} "
                            f"(default: {default})")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="a named shape instead of the 1.99 B model: qwen3.5-27b is Qwen3.5-27B's layers, 16 of "
                        "them (default: none)")
    p.add_argument("--fp8", action="store_true",
                   help="write the model's block-FP8 variant in the published layout (float8_e4m3fn weights with "
                        "a weight_scale_inv per 128 x 128 block, quantization_config listing the modules left in "
                        "bf16) (default: bf16)")
    p.add_argument("--shard-gb", type=float, default=2.0, help="safetensors shard size in GB (default: 2.0)")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="a tokenizer.json (with <|endoftext|>, <|im_start|>, <|im_end|>) to ship instead of the "
                        "built-in 4,096-token one; the vocabulary must fit --vocab-size (default: the built-in one)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr (default: shown)")
    args = p.parse_args(argv)
    if args.moe and args.preset:
        p.error("--preset and --moe are two different models: give one")
    defaults = MOE_DEFAULTS if args.moe else {**DEFAULTS, **(PRESETS[args.preset][0] if args.preset else {})}
    given = {key for key in MOE_DEFAULTS if getattr(args, key) is not None}
    if not args.moe and given - set(DEFAULTS):
        p.error(f"--{sorted(given - set(DEFAULTS))[0].replace('_', '-')} needs --moe")
    dims = {key: defaults[key] if getattr(args, key) is None else getattr(args, key) for key in defaults}
    if min(dims.values()) < 1 or not args.shard_gb > 0:
        p.error("the model's dimensions and --shard-gb must be positive")
    if args.moe and dims["experts_per_token"] > dims["experts"]:
        p.error(f"--experts-per-token {dims['experts_per_token']} exceeds --experts {dims['experts']}")
    try:
        config = write_bench_model(args.out_dir, args.seed, args.shard_gb, not args.no_progress, args.moe,
                                   args.tokenizer, args.preset, args.fp8, **dims)
    except (FileExistsError, ValueError) as exc:
        p.error(str(exc))
    count = parameter_count(config)
    on_disk = sum(f.stat().st_size for f in args.out_dir.glob("*.safetensors"))
    print(f"{args.out_dir}: {count:,} parameters ({count / 1e9:.2f} B), "
          f"{on_disk / 1e9:.2f} GB in {'FP8 (bf16 where left out)' if args.fp8 else 'bf16'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
