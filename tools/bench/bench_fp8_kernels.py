"""The FP8 section of tools/bench/bench_kernels.py (`--only fp8`): block-FP8 GEMMs on the benchmark
model's projections (bench_kernels.DECODE_GEMMS), against cuBLAS bf16 (F.linear) timed in the same run.

1. Headline rows at M = 1, 32, 64 (decode) and 2048 (a prefill chunk: does FP8 cost prefill time?):
   - hkv's Triton weight-only GEMM (hkv_kernels/fp8_gemm) with the tile fp8_tile picks;
   - torch's block-scaled cuBLAS GEMM (torch.nn.functional.scaled_mm, 1 x 128 activation groups by
     128 x 128 weight blocks) where the installed torch has it, with the activations quantized per
     1 x 128 group first: timed alone (`scaled_mm`) and with that quantization (`scaled_mm+quant`,
     what a model would pay).
   Per M, the decode step's GEMM total (each shape times its count) for bf16 and for hkv's FP8
   (`bf16_gemm_step_total`, `fp8_gemm_step_total`).
2. The tile sweep at M = 1, 4, 16, 32, 64 (DECODE_TILES' buckets): candidate tiles per bucket on every
   projection (`fp8_sweep_*` rows, the tile in the shape column; `*` marks the current entry), each
   shape's fastest, and per bucket the step totals of bf16, the current tile, the tile with the lowest
   total and each shape's fastest (`bf16_sweep_step_total`, `fp8_sweep_step_best`), acceptance 3's line
   at M = 1 and 64, and the lowest-total tile as the DECODE_TILES entry to paste into
   hkv_kernels/fp8_gemm/triton_fp8_gemm.py.

Every implementation and candidate is checked against the dequantizing reference before it is timed; a
variant that fails (compile error, unsupported shape, wrong result) prints one line and the rest go on.
Each op is timed twice. The row's ms, its GB/s, % of copy bandwidth and speed-up over bf16 F.linear (timed
the same way) are device time: CUDA graph replays over copies of the weight (tools/bench/device_time.py),
what a served decode step pays, and what the sweep ranks by. The last column, host-incl, is do_bench per
call (host Python and launches included; the figure earlier runs printed alone). Step totals read
GB/s on the weight bytes alone (acceptance 3: >= 60% of copy bandwidth at M = 1, >= 1.3x bf16 at M = 64).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton

from hkv_kernels.fp8_gemm.reference import FP8_MAX, dequantize, quantize
from hkv_kernels.fp8_gemm.triton_fp8_gemm import DECODE_TILES, Fp8Tile, fit_rows, fp8_linear, fp8_tile, k_split
from tools.bench.device_time import Weights, graph_ms, weight_sets

GB = 1e9
ROWS = (1, 32, 64, 2048)  # headline: decode batches, then one prefill chunk
SWEEP_ROWS = tuple(rows for rows, _ in DECODE_TILES)  # one sweep per DECODE_TILES bucket


@dataclass
class Projection:
    """One benchmark-model projection: bf16 weight and its FP8 form (device), GEMMs per decode step."""

    name: str
    n: int
    k: int
    count: int
    w: torch.Tensor  # [N, K] bf16
    q: torch.Tensor  # [N, K] float8_e4m3fn
    scale: torch.Tensor  # [ceil(N/128), ceil(K/128)] fp32
    w_ref: torch.Tensor  # [N, K] bf16: dequantize(q, scale), what every FP8 path must match


class Timing(NamedTuple):
    """ms per call of one op: `device` from graph replays over weight copies (device_time.graph_ms, what a
    served step pays), `host` from do_bench per call (host Python and launches included)."""

    device: float
    host: float


MISSING = Timing(float("inf"), float("inf"))  # an op that failed: a step total with it is inf


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def quick_bench(fn: Callable[[], object]) -> float:
    """Median ms over ~20 ms of repeats (L2 flushed each): the sweep's host-inclusive column."""
    return triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median")


def _gbytes(p: Projection, rows: int) -> float:
    return (p.q.numel() + p.scale.numel() * 4 + rows * (p.n + p.k) * 2) / GB


def _weight_gbytes(projections: list[Projection], fp8: bool) -> float:
    """The weight bytes a step's GEMMs read (each shape times its count): FP8 with scales, or bf16."""
    per = (lambda p: p.q.numel() + p.scale.numel() * 4) if fp8 else (lambda p: p.w.numel() * p.w.element_size())
    return sum(p.count * per(p) for p in projections) / GB


