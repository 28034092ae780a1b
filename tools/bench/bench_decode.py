"""Decode-step time of the benchmark model in-process: graphs against eager, and where the time goes.

Builds the benchmark model's architecture (tools/bench/make_bench_model.py's config) with
random bf16 weights straight on the GPU, the rank's pools and its ModelRunner, then
times decode steps of B sequences at a given context through the runner's own
path (arena copy, graph replay or eager forward, sampling). For each batch size it
prints the step time, the memory roofline of the step (weights + KV read + fp32
recurrent state read and written, at the measured copy bandwidth) and the ratio,
and, with --profile, kernels per step and GPU busy time against wall time.

    python -m tools.bench.bench_decode [--batches 1,32,64] [--context 576] [--json out.json] [--profile]
                                       [--moe | --preset qwen3.5-27b] [--kv-cache-dtype bfloat16,fp8_e4m3]
                                       [--graphs-only]

--kv-cache-dtype times the KV pool in each dtype of the list, one after the other in the same run (fp8_e4m3:
float8_e4m3fn pages, scale 1.0, as hkv-launch --kv-cache-dtype fp8_e4m3 serves them).

--moe builds the MoE benchmark model's architecture instead (tools/bench/make_bench_model.py --moe: Qwen3-Next-80B's
layer shapes, 4 layers); its roofline counts only the experts a batch touches (tools/bench/moe_roofline.py).

This measures the engine under the router; served numbers come from hkv-bench.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch

from hkv.engine.model_runner import ModelRunner
from hkv.ipc.messages import Chunk, NewSequence, SamplingParams, StepPlan
from hkv.ipc.request_table import RequestTable, TableLayout
from hkv.models.registry import resolve_family
from hkv.storage.kv_pool import KVPool
from hkv.storage.state_pool import StatePool

BENCH_CONFIG = dict(
    model_type="qwen3_5_text", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
    num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
    linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
    max_position_embeddings=32768, tie_word_embeddings=True, rms_norm_eps=1e-6,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
)
PAGE = 16


def build_model(config: dict, seed: int = 0) -> torch.nn.Module:
    """The architecture with random bf16 weights on the GPU (std 0.02; norms at their neutral values)."""
    family = resolve_family(config)
    cfg = family.config_class.from_hf(config)
    with torch.device("meta"):
        model = family(cfg)
    model = model.to(dtype=torch.bfloat16).to_empty(device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0 if ".linear_attn.norm." in name else 0.0)
            elif name.endswith("A_log"):
                p.copy_(torch.log(torch.empty_like(p, dtype=torch.float32).uniform_(1, 16, generator=gen)))
            elif name.endswith("dt_bias"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.eval()
    model.prepare_for_device()
    return model


def moe_config() -> dict:
    """config.json of the MoE benchmark model (tools/bench/make_bench_model.py --moe)."""
    from tools.bench.make_bench_model import MOE_DEFAULTS, moe_bench_config

    return moe_bench_config(**MOE_DEFAULTS, eot=0, im_end=2)


def preset_config(name: str) -> dict:
    """config.json of a make_bench_model --preset shape (its MTP layer left out: the step does not read it)."""
    from tools.bench.make_bench_model import DEFAULTS, PRESETS, bench_config

    dims, overrides = PRESETS[name]
    config = bench_config(**{**DEFAULTS, **dims}, eot=0, im_end=2, overrides=overrides)
    config.pop("mtp_num_hidden_layers")
    return config


KV_DTYPES = {"bfloat16": "bfloat16", "fp8_e4m3": "float8_e4m3fn"}  # --kv-cache-dtype -> the KV pool's dtype


def roofline_ms(model, batch: int, context: int, bandwidth: float, kv_bytes: int = 2) -> float:
    """Bytes a decode step must move at least, over the copy bandwidth: weights once, every
    sequence's KV read, every fp32 recurrent and conv state read and written."""
    cfg = model.cfg
    weights = sum(p.numel() * p.element_size() for name, p in model.named_parameters() if ".experts." not in name)
    if getattr(cfg, "num_experts", 0):  # MoE: the experts this batch touches (tools/bench/moe_roofline.py)
        from tools.bench.moe_roofline import touched_experts

        experts = sum(p.numel() * p.element_size() for name, p in model.named_parameters() if ".experts." in name)
        weights += touched_experts(cfg.num_experts, cfg.num_experts_per_tok, batch) / cfg.num_experts * experts
    kv = batch * context * len(cfg.full_layers) * 2 * cfg.num_key_value_heads * cfg.head_dim * kv_bytes
    state = model.state_layout(1).bytes_per_slot
    return (weights + kv + 2 * batch * state) / bandwidth * 1e3


def copy_bandwidth() -> float:
    """Bytes per second of a large device-to-device copy (read + write counted)."""
    src = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * src.numel() * 10 / (start.elapsed_time(end) / 1e3)


