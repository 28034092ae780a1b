"""What structured output costs a served decode step (issue 37): a running server, N streams at once,
first none of them constrained, then C of them with a JSON schema, in one run.

    python -m tools.bench.bench_structured --url http://127.0.0.1:8000 [--streams 64] [--constrained 32]
                                     [--input-len 128] [--output-len 256] [--vocab V] [--json out.json]
                                     [--schema bounded|unbounded]

Every stream is a greedy /v1/completions with a random token-id prompt. The unconstrained ones run
to --output-len (`ignore_eos`); the constrained ones carry `response_format` with SCHEMA, an array
of at least 40 small objects (integers, a bounded string, an enum, a boolean), which no answer of
--output-len tokens can finish, so they run to the same length and the two rounds decode the same
number of rows for the same number of steps. The figures: the server's mean step (its /metrics,
hkv_engine_step_seconds over hkv_engine_steps, prefills included, the same in both rounds), the
streams' median inter-token latency (the decode step as a client sees it) and mean TPOT, per
round, and the constrained round's over the plain one's. The constrained answers are read back
(/detokenize) and must begin as SCHEMA's do, so a mask that let a stray token through shows.

Where the constrained round's time goes, from the ranks' own figures (hkv_engine_grammar_* in /metrics):
the mean mask fill per step with grammar rows (llguidance, wall), the mean live rows it filled, and the
mean wait of a late-sampled step for the step before's answer. `--schema unbounded` drops the name's
maxLength (llguidance's slow case is a token inside a bounded string), so two runs on one server compare.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
from pathlib import Path

import aiohttp

from tools.bench.bench_client import RequestResult, completion_body, scrape_metrics, stream_completion

# --schema bounded (unbounded: the same without maxLength)
SCHEMA = {"type": "array", "minItems": 40, "items": {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99999},
                   "name": {"type": "string", "maxLength": 16},
                   "kind": {"enum": ["tool", "note", "task", "event"]},
                   "done": {"type": "boolean"}},
    "required": ["id", "name", "kind", "done"], "additionalProperties": False}}
# hkv_engine_grammar_<name>_total
GRAMMAR_COUNTERS = ("steps", "mask_seconds", "rows", "wait_seconds", "mask_cache_hits", "mask_cache_misses")


def schema_of(name: str) -> dict:
    """--schema: bounded = SCHEMA; unbounded = SCHEMA without the string's maxLength."""
    if name == "bounded":
        return SCHEMA
    properties = {**SCHEMA["items"]["properties"], "name": {"type": "string"}}
    return {**SCHEMA, "items": {**SCHEMA["items"], "properties": properties}}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.bench.bench_structured", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server (default: http://127.0.0.1:8000)")
    p.add_argument("--streams", type=int, default=64, help="streams at once in each round (default: 64)")
    p.add_argument("--constrained", type=int, default=32, help="of them constrained in the second round (default: 32)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (default: 128)")
    p.add_argument("--output-len", type=int, default=256, help="tokens each stream decodes (default: 256)")
    p.add_argument("--vocab", type=int, default=None, help="prompt ids below this (default: the server's vocab_size, "
                                                           "from /v1/models)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts (default: 0)")
    p.add_argument("--schema", choices=("bounded", "unbounded"), default="bounded",
                   help="the constrained streams' schema: bounded = SCHEMA (a maxLength 16 string), unbounded = "
                        "the same without maxLength (default: bounded)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here as JSON (default: none)")
    return p


async def _model_card(http: aiohttp.ClientSession, url: str) -> dict:
    async with http.get(f"{url}/v1/models") as resp:
        resp.raise_for_status()
        return (await resp.json())["data"][0]


def _body(model: str, prompt: tuple[int, ...], output_len: int, constrained: bool, schema: dict) -> dict:
    body = completion_body(model, prompt, output_len)
    if constrained:  # runs to output_len anyway: SCHEMA is longer; a grammar refuses ignore_eos
        del body["ignore_eos"]
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "items", "schema": schema}}
    return body


async def _round(http: aiohttp.ClientSession, args: argparse.Namespace, model: str, constrained: int,
                 seed: int) -> tuple[list[RequestResult], list[bool], dict | None, dict | None]:
    rng = random.Random(seed)
    prompts = [tuple(rng.randrange(args.vocab) for _ in range(args.input_len)) for _ in range(args.streams)]
    kinds = [i < constrained for i in range(args.streams)]
    results = [RequestResult(p, 0.0) for p in prompts]
    before = await scrape_metrics(http, args.url)
    await asyncio.gather(*(stream_completion(http, args.url, _body(model, p, args.output_len, k, schema_of(args.schema)), r)
                           for p, k, r in zip(prompts, kinds, results)))
    after = await scrape_metrics(http, args.url)
    return results, kinds, before, after


def _step_ms(before: dict | None, after: dict | None) -> float | None:
    if not before or not after:
        return None
    steps = after.get("hkv_engine_steps_total", 0) - before.get("hkv_engine_steps_total", 0)
    seconds = after.get("hkv_engine_step_seconds_total", 0) - before.get("hkv_engine_step_seconds_total", 0)
    return 1e3 * seconds / steps if steps else None


