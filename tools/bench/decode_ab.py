"""The MoE benchmark model's batch-1 decode step at two trees, in-process (tools/gpu/gpu_c1ab.sh decode): each
tree's graph step time and the kernels its steps run, so a served concurrency-1 gap can be put on the forward or
cleared of it.

    python3 - kernels OUT.json [--steps 20] [--context 576] < tools/bench/decode_ab.py   (cwd: the tree measured)
    python -m tools.bench.decode_ab summary DIR

`kernels` runs in the tree it measures, through that tree's own bench_decode (tools/bench/bench_decode.py, or
tools/bench_decode.py before the tools were split into folders): its random-weight MoE model, its DecodeRig at
B1 with CUDA graphs, its profile_step (the line `bench_decode --profile` prints), then every kernel of `--steps`
graph steps by name. It is fed on stdin so that a tree older than this file runs it too; its imports then
resolve in the working directory, the tree. bench_decode's own --profile keeps the 12 heaviest kernels (names
cut at 60 characters) and no per-kernel counts, too little to tell which launch changed.

`summary` reads DIR: decode_{base,head}_{round}.json (`bench_decode --moe --batches 1 --json`) and
kernels_{base,head}.json (`kernels`), and prints the graph step per round and its median for each tree, the
profiles, and the kernels whose launches per step or time per step differ (by more than 10% and 2 us).
"""

from __future__ import annotations

import argparse
import glob
import importlib
import json
import os
import statistics
import sys

TREES = ("base", "head")
REL_DIFF, ABS_DIFF_US = 0.10, 2.0  # a kernel's time per step differs past both


def per_step_table(events: list[tuple[str, float]], steps: int) -> dict[str, list[float]]:
    """(kernel name, device us) of `steps` steps -> name: [launches per step, us per step]."""
    table: dict[str, list[float]] = {}
    for name, us in events:
        row = table.setdefault(name, [0.0, 0.0])
        row[0] += 1 / steps
        row[1] += us / steps
    return table


def bench_decode_name(tools_dir: str) -> str:
    """The bench_decode module of the tree whose tools package is `tools_dir`: tools/bench/ since the split,
    tools/ before it."""
    split = os.path.exists(os.path.join(tools_dir, "bench", "bench_decode.py"))
    return "tools.bench.bench_decode" if split else "tools.bench_decode"


def _bench_decode():
    """The measured tree's bench_decode, checked to come from its tools package (an editable install's
    finder can answer for a module that package lacks: another tree's code, measured by mistake)."""
    import tools

    tools_dir = os.path.dirname(os.path.abspath(tools.__file__))
    bench = importlib.import_module(bench_decode_name(tools_dir))
    if not os.path.abspath(bench.__file__).startswith(tools_dir + os.sep):
        raise RuntimeError(f"{bench.__name__} came from {bench.__file__}, not from {tools_dir}")
    return bench


def _kernel_events(rig, steps: int) -> list[tuple[str, float]]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    rig.runner.execute(rig.decode(1))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            rig.runner.execute(rig.decode(1))
        torch.cuda.synchronize()
    return [(e.name, e.device_time) for e in prof.events() if e.device_type.name == "CUDA"]