def _step(projections: list[Projection], timing: Callable[[Projection], Timing | None]) -> Timing:
    """Count-weighted sum of each projection's Timing (a None makes it inf)."""
    times = [(p.count, timing(p) or MISSING) for p in projections]
    return Timing(sum(c * t.device for c, t in times), sum(c * t.host for c, t in times))


def _shape(p: Projection, rows: int) -> str:
    return f"M{rows} N{p.n} K{p.k} x{p.count}"


def tile_label(tile: Fp8Tile, split: int | None = None) -> str:
    """kind rows x weight rows x K step, warps, stages, per_sm, "so" for scale_out, "fs" for fused_sum, and
    the K split a shape got (sk)."""
    return (f"{tile.kind} {tile.block_m}x{tile.block_n}x{tile.block_k} w{tile.num_warps} s{tile.num_stages} "
            f"ps{tile.per_sm}" + (" so" if tile.scale_out else "") + (" fs" if tile.fused_sum else "")
            + ("" if split is None else f" sk{split}"))


def candidates(rows: int) -> list[Fp8Tile]:
    """Tiles to sweep for the DECODE_TILES bucket `rows` (each fitted to it), the current entry first, then
    other shapes of its kind, the neighbouring kind, the current tile with other K-split targets, the first
    three of those (the current entry and the next two) with scale_out flipped, and last the current entry
    and its scale_out twin with fused_sum flipped (the split's sum in the GEMM's own launch). 13 to 15 a
    bucket; tools/gpu/gpu_fp8.sh allows the section 400 s. Fp8Tile's docstring has the constraints."""
    current = dict(DECODE_TILES)[rows]

    def gemv(n, bk, warps):
        return Fp8Tile("gemv", 4, n, bk, warps, 1)

    def dot(n, bk, warps, stages):
        return Fp8Tile("dot", 64, n, bk, warps, stages)

    gemvs = [gemv(128, 64, 4), gemv(64, 64, 4), gemv(128, 32, 2), gemv(128, 128, 8), gemv(64, 32, 2)]
    dots = [dot(64, 128, 4, 4), dot(128, 128, 4, 3), dot(64, 64, 4, 5), dot(128, 128, 8, 3)]
    pool = {
        1: [*gemvs, dots[0]],
        4: [*gemvs[:4], *dots[:3]],
        16: [*dots, Fp8Tile("mm", 64, 64, 128, 4, 4), gemvs[0]],
    }.get(rows, [*dots, Fp8Tile("mm", 64, 64, 128, 4, 4)])
    pool += [replace(current, per_sm=ps) for ps in (1, 4, 8) if ps != current.per_sm]
    fitted = list(dict.fromkeys(fit_rows(t, rows) for t in [current, *pool]))  # drop duplicates, keep the order
    flipped = [replace(t, scale_out=not t.scale_out) for t in fitted[:3] if t.kind != "mm"]
    fused = [replace(t, fused_sum=not t.fused_sum) for t in [fitted[0], *flipped[:1]] if t.kind != "mm"]
    return list(dict.fromkeys([*fitted, *flipped, *fused]))


def _projections(gen: torch.Generator, dtype: torch.dtype) -> list[Projection]:
    from tools.bench.bench_kernels import DECODE_GEMMS

    out = []
    for name, n, k, count in DECODE_GEMMS:
        w = (torch.randn(n, k, device=gen.device, generator=gen) * 0.02).to(dtype)
        q, scale = quantize(w)
        out.append(Projection(name, n, k, count, w, q, scale, dequantize(q, scale, dtype)))
    return out


def _precompile(projections: list[Projection], gen: torch.Generator) -> dict[tuple[int, Fp8Tile], str]:
    """Compile every (rows, candidate) on every shape on a thread pool (Triton compiles in native code and
    ptxas, so threads overlap; the CPU interpreter is not thread-safe and gets one thread); returns the
    failures, each (rows, tile) -> its first error line."""
    k_max, dtype = max(p.k for p in projections), projections[0].w.dtype
    xs = {rows: torch.randn(rows, k_max, device=gen.device, generator=gen).to(dtype) for rows in {*SWEEP_ROWS, *ROWS}}
    jobs = [(rows, tile) for rows in SWEEP_ROWS for tile in candidates(rows)]
    # fp8_tile depends on the batch and dtype only
    jobs += [(rows, fp8_tile(rows, p.n, p.k, dtype, p.q.device)) for rows in ROWS for p in projections[:1]]

    def compile_one(job):
        rows, tile = job
        try:
            for p in projections:  # a K split or none, EVEN_K or not: each shape may need its own variant
                fp8_linear(xs[rows][:, : p.k], p.q, p.scale, tile=tile)
            return None
        except Exception as exc:  # reported once, and the timing loop skips the tile
            return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"

    with ThreadPoolExecutor(max_workers=16 if gen.device.type == "cuda" else 1) as pool:
        errors = dict(zip(jobs, pool.map(compile_one, jobs)))
    return {job: err for job, err in errors.items() if err is not None}


