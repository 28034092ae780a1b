"""Prefill steps of the benchmark model in-process: the prefill graphs' rounds against eager steps.

Builds the benchmark model (tools/bench/bench_decode.py's config, random bf16 weights on the GPU), the
rank's pools and its ModelRunner with every graph captured, then times whole steps (metadata,
forward, sampling) of the shared-prefix wave and its neighbours through the runner's own path,
three ways in the same run: as the cost model picks, with the prefill graphs forced, and eager.

    leader      one 2,176-token prompt keeping a checkpoint every 256 tokens (the wave's first step)
    followers   B prompts of 128 tokens after 2,048 cached ones (the wave's second step)
    long        one 8,192-token chunk (a long prompt's step)

For each it prints the wall time of each way, the GPU busy time and kernels of one step, and what
the cost model predicted for the rounds (their capture-time replays) against its eager estimate.

    python -m tools.bench.bench_prefill [--followers 31,64] [--iters 10] [--json out.json]

This measures the engine under the router; served numbers come from hkv-bench.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import numpy as np
import torch

from hkv.ipc.messages import Chunk, StepPlan
from tools.bench.bench_decode import BENCH_CONFIG, DecodeRig, build_model

PREFIX, QUESTION, INTERVAL, LONG = 2048, 128, 256, 8192


class PrefillRig(DecodeRig):
    """A runner over S sequences with room for LONG tokens each, plus checkpoint slots (KV is garbage)."""

    def __init__(self, model, seqs: int, budget: int):
        checkpoints = PREFIX // INTERVAL + 1
        super().__init__(model, seqs, LONG, graphs=True, extra_slots=checkpoints, max_tokens=budget + seqs,
                         checkpoint_interval=INTERVAL)
        self.checkpoint_slots = list(range(seqs, seqs + checkpoints))

    def _plan(self, chunks: list[Chunk]) -> StepPlan:
        self.step += 1
        return StepPlan(step=self.step, new=[], chunks=chunks, freed=[])

    def leader(self) -> StepPlan:
        n = PREFIX + QUESTION
        marks = [[INTERVAL * k, self.checkpoint_slots[k - 1]] for k in range(1, PREFIX // INTERVAL + 1)]
        return self._plan([Chunk(0, [(13 * i) % 1000 + 16 for i in range(n)], 0, True, marks)])

    def followers(self, batch: int) -> StepPlan:
        return self._plan([Chunk(s, [(7 * i + s) % 1000 + 16 for i in range(QUESTION)], PREFIX, True)
                           for s in range(1, batch + 1)])

    def long(self) -> StepPlan:
        return self._plan([Chunk(0, [(11 * i) % 1000 + 16 for i in range(LONG)], 0, True)])


def time_step(rig: PrefillRig, make, iters: int) -> tuple[float, str]:
    """Median wall milliseconds of one whole step, and how the runner ran it."""
    for _ in range(2):
        rig.runner.execute(make())
    times, how = [], None
    for _ in range(iters):
        plan = make()
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = rig.runner.execute(plan)
        times.append((time.perf_counter() - start) * 1e3)
        if result.error:
            raise RuntimeError(result.error)
        how = result.graph
    return float(np.median(times)), str(how)


def gpu_busy(rig: PrefillRig, make) -> tuple[float, int]:
    """GPU busy milliseconds and kernels of one step (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    rig.runner.execute(make())
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        rig.runner.execute(make())
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    return sum(e.device_time for e in kernels) / 1e3, len(kernels)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--followers", default="31,64", help="batch sizes of the followers' step (default: 31,64)")
    parser.add_argument("--iters", type=int, default=10, help="timed steps per point (default: 10)")
    parser.add_argument("--budget", type=int, default=8192, help="the step token budget (default: 8192)")
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_prefill needs a CUDA device", file=sys.stderr)
        return 2
    batches = [int(b) for b in args.followers.split(",")]
    model = build_model(BENCH_CONFIG)
    with torch.inference_mode():
        rig = PrefillRig(model, max(batches) + 1, args.budget)
        graphs = rig.runner.prefill_graphs
        print(f"graphs captured in {rig.capture_s:.1f} s: {len(graphs.sizes)} prefill buckets; eager floor "
              f"{graphs.budget_s * 1e3:.1f} ms; replays (1, 128) {graphs.costs[(1, 128)] * 1e3:.2f} ms, "
              f"(1, {graphs.largest}) {graphs.costs[(1, graphs.largest)] * 1e3:.2f} ms, "
              f"(16, 128) {graphs.costs.get((16, 128), math.nan) * 1e3:.2f} ms", flush=True)
        cases = [("leader", rig.leader)] + [(f"followers B{b}", lambda b=b: rig.followers(b)) for b in batches]
        cases.append(("long 8192", rig.long))
        rows = []
        measured = graphs.budget_s
        for name, make in cases:
            chunks = make().chunks
            prefill = [c for c in chunks if len(c.token_ids) > 1]
            estimate = graphs.eager_estimate_s(prefill) * 1e3
            forced_budget = 1e9
            graphs.budget_s = forced_budget
            plan = graphs.plan_chunks(prefill)
            predicted = sum(graphs.costs[r.bucket] for r in plan.rounds) * 1e3 if plan else math.nan
            row = {"case": name, "tokens": sum(len(c.token_ids) for c in prefill), "predicted_ms": predicted,
                   "eager_estimate_ms": estimate, "rounds": [list(r.bucket) for r in plan.rounds] if plan else None}
            for way, budget in (("picked", measured), ("graphs", forced_budget), ("eager", 0.0)):
                graphs.budget_s = budget
                ms, how = time_step(rig, make, args.iters)
                busy, kernels = gpu_busy(rig, make)
                row[way] = {"wall_ms": ms, "ran": how, "gpu_busy_ms": busy, "kernels": kernels}
            graphs.budget_s = measured
            rows.append(row)
            print(f"{name:14} {row['tokens']:5} tok  predicted {predicted:6.2f} ms (eager est. {estimate:6.2f})  "
                  + "  ".join(f"{w} {row[w]['wall_ms']:6.2f} ms [{row[w]['ran']}; busy {row[w]['gpu_busy_ms']:.2f}, "
                              f"{row[w]['kernels']} k]" for w in ("picked", "graphs", "eager")), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"capture_s": rig.capture_s, "eager_floor_ms": measured * 1e3,
                       "costs_ms": {f"{b}x{t}": c * 1e3 for (b, t), c in graphs.costs.items()}, "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
