"""Issue 13's workload against running servers: a prompt pushed off the device comes back from the CPU tier.

    python -m tools.bench.bench_tier_coverage --url http://127.0.0.1:8000 --baseline-url http://127.0.0.1:8001 \\
        [--prompt-tokens 8192] [--others 6 30] [--tail 64] [--output-tokens 8] [--vocab 1536] [--json out.json]

`--url` serves with the prefix cache and `--cpu-cache-gb`; `--baseline-url`
serves the same model with `--no-prefix-cache`. Per entry of `--others`, with
fresh random prompts: prompt A (`--prompt-tokens`), then that many other
prompts of the same length (each pushes A further off the device), then A +
`--tail` new tokens, streamed and timed (TTFT: request sent to first token
received), then the same request on the baseline. Prints the prompt tokens
served per tier (usage.cache), TTFT against the baseline, whether the two
outputs (`return_token_ids`, greedy) agree, and each tier's coverage from
/metrics (hkv_cache_held_tokens, hkv_cache_reachable_tokens). Token ids are
drawn from [3, --vocab), which every model's vocabulary covers at the
default. Plain HTTP, stdlib only: it also drives a CPU server at tiny sizes
(tests/e2e/test_tier_coverage.py).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass

_COVERAGE = re.compile(r'^hkv_cache_(held|reachable)_tokens\{tier="(\w+)"\} ([0-9.e+]+)$', re.M)


@dataclass
class Timed:
    """One streamed completion."""

    ttft_s: float  # request sent to the first token received
    total_s: float
    token_ids: list[int]
    cache: dict[str, int]  # usage.cache: prompt tokens served per tier


@dataclass
class Round:
    others: int
    prompt_tokens: int  # of the timed request (A + tail)
    cache: dict[str, int]  # per tier, for the timed request
    ttft_s: float
    baseline_ttft_s: float
    speedup: float  # baseline TTFT / TTFT
    outputs_equal: bool
    coverage: dict[str, dict[str, int]]  # tier -> {"held": tokens, "reachable": tokens}, after the round


def complete(url: str, prompt: list[int], max_tokens: int, timeout: float) -> Timed:
    """A greedy streamed completion of `prompt` (token ids), timed."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}  # fmt: skip
    request = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
    start = time.perf_counter()
    first, tokens, cache = None, [], {}
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            for choice in chunk.get("choices") or ():
                if choice.get("token_ids"):
                    first = time.perf_counter() if first is None else first
                    tokens += choice["token_ids"]
            if chunk.get("usage"):
                cache = chunk["usage"].get("cache", {})
    end = time.perf_counter()
    return Timed((first or end) - start, end - start, tokens, cache)


def coverage(url: str, timeout: float) -> dict[str, dict[str, int]]:
    """Per tier: tokens held and tokens a hit could reach, from /metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=timeout) as resp:
        text = resp.read().decode()
    out: dict[str, dict[str, int]] = {}
    for kind, tier, value in _COVERAGE.findall(text):
        out.setdefault(tier, {})[kind] = int(float(value))
    return out


def run_round(args: argparse.Namespace, others: int, rng: random.Random) -> Round:
    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, args.vocab) for _ in range(n)]

    first = prompt(args.prompt_tokens)
    complete(args.url, first, 1, args.timeout)
    for _ in range(others):
        complete(args.url, prompt(args.prompt_tokens), 1, args.timeout)
    again = first + prompt(args.tail)
    time.sleep(args.settle_s)  # let the last copies out land before asking again
    hit = complete(args.url, again, args.output_tokens, args.timeout)
    base = complete(args.baseline_url, again, args.output_tokens, args.timeout)
    return Round(others, len(again), hit.cache, hit.ttft_s, base.ttft_s, base.ttft_s / max(hit.ttft_s, 1e-9),
                 hit.token_ids == base.token_ids, coverage(args.url, args.timeout))  # fmt: skip


def run(args: argparse.Namespace) -> list[Round]:
    rng = random.Random(args.seed)
    for url in (args.url, args.baseline_url):  # first requests pay for warm-up (graphs, allocator)
        complete(url, [rng.randrange(3, args.vocab) for _ in range(32)], 2, args.timeout)
    return [run_round(args, others, rng) for others in args.others]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server with --cpu-cache-gb (default: %(default)s)")
    p.add_argument("--baseline-url", default="http://127.0.0.1:8001",
                   help="the same model with --no-prefix-cache (default: %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=8192, help="tokens of A and of each other prompt "
                   "(default: %(default)s)")
    p.add_argument("--others", type=int, nargs="+", default=[6, 30],
                   help="other prompts between A and A + tail, one round each (default: 6 30)")
    p.add_argument("--tail", type=int, default=64, help="new tokens after A in the timed request (default: 64)")
    p.add_argument("--output-tokens", type=int, default=8, help="tokens generated by the timed request (default: 8)")
    p.add_argument("--vocab", type=int, default=1536, help="token ids are drawn from [3, vocab) (default: 1536)")
    p.add_argument("--seed", type=int, default=0, help="prompt seed (default: 0)")
    p.add_argument("--settle-s", type=float, default=1.0,
                   help="pause before the timed request, for the last copies out (default: 1.0)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per HTTP request (default: 600)")
    p.add_argument("--json", default=None, help="also write the rounds to this file (default: none)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rounds = run(args)
    for r in rounds:
        cpu = r.coverage.get("cpu", {})
        print(f"others {r.others:3d}: prompt {r.prompt_tokens} tokens, served gpu {r.cache.get('gpu', 0)} "
              f"cpu {r.cache.get('cpu', 0)} disk {r.cache.get('disk', 0)}; TTFT {r.ttft_s:.3f} s vs "
              f"{r.baseline_ttft_s:.3f} s without prefix cache ({r.speedup:.1f}x); outputs equal: {r.outputs_equal}; "
              f"cpu tier holds {cpu.get('held', 0)} tokens, {cpu.get('reachable', 0)} reachable")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rounds], f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