def bench_fp8(row: Callable, bench: Callable, device: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> None:
    """The whole section; device and dtype exist for the interpreter's smoke test (fp32 on a CPU)."""
    gen = torch.Generator(device=device).manual_seed(0)
    projections = _projections(gen, dtype)
    failed = _precompile(projections, gen)
    for (rows, tile), err in failed.items():
        print(f"fp8: {tile_label(tile)} at M{rows} failed to run: {err}", flush=True)
    bf16 = _bench_headline(row, bench, projections, gen)
    _bench_sweep(row, projections, gen, bf16, failed)


def _bench_headline(row: Callable, bench: Callable, projections: list[Projection],
                    gen: torch.Generator) -> dict[tuple[int, str], Timing]:
    """hkv's default tile, bf16 and torch's scaled_mm at ROWS; returns the bf16 Timings by (rows, name)."""
    blockwise = scaled_mm_blockwise()
    if blockwise is None:
        print(f"fp8: torch {torch.__version__} has no block-scaled scaled_mm; timing hkv's kernel only", flush=True)
    bf16: dict[tuple[int, str], Timing] = {}
    fp8: dict[tuple[int, str], Timing | None] = {}
    for rows in ROWS:
        tile = fp8_tile(rows, projections[0].n, projections[0].k, projections[0].w.dtype, projections[0].q.device)
        print(f"fp8_tile at M{rows}: {tile_label(tile)}", flush=True)
        for p in projections:
            x = torch.randn(rows, p.k, device=gen.device, generator=gen).to(p.w.dtype)
            ref = F.linear(x, p.w_ref)
            base = bf16[rows, p.name] = _time_bf16(bench, p, x)
            sets = weight_sets((p.q, p.scale))
            ms = fp8[rows, p.name] = _time_checked(bench, fp8_linear, x, sets, ref, 2e-2,
                                                   f"fp8_linear {_shape(p, rows)}")
            if ms is not None:
                _row(row, f"fp8_gemm_{p.name}", _shape(p, rows), ms, _gbytes(p, rows), base)
            if blockwise is not None:
                _bench_scaled_mm(row, bench, blockwise, (x, sets, ref), _shape(p, rows), _gbytes(p, rows), base,
                                 p.name)
            del sets
    for rows in ROWS:
        base = _step(projections, lambda p: bf16[rows, p.name])
        ms = _step(projections, lambda p: fp8[rows, p.name])
        print(f"a step's GEMMs, M{rows}, device time: bf16 {base.device:.3f} ms, hkv FP8 {ms.device:.3f} ms "
              f"(x{base.device / ms.device:.2f}); host-inclusive: bf16 {base.host:.3f} ms, hkv FP8 {ms.host:.3f} ms",
              flush=True)
        _step_rows(row, ("bf16_gemm_step_total", "fp8_gemm_step_total"), rows, projections, ms, base)
    return bf16


def _row(row: Callable, name: str, shape: str, ms: Timing, gbytes: float, base: Timing) -> None:
    row(name, shape, ms.device, gbytes=gbytes, base_name="bf16 F.linear", base_ms=base.device, host_ms=ms.host,
        base_host_ms=base.host)


def _step_rows(row: Callable, names: tuple[str, str], rows: int, projections: list[Projection], ms: Timing,
               base: Timing) -> None:
    """A step's GEMM totals as two rows named (bf16, FP8), GB/s and % of copy on the weight bytes alone."""
    row(names[0], f"M{rows}", base.device, gbytes=_weight_gbytes(projections, fp8=False), host_ms=base.host)
    _row(row, names[1], f"M{rows}", ms, _weight_gbytes(projections, fp8=True), base)


def _time_bf16(host_bench: Callable, p: Projection, x: torch.Tensor) -> Timing:
    sets = weight_sets((p.w,))
    return Timing(graph_ms(lambda w: F.linear(x, w), sets), host_bench(lambda: F.linear(x, p.w)))


def _time_checked(host_bench: Callable, op: Callable[..., torch.Tensor], x: torch.Tensor, sets: list[Weights],
                  ref: torch.Tensor, tol: float, what: str) -> Timing | None:
    """op(x, *weights)'s Timing if its output on sets[0] (the original weights) is within tol (relative L2)
    of ref, else None with one printed line. The device time calls op on every set in turn."""
    try:
        err = _rel(op(x, *sets[0]), ref)
        if not err < tol:
            print(f"{what}: relative error {err:.2e} >= {tol:.0e}, not timed", flush=True)
            return None
        return Timing(graph_ms(lambda *weights: op(x, *weights), sets), host_bench(lambda: op(x, *sets[0])))
    except Exception as exc:  # a compile error or an unsupported shape: the other variants still run
        print(f"{what}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", flush=True)
        return None


def _bench_sweep(row: Callable, projections: list[Projection], gen: torch.Generator,
                 bf16: dict[tuple[int, str], Timing], failed: dict) -> None:
    """Every candidate of every bucket on every projection; per bucket, the tile with the lowest step total."""
    for rows in SWEEP_ROWS:
        current = candidates(rows)[0]
        tiles = [t for t in candidates(rows) if (rows, t) not in failed]
        if not tiles:
            print(f"sweep M{rows}: every candidate failed", flush=True)
            continue
        base: dict[str, Timing] = {}
        times: dict[str, dict[Fp8Tile, Timing]] = {}
        for p in projections:
            x = torch.randn(rows, p.k, device=gen.device, generator=gen).to(p.w.dtype)
            base[p.name] = bf16.get((rows, p.name)) or _time_bf16(quick_bench, p, x)
            times[p.name] = _sweep_shape(row, p, x, tiles, current, base[p.name])
        _print_recommendation(row, rows, current, tiles, projections, times, base)


def _sweep_shape(row: Callable, p: Projection, x: torch.Tensor, tiles: list[Fp8Tile], current: Fp8Tile,
                 base: Timing) -> dict[Fp8Tile, Timing]:
    """Every tile on one projection at x's rows; returns the Timings of the tiles that ran and matched."""
    rows = x.shape[0]
    ref = F.linear(x, p.w_ref)
    sets = weight_sets((p.q, p.scale))
    times: dict[Fp8Tile, Timing] = {}
    for tile in tiles:
        label = ("*" if tile == current else " ") + tile_label(tile, k_split(tile, rows, p.n, p.k, x.device)[1])
        ms = _time_checked(quick_bench, lambda x, q, s: fp8_linear(x, q, s, tile=tile), x, sets, ref, 2e-2,
                           f"fp8 sweep {_shape(p, rows)} {label}")
        if ms is not None:
            times[tile] = ms
            _row(row, f"fp8_sweep_{p.name}", f"M{rows} N{p.n} K{p.k} {label}", ms, _gbytes(p, rows), base)
    if times:
        best = min(times, key=lambda t: times[t].device)
        now = times.get(current, MISSING).device
        print(f"  pick M{rows} {p.name}: {tile_label(best, k_split(best, rows, p.n, p.k, x.device)[1])} "
              f"{times[best].device:.4f} ms (current / best: x{now / times[best].device:.2f})", flush=True)
    return times


def _print_recommendation(row: Callable, rows: int, current: Fp8Tile, tiles: list[Fp8Tile],
                          projections: list[Projection], times: dict[str, dict[Fp8Tile, Timing]],
                          base: dict[str, Timing]) -> None:
    """The bucket's step totals (device time ranks; host-inclusive beside), and the DECODE_TILES entry."""
    step = {tile: _step(projections, lambda p: times[p.name].get(tile)) for tile in tiles}
    best = min(step, key=lambda t: step[t].device)
    bf16 = _step(projections, lambda p: base[p.name])
    now = step.get(current, MISSING)
    per_shape = _step(projections, lambda p: min(times[p.name].values(), key=lambda t: t.device, default=None))
    print(f"sweep M{rows}, step GEMMs in device time: bf16 {bf16.device:.4f} ms, current tile {now.device:.4f} ms "
          f"(x{bf16.device / now.device:.2f}), best tile {step[best].device:.4f} ms "
          f"(x{bf16.device / step[best].device:.2f}), each shape's best {per_shape.device:.4f} ms "
          f"(x{bf16.device / per_shape.device:.2f}); host-inclusive: bf16 {bf16.host:.4f} ms, "
          f"current {now.host:.4f} ms, best tile {step[best].host:.4f} ms", flush=True)
    _step_rows(row, ("bf16_sweep_step_total", "fp8_sweep_step_best"), rows, projections, step[best], bf16)
    _print_acceptance(rows, projections, step[best], bf16)
    entry = (f'({rows}, Fp8Tile("{best.kind}", {best.block_m}, {best.block_n}, {best.block_k}, {best.num_warps}, '
             f"{best.num_stages}, per_sm={best.per_sm}{', scale_out=True' if best.scale_out else ''}"
             f"{', fused_sum=True' if best.fused_sum else ''})),")
    print(f"  DECODE_TILES entry for M <= {rows}{' (unchanged)' if best == current else ''}: {entry}", flush=True)


def _print_acceptance(rows: int, projections: list[Projection], best: Timing, bf16: Timing) -> None:
    """Issue 39's acceptance 3 on the best tile's device-time step: M = 1 by copy bandwidth, M = 64 by bf16."""
    from tools.bench.bench_kernels import CEIL

    if rows == 1:
        frac = _weight_gbytes(projections, fp8=True) / best.device * 1e3 / CEIL.get("copy", float("nan"))
        print(f"  acceptance 3 at M = 1: the best tile reads the step's FP8 weights at {100 * frac:.1f}% of copy "
              f"bandwidth (>= 60%)", flush=True)
    elif rows == 64:
        print(f"  acceptance 3 at M = 64: the best tile's step is x{bf16.device / best.device:.2f} bf16 (>= 1.3x)",
              flush=True)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 128) -> (fp8 [M, K], fp32 scales [M, K/128] with strides (1, M)): one
    multiplier per token and 128 columns, DeepSeek's dynamic activation scheme. cuBLAS's 1 x 128 scales
    are outer-dim-major; strides are built explicitly because t().contiguous().t() keeps a [1, G]
    tensor's (G, 1) strides (a size-1 dim makes it "contiguous" already), which torch refuses at M = 1."""
    groups = x.float().unflatten(-1, (-1, 128))  # [M, K/128, 128]
    scale = groups.abs().amax(-1).clamp_min(1e-12) / FP8_MAX  # [M, K/128]
    q = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).flatten(-2).to(torch.float8_e4m3fn)
    outer_major = torch.empty_strided(scale.shape, (1, scale.shape[0]), dtype=scale.dtype, device=scale.device)
    return q, outer_major.copy_(scale)


