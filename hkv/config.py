"""Configuration: frozen dataclasses built once from the command line.

`parse_cli(argv)` validates flags, reads the model's description once
(config.json and the tokenizer, through `hkv.models.loader.describe_model`),
resolves every "auto" value and returns one frozen `HkvConfig`. Children
receive it as JSON (`to_json` / `from_json`, msgspec) and never parse flags,
read config.json for facts, or read the environment themselves. This is the
only module that reads environment variables.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from hkv.argtypes import batch_sizes, mask_cache_mode
from hkv.engine.validate import MAX_SPEC_TOKENS
from hkv.ipc.rundir import create_run_dir
from hkv.keys import KeyHash  # noqa: F401  (re-exported: the api and tests take it from here)
from hkv.launch_flags import DEFAULT_DISK_CACHE_GB, DTYPES, PD_STAGING_GB, build_parser
from hkv.pd_flags import check_pd, pair_backend
from hkv_kernels.gdn import GDN_CHUNK

# tiny-hybrid: trained, shipped in the package; the others: random weights for tests (hkv/models/tiny.py)
BUILTIN_MODELS = ("tiny-hybrid", "tiny-dense", "tiny-hybrid-random")
LAYER_KINDS = ("full", "linear")  # full attention (KV pages) or linear attention (state slots)


class ConfigError(ValueError):
    """A bad flag or flag combination; the CLI prints it as one line and exits 2."""


@dataclass(frozen=True)
class ModelSpec:
    """What every actor needs to know about the served model, read once at the CLI.

    Built by `hkv.models.loader.describe_model` from config.json (through the model family's own parser, so the
    rank builds exactly this model) and the tokenizer (EOS ids, the chat template's tool-call format). Nothing else
    parses config.json to learn these facts.
    """

    family: str  # config.json model_type
    layer_kinds: tuple[str, ...]  # per model layer, one of LAYER_KINDS
    vocab_size: int
    max_context: int  # max_position_embeddings: prompt + output tokens of one sequence
    eos_ids: tuple[int, ...]  # generation config, config.json and the tokenizer's eos_token
    hidden_size: int
    num_heads: int  # attention query heads
    num_kv_heads: int
    head_dim: int
    linear_k_heads: int = 0  # Gated DeltaNet key heads (0 for dense models)
    linear_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0
    conv_kernel: int = 0  # GDN causal conv width
    declared_dtype: str | None = None  # config.json's dtype / torch_dtype, if any
    tool_call_format: str | None = None  # what the chat template teaches: hermes | qwen3_coder | None

    @property
    def hybrid(self) -> bool:
        """The model has linear-attention layers (state slots, checkpoints)."""
        return "linear" in self.layer_kinds

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind == "full")

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind == "linear")


@dataclass(frozen=True)
class ModelConfig:
    model: str  # the CLI value: a checkpoint folder or a built-in name
    path: str  # resolved checkpoint folder
    dtype: str  # resolved: float32 | bfloat16 | float16
    device: str  # cpu | cuda
    tp: int
    seed: int
    cpu_threads: int  # torch intra-op threads of a CPU rank (leaves cores to the api and router)
    spec: ModelSpec  # the model's description
    cuda_graph_max_bs: int = 0  # CUDA: decode batches up to this replay captured graphs; 0 = eager
    # --compile-cache-dir, resolved and created (mode 0700): compiled kernels and autotuning results; "" = none
    compile_cache_dir: str = ""
    # --kv-cache-dtype resolved: the KV pages' dtype when it is not the model's (float8_e4m3fn); "" = dtype
    kv_dtype: str = ""
    quantize: str = "none"  # --quantize: none | fp8 (a float checkpoint's projections in block FP8)
    profile_rows: tuple[int, ...] = ()  # $HKV_PROFILE_STEPS: decode batch sizes to profile (hkv/engine/step_profile.py)
    profile_dir: str = ""  # $HKV_PROFILE_DIR, absolute: where the ranks write their step profiles ("": the log only)

    @property
    def kv_cache_dtype(self) -> str:
        """The KV pool's dtype: float32 | bfloat16 | float16 | float8_e4m3fn."""
        return self.kv_dtype or self.dtype

    @property
    def cache_dtype_name(self) -> str:
        """What the cache fingerprint names (hkv.cache.keys): the model dtype, plus the KV dtype when it
        differs, so FP8 pages and model-dtype pages never share keys (and auto keeps the older keys)."""
        return self.dtype if self.kv_cache_dtype == self.dtype else f"{self.dtype}/kv:{self.kv_cache_dtype}"

    @property
    def max_context(self) -> int:
        return self.spec.max_context

    def compile_env(self) -> dict[str, str]:
        """The environment a rank compiles kernels under (hkv/actors/rank.py sets it before the first compile):
        Triton's cache in the compile cache directory, with autotuning results kept there too
        (TRITON_CACHE_AUTOTUNING: every autotuner, not only those that ask, as fla-core's do); {} without one."""
        if not self.compile_cache_dir:
            return {}
        return {"TRITON_CACHE_DIR": str(Path(self.compile_cache_dir) / "triton"), "TRITON_CACHE_AUTOTUNING": "1"}

    def apply_compile_env(self) -> None:
        """Set compile_env() in this process (a rank, before its first kernel compiles): this module is the
        one that touches the environment."""
        os.environ.update(self.compile_env())


@dataclass(frozen=True)
class CacheConfig:
    page_size: int
    # device KV capacity in tokens (a multiple of page_size); None on CUDA without the flag: the
    # rank sizes the pool from the GPU memory left after weights and activations and reports it
    max_total_tokens: int | None
    prefix_cache: bool
    hybrid: bool  # the model has linear-attention layers (ModelSpec.hybrid)
    checkpoint_interval: int | None  # hybrid: tokens between checkpoints; None for dense models
    # hybrid: linear-state slots, live states and checkpoints together; 0 for dense; None: the
    # rank sizes it from GPU memory (CUDA without --state-slots, hkv/engine/sizing.py)
    state_slots: int | None
    cpu_cache_gb: float  # CPU tier (shm page pool) size; 0 = no tiers
    disk_cache_dir: str | None  # disk tier folder (absolute), None = no disk tier
    disk_cache_gb: float | None  # disk tier budget; set whenever disk_cache_dir is
    gpu_memory_fraction: float = 0.9  # CUDA: share of the GPU's memory for weights, activations and pools
    tier_checkpoint_interval: int | None = None  # hybrid with tiers: tokens between interior tier checkpoints

    @property
    def tiers(self) -> bool:
        """A cache worker runs (CPU tier, maybe disk behind it)."""
        return self.cpu_cache_gb > 0

    @property
    def num_pages(self) -> int | None:
        """KV pages the flags fix; None when the rank sizes the pool (CUDA, no --max-total-tokens)."""
        return None if self.max_total_tokens is None else self.max_total_tokens // self.page_size


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int
    chunked_prefill_size: int  # prompt tokens per step across all sequences
    max_queued_requests: int  # bounded admission queue at the router (429 beyond it)
    prefix_wait_tokens: int = 256  # a waiting prompt waits for another's prefill of a prefix this much longer; 0 = off
    grammar_threads: int = 0  # --grammar-threads: a rank's mask threads; 0 = grammar.default_mask_threads()
    grammar_device_wait: bool = False  # experimental $HKV_GRAMMAR_DEVICE_WAIT=1: masks off the main thread, CUDA waits
    grammar_mask_cache: str = "on"  # $HKV_GRAMMAR_MASK_CACHE: 0 "off", verify; json_schema masks by schema state


@dataclass(frozen=True)
class SpecConfig:
    spec_tokens: int  # K: MTP drafts per step, 0 = off
    draft_window: int  # W: draft-layer K/V positions kept per request, 0 = full length (paged)
    oracle: str | None = None  # benchmarks: $HKV_SPEC_ORACLE, a file of known continuations (docs/spec.md)


@dataclass(frozen=True)
class ServerConfig:
    host: str
    port: int
    name: str  # instance name: shared-memory segments are /hkv-<name>-<region>
    mode: str
    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    secret_file: str | None
    api_key: KeyHash | None  # /v1/* and, without admin_key, admin routes
    log_level: str
    max_body_bytes: int
    drain_timeout_s: float
    request_timeout_s: float = 30.0  # a request's head and body must arrive within this (408 after)
    max_connections: int = 1024  # open HTTP connections; later ones get 503 and are closed
    stall_timeout_s: float = 10.0  # /ready is 503 when no step finished for this long with work pending, or the
    # ranks, probed when idle for half of it, have not answered for this long
    admin_key: KeyHash | None = None  # POST /cache/flush and later admin routes; None: the api key
    metrics_key: KeyHash | None = None  # GET /metrics; None: open
    pd_port: int = 0  # prefill/decode: the transporter's TCP port on `host` (0: a free one)
    pd_timeout_s: float = 30.0  # prefill/decode: a transfer not done by then rolls back at both ends
    pd_transfer: str = "auto"  # prefill/decode: auto | pair | tier (hkv/pd_flags.py)
    pd_stall_pull_s: float = 0.0  # tests: $HKV_PD_STALL_PULL_S, the transporter stalls a pull (or pair send)
    startup_stall_s: float = 0.0  # tests: $HKV_STARTUP_STALL_S, a rank holds its start-up this long after the weights
    log_request_times: bool = False  # the router logs where each finished request's time went (hkv/engine/timeline.py)
    tool_call_parser: str | None = None  # hermes | qwen3_coder (hkv/openai/chat_output.py); None: tools refused
    reasoning_parser: str | None = None  # qwen3: <think> blocks become reasoning_content; None: all is content


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
        return msgspec.json.encode(self).decode()

    @classmethod
    def from_json(cls, text: str | bytes) -> "HkvConfig":
        """The config a launcher wrote; msgspec checks every field's type on the way in."""
        return msgspec.json.decode(text, type=cls)

    def ipc_address(self, link: str) -> str:
        """The ipc:// endpoint of one link inside this instance's private run directory."""
        return f"ipc://{self.run_dir}/{link}.sock"

    @property
    def pair_backend(self) -> str:
        """The pair group's backend this prefill/decode instance moves prompts with ("": none; hkv/pd_flags.py)."""
        return pair_backend(self.server.mode, self.model.device, self.server.pd_transfer, self.model.tp,
                            self.spec.spec_tokens)


def user_cache_dir() -> Path:
    """The user's cache folder: $XDG_CACHE_HOME, else ~/.cache."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


def builtin_cache_dir() -> str:
    """Folder for built-in model checkpoints: $HKV_CACHE_DIR or ~/.cache/hkv."""
    env = os.environ.get("HKV_CACHE_DIR")
    if env:
        return env
    return str(user_cache_dir() / "hkv")


def _check_combinations(args: argparse.Namespace) -> None:
    if args.tp > 1 and args.mode in ("prefill", "decode"):
        raise ConfigError(f"--tp {args.tp}: prefill/decode instances run one rank (--tp 1) so far")
    if args.tp > 1 and args.quantize != "none":
        raise ConfigError(f"--tp {args.tp} with --quantize {args.quantize}: FP8 weights run on one rank (--tp 1) so far")
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
    if args.cpu_cache_gb is None:  # prefill and decode instances stage their transfers in the CPU tier
        args.cpu_cache_gb = PD_STAGING_GB if args.mode in ("prefill", "decode") else 0.0
    _check_tiers(args)
    check_pd(args, ConfigError)
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
    if args.tier_checkpoint_interval is not None and args.cpu_cache_gb <= 0:
        raise ConfigError("--tier-checkpoint-interval needs --cpu-cache-gb > 0")
    if args.disk_cache_dir is None:
        return
    if args.cpu_cache_gb <= 0:
        raise ConfigError("--disk-cache-dir needs --cpu-cache-gb > 0 (disk entries come back through the CPU tier)")
    if args.disk_cache_gb is not None and args.disk_cache_gb <= 0:
        raise ConfigError("--disk-cache-gb must be > 0")
    target = Path(args.disk_cache_dir)
    if target.exists() and not target.is_dir():
        raise ConfigError(f"--disk-cache-dir {args.disk_cache_dir}: exists and is not a directory")


def _check_spec(args: argparse.Namespace, spec: ModelSpec, path: str) -> None:
    """--spec-tokens / --draft-window against each other, the model and the other flags (exit 2)."""
    k, w = args.spec_tokens, args.draft_window
    if k == 0:
        if w is not None:
            raise ConfigError("--draft-window needs --spec-tokens >= 1")
        return
    if k > MAX_SPEC_TOKENS:
        raise ConfigError(f"--spec-tokens {k}: at most {MAX_SPEC_TOKENS}")
    if w is not None and 0 < w < k + 1:
        raise ConfigError(f"--draft-window {w}: must be 0 (full length) or at least --spec-tokens + 1 ({k + 1})")
    if not spec.hybrid or spec.family not in ("qwen3_5", "qwen3_5_text", "qwen3_next", "qwen3_5_moe",
                                               "qwen3_5_moe_text"):
        raise ConfigError(f"--spec-tokens: drafting uses a Qwen3.5 / Qwen3-Next MTP module; {args.model} is "
                          f"{spec.family}")
    from hkv.models.loader import mtp_layers  # reads the weights' headers: only when drafting

    if mtp_layers(path) < 1:
        raise ConfigError(f"--spec-tokens needs MTP weights (mtp.*); {args.model} has none")


def _describe(path: str) -> ModelSpec:
    """The model's description; a checkpoint hkv cannot serve is a ConfigError (exit 2)."""
    from hkv.models.loader import describe_model

    try:
        return describe_model(path)
    except (OSError, ValueError) as exc:  # ModelLoadError, TokenizerError and family parse errors are ValueErrors
        raise ConfigError(f"--model {path}: {exc}") from None


def _check_tp(args: argparse.Namespace, path: str) -> None:
    """--tp N against the model's heads and widths and the other flags (exit 2, before any rank starts)."""
    if args.tp == 1:
        return
    from hkv.models.loader import check_tp

    try:
        check_tp(path, args.tp)
    except ValueError as exc:
        raise ConfigError(f"--model {args.model}: {exc}") from None


def _resolve_checkpoints(
    args: argparse.Namespace, hybrid: bool, max_running: int, on_cpu: bool
) -> tuple[int | None, int | None]:
    """(checkpoint interval, state slots) for the model, the slots None where the rank sizes them
    from GPU memory; exits 2 on a bad combination."""
    if not hybrid:
        for flag, value in (("--checkpoint-interval", args.checkpoint_interval), ("--state-slots", args.state_slots)):
            if value is not None:
                raise ConfigError(f"{flag} applies to hybrid models only; {args.model} has no linear attention")
        return None, 0
    # checkpoints inside a prefill chunk fall on GDN chunk boundaries (docs/cache.md, "In-chunk checkpoints")
    align = math.lcm(args.page_size, GDN_CHUNK)
    interval = args.checkpoint_interval or -(-16 * args.page_size // align) * align
    if interval % align:
        raise ConfigError(f"--checkpoint-interval ({interval}) must be a multiple of {align}, the least common "
                          f"multiple of --page-size ({args.page_size}) and the GDN chunk ({GDN_CHUNK} tokens)")
    # A checkpoint of a real model is tens of MiB (docs/sizing.md): on a GPU the rank gives them a
    # share of the memory (None here), so that many prefixes keep their deepest checkpoints.
    slots = args.state_slots or (3 * max_running if on_cpu else None)
    if slots is not None and (slots < max_running or (slots == max_running and not args.no_prefix_cache)):
        raise ConfigError(
            f"--state-slots ({slots}) must exceed --max-running-requests ({max_running}): "
            "each running request holds a live state slot and checkpoints need the rest"
        )
    return interval, slots


def _graph_max_bs(args: argparse.Namespace, max_running: int, on_cpu: bool) -> int:
    """The largest decode batch replayed from a CUDA graph; 0 on CPU or with --no-cuda-graph."""
    if args.no_cuda_graph and args.cuda_graph_max_bs is not None:
        raise ConfigError("--cuda-graph-max-bs and --no-cuda-graph contradict each other")
    if on_cpu or args.no_cuda_graph:
        return 0
    return min(args.cuda_graph_max_bs or max_running, max_running)


def _tier_checkpoint_interval(args: argparse.Namespace, spec: ModelSpec, interval: int | None,
                              dtype: str) -> int | None:  # fmt: skip
    """Tokens between the tiers' interior checkpoints (hybrid with tiers), else None; exits 2 on a bad value."""
    requested = args.tier_checkpoint_interval
    if requested is not None and not spec.hybrid:
        raise ConfigError(f"--tier-checkpoint-interval applies to hybrid models only; {args.model} has no "
                          "linear attention")
    if interval is None or args.cpu_cache_gb <= 0:
        return None
    if requested is not None:
        if requested % interval:
            raise ConfigError(f"--tier-checkpoint-interval ({requested}) must be a multiple of "
                              f"--checkpoint-interval ({interval})")  # fmt: skip
        return requested
    # docs/sizing.md: KV bytes per token of the full-attention layers, fp32 state bytes per checkpoint
    kv_per_token = 2 * len(spec.full_layers) * spec.num_kv_heads * spec.head_dim * _KV_BYTES[dtype]
    conv_dim = 2 * spec.linear_k_heads * spec.linear_k_dim + spec.linear_v_heads * spec.linear_v_dim
    per_layer = spec.linear_v_heads * spec.linear_k_dim * spec.linear_v_dim + conv_dim * (spec.conv_kernel - 1)
    state_bytes = len(spec.linear_layers) * per_layer * 4
    span = -(-state_bytes // max(1, kv_per_token))  # tokens whose KV weighs one checkpoint
    return max(1, -(-span // interval)) * interval


def _compile_cache_dir(flag: str | None) -> str:
    """--compile-cache-dir resolved and created (mode 0700); a ConfigError (exit 2) when it cannot serve.

    The default ignores $HKV_CACHE_DIR, which tests point at a fresh folder for the built-in models: a
    GPU test session would compile every kernel again. The ranks load the compiled code it holds, so it
    must be this user's and writable by no one else.
    """
    path = (Path(flag).expanduser() if flag else user_cache_dir() / "hkv" / "compile").resolve()
    name = f"--compile-cache-dir {path}"
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{name}: exists and is not a directory")
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = path.stat()
    except OSError as exc:
        raise ConfigError(f"{name}: {exc.strerror or exc}") from None
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise ConfigError(f"{name}: must be owned by this user and writable by no one else (it holds compiled code "
                          f"the ranks load); it is mode {st.st_mode & 0o777:o}, owner uid {st.st_uid}")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{name}: not writable")
    return str(path)


def _valid_name(name: str) -> bool:
    return 0 < len(name) <= 32 and all(c.isalnum() or c in "_." for c in name) and name.isascii()


def _resolve_device(requested: str | None) -> str:
    import torch

    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available")
    if requested is not None:
        return requested
    return "cuda" if torch.cuda.is_available() else "cpu"


_KV_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}  # bytes of one KV element


def _resolve_kv_dtype(requested: str) -> str:
    """--kv-cache-dtype resolved to ModelConfig.kv_dtype: "" (the model dtype) or float8_e4m3fn."""
    return "float8_e4m3fn" if requested == "fp8_e4m3" else ""


def _resolve_dtype(requested: str, device: str, declared: str | None) -> str:
    if requested != "auto":
        if device == "cpu" and requested == "float16":
            raise ConfigError("--dtype float16 is not supported on --device cpu")
        return requested
    if device == "cpu":
        return "float32"
    return declared if declared in DTYPES[1:] else "bfloat16"


def _profile_steps(max_running: int) -> dict:
    """ModelConfig's profile fields from $HKV_PROFILE_STEPS and $HKV_PROFILE_DIR; ConfigError on a bad list."""
    rows = _env_mode("HKV_PROFILE_STEPS", lambda raw: batch_sizes(raw, max_running) if raw.strip() else ())
    folder = os.environ.get("HKV_PROFILE_DIR", "") if rows else ""
    return {"profile_rows": rows, "profile_dir": str(Path(folder).absolute()) if folder else ""}


def _env_mode(name: str, parse):  # $name through parse (unset reads as ""); a bad value exits 2
    try:
        return parse(os.environ.get(name, ""))
    except ValueError as exc:
        raise ConfigError(f"{name}={os.environ.get(name)!r}: want {exc}") from None


def _cpu_threads() -> int:
    """Intra-op threads for a CPU rank: spinning OpenMP threads that share cores with the
    api and router slow small forwards tenfold, so keep two cores free when there are few."""
    cores = len(os.sched_getaffinity(0))
    return max(1, cores - 2)


def _resolve_model_path(model: str, cache_dir: str) -> str:
    if model in BUILTIN_MODELS:
        from hkv.models.tiny import builtin_folder

        try:
            return str(builtin_folder(model, Path(cache_dir)))
        except FileNotFoundError as exc:  # an install without the shipped folder
            raise ConfigError(str(exc)) from None
    return str(Path(model).resolve())


def _cache_config(args: argparse.Namespace, spec: ModelSpec, max_running: int, on_cpu: bool,
                  dtype: str) -> CacheConfig:  # fmt: skip
    interval, state_slots = _resolve_checkpoints(args, spec.hybrid, max_running, on_cpu)
    return CacheConfig(
        page_size=args.page_size,
        max_total_tokens=args.max_total_tokens or (32768 if on_cpu else None),
        prefix_cache=not args.no_prefix_cache,
        hybrid=spec.hybrid,
        checkpoint_interval=interval,
        state_slots=state_slots,
        cpu_cache_gb=args.cpu_cache_gb,
        disk_cache_dir=str(Path(args.disk_cache_dir).resolve()) if args.disk_cache_dir else None,
        disk_cache_gb=(args.disk_cache_gb or DEFAULT_DISK_CACHE_GB) if args.disk_cache_dir else None,
        gpu_memory_fraction=args.gpu_memory_fraction or 0.9,
        tier_checkpoint_interval=_tier_checkpoint_interval(args, spec, interval, dtype),
    )


def _key(flag: str, value: str | None, env: str) -> KeyHash | None:
    """A bearer key from its flag or environment variable, hashed; ConfigError if it cannot travel in a header."""
    key = value if value is not None else os.environ.get(env) or None
    if key is None:
        return None
    if not key or not key.isascii() or not key.isprintable() or " " in key:
        raise ConfigError(f"{flag} must be printable ASCII without spaces")
    return KeyHash.of(key)


def _api_key(args: argparse.Namespace) -> KeyHash | None:
    if args.api_key is not None and args.api_key_file is not None:
        raise ConfigError("give --api-key or --api-key-file, not both")
    if args.api_key_file is None:
        return _key("--api-key", args.api_key, "HKV_API_KEY")
    try:
        lines = Path(args.api_key_file).read_text(encoding="utf-8").strip().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--api-key-file {args.api_key_file}: {exc}") from None
    if len(lines) != 1:
        raise ConfigError(f"--api-key-file {args.api_key_file}: want the key on one line")
    return _key("--api-key-file", lines[0].strip(), "HKV_API_KEY")


def _tool_call_parser(args: argparse.Namespace, spec: ModelSpec) -> str | None:
    """--tool-call-parser resolved: auto takes the format the chat template teaches (the model's description)."""
    if args.tool_call_parser != "auto":
        return None if args.tool_call_parser == "none" else args.tool_call_parser
    return spec.tool_call_format


def _server_config(args: argparse.Namespace, name: str, spec: ModelSpec) -> ServerConfig:
    return ServerConfig(
        host=args.host,
        port=args.port,
        name=name,
        mode=args.mode,
        prefill_urls=tuple(args.prefill_url),
        decode_urls=tuple(args.decode_url),
        secret_file=str(Path(args.secret_file).resolve()) if args.secret_file else None,
        api_key=_api_key(args),
        log_level=args.log_level,
        max_body_bytes=8 * 1024 * 1024,
        drain_timeout_s=60.0,
        request_timeout_s=args.request_timeout,
        max_connections=args.max_connections,
        stall_timeout_s=args.stall_timeout,
        admin_key=_key("--admin-key", args.admin_key, "HKV_ADMIN_KEY"),
        metrics_key=_key("--metrics-key", args.metrics_key, "HKV_METRICS_KEY"),
        pd_port=args.pd_port,
        pd_timeout_s=args.pd_timeout,
        pd_transfer=args.pd_transfer,
        log_request_times=args.log_request_times,
        tool_call_parser=_tool_call_parser(args, spec),
        reasoning_parser=None if args.reasoning_parser == "none" else args.reasoning_parser,
        pd_stall_pull_s=float(os.environ.get("HKV_PD_STALL_PULL_S") or 0.0),  # fault injection (tests/e2e/test_pd.py)
        startup_stall_s=float(os.environ.get("HKV_STARTUP_STALL_S") or 0.0),  # (tests/e2e/test_startup.py)
    )


def parse_cli(argv: list[str] | None = None) -> HkvConfig:
    """Parse and validate flags, read the model's description, resolve "auto" values;
    raises ConfigError or exits 2."""
    args = build_parser().parse_args(argv)
    _check_combinations(args)
    device = _resolve_device(args.device)
    cache_dir = builtin_cache_dir()
    path = _resolve_model_path(args.model, cache_dir)
    spec = _describe(path)
    _check_spec(args, spec, path)
    _check_tp(args, path)
    dtype = _resolve_dtype(args.dtype, device, spec.declared_dtype)
    name = args.name or f"hkv{args.port}"
    on_cpu = device == "cpu"
    max_running = args.max_running_requests or (32 if on_cpu else 256)
    kv_dtype = _resolve_kv_dtype(args.kv_cache_dtype)
    cache = _cache_config(args, spec, max_running, on_cpu, kv_dtype or dtype)
    server = _server_config(args, name, spec)
    compile_cache_dir = _compile_cache_dir(args.compile_cache_dir)
    profile, mask_cache = _profile_steps(max_running), _env_mode("HKV_GRAMMAR_MASK_CACHE", mask_cache_mode)
    run_dir = create_run_dir(name)  # mode 0700, marked with this process as its creator; nothing may fail after it
    return HkvConfig(
        model=ModelConfig(args.model, path, dtype, device, args.tp, args.seed, _cpu_threads(), spec,
                          cuda_graph_max_bs=_graph_max_bs(args, max_running, on_cpu),
                          compile_cache_dir=compile_cache_dir, kv_dtype=kv_dtype, quantize=args.quantize,
                          **profile),
        cache=cache,
        scheduler=SchedulerConfig(
            max_running_requests=max_running,
            chunked_prefill_size=args.chunked_prefill_size or (512 if on_cpu else 8192),
            max_queued_requests=4096,
            prefix_wait_tokens=args.prefix_wait_tokens,
            grammar_threads=args.grammar_threads or 0,
            grammar_device_wait=os.environ.get("HKV_GRAMMAR_DEVICE_WAIT") == "1",  # hkv/engine/mask_wait.py
            grammar_mask_cache=mask_cache,
        ),
        spec=SpecConfig(args.spec_tokens, args.draft_window or 0, os.environ.get("HKV_SPEC_ORACLE") or None),
        server=server,
        run_dir=run_dir,
        builtin_cache_dir=cache_dir,
    )