def grammar_figures(before: dict | None, after: dict | None) -> dict | None:
    """The ranks' mask figures between two scrapes: steps with grammar rows, the mean mask fill (ms) and
    live rows per such step, the mean late wait (ms), the mask cache's hits and misses; None without both scrapes
    or with no such step."""
    if not before or not after:
        return None
    delta = {k: after.get(f"hkv_engine_grammar_{k}_total", 0.0) - before.get(f"hkv_engine_grammar_{k}_total", 0.0)
             for k in GRAMMAR_COUNTERS}
    steps = delta["steps"]
    if steps <= 0:
        return None
    return {"steps": int(steps), "mask_ms": 1e3 * delta["mask_seconds"] / steps, "rows": delta["rows"] / steps,
            "wait_ms": 1e3 * delta["wait_seconds"] / steps,
            "mask_us_per_row": 1e6 * delta["mask_seconds"] / delta["rows"] if delta["rows"] else None,
            "cache_hits": int(delta["mask_cache_hits"]), "cache_misses": int(delta["mask_cache_misses"])}


def _figures(results: list[RequestResult], kinds: list[bool], before, after) -> dict:
    errors = [r.error for r in results if r.error]
    if errors:
        raise SystemExit(f"bench_structured: {len(errors)} streams failed, first: {errors[0]}")
    itls = [g for r in results for g in r.itls()]
    groups = {}
    for name, want in (("plain", False), ("constrained", True)):
        tpots = [r.tpot for r, k in zip(results, kinds) if k == want and r.tpot is not None]
        if tpots:
            groups[name] = {"streams": len(tpots), "tpot_ms": 1e3 * statistics.mean(tpots),
                            "tokens": sum(len(r.output) for r, k in zip(results, kinds) if k == want)}
    return {"step_ms": _step_ms(before, after), "itl_median_ms": 1e3 * statistics.median(itls), "groups": groups,
            "grammar": grammar_figures(before, after)}


async def _texts(http: aiohttp.ClientSession, url: str, results: list[RequestResult]) -> list[str]:
    texts = []
    for r in results:
        async with http.post(f"{url}/detokenize", json={"tokens": r.output}) as resp:
            resp.raise_for_status()
            texts.append((await resp.json())["prompt"])
    return texts


async def main_async(args: argparse.Namespace) -> dict:
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        card = await _model_card(http, args.url)
        args.vocab = args.vocab or card.get("vocab_size") or 1000
        model = card["id"]
        await _round(http, args, model, 0, args.seed + 99)  # warm-up: compiles, graphs, the grammar's tokenizer
        plain = _figures(*await _round(http, args, model, 0, args.seed))
        results, kinds, before, after = await _round(http, args, model, args.constrained, args.seed + 1)
        mixed = _figures(results, kinds, before, after)
        texts = await _texts(http, args.url, [r for r, k in zip(results, kinds) if k])
    # SCHEMA's answers begin so (compact JSON); a token the mask should have refused shows as another start
    malformed = [t for t in texts if not t.startswith('[{"id": ')]
    out = {"streams": args.streams, "constrained": args.constrained, "schema": args.schema, "input_len": args.input_len,
           "output_len": args.output_len, "plain": plain, "mixed": mixed, "sample": texts[0][:200] if texts else "",
           "malformed": len(malformed)}
    for key in ("step_ms", "itl_median_ms"):
        if plain[key] and mixed[key]:
            out[f"{key}_ratio"] = mixed[key] / plain[key]
    return out


def report(out: dict) -> str:
    lines = [f"{out['streams']} streams of {out['input_len']} + {out['output_len']} tokens; "
             f"{out['constrained']} constrained ({out.get('schema', 'bounded')} schema) in the second round"]
    for name in ("plain", "mixed"):
        r = out[name]
        step = f"{r['step_ms']:.3f}" if r["step_ms"] else "-"
        groups = "  ".join(f"{g}: TPOT {v['tpot_ms']:.3f} ms ({v['streams']} streams)" for g, v in r["groups"].items())
        lines.append(f"{name:6} server step {step} ms  median ITL {r['itl_median_ms']:.3f} ms  {groups}")
    for key in ("step_ms_ratio", "itl_median_ms_ratio"):
        if key in out:
            lines.append(f"{key.replace('_ms_ratio', '')} constrained / plain: {out[key]:.3f}")
    g = out["mixed"].get("grammar")
    lines.append("grammar masks: none counted (a server without hkv_engine_grammar_*?)" if not g else
                 f"grammar masks: {g['mask_ms']:.3f} ms a step with grammar rows ({g['steps']} steps, "
                 f"{g['rows']:.1f} live rows, {g['mask_us_per_row'] or 0:.1f} us a row), late wait {g['wait_ms']:.3f} ms; "
                 f"mask cache {g['cache_hits']} hits, {g['cache_misses']} misses")
    lines.append(f"a constrained answer: {out['sample']!r}; answers not starting as SCHEMA's: {out['malformed']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if not 0 <= args.constrained <= args.streams:
        sys.exit("bench_structured: --constrained must lie in [0, --streams]")
    out = asyncio.run(main_async(args))
    print(report(out))
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
