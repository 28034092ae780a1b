"""Load an HF checkpoint folder: config.json, safetensors weights (single or sharded); the
model's description for the config (describe_model); and the cache fingerprint (weights
digest included) for the CPU/disk tiers.

Weights are read with safetensors' `safe_open` only (never pickle). The model
is built on the meta device and materialized on the target device in the
target dtype, so host memory never holds a second full copy.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from hkv.config import ModelSpec
from hkv.models.kv_scales import KVScaleError, KVScaleReader
from hkv.models.fp8 import (
    QuantizationError, checkpoint_fp8, checkpoint_targets, convert_to_fp8, quantize_stream, quantize_targets,
)
from hkv.models.parallel import ShardPlan, TPConfigError, TPGroup, apply_tp, shard_config
from hkv.models.registry import resolve_family
from hkv.models.tokenizer import Tokenizer, tool_call_format

log = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# checkpoint tensor dtypes we cast from; anything else is a quantized format we do not run
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_FP8_DTYPES = (*_FLOAT_DTYPES, torch.float8_e4m3fn)  # and the weights of an FP8 checkpoint
QUANTIZE_CHOICES = ("none", "fp8")  # --quantize
_INDEX_NAME = "model.safetensors.index.json"


class ModelLoadError(ValueError):
    """The checkpoint folder is missing something or holds something we cannot load."""


@dataclass(frozen=True)
class LoadedModel:
    model: torch.nn.Module  # a family class from the registry, in eval mode, on the requested device/dtype
    hf_config: dict  # config.json as read
    # model layer -> (K scale, V scale) of FP8 KV pages, for the layers the checkpoint gives them (others: 1.0)
    kv_scales: dict[int, tuple[float, float]] = field(default_factory=dict)


@dataclass(frozen=True)
class WeightShard:
    path: Path
    tensor_names: tuple[str, ...]  # tensors read from this file, in file order


def read_hf_config(folder: Path) -> dict:
    """config.json of a checkpoint folder; ModelLoadError when the folder or file is missing or invalid."""
    if not folder.is_dir():
        raise ModelLoadError(f"model folder not found: {folder}")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{folder}: no config.json")
    try:
        hf_config = json.loads(config_path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ModelLoadError(f"{config_path}: not valid JSON ({exc})") from exc
    if not isinstance(hf_config, dict):
        raise ModelLoadError(f"{config_path}: expected a JSON object")
    try:
        checkpoint_fp8(hf_config)  # FP8 block-quantized checkpoints load; other quantizations are refused here
    except QuantizationError as exc:
        raise ModelLoadError(f"{folder}: {exc}") from None
    return hf_config


def _shard_header(path: Path) -> list[str]:
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return list(f.keys())
    except (SafetensorError, OSError) as exc:
        raise ModelLoadError(f"{path}: cannot read safetensors header ({exc})") from exc


def _indexed_shards(folder: Path, index_path: Path) -> list[WeightShard]:
    try:
        weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"{index_path}: not a valid safetensors index ({exc})") from exc
    by_file: dict[str, list[str]] = {}
    for name, file_name in weight_map.items():
        by_file.setdefault(file_name, []).append(name)
    shards = []
    for file_name in sorted(by_file):
        # the index must name plain files inside this folder
        if Path(file_name).name != file_name or not file_name.endswith(".safetensors"):
            raise ModelLoadError(f"{index_path}: bad shard file name {file_name!r}")
        path = folder / file_name
        if not path.is_file():
            raise ModelLoadError(f"{folder}: shard {file_name} named by {_INDEX_NAME} is missing")
        present = set(_shard_header(path))
        absent = [n for n in by_file[file_name] if n not in present]
        if absent:
            raise ModelLoadError(f"{path}: {len(absent)} tensors listed in the index are not in it, e.g. {absent[0]}")
        shards.append(WeightShard(path, tuple(by_file[file_name])))
    return shards


def find_weight_shards(folder: Path) -> list[WeightShard]:
    """The safetensors files and the tensors to read from each; checks the index names real files and tensors."""
    index_path = folder / _INDEX_NAME
    if index_path.is_file():
        return _indexed_shards(folder, index_path)
    single = folder / "model.safetensors"
    files = [single] if single.is_file() else sorted(folder.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        hint = f" (found {pickled[0]}: pickle-based weights are not supported)" if pickled else ""
        raise ModelLoadError(f"{folder}: no *.safetensors weights{hint}")
    shards, seen = [], set()
    for path in files:
        names = _shard_header(path)
        dup = seen.intersection(names)
        if dup:
            raise ModelLoadError(f"{path}: tensor {sorted(dup)[0]} is also in another file and there is no index")
        seen.update(names)
        shards.append(WeightShard(path, tuple(names)))
    return shards


def iter_tensors(shards: list[WeightShard], progress: Callable[[], None] | None = None, fp8: bool = False,
                 plan: ShardPlan | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every tensor of every shard; `progress()` after each (a rank's start-up
    report), else a progress bar on a terminal. fp8: float8_e4m3fn tensors are accepted too (an FP8
    checkpoint's weights). plan: a tensor-parallel rank's shard plan; only its slice of each split
    tensor is read."""
    allowed = _FP8_DTYPES if fp8 else _FLOAT_DTYPES
    total = sum(len(s.tensor_names) for s in shards)
    with tqdm(total=total, desc="loading weights", unit="tensor", file=sys.stderr,
              disable=True if progress is not None else None) as bar:
        for shard in shards:
            with safe_open(str(shard.path), framework="pt", device="cpu") as f:
                for name in shard.tensor_names:
                    try:
                        tensor = f.get_tensor(name) if plan is None else plan.read(f, name)
                    except TPConfigError as exc:
                        raise ModelLoadError(f"{shard.path.name}: tensor {name}: {exc}") from None
                    if tensor.dtype not in allowed:
                        raise ModelLoadError(
                            f"{shard.path.name}: tensor {name} has dtype {tensor.dtype}; only float16/bfloat16/"
                            "float32 weights are supported (float8_e4m3fn in an FP8 block-quantized checkpoint)"
                        )
                    yield name, tensor
                    bar.update(1)
                    if progress is not None:
                        progress()


