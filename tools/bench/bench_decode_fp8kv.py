"""The FP8 KV decode sweep of tools/bench/bench_kernels.py (`--only decode_fp8kv`, issue 39): the split
decode attention of the benchmark model's full-attention layers (Hq 16, Hkv 2, D 256, page 16) over bf16
pages and over FP8 pages of the same values, side by side, across tiles and split counts.

Why: at B32 x 32k keys FP8 KV made the decode step only 1.11x faster though the KV bytes halve
(docs/benchmarks.md, "FP8 KV pages"), so the FP8 path reads far below copy bandwidth. The tile is sized
in keys: an FP8 block moves half the bytes of a bf16 one. The sweep shows which tile and split count
keep each page dtype's loads in flight.

Shapes: B1 and B32 over 32,768 keys are swept (SHAPES); B64 over 4,096 (CHECKS) times only the current
tile and the B32 sweep's fastest, to show the wide pick holds there. B1 runs 6 layers' pages (each its
own, as a step reads them) so that a replay is not mostly launch latency; the others one layer's.
Candidates, per swept shape and page dtype:
1. every TILE_GRID tile (block_n x num_stages x num_warps; on FP8 pages x each way of reading them, KV_DOTS:
   the tile's `kv_dot`) at decode_splits' count, DECODE_TILES' entry first (`candidates`);
2. the TOP_TILES fastest of those with the split count halved and doubled (`split_variants`).
num_stages stops at 3: on sm_90 the K/V loads are pipelined (cp.async) from 2 stages on, and Triton 3.6
compiles 3 and 4 stages to the same PTX (tests/tools/bench/test_bench_decode_fp8kv.py checks it with
`compile_sm90`). Each variant is a compile of about a second that holds the GIL for most of it, so the
candidate count (about 150 compiles in all, 4 KV_DOTS on FP8 pages) is what bounds the section's time.
Each candidate is checked against paged_attention_ref in fp32 on the same pages (FP8 ones dequantized),
within the kernel tests' bound for the query dtype (float16's for the float16 dots of kv_dot 2 and 3 under
float32 queries, as tests/kernels/test_fp8_kv.py holds them), then timed in a CUDA graph (quick_bench, L2 flushed
before each replay). A tile that fails to compile (shared memory, registers) or to match prints one
"skipped" line and the rest go on.
Printed: a row per candidate (ms, GB/s and % of copy bandwidth on the KV bytes read, speed against the
current tile on the same pages); per (pages, B) the best tile and the current one re-timed with the full
bench, and the current's ratio to the best; FP8 against bf16 per B; and, per page dtype, the DECODE_TILES
line to paste into hkv_kernels/paged_attention/triton_paged_attention.py (narrow: the B1 pick, wide: B32's).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch
import triton

from hkv_kernels.kv_quant import FP8, dequantize, quantize
from hkv_kernels.meta import KernelMeta, build_meta
from hkv_kernels.paged_attention import triton_paged_attention as paged
from hkv_kernels.paged_attention.reference import paged_attention_ref
from hkv_kernels.paged_attention.triton_paged_attention import (
    KV_DOTS, DecodeTile, decode_splits, decode_tile, launch_paged_decode, scaled_splits, wide_decode,
)
from tools.bench.bench_fp8_kernels import quick_bench  # do_bench's median over ~20 ms: enough to rank tiles

GB = 1e9
HEADS = (16, 2, 256, 16)  # query heads, KV heads, head dim, page size: the benchmark model's full attention
SHAPES = ((1, 32768, 6), (32, 32768, 1))  # swept: (sequences, keys each, layers a replay reads)
CHECKS = ((64, 4096, 1),)  # the current tile and the same-width sweep's fastest only
TILE_GRID = {"block_n": (32, 64, 128), "num_stages": (2, 3), "num_warps": (4, 8)}
SPLIT_SCALES = (0.5, 2.0)  # decode_splits' count halved and doubled
TOP_TILES = 3  # tiles of step 1 that step 2 tries at other split counts; re-timed picks a check shape runs
KV_SCALES = (0.5, 2.0)  # (K, V): not 1.0, so a scale applied twice or never fails the check
# the bounds of tests/kernels/helpers.py (relative L2 error against the fp32 reference; a test keeps them equal)
REL_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def candidates(current: DecodeTile, fp8: bool = False) -> list[DecodeTile]:
    """Step 1: the current tile, then every TILE_GRID tile at decode_splits' count, on FP8 pages with each
    KV_DOTS way of reading them (duplicates dropped)."""
    grid = [DecodeTile(n, w, s, kv_dot=d) for d in (sorted(KV_DOTS) if fp8 else (0,)) for n in TILE_GRID["block_n"]
            for s in TILE_GRID["num_stages"] for w in TILE_GRID["num_warps"]]
    return list(dict.fromkeys([current, *grid]))


def split_variants(ranked: list[DecodeTile], auto: int, timed: list[DecodeTile]) -> list[DecodeTile]:
    """Step 2: the TOP_TILES first of `ranked` (fastest first) at each SPLIT_SCALES, leaving out any whose
    split count a timed tile of the same shape already ran (auto: decode_splits' count)."""
    def key(t: DecodeTile) -> tuple[int, int, int, int, int]:
        return t.block_n, t.num_warps, t.num_stages, t.kv_dot, scaled_splits(auto, t.split_scale)

    seen = {key(t) for t in timed}
    out = []
    for tile in ranked[:TOP_TILES]:
        for scale in SPLIT_SCALES:
            variant = replace(tile, split_scale=scale)
            if key(variant) not in seen:
                seen.add(key(variant))
                out.append(variant)
    return out


def tile_label(tile: DecodeTile, auto: int) -> str:
    """keys a block, warps, stages, the split count this shape gets, and a kv_dot other than 0."""
    dot = f" dot{tile.kv_dot}" if tile.kv_dot else ""
    return f"n{tile.block_n} w{tile.num_warps} st{tile.num_stages} s{scaled_splits(auto, tile.split_scale)}{dot}"


def tile_source(tile: DecodeTile) -> str:
    """The tile as DECODE_TILES' source writes it."""
    scale = "" if tile.split_scale == 1.0 else f", {tile.split_scale}"
    dot = f", kv_dot={tile.kv_dot}" if tile.kv_dot else ""
    return f"DecodeTile({tile.block_n}, {tile.num_warps}, {tile.num_stages}{scale}{dot})"


def table_entry(fp8: bool, narrow: DecodeTile, wide: DecodeTile) -> str:
    """One DECODE_TILES line: `    True: (DecodeTile(64, 4, 3), DecodeTile(32, 4, 2)),`."""
    return f"    {fp8}: ({tile_source(narrow)}, {tile_source(wide)}),"


def compile_sm90(fp8: bool, tile: DecodeTile, splits: int):
    """The split kernel of `tile` compiled for sm_90 on any machine (Triton's CUDA backend and the ptxas of
    its wheel), with bf16 queries at HEADS, as a B32 decode launches it."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    fn = paged._paged_decode_split_kernel
    hq, hkv, dim, page = HEADS
    consts = dict(SPLITS=splits, GROUP=hq // hkv, HEAD_DIM=dim, BLOCK_D=dim, PAGE_SIZE=page, BLOCK_M=16,
                  BLOCK_N=tile.block_n, PRECISION="tf32", FP8=fp8, KV_DOT=tile.kv_dot if fp8 else 0)
    pointers = dict(k_ptr="*fp8e4nv" if fp8 else "*bf16", q_ptr="*bf16", part_o_ptr="*fp32", part_ml_ptr="*fp32")
    signature = {name: "constexpr" if name in consts else pointers.get(name, "*i32" if name.endswith("_ptr") else
                 "fp32" if "scale" in name else "i32") for name in fn.arg_names}
    signature["v_ptr"] = signature["k_ptr"]
    # the launcher's specialization at B32: pointers 16-byte aligned, every integer but the page table's
    # stride (not specialized) a multiple of 16
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if signature[name] not in ("constexpr", "fp32") and name != "stride_pt"}
    target = GPUTarget("cuda", 90, 32)
    options = make_backend(target).parse_options({"num_warps": tile.num_warps, "num_stages": tile.num_stages})
    return triton.compile(ASTSource(fn, signature, consts, attrs), target=target, options=options.__dict__)


@dataclass
class Case:
    """One shape's inputs: queries, gate and output [B, Hq, D]; each layer's (K, V) pages in both dtypes."""

    batch: int
    ctx: int
    q: torch.Tensor
    gate: torch.Tensor
    out: torch.Tensor
    table: torch.Tensor  # [B, pages a sequence] int32, shuffled pages
    meta: KernelMeta
    pages: dict[bool, list[tuple[torch.Tensor, torch.Tensor]]]  # FP8 or not -> [(K, V)] a layer
    auto: int  # decode_splits' count


def make_case(batch: int, ctx: int, layers: int, device: str, dtype: torch.dtype) -> Case:
    hq, hkv, dim, page = HEADS
    gen = torch.Generator(device=device).manual_seed(batch)
    per_seq = -(-ctx // page)
    table = torch.randperm(batch * per_seq, device=device, generator=gen).view(batch, per_seq).to(torch.int32)
    plain = [tuple(torch.randn(batch * per_seq, page, hkv, dim, device=device, generator=gen, dtype=dtype)
                   for _ in range(2)) for _ in range(layers)]
    # FP8 pages of the same values (each stored as fp8(x / scale))
    fp8 = [(quantize(k, FP8, KV_SCALES[0]), quantize(v, FP8, KV_SCALES[1])) for k, v in plain]
    q = torch.randn(batch, hq, dim, device=device, generator=gen, dtype=dtype)
    gate = torch.randn(batch, hq, dim, device=device, generator=gen, dtype=dtype)
    meta = build_meta([1] * batch, [ctx] * batch, device, hq // hkv, dim, dtype)
    return Case(batch, ctx, q, gate, torch.empty_like(q), table, meta, {False: plain, True: fp8},
                decode_splits(batch, hkv, torch.device(device)))


def _launch(case: Case, fp8: bool, tile: DecodeTile, layer: int | None = None,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """The decode of one layer (or, layer None, of every layer in turn into one output) with `tile`."""
    out = case.out if out is None else out
    for k, v in case.pages[fp8] if layer is None else case.pages[fp8][layer:layer + 1]:
        launch_paged_decode(case.q, k, v, case.table, case.meta, HEADS[2] ** -0.5, out, case.gate,
                            block_n=tile.block_n, splits=scaled_splits(case.auto, tile.split_scale),
                            num_warps=tile.num_warps, num_stages=tile.num_stages, kv_scales=KV_SCALES,
                            kv_dot=tile.kv_dot if fp8 else None)
    return out


def reference(case: Case, fp8: bool) -> torch.Tensor:
    """Layer 0's gated output in fp32: paged_attention_ref on its pages dequantized to fp32 (an exact
    widening of bf16 and of fp8 * scale), times sigmoid(gate)."""
    k, v = (dequantize(x, torch.float32, scale) for x, scale in zip(case.pages[fp8][0], KV_SCALES))
    n = case.batch
    ref = paged_attention_ref(case.q.float(), k, v, case.table, [1] * n, [case.ctx] * n, HEADS[2] ** -0.5)
    return ref * torch.sigmoid(case.gate.float())


def _first_line(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def precompile(case: Case, fp8: bool, tiles: list[DecodeTile]) -> dict[DecodeTile, str]:
    """Run each tile once on layer 0, the first alone (it compiles the reduction every tile shares), the rest
    on a thread pool (ptxas runs outside the GIL; the interpreter is not thread-safe and gets one thread).
    Returns the tiles that failed, each with its first error line."""
    def compile_one(tile: DecodeTile) -> str | None:
        try:
            _launch(case, fp8, tile, 0, torch.empty_like(case.q))
            return None
        except Exception as exc:  # out of shared memory or registers: reported once, not timed
            return _first_line(exc)

    errors = {tile: compile_one(tile) for tile in tiles[:1]}
    with ThreadPoolExecutor(max_workers=16 if case.q.is_cuda else 1) as pool:
        errors.update(zip(tiles[1:], pool.map(compile_one, tiles[1:])))
    return {tile: err for tile, err in errors.items() if err is not None}


def time_step(case: Case, fp8: bool, tile: DecodeTile, timer: Callable[[Callable[[], object]], float]) -> float:
    """ms of one replay of every layer's decode (a CUDA graph on the GPU, plain calls elsewhere)."""
    if not case.q.is_cuda:
        return timer(lambda: _launch(case, fp8, tile))
    _launch(case, fp8, tile)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _launch(case, fp8, tile)
    return timer(graph.replay)