def weight_scales_for_scaled_mm(scale: torch.Tensor) -> torch.Tensor:
    """[ceil(N/128), G] block scales -> the [round_up(G, 4), ceil(N/128)] operand with strides (1, round_up(G, 4))
    that cuBLAS's 128 x 128 scaling takes for the transposed weight (rows past G are padding)."""
    blocks, groups = scale.shape
    padded = torch.zeros(blocks, -(-groups // 4) * 4, dtype=scale.dtype, device=scale.device)
    padded[:, :groups] = scale
    return padded.t()


def scaled_mm_blockwise() -> Callable | None:
    """torch's block-scaled FP8 GEMM as f(xq, x_scale, q, q_scale) -> bf16 [M, N], or None without it."""
    scaled_mm = getattr(F, "scaled_mm", None)
    scaling = getattr(F, "ScalingType", None)
    if scaled_mm is None or scaling is None or not hasattr(scaling, "BlockWise128x128"):
        return None

    def run(xq, x_scale, q, q_scale):
        return scaled_mm(xq, q.t(), x_scale, scaling.BlockWise1x128, q_scale, scaling.BlockWise128x128,
                         output_dtype=torch.bfloat16)

    return run


def _bench_scaled_mm(row, bench, blockwise, tensors, shape: str, gbytes: float, base: Timing, name: str) -> None:
    """torch's block-scaled GEMM on each FP8 weight copy of `sets` (its scales in cuBLAS's layout), alone and
    after quantizing the activations."""
    x, sets, ref = tensors
    mm_sets = [(q, weight_scales_for_scaled_mm(scale)) for q, scale in sets]
    xq, x_scale = quantize_activations(x)
    # activation rounding adds ~2^-4 relative per element; more means a wrong layout
    ms = _time_checked(bench, lambda _, q, w_scale: blockwise(xq, x_scale, q, w_scale), x, mm_sets, ref, 5e-2,
                       f"fp8 scaled_mm {shape}")
    if ms is None:
        return
    _row(row, f"fp8_scaled_mm_{name}", shape, ms, gbytes, base)
    ms = _time_checked(bench, lambda x, q, w_scale: blockwise(*quantize_activations(x), q, w_scale), x, mm_sets,
                       ref, 5e-2, f"fp8 scaled_mm+quant {shape}")
    if ms is not None:
        _row(row, f"fp8_scaled_mm+quant_{name}", shape, ms, gbytes, base)