def weights_digest(paths: list[Path], chunk_bytes: int = 1 << 20, cache: Path | None = None) -> str:
    """sha256 hex over each weight file's name, size and sha256, in name order.

    cache: a JSON file of per-file digests keyed by (resolved path, size,
    mtime_ns, inode); a file whose stat is unchanged is not read again (a
    large checkpoint hashes once, not at every start). Corrupt caches are
    ignored and rewritten.
    """
    paths = sorted(paths, key=lambda p: p.name)
    known = _read_digest_cache(cache)
    stats = {p: p.stat() for p in paths}
    signature = {p: f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}" for p, st in stats.items()}
    todo = [p for p in paths if signature[p] not in known]
    total = sum(stats[p].st_size for p in todo)
    with tqdm(total=total, desc="hashing weights", unit="B", unit_scale=True, file=sys.stderr,
              disable=None if todo else True) as bar:
        for path in todo:
            known[signature[path]] = _file_sha256(path, chunk_bytes, bar)
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.name.encode() + b"\0" + stats[path].st_size.to_bytes(8, "little"))
        digest.update(bytes.fromhex(known[signature[path]]))
    if cache is not None and todo:
        current = {signature[p]: known[signature[p]] for p in paths}
        older = {k: v for k, v in known.items() if k not in current}
        _write_digest_cache(cache, older | current)  # this checkpoint's files last: trimmed last
    return digest.hexdigest()


def _file_sha256(path: Path, chunk_bytes: int, bar) -> str:
    file_digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            file_digest.update(chunk)
            bar.update(len(chunk))
    return file_digest.hexdigest()


_DIGEST_CACHE_MAX = 4096  # entries kept; the oldest go first


