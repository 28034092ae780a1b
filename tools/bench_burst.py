"""A burst of requests for one prefix that reaches the router in the same step, against a live server.

A request spread over HTTP rarely lands in the router's same step as another, so this tool makes
them: it keeps one unrelated request decoding (a step is always in flight), stops the server's rank
(SIGSTOP), sends the burst, waits until the api has passed it on, and resumes the rank (SIGCONT). The
router then takes every request of the burst in at the same step. Times to first token count from
the resume, so the pause itself is not in them. The cache is flushed before each round.

    python -m tools.bench_burst --url http://127.0.0.1:8000 [--requests 32] [--shared 2048] [--own 128]
        [--rounds 3] [--name NAME | --rank-pid PID] [--vocab 151936] [--json out.json]

The rank is found by its command line (`hkv.actors.rank`, of instance --name if given) unless
--rank-pid names it; exactly one must match. Prints per round the mean / median / max time to first token, the cached
tokens per request and hkv_engine_prefix_waits_total's growth (requests that waited for the prefix
another request was prefilling: docs/cache.md).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

from hkv.argtypes import positive_int


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


def metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


class Stream(threading.Thread):
    """One streamed completion; records the time of its first token and its usage."""

    def __init__(self, url: str, prompt: list[int], max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                "return_token_ids": True, "ignore_eos": True, "stream": True,
                                "stream_options": {"include_usage": True}}).encode()
        self.url, self.first, self.usage, self.error, self.tokens = url, None, None, None, 0
        self.started = threading.Event()
        self.response = None
        self.closing = False

    def run(self) -> None:
        req = urllib.request.Request(f"{self.url}/v1/completions", data=self.body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=600) as resp:
                self.response = resp
                for raw in resp:
                    line = raw.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        self.error = str(event["error"])
                        return
                    for choice in event.get("choices", []):
                        if choice.get("token_ids"):
                            self.first = self.first or time.monotonic()
                            self.tokens += len(choice["token_ids"])
                            self.started.set()
                    self.usage = event.get("usage") or self.usage
        except Exception as exc:  # noqa: BLE001 - reading a response closed under it raises several types
            if not self.closing:  # (the blocker is cut off on purpose)
                self.error = self.error or f"{type(exc).__name__}: {exc}"
        finally:
            self.started.set()


def one_round(args, rank: int, rng: random.Random) -> dict:
    urllib.request.urlopen(urllib.request.Request(f"{args.url}/cache/flush", method="POST"), timeout=30).read()
    shared = [rng.randrange(16, args.vocab) for _ in range(args.shared)]
    prompts = [shared + [rng.randrange(16, args.vocab) for _ in range(args.own)] for _ in range(args.requests)]
    waits_before = metric(args.url, "hkv_engine_prefix_waits_total")
    models = json.loads(urllib.request.urlopen(f"{args.url}/v1/models", timeout=10).read())["data"]
    blocker = Stream(args.url, [rng.randrange(16, args.vocab) for _ in range(16)], models[0]["max_model_len"] - 16)
    blocker.start()
    blocker.started.wait(300)
    if blocker.error:
        raise SystemExit(f"the blocking request failed: {blocker.error}")
    os.kill(rank, signal.SIGSTOP)
    try:
        burst = [Stream(args.url, p, args.output) for p in prompts]
        for s in burst:
            s.start()
        time.sleep(args.gather_s)
    finally:
        os.kill(rank, signal.SIGCONT)
        resumed = time.monotonic()
    for s in burst:
        s.join(600)
    blocker.closing = True
    if blocker.response is not None:
        blocker.response.close()  # the server aborts it
    blocker.join(30)
    failed = [s.error for s in burst if s.error or s.first is None]
    if failed:
        raise SystemExit(f"{len(failed)} burst requests failed: {failed[0]}")
    ttft = [(s.first - resumed) * 1e3 for s in burst]
    cached = [s.usage["prompt_tokens_details"]["cached_tokens"] for s in burst]
    prompt_tokens = sum(s.usage["prompt_tokens"] for s in burst)
    return {"ttft_ms": {"mean": statistics.mean(ttft), "median": statistics.median(ttft), "max": max(ttft)},
            "cached_tokens": cached, "hit_rate": sum(cached) / prompt_tokens,
            "ideal_hit_rate": (args.requests - 1) * (args.shared // args.page * args.page) / prompt_tokens,
            "prefix_waits": metric(args.url, "hkv_engine_prefix_waits_total") - waits_before}


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
    rank = args.rank_pid or find_rank(args.name)
    rng = random.Random(args.seed)
    rounds = []
    for i in range(args.rounds):
        r = one_round(args, rank, rng)
        rounds.append(r)
        t = r["ttft_ms"]
        print(f"round {i + 1}: {args.requests} x ({args.shared} shared + {args.own}) in one step: TTFT from resume "
              f"mean {t['mean']:.1f} / median {t['median']:.1f} / max {t['max']:.1f} ms; hit rate "
              f"{100 * r['hit_rate']:.1f}% of an ideal {100 * r['ideal_hit_rate']:.1f}%; cached per request "
              f"{sorted(set(r['cached_tokens']))}; prefix waits {r['prefix_waits']:.0f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rounds": rounds}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