def kv_gbytes(case: Case, fp8: bool) -> float:
    """K and V bytes a replay reads."""
    k = case.pages[fp8][0][0]
    return len(case.pages[fp8]) * 2 * case.batch * case.ctx * k.shape[2] * k.shape[3] * k.element_size() / GB


def page_name(dtype: torch.dtype, fp8: bool) -> str:
    """Pages as --kv-cache-dtype names them (the other pages hold the queries' dtype)."""
    return "fp8_e4m3" if fp8 else str(dtype).removeprefix("torch.")


@dataclass
class Sweep:
    """One (shape, page dtype)'s result: each timed tile's quick ms; the current tile and the fastest few
    re-timed with the full bench, fastest first."""

    times: dict[DecodeTile, float]
    current: DecodeTile
    current_ms: float  # nan: the current tile failed
    ranked: list[tuple[DecodeTile, float]]  # (tile, full-bench ms)

    @property
    def best(self) -> DecodeTile:
        return self.ranked[0][0]

    @property
    def best_ms(self) -> float:
        return self.ranked[0][1]


def sweep(row: Callable, bench: Callable, case: Case, fp8: bool, only: list[DecodeTile] | None = None) -> Sweep | None:
    """Steps 1 and 2 on one shape and page dtype (or, with `only`, the current tile and those), then the
    current tile and the TOP_TILES fastest re-timed with bench."""
    current = decode_tile(case.batch, HEADS[1], fp8)
    name, shape = page_name(case.q.dtype, fp8), f"B{case.batch} L{case.ctx} x{len(case.pages[fp8])}"
    ref, gbytes = reference(case, fp8), kv_gbytes(case, fp8)
    times: dict[DecodeTile, float] = {}

    def run(tiles: list[DecodeTile]) -> None:
        failed = precompile(case, fp8, tiles)
        for tile in tiles:
            label = ("*" if tile == current else " ") + tile_label(tile, case.auto)
            ms = _checked_ms(case, fp8, tile, ref, failed.get(tile), f"decode_fp8kv {name} {shape} {label}")
            if ms is not None:
                times[tile] = ms
                row(f"decode_fp8kv {name}", f"{shape} {label}", ms, gbytes=gbytes, base_name="current tile",
                    base_ms=times.get(current))

    step1 = candidates(current, fp8) if only is None else list(dict.fromkeys([current, *only]))
    run(step1)
    if only is None:
        run(split_variants(sorted(times, key=times.get), case.auto, step1))
    if not times:
        print(f"decode_fp8kv {name} {shape}: every candidate was skipped", flush=True)
        return None
    final = {t: time_step(case, fp8, t, bench) for t in dict.fromkeys([*sorted(times, key=times.get)[:TOP_TILES],
                                                                      current]) if t in times}
    result = Sweep(times, current, final.get(current, float("nan")), sorted(final.items(), key=lambda kv: kv[1]))
    row(f"decode_fp8kv_best {name}", f"{shape} {tile_label(result.best, case.auto)}", result.best_ms, gbytes=gbytes,
        base_name=f"current {tile_label(current, case.auto)}", base_ms=result.current_ms)
    print(f"  pick {name} {shape}: {tile_label(result.best, case.auto)} {result.best_ms:.4f} ms; current "
          f"{tile_label(current, case.auto)} {result.current_ms:.4f} ms, current / best "
          f"x{result.current_ms / result.best_ms:.2f}", flush=True)
    return result


