"""hkv-launch's prefill/decode and security flag groups, and the checks of their combinations.

Split out of hkv/config.py (which builds the frozen config from them) to keep
that file readable; docs/pd.md describes the modes.
"""

from __future__ import annotations

import argparse
from urllib.parse import urlsplit

from hkv.argtypes import positive_float

MODES = ("normal", "prefill", "decode", "pd-master")
DEFAULT_PD_TIMEOUT_S = 30.0
PD_TRANSFERS = ("auto", "pair", "tier")


def pd_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prefill/decode disaggregation")
    g.add_argument("--mode", choices=MODES, default="normal",
                   help="instance role (default: normal): prefill and decode instances run behind a pd-master, "
                        "which picks one of each per request (docs/pd.md)")
    g.add_argument("--prefill-url", action="append", default=[],
                   help="pd-master: a prefill instance's http://host:port, repeatable (default: none)")
    g.add_argument("--decode-url", action="append", default=[],
                   help="pd-master: a decode instance's http://host:port, repeatable (default: none)")
    g.add_argument("--pd-port", type=int, default=0,
                   help="prefill/decode: TCP port of the transporter, bound on --host (default: 0, a free port, "
                        "announced at GET /pd/info)")
    g.add_argument("--pd-timeout", type=positive_float, default=DEFAULT_PD_TIMEOUT_S,
                   help="prefill/decode: seconds a transfer may take before both ends roll it back "
                        f"(default: {DEFAULT_PD_TIMEOUT_S:.0f})")
    g.add_argument("--pd-transfer", choices=PD_TRANSFERS, default="auto",
                   help="prefill/decode: how a prompt's pages move between the instances; auto: CUDA IPC when "
                        "both share a GPU, NCCL point-to-point between GPUs, the CPU tier over ZeroMQ on CPU; "
                        "pair: as auto, but on CPU a gloo pair group between the ranks (the NCCL path's code); "
                        "tier: always staged in the CPU tier; both instances should agree (default: auto)")


def security_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("security")
    g.add_argument("--api-key", default=None,
                   help="bearer key /v1/* requests must carry; visible in ps, prefer --api-key-file "
                        "(default: $HKV_API_KEY, else none)")
    g.add_argument("--api-key-file", default=None,
                   help="read the api key from this file, one line (default: none)")
    g.add_argument("--admin-key", default=None,
                   help="bearer key of POST /cache/flush and other admin routes (default: $HKV_ADMIN_KEY, "
                        "else the api key)")
    g.add_argument("--metrics-key", default=None,
                   help="bearer key of GET /metrics (default: $HKV_METRICS_KEY, else /metrics is open)")
    g.add_argument("--secret-file", default=None,
                   help="file (mode 0600, at least 32 bytes) holding the HMAC secret of the control messages "
                        "between prefill, decode and pd-master instances; needed in those modes (default: none)")


def pair_backend(mode: str, device: str, pd_transfer: str, tp: int, spec_tokens: int) -> str:
    """The pair process group's backend a prefill or decode rank moves prompts with: "nccl", "gloo" or ""
    (none: the CPU tier, and CUDA IPC on one GPU). One rank a side, and no drafter (its window is not sent)."""
    if mode not in ("prefill", "decode") or pd_transfer == "tier" or tp != 1 or spec_tokens:
        return ""
    if device == "cuda":
        return "nccl"
    return "gloo" if pd_transfer == "pair" else ""


def check_pd(args: argparse.Namespace, error: type[Exception]) -> None:
    """Raise `error` with one line for a flag combination the modes cannot serve."""
    mode = args.mode
    if (args.prefill_url or args.decode_url) and mode != "pd-master":
        raise error("--prefill-url and --decode-url are pd-master flags (give --mode pd-master)")
    if mode == "pd-master" and not (args.prefill_url and args.decode_url):
        raise error("--mode pd-master needs at least one --prefill-url and one --decode-url")
    for url in (*args.prefill_url, *args.decode_url):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
            raise error(f"instance URL {url!r}: want http://host:port")
    if mode != "normal" and args.secret_file is None:
        raise error(f"--mode {mode} needs --secret-file (the HMAC secret shared by the instances)")
    if not 0 <= args.pd_port < 65536:
        raise error(f"--pd-port must be in 0..65535, got {args.pd_port}")
    if mode in ("prefill", "decode"):
        if args.no_prefix_cache:
            raise error(f"--mode {mode} moves prompts through the prefix cache (drop --no-prefix-cache)")
        if args.cpu_cache_gb <= 0:
            raise error(f"--mode {mode} stages transfers in the CPU tier: give --cpu-cache-gb > 0")
    if args.secret_file is not None:
        from hkv.ipc.auth import AuthError, load_secret

        try:
            load_secret(args.secret_file)
        except AuthError as exc:
            raise error(f"--secret-file: {exc}") from None