def measure_kernels(out: str, steps: int, context: int, iters: int) -> dict:
    """The tree's B1 graph step (median ms over `iters`), its profile_step, and its kernels per step."""
    import torch

    bench = _bench_decode()
    model = bench.build_model(bench.moe_config())
    with torch.inference_mode():
        rig = bench.DecodeRig(model, 1, context, True)
        step_ms = rig.time_steps(1, iters)
        own = bench.profile_step(rig, 1)
        table = per_step_table(_kernel_events(rig, steps), steps)
    doc = {"module": bench.__file__, "step_ms": step_ms, "kernels": own["kernels"], "h2d_copies": own["h2d_copies"],
           "gpu_busy_ms": own["gpu_busy_ms"], "wall_ms": own["wall_ms"], "steps": steps, "by_kernel": table}
    with open(out, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
    print(f"{bench.__file__}: graphs B1 step {step_ms:.3f} ms; {own['kernels']} kernels, {own['h2d_copies']} H2D, "
          f"GPU busy {own['gpu_busy_ms']:.3f} of {own['wall_ms']:.3f} ms", flush=True)
    return doc


def graph_step_ms(doc: dict) -> float:
    """The B1 graph row's step ms of a `bench_decode --json` document (bfloat16 KV where it names one)."""
    rows = [r for r in doc["rows"] if r["graphs"] and r["batch"] == 1 and r.get("kv_dtype", "bfloat16") == "bfloat16"]
    if len(rows) != 1:
        raise ValueError(f"expected one B1 graph row, found {len(rows)}")
    return rows[0]["step_ms"]


def kernel_diff(base: dict[str, list[float]], head: dict[str, list[float]]) -> list[tuple[str, list, list]]:
    """(name, [count, us] at base, at head) of the kernels whose launches or time per step differ, the
    largest time difference first; a kernel one tree lacks has [0, 0] there."""
    rows = []
    for name in sorted(set(base) | set(head)):
        b, h = base.get(name, [0.0, 0.0]), head.get(name, [0.0, 0.0])
        moved = abs(h[1] - b[1])
        if round(b[0], 3) != round(h[0], 3) or (moved > ABS_DIFF_US and moved > REL_DIFF * b[1]):
            rows.append((name, b, h))
    return sorted(rows, key=lambda r: -abs(r[2][1] - r[1][1]))


def _rounds(folder: str, tree: str) -> list[float]:
    paths = sorted(glob.glob(os.path.join(folder, f"decode_{tree}_*.json")),
                   key=lambda p: int(p.rsplit("_", 1)[1].split(".")[0]))
    steps = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            steps.append(graph_step_ms(json.load(f)))
    return steps


def summary_lines(folder: str) -> list[str]:
    lines, medians, profiles = [], {}, {}
    for tree in TREES:
        steps = _rounds(folder, tree)
        if steps:
            medians[tree] = statistics.median(steps)
            lines.append(f"decode {tree}: graph step per round {' '.join(f'{x:.3f}' for x in steps)} ms "
                         f"(median {medians[tree]:.3f})")
    if len(medians) == 2:
        lines.append(f"decode head / base: {medians['head'] / medians['base']:.3f}")
    for tree in TREES:
        path = os.path.join(folder, f"kernels_{tree}.json")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                profiles[tree] = p = json.load(f)
            lines.append(f"profile {tree}: step {p['step_ms']:.3f} ms; {p['kernels']} kernels, {p['h2d_copies']} "
                         f"H2D, GPU busy {p['gpu_busy_ms']:.3f} of {p['wall_ms']:.3f} ms; over {p['steps']} steps "
                         f"{sum(c for c, _ in p['by_kernel'].values()):.1f} kernels and "
                         f"{sum(us for _, us in p['by_kernel'].values()):.1f} us a step")
    if len(profiles) == 2:
        diff = kernel_diff(profiles["base"]["by_kernel"], profiles["head"]["by_kernel"])
        lines.append(f"kernels that differ per step (launches, us: base -> head): {len(diff) or 'none'}")
        lines += [f"  {b[0]:.2f} -> {h[0]:.2f}  {b[1]:8.1f} -> {h[1]:8.1f} us  {name[:100]}" for name, b, h in diff]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    kernels = sub.add_parser("kernels", help="in the tree measured (a GPU): its B1 graph step and kernels")
    kernels.add_argument("out", help="JSON file to write")
    kernels.add_argument("--steps", type=int, default=20, help="graph steps profiled (default: 20)")
    kernels.add_argument("--context", type=int, default=576, help="tokens in the sequence (default: 576)")
    kernels.add_argument("--iters", type=int, default=200, help="timed steps (default: 200)")
    summary = sub.add_parser("summary", help="base against head from a folder of results")
    summary.add_argument("folder")
    args = parser.parse_args(argv)
    if args.command == "kernels":
        measure_kernels(args.out, args.steps, args.context, args.iters)
    else:
        print("\n".join(summary_lines(args.folder)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
