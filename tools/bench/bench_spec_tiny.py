"""Speculative decoding on the trained built-in model: acceptance and decode speed on held-out prompts.

    python -m tools.bench.bench_spec_tiny --url http://127.0.0.1:8000 [--headers 20] [--max-tokens 128] [--json F]

Sends the greedy continuations of held-out function headers (tools/train/tiny_eval.py's `find_headers` over
the held-out packages of this Python's standard library), one request at a time (decode speed of one
stream, where speculation helps most), and reports output tokens/s and the server's speculative
counters over the run (/metrics deltas: drafts verified and accepted, the acceptance histogram).
Run it once against a server without --spec-tokens and once per K to compare (tools/gpu/gpu_bench.sh spec).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import aiohttp

from tools.bench import bench_report
from tools.bench.bench_client import scrape_metrics
from tools.train.tiny_corpus import HELD_OUT, load_corpus
from tools.train.tiny_eval import find_headers


async def _run(url: str, prompts: list[str], max_tokens: int) -> dict:
    async with aiohttp.ClientSession() as http:
        before = await scrape_metrics(http, url)
        started, tokens = time.perf_counter(), 0
        for prompt in prompts:
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True}
            async with http.post(f"{url}/v1/completions", json=body) as resp:
                if resp.status != 200:
                    raise SystemExit(f"bench_spec_tiny: HTTP {resp.status}: {await resp.text()}")
                tokens += len((await resp.json())["choices"][0]["token_ids"])
        seconds = time.perf_counter() - started
        after = await scrape_metrics(http, url)
    return {"requests": len(prompts), "output_tokens": tokens, "seconds": seconds,
            "output_tokens_per_s": tokens / seconds, "speculative": bench_report.speculative(before, after)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench.bench_spec_tiny", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server (default: http://127.0.0.1:8000)")
    p.add_argument("--headers", type=int, default=20, help="held-out function headers to continue (default: 20)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per continuation (default: 128)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here as JSON (default: none)")
    args = p.parse_args(argv)
    corpus = load_corpus(None, HELD_OUT)
    prompts = [h.prompt for h in find_headers(corpus.held_out, args.headers)]
    report = asyncio.run(_run(args.url, prompts, args.max_tokens))
    spec = report["speculative"] or {}
    print(f"{report['requests']} prompts, {report['output_tokens']} tokens in {report['seconds']:.2f} s: "
          f"{report['output_tokens_per_s']:.1f} tokens/s; acceptance {spec.get('acceptance_rate')}, "
          f"drafts accepted per verify step {spec.get('mean_accepted')}, histogram {spec.get('histogram')}")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
