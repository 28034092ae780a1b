"""How a host's CPUs fill structured output's token masks (issue 37): no GPU, no server.

    python -m tools.bench.bench_mask_threads --tokenizer TOKENIZER.json [--vocab V] [--rows 32] [--steps 80]
                                             [--threads 1,2,4,8,12] [--busy 0,4] [--cache] [--json out.json]

Walks `--rows` matchers of tools/bench/bench_structured's schema (bounded by default, `--schema unbounded`
drops its maxLength) for `--steps` tokens each, tokens drawn uniformly from their masks (as a random-weight
model picks), then replays the same walks and times each step's fill of all rows: hkv's MaskWorkers (the
rank's row queue) and llguidance's LLExecutor, at each thread count, with `--busy` processes spinning beside
(a served host's api, router and client keep cores busy). Prints the mean fill a step, the best of 2 replays.
`--cache` adds the row queue with the mask cache (hkv/engine/mask_cache.py, a server's default), warmed by one
replay first, as a server's stays warm across a schema's requests.
On a device host this tells the mask thread count to use (`--grammar-threads`) and how far the fill scales.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import sys
import time

import torch

from hkv.engine.grammar import Grammars, MaskWorkers, fill_masks
from hkv.ipc.messages import Constraint
from tools.bench.bench_grammar import allowed_ids
from tools.bench.bench_structured import schema_of


def _spin(stop) -> None:
    while not stop.is_set():
        sum(range(1000))


def _ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"want comma-separated non-negative integers, not {text!r}")
    return values


def record_walks(grammars: Grammars, constraint: Constraint, rows: int, steps: int, eos: int, seed: int = 0
                 ) -> list[list[int]]:
    """`rows` token walks of `steps` tokens, each drawn uniformly from its matcher's mask (EOS avoided
    while anything else is allowed)."""
    rng = random.Random(seed)
    mask = torch.empty(1, grammars.words, dtype=torch.int32)
    walks = []
    for _ in range(rows):
        matcher, tokens = grammars.matcher(constraint), []
        for _ in range(steps):
            matcher.fill(mask[0])
            allowed = [int(t) for t in allowed_ids(mask[0], grammars.vocab_size) if t != eos] or [eos]
            token = rng.choice(allowed)
            tokens.append(token)
            matcher.consume(token)
        walks.append(tokens)
    return walks


def replay_ms(grammars: Grammars, constraint: Constraint, walks: list[list[int]], fill) -> float:
    """Mean wall ms of `fill(matchers, masks)` a step, the matchers advancing along `walks`."""
    matchers = [grammars.matcher(constraint) for _ in walks]
    masks = torch.empty(len(walks), grammars.words, dtype=torch.int32)
    total = 0.0
    for step in range(len(walks[0])):
        started = time.perf_counter()
        fill(matchers, masks)
        total += time.perf_counter() - started
        for matcher, walk in zip(matchers, walks):
            matcher.consume(walk[step])
    return total / len(walks[0]) * 1e3


def _cached_ms(grammars: Grammars, constraint: Constraint, walks: list[list[int]], workers: MaskWorkers) -> float:
    """replay_ms of the row queue on `grammars` (its mask cache on) once the first replay warmed it."""
    def fill(matchers, masks):
        fill_masks(matchers, masks, workers)

    replay_ms(grammars, constraint, walks, fill)
    return min(replay_ms(grammars, constraint, walks, fill) for _ in range(2))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", required=True, help="a tokenizer.json (Qwen's, or bench_grammar's 151k)")
    parser.add_argument("--vocab", type=int, default=0, help="the model's logit rows (default: the tokenizer's)")
    parser.add_argument("--eos", type=int, default=-1, help="the EOS id (default: the last id)")
    parser.add_argument("--schema", choices=["bounded", "unbounded"], default="bounded")
    parser.add_argument("--rows", type=int, default=32, help="constrained rows a step (default: 32)")
    parser.add_argument("--steps", type=int, default=80, help="tokens each row walks (default: 80)")
    parser.add_argument("--threads", type=_ints, default=[1, 2, 4, 8, 12], help="thread counts (default: 1,2,4,8,12)")
    parser.add_argument("--busy", type=_ints, default=[0, 4], help="spinning processes beside (default: 0,4)")
    parser.add_argument("--cache", action="store_true", help="also the row queue with the mask cache on, warm")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.rows < 1 or args.steps < 1 or 0 in args.threads:
        parser.error("--rows, --steps and every --threads value must be at least 1")
    from tokenizers import Tokenizer

    size = Tokenizer.from_file(args.tokenizer).get_vocab_size()
    vocab = args.vocab or size
    eos = args.eos if args.eos >= 0 else size - 1
    grammars = Grammars(args.tokenizer, vocab, [eos], 1)
    cached = Grammars(args.tokenizer, vocab, [eos], 1, mask_cache="on") if args.cache else None
    constraint = Constraint("json_schema", json.dumps(schema_of(args.schema)))
    print(f"{os.cpu_count()} CPUs ({len(os.sched_getaffinity(0))} usable); {args.rows} rows of the {args.schema} "
          f"schema, {args.steps} steps, vocabulary {vocab}", flush=True)
    walks = record_walks(grammars, constraint, args.rows, args.steps, eos)
    import llguidance

    results = []
    for busy in args.busy:
        stop = mp.Event()
        spinners = [mp.Process(target=_spin, args=(stop,), daemon=True) for _ in range(busy)]
        for p in spinners:
            p.start()
        try:
            for threads in args.threads:
                workers, executor = MaskWorkers(threads), llguidance.LLExecutor(threads)
                try:
                    queue = min(replay_ms(grammars, constraint, walks, lambda ms, m: fill_masks(ms, m, workers))
                                for _ in range(2))
                    llg = min(replay_ms(grammars, constraint, walks, lambda ms, m: executor.unsafe_compute_mask_ptr(
                        [(x._inner, i) for i, x in enumerate(ms)], m.data_ptr(), m.shape[1] * 4, m.shape[0]))
                        for _ in range(2))
                    cache = _cached_ms(cached, constraint, walks, workers) if cached else None
                finally:
                    workers.close()
                results.append({"busy": busy, "threads": threads, "queue_ms": queue, "llexecutor_ms": llg,
                                "cached_ms": cache})
                print(f"busy {busy:2d}  threads {threads:2d}:  row queue {queue:7.3f} ms  LLExecutor {llg:7.3f} ms"
                      + (f"  cached {cache:7.3f} ms" if cache is not None else "") + f" a step ({args.rows} rows)",
                      flush=True)
        finally:
            stop.set()
            for p in spinners:
                p.join()
    out = {"cpus": os.cpu_count(), "rows": args.rows, "steps": args.steps, "schema": args.schema, "results": results}
    if cached:
        out["cache"] = {"hits": cached.mask_cache.hits, "misses": cached.mask_cache.misses,
                        "bytes": cached.mask_cache.bytes}
        print(f"mask cache: {cached.mask_cache.hits} hits, {cached.mask_cache.misses} misses, "
              f"{cached.mask_cache.bytes / 2**20:.1f} MiB held", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
