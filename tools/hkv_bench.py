"""hkv-bench: drive a running hkv (or any OpenAI-compatible) server with a token-id workload and report
TTFT, TPOT, ITL, throughput, cache hits per tier against the workload's ideal, and server step figures.

    hkv-bench --small                                   # seconds on a CPU server with the built-in model
    hkv-bench --url http://127.0.0.1:8000 --json out.json --plot-dir plots/
    hkv-bench --workload multi-turn --conversations 16 --turns 4 --concurrency 8
    hkv-bench --workload random --num-prompts 200 --request-rate 4
    hkv-bench --model-path /models/bench --baseline hf  # also HF generate on the same prompts

Prompts are random token ids in [16, vocab): vocab is --vocab, else the
vocab_size of --model-path's config.json, else 1024 (the server's
/v1/models does not report it). Every request streams with
return_token_ids, ignore_eos and temperature 0, so each gives exactly
--output-len tokens. The cache is flushed (POST /cache/flush) after the
warm-up, so the ideal hit rate, computed for an empty infinite cache, bounds
the measured one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from tqdm import tqdm

from tools.bench import bench_report as report_mod
from tools.bench.bench_client import RequestResult, completion_body, run_sessions, scrape_metrics, stream_completion
from tools.bench.bench_workloads import (
    MIN_TOKEN_ID, Session, cap_requests, ideal_hits, multi_turn, random_prompts, request_count, shared_prefix,
)

DEFAULT_VOCAB = 1024  # below every real vocabulary and the built-in models' 1536
DEFAULT_CONCURRENCY = 16
# the generated-shared-prefix defaults, and --small: a few seconds on a CPU server with
# tiny-hybrid; a 256-token system prompt ends on the default checkpoint interval, so hybrids hit
PRESETS = {
    "default": dict(groups=64, prompts_per_group=16, system_len=2048, question_len=128, output_len=256,
                    concurrency=None),
    "small": dict(groups=2, prompts_per_group=4, system_len=256, question_len=16, output_len=8, concurrency=4),
}


class BenchError(Exception):
    """The server could not be benchmarked (unreachable, refuses the workload): one line, exit 1."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one clear line, exit 2
        print(f"hkv-bench: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _workload_flags(p: argparse.ArgumentParser) -> None:
    d, s = PRESETS["default"], PRESETS["small"]
    p.add_argument("--workload", choices=("shared-prefix", "multi-turn", "random"), default="shared-prefix",
                   help="shared-prefix: groups sharing a system prompt; multi-turn: conversations whose turns "
                        "extend the previous prompt and answer; random: unrelated prompts (default: shared-prefix)")
    p.add_argument("--small", action="store_true",
                   help=f"small shared-prefix preset: {s['groups']} groups x {s['prompts_per_group']} prompts, "
                        f"{s['system_len']} system, {s['question_len']} question, {s['output_len']} output, "
                        f"concurrency {s['concurrency']} (explicit flags still win; default: off)")
    for flag, key, what in (("--groups", "groups", "shared-prefix groups"),
                            ("--prompts-per-group", "prompts_per_group", "prompts per group"),
                            ("--system-len", "system_len", "system prompt tokens of a group"),
                            ("--question-len", "question_len",
                             "own tokens per prompt (shared-prefix) or new user tokens per turn (multi-turn)"),
                            ("--output-len", "output_len", "tokens generated per request")):
        p.add_argument(flag, type=int, default=None, help=f"{what} (default: {d[key]}; --small: {s[key]})")
    p.add_argument("--conversations", type=int, default=32, help="multi-turn conversations (default: 32)")
    p.add_argument("--turns", type=int, default=4, help="turns per multi-turn conversation (default: 4)")
    p.add_argument("--input-len", type=int, default=1024, help="longest random prompt, tokens (default: 1024)")
    p.add_argument("--range-ratio", type=float, default=0.5,
                   help="random prompt lengths are uniform in [input-len x ratio, input-len] (default: 0.5)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="random: how many prompts (default: 1024); other workloads: cap on the requests sent "
                        "(default: all)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="hkv-bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server (default: http://127.0.0.1:8000)")
    p.add_argument("--api-key", default=None, help="sent as Authorization: Bearer (default: none)")
    _workload_flags(p)
    p.add_argument("--concurrency", type=int, default=None,
                   help=f"sessions in flight (default: {DEFAULT_CONCURRENCY}, or no cap with --request-rate; "
                        f"--small: {PRESETS['small']['concurrency']})")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrivals per second of sessions (requests, or conversations in multi-turn); "
                        "seeded (default: inf, all at once)")
    p.add_argument("--warmup", type=int, default=1,
                   help="random warm-up requests before the timed phase, left out of every figure (default: 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals (default: 0)")
    p.add_argument("--vocab", type=int, default=None,
                   help=f"token ids are drawn from [{MIN_TOKEN_ID}, vocab) (default: --model-path's vocab_size, "
                        f"else the server's (/v1/models), else {DEFAULT_VOCAB})")
    p.add_argument("--model-path", type=Path, default=None,
                   help="the served checkpoint folder: its vocab_size, and the model of --baseline (default: none)")
    p.add_argument("--page-size", type=int, default=16, help="page size of the ideal cache (default: 16)")
    p.add_argument("--no-flush", action="store_true",
                   help="do not POST /cache/flush before the timed phase (default: flush)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds a stream may go without an event (default: 600)")
    p.add_argument("--json", type=Path, default=None, help="write every figure here as JSON (default: none)")
    p.add_argument("--save-outputs", type=Path, default=None,
                   help="write every timed request's prompt and output token ids here as JSON, the oracle file "
                        "of HKV_SPEC_ORACLE (docs/spec.md) (default: none)")
    p.add_argument("--plot-dir", type=Path, default=None,
                   help="write ttft.png, itl.png and throughput.png here; needs matplotlib (default: none)")
    p.add_argument("--baseline", choices=("hf",), default=None,
                   help="also run HF transformers generate on --model-path, same prompts, batches of the "
                        "concurrency (default: none)")
    p.add_argument("--baseline-num-prompts", type=int, default=None,
                   help="give the baseline only the first N prompts (default: all)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr (default: shown)")
    return p


def _check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit 2 with one line on any value the benchmark cannot run with."""
    at_least = {"groups": 1, "prompts_per_group": 1, "system_len": 0, "question_len": 1, "output_len": 1,
                "conversations": 1, "turns": 1, "input_len": 1, "num_prompts": 1, "concurrency": 1,
                "warmup": 0, "page_size": 1, "baseline_num_prompts": 1}
    for key, low in at_least.items():
        value = getattr(args, key)
        if value is not None and value < low:
            p.error(f"--{key.replace('_', '-')} must be at least {low}, got {value}")
    if not 0 < args.range_ratio <= 1:
        p.error(f"--range-ratio must be in (0, 1], got {args.range_ratio}")
    if not args.request_rate > 0:
        p.error(f"--request-rate must be positive, got {args.request_rate}")
    if not args.timeout > 0:
        p.error(f"--timeout must be positive, got {args.timeout}")
    if args.vocab is not None and args.vocab <= MIN_TOKEN_ID:
        p.error(f"--vocab must exceed {MIN_TOKEN_ID}, got {args.vocab}")
    if args.model_path is not None and not (args.model_path / "config.json").is_file():
        p.error(f"--model-path {args.model_path}: no config.json there")
    if args.baseline and args.model_path is None:
        p.error("--baseline hf needs --model-path (the checkpoint the server runs)")


def _vocab(p: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[int, str]:
    """The id range of the prompts and where it came from."""
    if args.vocab is not None:
        return args.vocab, "--vocab"
    if args.model_path is not None:
        try:
            config = json.loads((args.model_path / "config.json").read_text())
            size = (config.get("text_config") or config).get("vocab_size", config.get("vocab_size"))
        except (ValueError, AttributeError) as exc:
            p.error(f"--model-path {args.model_path}: config.json is not a JSON object ({exc})")
        if size:
            return int(size), "--model-path"
    return DEFAULT_VOCAB, "default"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    preset = PRESETS["small" if args.small else "default"]
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.concurrency is None and args.request_rate == float("inf"):
        args.concurrency = DEFAULT_CONCURRENCY
    _check(p, args)
    args.vocab, args.vocab_source = _vocab(p, args)
    return args


def build_workload(args: argparse.Namespace) -> tuple[dict, list[Session]]:
    """The workload's parameters (as reported) and its sessions, capped to --num-prompts requests."""
    v, seed = args.vocab, args.seed
    if args.workload == "shared-prefix":
        params = dict(groups=args.groups, prompts_per_group=args.prompts_per_group, system_len=args.system_len,
                      question_len=args.question_len)
        sessions = shared_prefix(args.groups, args.prompts_per_group, args.system_len, args.question_len, v, seed)
    elif args.workload == "multi-turn":
        params = dict(conversations=args.conversations, turns=args.turns, user_len=args.question_len)
        sessions = multi_turn(args.conversations, args.turns, args.question_len, v, seed)
    else:
        count = args.num_prompts or 1024
        params = dict(num_prompts=count, input_len=args.input_len, range_ratio=args.range_ratio)
        sessions = random_prompts(count, args.input_len, args.range_ratio, v, seed)
    sessions = cap_requests(sessions, args.num_prompts)
    workload = {"name": args.workload, **params, "output_len": args.output_len, "requests": request_count(sessions)}
    return workload, sessions


def longest_sequence(sessions: list[Session], output_len: int) -> int:
    """Tokens the longest session's last turn holds at its end (prompt plus every answer)."""
    return max(sum(len(t) for t in s.turns) + len(s.turns) * output_len for s in sessions)


async def _server_model(http: aiohttp.ClientSession, url: str) -> dict:
    try:
        async with http.get(f"{url}/v1/models") as resp:
            if resp.status != 200:
                raise BenchError(f"GET {url}/v1/models answered {resp.status}")
            cards = (await resp.json()).get("data") or []
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        raise BenchError(f"cannot reach {url}: {exc}") from exc
    if not cards:
        raise BenchError(f"{url}/v1/models lists no model")
    return cards[0]


async def _flush(http: aiohttp.ClientSession, url: str) -> None:
    """Empty the server's cache so that the ideal (an empty cache's) bounds the hits; a refusal only warns."""
    try:
        async with http.post(f"{url}/cache/flush") as resp:
            status = resp.status
    except aiohttp.ClientError as exc:
        status = type(exc).__name__
    if status != 200:
        print(f"hkv-bench: warning: POST /cache/flush answered {status}; hits may include older entries",
              file=sys.stderr)


@dataclass
class Run:
    """What the timed phase produced, for the report."""

    model: dict  # the server's /v1/models card
    workload: dict  # the workload's parameters, as reported (build_workload)
    results: list[RequestResult]  # timed requests in the order sent
    started: float  # perf_counter at the first request
    ended: float  # perf_counter at the last request's end
    metrics_before: dict | None  # /metrics samples before and after the timed phase (None: unreadable)
    metrics_after: dict | None

    @property
    def done(self) -> list[RequestResult]:
        return [r for r in self.results if r.error is None]


def server_vocab(args: argparse.Namespace, model: dict) -> None:
    """Without --vocab or --model-path, prompt ids come from the server's vocabulary (/v1/models' vocab_size,
    an hkv extension), so a model under DEFAULT_VOCAB tokens gets no id it would refuse."""
    size = model.get("vocab_size")
    if args.vocab_source == "default" and isinstance(size, int) and size > MIN_TOKEN_ID:
        args.vocab, args.vocab_source = size, "server"


async def run_benchmark(args: argparse.Namespace) -> Run:
    """Read the server's model card, build the workload, warm up, flush the cache, then run the workload
    between two /metrics scrapes."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=args.timeout)
    async with aiohttp.ClientSession(timeout=timeout, headers=headers,
                                     connector=aiohttp.TCPConnector(limit=0)) as http:
        model = await _server_model(http, args.url)
        server_vocab(args, model)
        workload, sessions = build_workload(args)
        need, allowed = longest_sequence(sessions, args.output_len), model.get("max_model_len")
        if allowed is not None and need > allowed:
            raise BenchError(f"the workload needs sequences of {need} tokens; the server allows {allowed}")

        async def send(prompt):
            result = RequestResult(prompt, time.perf_counter())
            await stream_completion(http, args.url, completion_body(model["id"], prompt, args.output_len), result)
            return result

        if args.warmup:
            warm = random_prompts(args.warmup, len(sessions[0].turns[0]), 1.0, args.vocab, args.seed + 1)
            failed = [r for r in await run_sessions(warm, send, args.concurrency, float("inf"), args.seed,
                                                    lambda r: None) if r.error]
            if failed:
                raise BenchError(f"warm-up request failed: {failed[0].error}")
        if not args.no_flush:
            await _flush(http, args.url)
        before = await scrape_metrics(http, args.url)
        bar = tqdm(total=request_count(sessions), desc="hkv-bench", unit="req", file=sys.stderr,
                   disable=args.no_progress)
        started = time.perf_counter()
        try:
            results = await run_sessions(sessions, send, args.concurrency, args.request_rate, args.seed,
                                         lambda r: bar.update(1))
        finally:
            bar.close()
        ended = max((r.finished_at for r in results if r.finished_at is not None), default=time.perf_counter())
        after = await scrape_metrics(http, args.url)
    return Run(model, workload, results, started, ended, before, after)


def build_report(args: argparse.Namespace, run: Run) -> dict:
    """Every figure of the run, as written by --json."""
    done = run.done
    ideal = ideal_hits([(r.prompt, r.output) for r in run.results], args.page_size)
    ideal_done = sum(hit for hit, r in zip(ideal, run.results) if r.error is None)
    failed = [r for r in run.results if r.error is not None]
    return {
        "config": {
            "url": args.url, "model": run.model.get("id"), "vocab": args.vocab, "vocab_source": args.vocab_source,
            "seed": args.seed, "concurrency": args.concurrency, "request_rate": _finite(args.request_rate),
            "warmup": args.warmup, "page_size": args.page_size, "flushed": not args.no_flush,
        },
        "workload": run.workload,
        "requests": {
            "sent": len(run.results), "completed": len(done), "failed": len(failed),
            "first_error": failed[0].error if failed else None,
            "output_tokens": sum(len(r.output) for r in done),
            "expected_output_tokens": len(done) * args.output_len,
        },
        "throughput": report_mod.throughput(done, run.ended - run.started),
        "latency": report_mod.latencies(done),
        "cache": report_mod.cache_hits(done, ideal_done),
        "server": report_mod.server_figures(run.metrics_before, run.metrics_after),
        "speculative": report_mod.speculative(run.metrics_before, run.metrics_after),
        "baseline": None,
        "plots": [],
    }


def _finite(value: float) -> float | None:
    return None if value == float("inf") else value


def add_baseline(args: argparse.Namespace, report: dict, run: Run) -> None:
    """Run HF generate on the timed prompts and put its figures and the ratio into report['baseline']."""
    from tools.bench.bench_hf import run_hf_baseline

    done = run.done[: args.baseline_num_prompts]
    baseline = run_hf_baseline(args.model_path, [r.prompt for r in done], args.concurrency or DEFAULT_CONCURRENCY,
                               args.output_len, progress=not args.no_progress)
    outputs = baseline.pop("outputs")
    baseline["same_tokens_fraction"] = sum(o == r.output for o, r in zip(outputs, done)) / len(done)
    hkv = report["throughput"]["output_tokens_per_s"]
    baseline["hkv_output_tokens_per_s"] = hkv
    theirs = baseline["output_tokens_per_s"]
    baseline["hkv_over_hf"] = hkv / theirs if hkv and theirs else None
    report["baseline"] = baseline


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        run = asyncio.run(run_benchmark(args))
    except BenchError as exc:
        print(f"hkv-bench: {exc}", file=sys.stderr)
        return 1
    report = build_report(args, run)
    if args.baseline and run.done:
        add_baseline(args, report, run)
    if args.plot_dir is not None:
        report["plots"] = [str(p) for p in report_mod.write_plots(run.done, run.started, args.plot_dir)]
    print(report_mod.table(report))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if args.save_outputs is not None:
        outputs = [{"prompt": list(r.prompt), "output": r.output} for r in run.done]
        partial = args.save_outputs.with_name(args.save_outputs.name + ".partial")
        partial.write_text(json.dumps(outputs) + "\n")
        partial.replace(args.save_outputs)  # whole or not at all: a server may be reading it (HKV_SPEC_ORACLE)
    if report["requests"]["failed"]:
        print(f"hkv-bench: {report['requests']['failed']} requests failed, first: "
              f"{report['requests']['first_error']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