def _checked_ms(case: Case, fp8: bool, tile: DecodeTile, ref: torch.Tensor, error: str | None,
                what: str) -> float | None:
    """The tile's quick ms if it compiled (error None) and layer 0's output is within the queries' dtype's
    REL_TOL of ref, else None and a "skipped" line."""
    tol = check_tol(case.q.dtype, tile.kv_dot if fp8 else 0)
    if error is None:
        try:
            err = _rel(_launch(case, fp8, tile, 0, torch.full_like(case.q, float("nan"))), ref)
            if err < tol:
                return time_step(case, fp8, tile, quick_bench)
            error = f"relative error {err:.2e} >= {tol:.0e}"
        except Exception as exc:  # a failure the compile pass did not meet (graph capture)
            error = _first_line(exc)
    print(f"{what}: skipped ({error})", flush=True)
    return None


def check_tol(dtype: torch.dtype, kv_dot: int) -> float:
    """The bound a candidate's output is held to: its queries' dtype's, float16's for float16 dots (kv_dot 2
    and 3) under float32 queries."""
    return REL_TOL[torch.float16 if kv_dot >= 2 and dtype == torch.float32 else dtype]


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()  # NaN (an unwritten element) fails `< tol`


def bench_decode_fp8kv(row: Callable, bench: Callable, device: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> None:
    """The whole section; device and dtype exist for the interpreter's smoke test (fp32 on a CPU)."""
    results: dict[tuple[bool, int], Sweep | None] = {}
    for shape in (*SHAPES, *CHECKS):
        batch, ctx, layers = shape
        case = make_case(batch, ctx, layers, device, dtype)
        for fp8 in (False, True):
            if shape in SHAPES:
                results[fp8, batch] = sweep(row, bench, case, fp8)
            elif (swept := _swept_like(batch, fp8, results)) is not None:
                results[fp8, batch] = sweep(row, bench, case, fp8, only=[t for t, _ in swept.ranked])
        del case
        if device == "cuda":
            torch.cuda.empty_cache()
    report(results, dtype)


def _swept_like(batch: int, fp8: bool, results: dict[tuple[bool, int], Sweep | None]) -> Sweep | None:
    """The first swept shape's result of batch's width (narrow or wide) on the same pages, if any."""
    same = [b for b, _, _ in SHAPES if wide_decode(b, HEADS[1]) == wide_decode(batch, HEADS[1])]
    return results.get((fp8, same[0])) if same else None


def report(results: dict[tuple[bool, int], Sweep | None], dtype: torch.dtype) -> None:
    """FP8 against the other pages per B (current tiles and best tiles); per page dtype the DECODE_TILES line
    (the first narrow and the first wide swept shape's picks, B1 and B32), and how each check shape ran it."""
    for batch, ctx, _ in (*SHAPES, *CHECKS):
        plain, fp8 = results.get((False, batch)), results.get((True, batch))
        if plain and fp8:
            print(f"B{batch} x {ctx}: FP8 pages against {page_name(dtype, False)} pages: current tiles "
                  f"x{plain.current_ms / fp8.current_ms:.2f}, best tiles x{plain.best_ms / fp8.best_ms:.2f}",
                  flush=True)
    narrow = next(b for b, _, _ in SHAPES if not wide_decode(b, HEADS[1]))
    wide = next(b for b, _, _ in SHAPES if wide_decode(b, HEADS[1]))
    for fp8 in (True, False):
        picks = [results.get((fp8, b)) for b in (narrow, wide)]
        if not all(picks):
            print(f"DECODE_TILES {page_name(dtype, fp8)}: no line (a swept shape had no result)", flush=True)
            continue
        unchanged = all(p.best == p.current for p in picks)
        print(f"DECODE_TILES line for {page_name(dtype, fp8)} pages (B{narrow}, B{wide} picks)"
              f"{' (unchanged)' if unchanged else ''}:\n{table_entry(fp8, picks[0].best, picks[1].best)}", flush=True)
        for batch, ctx, _ in CHECKS:
            check = results.get((fp8, batch))
            pick = picks[wide_decode(batch, HEADS[1])].best
            there = None if check is None else dict(check.ranked).get(pick)
            if there is None:
                print(f"  check B{batch} x {ctx}: the pick was not timed", flush=True)
                continue
            print(f"  check B{batch} x {ctx}: the pick {there:.4f} ms, current {check.current_ms:.4f} ms, "
                  f"current / pick x{check.current_ms / there:.2f}", flush=True)
