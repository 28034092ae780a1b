"""Configuration: frozen dataclasses built once from the command line.

`parse_cli(argv)` validates flags, resolves every "auto" value and returns one
frozen `HkvConfig`. Children receive it as JSON (`to_json` / `from_json`) and
never parse flags or read the environment themselves. This is the only module
that reads environment variables.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

BUILTIN_MODELS = ("tiny-hybrid", "tiny-dense")
DTYPES = ("auto", "float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """A bad flag or flag combination; the CLI prints it as one line and exits 2."""


@dataclass(frozen=True)
class ModelConfig:
    model: str  # the CLI value: a checkpoint folder or a built-in name
    path: str  # resolved checkpoint folder
    dtype: str  # resolved: float32 | bfloat16 | float16
    device: str  # cpu | cuda
    tp: int
    seed: int
    cpu_threads: int  # torch intra-op threads of a CPU rank (leaves cores to the api and router)
    max_context: int  # the model's context length (max_position_embeddings)


@dataclass(frozen=True)
class CacheConfig:
    page_size: int
    max_total_tokens: int  # device KV capacity in tokens (a multiple of page_size)
    prefix_cache: bool
    hybrid: bool  # the model has linear-attention layers (state slots, checkpoints)
    checkpoint_interval: int | None  # hybrid: tokens between checkpoints; None for dense models
    state_slots: int  # hybrid: linear-state slots, live states and checkpoints together; 0 for dense
    cpu_cache_gb: float  # CPU tier (shm page pool) size; 0 = no tiers
    disk_cache_dir: str | None  # disk tier folder (absolute), None = no disk tier
    disk_cache_gb: float | None  # disk tier budget; set whenever disk_cache_dir is

    @property
    def tiers(self) -> bool:
        """A cache worker runs (CPU tier, maybe disk behind it)."""
        return self.cpu_cache_gb > 0

    @property
    def num_pages(self) -> int:
        return self.max_total_tokens // self.page_size


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int
    chunked_prefill_size: int  # prompt tokens per step across all sequences
    max_queued_requests: int  # bounded admission queue at the router (429 beyond it)


@dataclass(frozen=True)
class SpecConfig:
    spec_tokens: int
    draft_window: int | None


@dataclass(frozen=True)
class ServerConfig:
    host: str
    port: int
    name: str  # instance name: shared-memory segments are /hkv-<name>-<region>
    mode: str
    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    secret_file: str | None
    api_key: str | None
    log_level: str
    max_body_bytes: int
    drain_timeout_s: float


@dataclass(frozen=True)
class HkvConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    spec: SpecConfig
    server: ServerConfig
    run_dir: str  # private (0700) directory for ipc:// sockets of this instance
    builtin_cache_dir: str = field(default="")  # where built-in models are written

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "HkvConfig":
        raw = json.loads(text)
        server = raw["server"]
        server["prefill_urls"] = tuple(server["prefill_urls"])
        server["decode_urls"] = tuple(server["decode_urls"])
        return cls(
            model=ModelConfig(**raw["model"]),
            cache=CacheConfig(**raw["cache"]),
            scheduler=SchedulerConfig(**raw["scheduler"]),
            spec=SpecConfig(**raw["spec"]),
            server=ServerConfig(**raw["server"]),
            run_dir=raw["run_dir"],
            builtin_cache_dir=raw["builtin_cache_dir"],
        )

    def ipc_address(self, link: str) -> str:
        """The ipc:// endpoint of one link inside this instance's private run directory."""
        return f"ipc://{self.run_dir}/{link}.sock"


DEFAULT_DISK_CACHE_GB = 16.0  # --disk-cache-gb when only --disk-cache-dir is given


