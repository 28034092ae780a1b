"""hkv-launch's flags: the parser and its model, cache, tier, scheduling and server groups (the
prefill/decode and security groups are hkv/pd_flags.py's).

Split out of hkv/config.py, which checks the flags' combinations and builds the frozen config from
them; nothing here reads the environment.
"""

from __future__ import annotations

import argparse
import sys

from hkv.argtypes import fraction as _fraction, grammar_threads as _grammar_threads
from hkv.argtypes import non_negative_float as _non_negative_float
from hkv.argtypes import non_negative_int as _non_negative_int
from hkv.argtypes import positive_float as _positive_float, positive_int as _positive_int
from hkv.engine.validate import MAX_SPEC_TOKENS
from hkv.pd_flags import pd_flags, security_flags

DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")  # --kv-cache-dtype; fp8_e4m3 stores float8_e4m3fn pages
DEFAULT_DISK_CACHE_GB = 16.0  # --disk-cache-gb when only --disk-cache-dir is given
PD_STAGING_GB = 2.0  # --cpu-cache-gb of a prefill or decode instance that gives none: room to stage its transfers


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one clear line, exit 2
        print(f"hkv-launch: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default="tiny-hybrid",
                   help="an HF checkpoint folder, or a built-in model: tiny-hybrid (trained on Python's standard "
                        "library), tiny-dense or tiny-hybrid-random (random weights, for tests) (default: tiny-hybrid)")
    g.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="where the ranks run (default: cuda when a CUDA device is visible, else cpu)")
    g.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="weights and KV dtype (default: auto = float32 on cpu, else the checkpoint's, else bfloat16)")
    g.add_argument("--quantize", choices=("none", "fp8"), default="none",
                   help="fp8: quantize a float checkpoint's projections at load into FP8 with a scale per "
                        "128 x 128 block (the layout of published FP8 checkpoints, which load as FP8 without "
                        "it); embeddings, lm_head, norms, MoE routers and gates and the GDN a/b projections keep "
                        "--dtype (default: none)")
    g.add_argument("--tp", type=_positive_int, default=1,
                   help="tensor-parallel ranks, one process (and on cuda one GPU) each, sharing every step; N "
                        "must divide the model's attention, GDN key and value heads and MLP widths, and divide "
                        "or be a multiple of its KV heads; not with --mode prefill|decode (default: 1)")
    g.add_argument("--seed", type=int, default=0,
                   help="seed of the ranks' torch generators; sampling seeds are per request (default: 0)")
    g.add_argument("--compile-cache-dir", default=None,
                   help="folder of compiled GPU kernels and their autotuning results (Triton's cache), kept "
                        "for later starts and other instances; created with mode 0700, and refused when another "
                        "user owns it or others may write it (default: $XDG_CACHE_HOME/hkv/compile, else "
                        "~/.cache/hkv/compile)")


def _cache_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cache")
    g.add_argument("--page-size", type=_positive_int, default=16, help="tokens per KV page (default: 16)")
    g.add_argument("--max-total-tokens", type=_positive_int, default=None,
                   help="device KV capacity in tokens, a multiple of --page-size (default: 32768 on cpu; on cuda "
                        "what --gpu-memory-fraction leaves after weights, activations and state slots)")
    g.add_argument("--checkpoint-interval", type=_positive_int, default=None,
                   help="hybrid models: tokens between saved linear-state checkpoints, a multiple of both "
                        "--page-size and 64, the GDN chunk (default: 16 pages, rounded up to such a multiple)")
    g.add_argument("--state-slots", type=_positive_int, default=None,
                   help="hybrid models: linear-state slots for live states and checkpoints together "
                        "(default: 3 x --max-running-requests on cpu; on cuda --max-running-requests plus "
                        "a quarter of the memory --gpu-memory-fraction leaves after the weights, in checkpoints)")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="dtype of the KV pages (device pool, CPU and disk tiers, PD transfers): auto = the model "
                        "dtype (--dtype); fp8_e4m3 = float8_e4m3fn with a per-layer scale (the checkpoint's "
                        "k_scale / v_scale, else 1.0), half the bytes of bf16, so about twice the pages in the same "
                        "memory (default: auto)")
    g.add_argument("--no-prefix-cache", action="store_true",
                   help="turn prefix reuse off: nothing is matched or kept (default: on)")


def _tier_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("tiers")
    g.add_argument("--cpu-cache-gb", type=_non_negative_float, default=None,
                   help="CPU tier size in GiB of shared memory; 0 = no CPU or disk tier (default: 0; with --mode "
                        f"prefill or decode, where the tier stages transfers, {PD_STAGING_GB:g})")
    g.add_argument("--disk-cache-dir", default=None,
                   help="folder of the disk tier behind the CPU tier (default: none, no disk tier)")
    g.add_argument("--disk-cache-gb", type=_non_negative_float, default=None,
                   help=f"disk tier budget in GiB (default: {DEFAULT_DISK_CACHE_GB:g} when --disk-cache-dir is given)")
    g.add_argument("--tier-checkpoint-interval", type=_positive_int, default=None,
                   help="hybrid models: tokens between the interior checkpoints the CPU and disk tiers keep, a "
                        "multiple of --checkpoint-interval; every prompt end and finish keeps one too (default: the "
                        "smallest multiple at which a checkpoint's bytes are at most the KV of the tokens it spans)")