def _read_digest_cache(cache: Path | None) -> dict[str, str]:
    if cache is None:
        return {}
    try:
        doc = json.loads(cache.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(doc, dict):
        return {}
    return {k: v for k, v in doc.items() if isinstance(k, str) and isinstance(v, str) and len(v) == 64
            and all(c in "0123456789abcdef" for c in v)}


def _write_digest_cache(cache: Path, entries: dict[str, str]) -> None:
    """Write atomically (temp file, rename), mode 0600; a failure only costs a re-hash next time."""
    items = list(entries.items())[-_DIGEST_CACHE_MAX:]
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        temp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(dict(items), f)
        os.replace(temp, cache)
    except OSError:
        pass


def _build_meta(family: type, cfg: object, dtype: torch.dtype, mtp: bool = False,
                tp: TPGroup | None = None) -> torch.nn.Module:
    # construct without allocating or initializing (allocated once on the target device by to_empty);
    # under --tp with this rank's heads and widths
    with torch.device("meta"):
        model = family(cfg if tp is None else shard_config(cfg, tp.size))
        if mtp:
            model.enable_mtp()
        if tp is not None:
            apply_tp(model, tp, cfg.vocab_size)
    return model.to(dtype=dtype)


def load_model(path: str | Path, dtype: str, device: str, mtp: bool = False,
               progress: Callable[[], None] | None = None, quantize: str = "none",
               tp: TPGroup | None = None, shards: list[WeightShard] | None = None) -> LoadedModel:
    """Build the checkpoint's model family on `device` in `dtype` and load its weights
    (with mtp=True also its MTP module, `mtp.*`, for speculative decoding).

    progress: called after each tensor is read (a rank's start-up phase, whose total the caller takes from
    `shards`: the folder's find_weight_shards, passed in so their headers are read once).
    quantize: "fp8" quantizes a float checkpoint's projections at load into 128 x 128 block FP8
    (hkv/models/fp8.py); an FP8 checkpoint (quantization_config) loads its FP8 weights as they are.
    tp: this rank's tensor-parallel group (torch.distributed initialized): the model gets the rank's
    heads and widths (hkv/models/parallel.py) and only the rank's slices are read.

    dtype: float32 | bfloat16 | float16 (resolved, never "auto"): activations and the unquantized
    weights. Raises ModelLoadError for a missing folder/config/weights/shard or unsupported tensors,
    ValueError for an unsupported model_type or config variant, WeightLoadError when tensors do not match.
    """
    if dtype not in TORCH_DTYPES:
        raise ModelLoadError(f"dtype {dtype!r} not one of {sorted(TORCH_DTYPES)}")
    if quantize not in QUANTIZE_CHOICES:
        raise ModelLoadError(f"quantize {quantize!r} not one of {list(QUANTIZE_CHOICES)}")
    folder = Path(path)
    hf_config = read_hf_config(folder)
    family = resolve_family(hf_config)
    cfg = family.config_class.from_hf(hf_config)
    shards = find_weight_shards(folder) if shards is None else shards
    model = _build_meta(family, cfg, TORCH_DTYPES[dtype], mtp, tp)
    plan = None if tp is None else ShardPlan(family.shard_rules(cfg), tp.rank, tp.size)
    fp8_checkpoint = checkpoint_fp8(hf_config)
    tensors = iter_tensors(shards, progress, fp8=fp8_checkpoint, plan=plan)
    if fp8_checkpoint:  # already FP8: quantize changes nothing
        if quantize == "fp8":
            log.info("--quantize fp8: %s is an FP8 checkpoint already; its FP8 weights load as they are", folder)
        convert_to_fp8(model, checkpoint_targets(model, (n for s in shards for n in s.tensor_names)))
    elif quantize == "fp8":
        targets = quantize_targets(model)
        convert_to_fp8(model, targets)
        tensors = quantize_stream(tensors, targets)
    model = model.to_empty(device=device)
    scales = KVScaleReader()  # FP8 KV scales are no parameters: taken out of the stream first
    model.load_weights(scales.absorb(tensors))
    model.eval()
    model.prepare_for_device()  # CUDA: fused projections (views of one weight; CPU: nothing)
    try:
        kv_scales = scales.scales(model.layer_map)
    except KVScaleError as exc:
        raise ModelLoadError(str(exc)) from None
    return LoadedModel(model=model, hf_config=hf_config, kv_scales=kv_scales)


def check_tp(path: str | Path, tp: int) -> None:
    """Raise TPConfigError (a ValueError) when `tp` ranks cannot split the checkpoint's heads and widths."""
    hf_config = read_hf_config(Path(path))
    if tp > 1 and checkpoint_fp8(hf_config):  # the block scales would need block-aligned shard plans
        raise TPConfigError(f"--tp {tp}: an FP8 checkpoint runs on one rank (--tp 1) so far")
    family = resolve_family(hf_config)
    shard_config(family.config_class.from_hf(hf_config), tp)


def describe_model(path: str | Path) -> ModelSpec:
    """The served model's description (hkv.config.ModelSpec): the family's own parse of
    config.json plus the tokenizer's EOS ids and the tool-call format its chat template teaches. The CLI
    calls this once; actors read the result.

    Raises ModelLoadError (or the family's ValueError) for a checkpoint hkv cannot serve.
    """
    folder = Path(path)
    hf_config = read_hf_config(folder)
    family = resolve_family(hf_config)
    try:
        cfg = family.config_class.from_hf(hf_config)
    except KeyError as exc:
        raise ModelLoadError(f"{folder}/config.json: missing {exc}") from None
    if not isinstance(cfg.max_position_embeddings, int) or cfg.max_position_embeddings < 2:
        raise ModelLoadError(f"{folder}/config.json: max_position_embeddings must be an integer >= 2, "
                             f"got {cfg.max_position_embeddings!r}")
    layer_types = getattr(cfg, "layer_types", ("full_attention",) * cfg.num_hidden_layers)
    kinds = tuple("linear" if t == "linear_attention" else "full" for t in layer_types)
    text = hf_config.get("text_config") or hf_config
    declared = text.get("dtype") or text.get("torch_dtype") or hf_config.get("dtype") or hf_config.get("torch_dtype")
    linear = {}
    if "linear" in kinds:
        linear = dict(linear_k_heads=cfg.linear_num_key_heads, linear_v_heads=cfg.linear_num_value_heads,
                      linear_k_dim=cfg.linear_key_head_dim, linear_v_dim=cfg.linear_value_head_dim,
                      conv_kernel=cfg.linear_conv_kernel_dim)
    tokenizer = Tokenizer.from_folder(folder)
    return ModelSpec(
        family=hf_config["model_type"], layer_kinds=kinds, vocab_size=cfg.vocab_size,
        max_context=cfg.max_position_embeddings, eos_ids=tokenizer.eos_token_ids,
        tool_call_format=tool_call_format(tokenizer.chat_template),
        hidden_size=cfg.hidden_size, num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim, declared_dtype=declared if isinstance(declared, str) else None, **linear,
    )


def mtp_layers(path: str | Path) -> int:
    """MTP layers whose weights (mtp.fc and mtp.layers.N.*) the folder's safetensors hold (what
    --spec-tokens drafts with); 0 without weights (the rank's load then says what is missing)."""
    try:
        names = [n for shard in find_weight_shards(Path(path)) for n in shard.tensor_names]
    except ModelLoadError:
        return 0
    if "mtp.fc.weight" not in names:
        return 0
    return len({n.split(".")[2] for n in names if n.startswith("mtp.layers.")})


def meta_model(path: str | Path, tp: int = 1) -> torch.nn.Module:
    """The checkpoint's model family built on the meta device: layouts without weights or memory
    (one rank's of `tp`)."""
    return meta_model_of(read_hf_config(Path(path)), tp)


def meta_model_of(hf_config: dict, tp: int = 1) -> torch.nn.Module:
    """The model family of a config.json dict, on the meta device (nothing allocated); with tp > 1
    one rank's shard of it (its heads and widths, hkv/models/parallel.py)."""
    family = resolve_family(hf_config)
    with torch.device("meta"):
        return family(shard_config(family.config_class.from_hf(hf_config), tp))


def cache_fingerprint(path: str | Path, dtype: str, page_size: int, tp: int, device: str,
                      digest_cache: Path | None = None, quantize: str = "none"):
    """The ModelFingerprint that roots every CPU/disk tier key (hkv/cache/keys.py); dtype: the model dtype,
    plus the KV pages' when they differ (ModelConfig.cache_dtype_name, "bfloat16/kv:float8_e4m3fn").

    architecture: model_type + sha256 of config.json's canonical JSON (an FP8 checkpoint's
    quantization_config included); weights: `weights_digest` of the shard files; tokenizer: sha256
    over tokenizer.json and tokenizer_config.json (those present); dtype: the activation dtype, with
    "+fp8" when --quantize fp8 quantizes a float checkpoint at load (other weights, same files).
    """
    from hkv.cache.keys import ModelFingerprint, tp_layout

    folder = Path(path)
    hf_config = read_hf_config(folder)
    canonical = json.dumps(hf_config, sort_keys=True, separators=(",", ":")).encode()
    architecture = f"{hf_config.get('model_type')}:{hashlib.sha256(canonical).hexdigest()}"
    tokenizer = hashlib.sha256()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        file = folder / name
        if file.is_file():
            tokenizer.update(name.encode() + b"\0" + file.read_bytes())
    weights = weights_digest([s.path for s in find_weight_shards(folder)], cache=digest_cache)
    if quantize == "fp8" and not checkpoint_fp8(hf_config):
        dtype = f"{dtype}+fp8"
    return ModelFingerprint(architecture, weights, dtype, page_size, tp_layout(tp, device), tokenizer.hexdigest())
