"""Benchmark the prefix index (hkv.cache) on a shared-prefix workload.

Workload (fixed by issue 3): 2,000 requests, seed 0, token ids uniform in
[0, 32000); 16 groups each sharing one 512-token prefix; per request a unique
128-token question and 128 unique output tokens; requests shuffled. Per
request: match the prompt (prefix + question), then insert prompt + output as
a finished request does. Page sizes 1 and 16; unbounded, and with a capacity
of 131,072 tokens (the overflow is evicted, LRU).

Modes:
  index        RadixTree + PagePool, the operations SGLang's RadixCache bench does:
               match, lock the hit, allocate (evicting), insert, touch, unlock.
  index-hybrid the same with checkpoints: the hit is the deepest checkpoint,
               and the request inserts at 256, 512 (chunk ends), 640 (prompt end)
               and 768 (finish), attaching a checkpoint at each (evicting LRU
               checkpoints beyond `capacity / 128` slots when bounded).
  coord        the full CacheCoordinator path a router takes: begin, match,
               reserve, commit, publish, release (dense, then hybrid).

Figures are CPU time per request (time.process_time, so time the process
spends descheduled on a shared machine is not counted), collector on; the
best and the median of --repeat runs are printed.

Usage: python -m tools.bench.bench_radix [--repeat 7] [--json]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time

from hkv.cache import CacheCoordinator, CacheSpec, PagePool, RadixTree, SlotPool

REQUESTS, GROUPS, PREFIX, QUESTION, OUTPUT, VOCAB = 2000, 16, 512, 128, 128, 32000
CAPACITY_TOKENS = 131_072
HYBRID_BOUNDARIES = (256, 512, 640, 768)  # checkpoint interval 256, prompt end, finish
SGLANG_US = {(1, False): 92, (16, False): 77, (1, True): 162, (16, True): 147}


def workload(seed: int = 0) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(prompt, prompt + output) per request, in the shuffled order they arrive."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(VOCAB) for _ in range(PREFIX)] for _ in range(GROUPS)]
    requests = []
    for i in range(REQUESTS):
        prompt = prefixes[i % GROUPS] + [rng.randrange(VOCAB) for _ in range(QUESTION)]
        output = [rng.randrange(VOCAB) for _ in range(OUTPUT)]
        requests.append((prompt, prompt + output))
    rng.shuffle(requests)
    # Token ids arrive as lists (as from a tokenizer); converting them is part of the timed work.
    return requests


def _room(tree: RadixTree, pool: PagePool, need: int, slots: SlotPool | None = None) -> list[int]:
    """Allocate `need` pages, evicting LRU leaves (and their checkpoints) for room."""
    while pool.free_count < need:
        node, ckpt = tree.evict_leaf()
        pool.free(node.pages)
        if ckpt is not None:
            slots.free([ckpt.slot])
    return pool.allocate(need)


def run_index(requests, page_size: int, bounded: bool) -> float:
    """Seconds for the dense index workload."""
    total = len(requests[0][1])
    capacity = CAPACITY_TOKENS if bounded else REQUESTS * total
    tree, pool = RadixTree(page_size), PagePool(capacity // page_size, page_size)
    gc.collect()  # setup garbage (the pools' id tuples, the last run's tree) is not the index's cost
    start = time.process_time()
    for prompt, full in requests:
        full = tuple(full)
        found = tree.match(full, len(prompt))
        node, length = found.node, found.length
        pages = tree.path_pages(node, length)
        tree.lock(node)
        pages += _room(tree, pool, (total - length) // page_size)
        # A match ending at a node's end is a valid place to resume the walk.
        done = tree.insert(full, pages, node if node.depth == length else None)
        tree.touch(done.node)
        tree.unlock(node)
    return time.process_time() - start


def run_index_hybrid(requests, page_size: int, bounded: bool) -> float:
    """Seconds for the checkpoint-carrying index workload."""
    total = len(requests[0][1])
    capacity = CAPACITY_TOKENS if bounded else REQUESTS * total
    tree, pool = RadixTree(page_size), PagePool(capacity // page_size, page_size)
    slots = SlotPool("state_slots", capacity // 128 if bounded else REQUESTS * len(HYBRID_BOUNDARIES))
    gc.collect()  # setup garbage (the pools' id tuples, the last run's tree) is not the index's cost
    start = time.process_time()
    for prompt, full in requests:
        full = tuple(full)
        ckpt_node = tree.match(full, len(prompt)).checkpoint_node
        length = 0 if ckpt_node is None else ckpt_node.depth
        lock = tree.root if ckpt_node is None else ckpt_node
        pages = tree.path_pages(lock, length)
        tree.lock(lock)
        pages += _room(tree, pool, (total - length) // page_size, slots)
        for boundary in HYBRID_BOUNDARIES:
            if boundary <= length:
                continue
            node = tree.insert(full[:boundary], pages[: boundary // page_size], lock).node
            tree.lock(node)
            tree.unlock(lock)
            lock = node
            if node.checkpoint is None:
                if slots.free_count == 0:
                    slots.free([tree.evict_checkpoint(False).slot])
                tree.attach_checkpoint(node, slots.allocate(1)[0], None)
            tree.touch(node)
        tree.unlock(lock)
    return time.process_time() - start


def run_coordinator(requests, page_size: int, bounded: bool, hybrid: bool) -> float:
    """Seconds for the full router path through the CacheCoordinator."""
    total = len(requests[0][1])
    capacity = CAPACITY_TOKENS if bounded else REQUESTS * total
    slots = (capacity // 128 if bounded else REQUESTS * len(HYBRID_BOUNDARIES)) if hybrid else 0
    spec = CacheSpec(page_size, capacity // page_size, slots + 1, 0, hybrid, 256 if hybrid else None, True)
    coord = CacheCoordinator(spec)
    gc.collect()  # setup garbage (the pools' id tuples, the last run's tree) is not the index's cost
    start = time.process_time()
    for rid, (prompt, full) in enumerate(requests):
        txn = coord.begin(rid)
        hit = txn.match(prompt)
        txn.reserve(tokens=total - hit.length, state_slots=1 if hybrid else 0)
        txn.commit()
        for boundary in HYBRID_BOUNDARIES if hybrid else (total,):
            if boundary > hit.length:
                coord.publish(rid, full, boundary, checkpoint=hybrid)
        coord.release(rid)
    return time.process_time() - start


def measure(fn, requests, repeat: int, *args) -> dict:
    times = [fn(requests, *args) / len(requests) * 1e6 for _ in range(repeat)]
    return {"best_us": round(min(times), 1), "median_us": round(statistics.median(times), 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=7, help="runs per configuration (best and median shown)")
    parser.add_argument("--json", action="store_true", help="print a JSON list of rows instead of a table")
    args = parser.parse_args(argv)
    requests = workload(0)
    # The workload's 2,000 token lists are input, not index state: keep the collector off them.
    gc.collect()
    gc.freeze()
    rows = []
    for page_size in (1, 16):
        for bounded in (False, True):
            cap = "131072" if bounded else "unbounded"
            rows.append(("index", page_size, cap, measure(run_index, requests, args.repeat, page_size, bounded)))
            rows[-1][3]["sglang_us"] = SGLANG_US[(page_size, bounded)]
            rows.append(("index-hybrid", page_size, cap, measure(run_index_hybrid, requests, args.repeat, page_size, bounded)))
            for hybrid in (False, True):
                mode = "coord-hybrid" if hybrid else "coord"
                rows.append((mode, page_size, cap, measure(run_coordinator, requests, args.repeat, page_size, bounded, hybrid)))
    if args.json:
        print(json.dumps([{"mode": m, "page_size": p, "capacity": c, **r} for m, p, c, r in rows]))
        return 0
    print(f"{'mode':<14}{'page':>5}  {'capacity':<10}{'best us/req':>12}{'median':>9}{'SGLang':>8}")
    for mode, page_size, cap, r in rows:
        ref = r.get("sglang_us", "")
        print(f"{mode:<14}{page_size:>5}  {cap:<10}{r['best_us']:>12}{r['median_us']:>9}{ref:>8}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