def builtin_cache_dir() -> str:
    """Folder for built-in model checkpoints: $HKV_CACHE_DIR or ~/.cache/hkv."""
    env = os.environ.get("HKV_CACHE_DIR")
    if env:
        return env
    return str(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hkv")


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one clear line, exit 2
        print(f"hkv-launch: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="hkv-launch", description="Serve a language model with hkv.")
    p.add_argument("--model", default="tiny-hybrid", help="checkpoint folder, tiny-hybrid or tiny-dense")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--name", default=None, help="instance name (default: hkv<port>)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    p.add_argument("--dtype", choices=DTYPES, default="auto")
    p.add_argument("--tp", type=_positive_int, default=1)
    p.add_argument("--page-size", type=_positive_int, default=16)
    p.add_argument("--max-total-tokens", type=_positive_int, default=None)
    p.add_argument("--max-running-requests", type=_positive_int, default=None)
    p.add_argument("--chunked-prefill-size", type=_positive_int, default=None)
    p.add_argument("--checkpoint-interval", type=_positive_int, default=None)
    p.add_argument("--state-slots", type=_positive_int, default=None)
    p.add_argument("--no-prefix-cache", action="store_true")
    p.add_argument("--cpu-cache-gb", type=_non_negative_float, default=0.0)
    p.add_argument("--disk-cache-dir", default=None)
    p.add_argument("--disk-cache-gb", type=_non_negative_float, default=None)
    p.add_argument("--spec-tokens", type=_non_negative_int, default=0)
    p.add_argument("--draft-window", type=_non_negative_int, default=None)
    p.add_argument("--mode", choices=("normal", "prefill", "decode", "pd-master"), default="normal")
    p.add_argument("--prefill-url", action="append", default=[])
    p.add_argument("--decode-url", action="append", default=[])
    p.add_argument("--secret-file", default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    return p


def _not_built_yet(args: argparse.Namespace) -> list[str]:
    """Flags whose features have not landed: refusing them beats silently ignoring them."""
    pending = []
    if args.tp != 1:
        pending.append("--tp")
    for flag, value in (
        ("--draft-window", args.draft_window),
        ("--secret-file", args.secret_file),
    ):
        if value is not None:
            pending.append(flag)
    if args.spec_tokens > 0:
        pending.append("--spec-tokens")
    if args.mode != "normal":
        pending.append("--mode")
    if args.prefill_url:
        pending.append("--prefill-url")
    if args.decode_url:
        pending.append("--decode-url")
    return pending


def _check_combinations(args: argparse.Namespace) -> None:
    if not 0 < args.port < 65536:
        raise ConfigError(f"--port must be in 1..65535, got {args.port}")
    if args.max_total_tokens is not None and args.max_total_tokens % args.page_size:
        raise ConfigError(
            f"--max-total-tokens ({args.max_total_tokens}) must be a multiple of --page-size ({args.page_size})"
        )
    if args.max_total_tokens is not None and args.max_total_tokens < 2 * args.page_size:
        raise ConfigError("--max-total-tokens must hold at least two pages")
    if args.name is not None and not _valid_name(args.name):
        raise ConfigError("--name may hold only letters, digits, '_' and '.', at most 32 characters")
    _check_tiers(args)
    if args.model not in BUILTIN_MODELS and not Path(args.model, "config.json").is_file():
        raise ConfigError(f"--model {args.model}: not a built-in model and no config.json in that folder")


def _check_tiers(args: argparse.Namespace) -> None:
    """The CPU tier needs the prefix cache; the disk tier sits behind the CPU tier."""
    if args.cpu_cache_gb > 0 and args.no_prefix_cache:
        raise ConfigError("--cpu-cache-gb needs the prefix cache (drop --no-prefix-cache)")
    if args.cpu_cache_gb > 4096:
        raise ConfigError(f"--cpu-cache-gb {args.cpu_cache_gb} is more than 4096")
    if args.disk_cache_gb is not None and args.disk_cache_dir is None:
        raise ConfigError("--disk-cache-gb needs --disk-cache-dir")
    if args.disk_cache_dir is None:
        return
    if args.cpu_cache_gb <= 0:
        raise ConfigError("--disk-cache-dir needs --cpu-cache-gb > 0 (disk entries come back through the CPU tier)")
    if args.disk_cache_gb is not None and args.disk_cache_gb <= 0:
        raise ConfigError("--disk-cache-gb must be > 0")
    target = Path(args.disk_cache_dir)
    if target.exists() and not target.is_dir():
        raise ConfigError(f"--disk-cache-dir {args.disk_cache_dir}: exists and is not a directory")


def _read_hf_config(model_path: str) -> dict:
    try:
        hf = json.loads(Path(model_path, "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--model {model_path}: unreadable config.json ({exc})") from None
    return hf.get("text_config", hf)


def _max_context(text_cfg: dict) -> int:
    value = text_cfg.get("max_position_embeddings")
    if not isinstance(value, int) or value < 2:
        raise ConfigError(f"config.json: max_position_embeddings must be an integer >= 2, got {value!r}")
    return value


def _is_hybrid(text_cfg: dict) -> bool:
    return "linear_attention" in (text_cfg.get("layer_types") or ())


def _resolve_checkpoints(
    args: argparse.Namespace, hybrid: bool, max_running: int, on_cpu: bool
) -> tuple[int | None, int]:
    """(checkpoint interval, state slots) for the model; exits 2 on a bad combination."""
    if not hybrid:
        for flag, value in (("--checkpoint-interval", args.checkpoint_interval), ("--state-slots", args.state_slots)):
            if value is not None:
                raise ConfigError(f"{flag} applies to hybrid models only; {args.model} has no linear attention")
        return None, 0
    interval = args.checkpoint_interval or 16 * args.page_size
    if interval % args.page_size:
        raise ConfigError(f"--checkpoint-interval ({interval}) must be a multiple of --page-size ({args.page_size})")
    # A checkpoint of a real model is tens of MiB (docs/sizing.md): be frugal on GPUs.
    slots = args.state_slots or (3 * max_running if on_cpu else max_running + 64)
    if slots < max_running or (slots == max_running and not args.no_prefix_cache):
        raise ConfigError(
            f"--state-slots ({slots}) must exceed --max-running-requests ({max_running}): "
            "each running request holds a live state slot and checkpoints need the rest"
        )
    return interval, slots


def _valid_name(name: str) -> bool:
    return 0 < len(name) <= 32 and all(c.isalnum() or c in "_." for c in name) and name.isascii()


def _resolve_device(requested: str | None) -> str:
    import torch

    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available")
    if requested is not None:
        return requested
    return "cuda" if torch.cuda.is_available() else "cpu"


def _resolve_dtype(requested: str, device: str, text_cfg: dict) -> str:
    if requested != "auto":
        if device == "cpu" and requested == "float16":
            raise ConfigError("--dtype float16 is not supported on --device cpu")
        return requested
    if device == "cpu":
        return "float32"
    declared = text_cfg.get("dtype") or text_cfg.get("torch_dtype") or "bfloat16"
    return declared if declared in DTYPES[1:] else "bfloat16"


def _cpu_threads() -> int:
    """Intra-op threads for a CPU rank: spinning OpenMP threads that share cores with the
    api and router slow small forwards tenfold, so keep two cores free when there are few."""
    cores = len(os.sched_getaffinity(0))
    return max(1, cores - 2)


def _resolve_model_path(model: str, cache_dir: str) -> str:
    if model in BUILTIN_MODELS:
        from hkv.models.tiny import ensure_builtin

        return str(ensure_builtin(model, Path(cache_dir)))
    return str(Path(model).resolve())


def parse_cli(argv: list[str] | None = None) -> HkvConfig:
    """Parse and validate flags, resolve "auto" values; raises ConfigError or exits 2."""
    args = build_parser().parse_args(argv)
    pending = _not_built_yet(args)
    if pending:
        raise ConfigError(f"not implemented yet: {pending[0]}")
    _check_combinations(args)
    device = _resolve_device(args.device)
    cache_dir = builtin_cache_dir()
    path = _resolve_model_path(args.model, cache_dir)
    text_cfg = _read_hf_config(path)
    dtype = _resolve_dtype(args.dtype, device, text_cfg)
    name = args.name or f"hkv{args.port}"
    on_cpu = device == "cpu"
    max_total = args.max_total_tokens or (32768 if on_cpu else 262144)
    max_running = args.max_running_requests or (32 if on_cpu else 256)
    hybrid = _is_hybrid(text_cfg)
    interval, state_slots = _resolve_checkpoints(args, hybrid, max_running, on_cpu)
    run_dir = tempfile.mkdtemp(prefix=f"hkv-{name}-")  # mode 0700
    return HkvConfig(
        model=ModelConfig(args.model, path, dtype, device, args.tp, args.seed, _cpu_threads(), _max_context(text_cfg)),
        cache=CacheConfig(
            page_size=args.page_size,
            max_total_tokens=max_total,
            prefix_cache=not args.no_prefix_cache,
            hybrid=hybrid,
            checkpoint_interval=interval,
            state_slots=state_slots,
            cpu_cache_gb=args.cpu_cache_gb,
            disk_cache_dir=str(Path(args.disk_cache_dir).resolve()) if args.disk_cache_dir else None,
            disk_cache_gb=(args.disk_cache_gb or DEFAULT_DISK_CACHE_GB) if args.disk_cache_dir else None,
        ),
        scheduler=SchedulerConfig(
            max_running_requests=max_running,
            chunked_prefill_size=args.chunked_prefill_size or (512 if on_cpu else 8192),
            max_queued_requests=4096,
        ),
        spec=SpecConfig(args.spec_tokens, args.draft_window),
        server=ServerConfig(
            host=args.host,
            port=args.port,
            name=name,
            mode=args.mode,
            prefill_urls=tuple(args.prefill_url),
            decode_urls=tuple(args.decode_url),
            secret_file=args.secret_file,
            api_key=args.api_key or os.environ.get("HKV_API_KEY") or None,
            log_level=args.log_level,
            max_body_bytes=8 * 1024 * 1024,
            drain_timeout_s=60.0,
        ),
        run_dir=run_dir,
        builtin_cache_dir=cache_dir,
    )
