"""A burst of requests for one prefix that reaches the router in the same step, against a live server.

A request spread over HTTP rarely lands in the router's same step as another, so this tool makes
them: it keeps one unrelated request decoding (a step is always in flight), stops the server's rank
(SIGSTOP), sends the burst, waits until the api has passed it on, and resumes the rank (SIGCONT). The
router then takes every request of the burst in at the same step. Times to first token count from
the resume, so the pause itself is not in them. The cache is flushed before each round.

    python -m tools.bench.bench_burst --url http://127.0.0.1:8000 [--requests 32] [--shared 2048] [--own 128]
        [--rounds 3] [--name NAME | --rank-pid PID] [--vocab 151936] [--json out.json]

The rank is found by its command line (`hkv.actors.rank`, of instance --name if given) unless
--rank-pid names it; exactly one must match. Prints per round the mean / median / max time to first token, the cached
tokens per request and hkv_engine_prefix_waits_total's growth (requests that waited for the prefix
another request was prefilling: docs/cache.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import sys
import time
from pathlib import Path

import aiohttp

from hkv.argtypes import positive_int
from tools.bench.bench_client import RequestResult, completion_body, scrape_metrics, stream_completion


def find_rank(name: str | None) -> int:
    """The pid of the one `hkv.actors.rank` process on this machine (of instance `name`: its run
    directory is /tmp/hkv-<name>-...)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if b"hkv.actors.rank" in cmd and (name is None or f"/hkv-{name}-".encode() in cmd):
            found.append(int(entry.name))
    if len(found) != 1:
        raise SystemExit(f"expected one hkv.actors.rank process, found {len(found)}: pass --name or --rank-pid")
    return found[0]


WAITS = "hkv_engine_prefix_waits_total"


async def one_round(http: aiohttp.ClientSession, args, model: dict, rank: int, rng: random.Random) -> dict:
    """One burst over a flushed cache: the streams are hkv-bench's (tools/bench/bench_client.py)."""
    async with http.post(f"{args.url}/cache/flush") as resp:
        resp.raise_for_status()
    shared = [rng.randrange(16, args.vocab) for _ in range(args.shared)]
    prompts = [shared + [rng.randrange(16, args.vocab) for _ in range(args.own)] for _ in range(args.requests)]
    waits_before = (await scrape_metrics(http, args.url) or {}).get(WAITS, 0.0)

    def start(prompt: list[int], max_tokens: int) -> tuple[RequestResult, asyncio.Task]:
        result = RequestResult(tuple(prompt), time.perf_counter())
        body = completion_body(model["id"], prompt, max_tokens)
        return result, asyncio.ensure_future(stream_completion(http, args.url, body, result))

    blocker, blocking = start([rng.randrange(16, args.vocab) for _ in range(16)], model["max_model_len"] - 16)
    while not blocker.events and not blocking.done():  # decoding: a step is in flight from now on
        await asyncio.sleep(0.01)
    if blocker.error or blocking.done():
        raise SystemExit(f"the blocking request failed: {blocker.error}")
    os.kill(rank, signal.SIGSTOP)
    try:
        burst = [start(p, args.output) for p in prompts]
        await asyncio.sleep(args.gather_s)
    finally:
        os.kill(rank, signal.SIGCONT)
        resumed = time.perf_counter()
    await asyncio.gather(*(task for _, task in burst))
    blocking.cancel()  # its connection closes: the server aborts it
    with contextlib.suppress(asyncio.CancelledError):
        await blocking
    results = [result for result, _ in burst]
    failed = [r.error for r in results if r.error or not r.events]
    if failed:
        raise SystemExit(f"{len(failed)} burst requests failed: {failed[0]}")
    ttft = [(r.events[0][0] - resumed) * 1e3 for r in results]
    cached = [r.usage["prompt_tokens_details"]["cached_tokens"] for r in results]
    prompt_tokens = sum(r.usage["prompt_tokens"] for r in results)
    return {"ttft_ms": {"mean": statistics.mean(ttft), "median": statistics.median(ttft), "max": max(ttft)},
            "cached_tokens": cached, "hit_rate": sum(cached) / prompt_tokens,
            "ideal_hit_rate": (args.requests - 1) * (args.shared // args.page * args.page) / prompt_tokens,
            "prefix_waits": (await scrape_metrics(http, args.url) or {}).get(WAITS, 0.0) - waits_before}


async def run(args, rank: int) -> list[dict]:
    rng = random.Random(args.seed)
    rounds = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        async with http.get(f"{args.url}/v1/models") as resp:
            model = (await resp.json())["data"][0]
        for i in range(args.rounds):
            r = await one_round(http, args, model, rank, rng)
            rounds.append(r)
            t = r["ttft_ms"]
            print(f"round {i + 1}: {args.requests} x ({args.shared} shared + {args.own}) in one step: TTFT from "
                  f"resume mean {t['mean']:.1f} / median {t['median']:.1f} / max {t['max']:.1f} ms; hit rate "
                  f"{100 * r['hit_rate']:.1f}% of an ideal {100 * r['ideal_hit_rate']:.1f}%; cached per request "
                  f"{sorted(set(r['cached_tokens']))}; prefix waits {r['prefix_waits']:.0f}", flush=True)
    return rounds


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default: http://127.0.0.1:8000)")
    ap.add_argument("--requests", type=positive_int, default=32, help="requests in the burst (default: 32)")
    ap.add_argument("--shared", type=positive_int, default=2048, help="tokens of the shared prefix (default: 2048)")
    ap.add_argument("--own", type=positive_int, default=128, help="tokens of each request's own (default: 128)")
    ap.add_argument("--output", type=positive_int, default=8, help="tokens generated per request (default: 8)")
    ap.add_argument("--rounds", type=positive_int, default=3, help="bursts, cache flushed before each (default: 3)")
    ap.add_argument("--gather-s", type=float, default=1.0,
                    help="seconds the rank stays stopped while the burst arrives (default: 1.0)")
    ap.add_argument("--rank-pid", type=positive_int, help="the server's rank (default: found by --name)")
    ap.add_argument("--name", help="the server's instance name (hkv-launch --name), to find its rank")
    ap.add_argument("--vocab", type=positive_int, default=1536, help="token ids are drawn below this (default: 1536)")
    ap.add_argument("--page", type=positive_int, default=256,
                    help="hit granularity for the ideal hit rate: the checkpoint interval, or the page size of a "
                         "dense model (default: 256)")
    ap.add_argument("--seed", type=int, default=0, help="prompt seed (default: 0)")
    ap.add_argument("--json", help="write the rounds to this file")
    args = ap.parse_args(argv)
    if not 0.05 <= args.gather_s <= 5.0:
        ap.error("--gather-s must be within 0.05 and 5 (the server's stall timeout is 10 s by default)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    rounds = asyncio.run(run(args, args.rank_pid or find_rank(args.name)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rounds": rounds}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