class DecodeRig:
    """One runner over B sequences of `context` tokens each (their KV is garbage: speed only)."""

    def __init__(self, model, max_bs: int, context: int, graphs: bool, extra_slots: int = 0,
                 max_tokens: int | None = None, checkpoint_interval: int | None = None, kv_dtype: str = "bfloat16"):
        """extra_slots: state slots max_bs .. max_bs + extra_slots - 1 beside the sequences' own (for
        checkpoints); max_tokens: the step token budget (max_bs * 130 by default)."""
        self.context = context
        pages_per_seq = -(-(context + 64) // PAGE)
        num_pages = max_bs * pages_per_seq
        layout = TableLayout(slots=max_bs, max_pages=pages_per_seq + 1)
        self.table = RequestTable(layout, memoryview(bytearray(layout.nbytes())))
        self.kv = KVPool(model.kv_layout(num_pages + 1, PAGE, kv_dtype, "cuda"), model.layer_map,
                         attn_dtype=torch.bfloat16)
        self.state = StatePool(model.state_layout(max_bs + extra_slots + 1, device="cuda"))
        self.runner = ModelRunner(model, self.kv, self.state, self.table, PAGE, "cuda",
                                  scratch=(num_pages, max_bs + extra_slots), max_tokens=max_tokens or max_bs * 130,
                                  graph_max_bs=max_bs if graphs else 0, checkpoint_interval=checkpoint_interval)
        self.capture_s = self.runner.capture_graphs()
        for s in range(max_bs):
            self.table.write_pages(s, list(range(s * pages_per_seq, (s + 1) * pages_per_seq)))
        greedy = SamplingParams(max_tokens=1 << 20, temperature=0.0)
        new = [NewSequence(s, s + 1, greedy, s) for s in range(max_bs)]
        self.runner.execute(StepPlan(step=0, new=new, chunks=[], freed=[]))
        self.step = 1

    def decode(self, batch: int) -> StepPlan:
        chunks = [Chunk(s, [17 + s], self.context, True) for s in range(batch)]
        self.step += 1
        return StepPlan(step=self.step, new=[], chunks=chunks, freed=[])

    def mixed(self, batch: int, prefill: int = 128) -> StepPlan:
        """batch - 1 decoding sequences and one new prompt of `prefill` tokens (an eager step)."""
        chunks = [Chunk(s, [17 + s], self.context, True) for s in range(batch - 1)]
        chunks.append(Chunk(batch - 1, [(19 * i) % 1000 + 16 for i in range(prefill)], 0, True))
        self.step += 1
        return StepPlan(step=self.step, new=[], chunks=chunks, freed=[])

    def questions(self, batch: int, prefill: int = 128) -> StepPlan:
        """batch prompts that hit a cached prefix: `prefill` own tokens each after `context - prefill`
        cached ones (the shared-prefix workload's second step)."""
        start = self.context - prefill
        chunks = [Chunk(s, [(7 * i + s) % 1000 + 16 for i in range(prefill)], start, True) for s in range(batch)]
        self.step += 1
        return StepPlan(step=self.step, new=[], chunks=chunks, freed=[])

    def time_steps(self, batch: int, iters: int, kind: str = "decode") -> float:
        """Median wall milliseconds of one whole step (metadata, forward, sampling) of `kind`."""
        make = getattr(self, kind)
        for _ in range(5):
            self.runner.execute(make(batch))
        times = []
        for _ in range(iters):
            plan = make(batch)
            torch.cuda.synchronize()
            start = time.perf_counter()
            result = self.runner.execute(plan)
            times.append((time.perf_counter() - start) * 1e3)
            if result.error:
                raise RuntimeError(result.error)
        return float(np.median(times))


def profile_step(rig: DecodeRig, batch: int, kind: str = "decode") -> dict:
    """Kernels launched and GPU busy time within one step of `kind`, against its wall time, and
    the host operations that took the most time (self CPU time, profiler overhead included)."""
    from torch.profiler import ProfilerActivity, profile

    make = getattr(rig, kind)
    rig.runner.execute(make(batch))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        rig.runner.execute(make(batch))
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) * 1e3
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    busy = sum(e.device_time for e in kernels) / 1e3  # us -> ms
    memcpy_h2d = sum(1 for e in kernels if "HtoD" in e.name or "Memcpy HtoD" in e.name)
    top: dict[str, float] = {}
    for e in kernels:
        top[e.name[:60]] = top.get(e.name[:60], 0.0) + e.device_time / 1e3
    host = [(e.key[:60], e.self_cpu_time_total / 1e3, e.count) for e in prof.key_averages()]
    import cProfile
    import io
    import pstats

    cp = cProfile.Profile()
    cp.enable()
    for _ in range(3):
        rig.runner.execute(make(batch))
    cp.disable()
    text = io.StringIO()
    pstats.Stats(cp, stream=text).sort_stats("tottime").print_stats(25)
    python_top = [line for line in text.getvalue().splitlines() if line.strip()][-26:]
    return {"kernels": len(kernels), "h2d_copies": memcpy_h2d, "gpu_busy_ms": busy, "wall_ms": wall,
            "top": sorted(top.items(), key=lambda kv: -kv[1])[:12],
            "host_top": sorted(host, key=lambda r: -r[1])[:15], "python_top_3_steps": python_top}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,32,64", help="decode batch sizes (default: 1,32,64)")
    parser.add_argument("--context", type=int, default=576, help="tokens already in each sequence (default: 576)")
    parser.add_argument("--iters", type=int, default=50, help="timed steps per point (default: 50)")
    parser.add_argument("--profile", action="store_true", help="also profile one step per batch size")
    parser.add_argument("--mixed", action="store_true",
                        help="also time prefill steps: decodes plus one 128-token prompt, and B prompts of 128 "
                             "tokens after a cached prefix (as the cost model picks, then eager)")
    parser.add_argument("--moe", action="store_true", help="the MoE benchmark model's architecture instead")
    from tools.bench.make_bench_model import PRESETS

    parser.add_argument("--preset", choices=sorted(PRESETS),
                        help="a make_bench_model --preset shape instead (qwen3.5-27b: Qwen3.5-27B's layers, 16)")
    parser.add_argument("--kv-cache-dtype", default="bfloat16",
                        help="KV pool dtypes to time, a comma list of bfloat16 and fp8_e4m3 (default: bfloat16)")
    parser.add_argument("--graphs-only", action="store_true", help="time graph replays only, not eager steps too")
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args(argv)
    kv_dtypes = args.kv_cache_dtype.split(",")
    if any(d not in KV_DTYPES for d in kv_dtypes):
        parser.error(f"--kv-cache-dtype: each of {sorted(KV_DTYPES)}, got {args.kv_cache_dtype!r}")
    if args.moe and args.preset:
        parser.error("--moe and --preset are two different models: give one")
    if not torch.cuda.is_available():
        print("bench_decode needs a CUDA device", file=sys.stderr)
        return 2
    batches = [int(b) for b in args.batches.split(",")]
    bw = copy_bandwidth()
    model = build_model(moe_config() if args.moe else preset_config(args.preset) if args.preset else BENCH_CONFIG)
    params = sum(p.numel() for p in model.parameters())
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.2f} TB/s; model {params / 1e9:.2f} B params",
          flush=True)
    out = {"copy_bandwidth": bw, "params": params, "context": args.context, "rows": []}
    with torch.inference_mode():
        for kv_dtype, graphs in [(d, g) for d in kv_dtypes for g in ((True,) if args.graphs_only else (True, False))]:
            rig = DecodeRig(model, max(batches), args.context, graphs, kv_dtype=KV_DTYPES[kv_dtype])
            if graphs:
                print(f"{kv_dtype} KV: graphs captured in {rig.capture_s:.1f} s", flush=True)
            for b in batches:
                ms = rig.time_steps(b, args.iters)
                roof = roofline_ms(model, b, args.context, bw, rig.kv.kv.element_size())
                row = {"graphs": graphs, "batch": b, "kv_dtype": kv_dtype, "step_ms": ms, "roofline_ms": roof,
                       "of_roofline": roof / ms}
                if args.profile:
                    row["profile"] = profile_step(rig, b)
                out["rows"].append(row)
                prof = row.get("profile")
                extra = (f"; {prof['kernels']} kernels, {prof['h2d_copies']} H2D, GPU busy "
                         f"{prof['gpu_busy_ms']:.2f} of {prof['wall_ms']:.2f} ms") if prof else ""
                print(f"{kv_dtype:9} {'graphs' if graphs else 'eager '} B{b:<4} step {ms:7.3f} ms  roofline {roof:6.3f} ms  "
                      f"{100 * roof / ms:5.1f}%{extra}", flush=True)
                if args.mixed and graphs:
                    short = rig.runner.prefill_graphs
                    measured = short.budget_s
                    # B prompts after a cached prefix: as the cost model picks (graph parts below its
                    # eager floor), then forced eager, in the same run
                    for kind, budget in (("mixed", measured), ("questions", measured), ("questions", 0.0)):
                        short.budget_s = budget
                        ms = rig.time_steps(b, max(5, args.iters // 5), kind)
                        how = "eager" if budget <= 0 else "as picked"
                        row = {"graphs": graphs, "batch": b, "kind": kind, "step_ms": ms, "how": how,
                               "eager_floor_ms": measured * 1e3}
                        if args.profile:
                            row["profile"] = profile_step(rig, b, kind)
                        out["rows"].append(row)
                        prof = row.get("profile")
                        extra = (f"; {prof['kernels']} kernels, GPU busy {prof['gpu_busy_ms']:.2f} of "
                                 f"{prof['wall_ms']:.2f} ms") if prof else ""
                        print(f"{kind:9} B{b:<4} {how:9} step {ms:7.3f} ms (eager floor {measured * 1e3:.1f} ms)"
                              f"{extra}", flush=True)
                    short.budget_s = measured
            del rig
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