def _scheduling_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("scheduling")
    g.add_argument("--max-running-requests", type=_positive_int, default=None,
                   help="sequences in the running batch at once (default: 32 on cpu, 256 on cuda)")
    g.add_argument("--chunked-prefill-size", type=_positive_int, default=None,
                   help="tokens per step across all sequences, prefill chunks included (default: 512 on cpu, "
                        "8192 on cuda)")
    g.add_argument("--prefix-wait-tokens", type=_non_negative_int, default=256,
                   help="a waiting request whose prompt shares a prefix with a prompt another request is still "
                        "prefilling waits for it when that adds at least this many cached tokens, rather than "
                        "compute the prefix again beside it; 0 = never wait (default: 256)")
    g.add_argument("--grammar-threads", type=_grammar_threads, default=None,
                   help="structured output: threads each rank fills a step's token masks with (llguidance, a row "
                        "at a time), 1..256 (default: a quarter of the CPUs, 1 to 8)")
    g.add_argument("--spec-tokens", type=_non_negative_int, default=0,
                   help=f"speculative decoding: tokens the checkpoint's MTP module drafts per step, verified in one "
                        f"target forward; at most {MAX_SPEC_TOKENS}, needs mtp.* weights (default: 0 = off)")
    g.add_argument("--draft-window", type=_non_negative_int, default=None,
                   help="positions of draft-layer K/V kept per request: 0 = full length, paged like the target; "
                        "W > 0 = a ring of the last W, at least --spec-tokens + 1 (default: 0)")
    g.add_argument("--no-cuda-graph", action="store_true",
                   help="run decode, verify, short one-sequence prefill and mixed steps eagerly on CUDA, no "
                        "captured graphs (default: graphs on)")
    g.add_argument("--cuda-graph-max-bs", type=_positive_int, default=None,
                   help="largest decode batch captured in a CUDA graph (with --spec-tokens K: verify batch, at "
                        "most 512 / (K + 1)); larger ones run eagerly (default: --max-running-requests)")
    g.add_argument("--gpu-memory-fraction", type=_fraction, default=None,
                   help="share of the GPU's memory for weights, activations, graphs and cache pools; "
                        "sizes the KV pool when --max-total-tokens is not given (default: 0.9)")


def _server_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="interface the HTTP api binds (default: 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="HTTP port (default: 8000)")
    g.add_argument("--name", default=None,
                   help="instance name; shared memory is /hkv-<name>-<region> (default: hkv<port>)")
    g.add_argument("--request-timeout", type=_positive_float, default=30.0,
                   help="seconds a client has to send a request's head and body; a slower one gets 408 and its "
                        "connection is closed; also the idle time after which a keep-alive connection is closed "
                        "(default: 30)")
    g.add_argument("--max-connections", type=_positive_int, default=1024,
                   help="open HTTP connections at most; one past it gets 503 and is closed (default: 1024)")
    g.add_argument("--stall-timeout", type=_positive_float, default=10.0,
                   help="seconds without a finished step, while work is pending, after which /ready answers 503; "
                        "idle ranks are probed every half of it and /ready answers 503 once they have not answered "
                        "for this long (default: 10)")
    g.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info",
                   help="log level of every actor; debug also checks the cache books after every step (default: info)")
    g.add_argument("--tool-call-parser", choices=("auto", "hermes", "qwen3_coder", "none"), default="auto",
                   help="how chat answers carry tool calls: hermes (<tool_call>{json}</tool_call>, Qwen2.5/Qwen3), "
                        "qwen3_coder (<function=...><parameter=...> XML, Qwen3-Coder/Qwen3.5); auto picks the "
                        "format the chat template teaches; none refuses `tools` (default: auto)")
    g.add_argument("--reasoning-parser", choices=("none", "qwen3"), default="none",
                   help="qwen3: the answer's <think>...</think> block becomes `reasoning_content` on "
                        "/v1/chat/completions (default: none, all text is `content`)")
    g.add_argument("--log-request-times", action="store_true",
                   help="the router logs one line per finished request: when its peer fetch and tier lookup "
                        "answered, its admission, first step, first token and finish, in ms from its arrival, for "
                        "TTFT breakdowns (default: off)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="hkv-launch", description="Serve a language model with hkv (OpenAI-compatible HTTP).")
    for group in (_model_flags, _cache_flags, _tier_flags, _scheduling_flags, _server_flags, pd_flags,
                  security_flags):
        group(p)
    return p
