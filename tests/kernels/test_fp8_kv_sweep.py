"""The split decode's tile table by page dtype (hkv_kernels/paged_attention) and the FP8 KV decode sweep
that picks its entries (tools/bench/bench_decode_fp8kv.py): candidates, the printed table line, and the
section itself in the interpreter."""

import inspect

import torch

import hkv_kernels.paged_attention.triton_paged_attention as paged
from hkv_kernels.kv_quant import FP8, quantize
from hkv_kernels.meta import build_meta
from hkv_kernels.paged_attention.triton_paged_attention import (
    DECODE_TILES, KV_DOTS, DecodeTile, decode_tile, launch_paged_decode, scaled_splits,
)
from tests.kernels.helpers import REL_TOL
from tools.bench import bench_decode_fp8kv as sweep
from tools.bench import bench_kernels


def test_decode_tile_is_looked_up_by_page_dtype_and_width():
    assert decode_tile(1, 2, True) == DECODE_TILES[True][0]
    assert decode_tile(15, 2, False) == DECODE_TILES[False][0]  # 30 programs: narrow
    assert decode_tile(16, 2, True) == DECODE_TILES[True][1]  # 32: wide
    assert decode_tile(4, 8, False) == DECODE_TILES[False][1]
    assert [scaled_splits(9, 0.5), scaled_splits(1, 0.5), scaled_splits(16, 2.0), scaled_splits(5, 1.0)] == [4, 1, 32, 5]


class _Recorder:
    """Stands in for a @triton.jit kernel: records each launch's grid and keyword arguments."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, kwargs))


def test_the_launcher_takes_the_tile_of_its_page_dtype(monkeypatch):
    """FP8 pages and fp32 pages each get their DECODE_TILES entry: keys a block, warps, stages, and
    decode_splits' count (3 off CUDA) times the entry's split_scale, in the grid and in the reduction."""
    tiles = {False: (DecodeTile(16, 2, 1, 2.0), DecodeTile(32, 4, 2)), True: (DecodeTile(128, 8, 4, 0.5),
                                                                             DecodeTile(64, 4, 3))}
    monkeypatch.setattr(paged, "DECODE_TILES", tiles)
    split, reduce = _Recorder(), _Recorder()
    monkeypatch.setattr(paged, "_paged_decode_split_kernel", split)
    monkeypatch.setattr(paged, "_paged_decode_reduce_kernel", reduce)
    q = torch.randn(2, 4, 16)
    meta = build_meta([1, 1], [5, 9], "cpu", 2, 16, torch.float32)
    table = torch.arange(6).view(2, 3)
    for fp8, (block_n, warps, stages, splits) in ((True, (128, 8, 4, 1)), (False, (16, 2, 1, 6))):
        k = torch.randn(6, 4, 2, 16)
        k = quantize(k, FP8, 1.0) if fp8 else k
        launch_paged_decode(q, k, k.clone(), table, meta, 0.25, torch.empty_like(q))
        grid, kwargs = split.launches[-1]
        assert (grid, kwargs["BLOCK_N"], kwargs["num_warps"], kwargs["num_stages"], kwargs["FP8"]) == (
            (2, 2, splits), block_n, warps, stages, fp8)
        assert reduce.launches[-1][1]["SPLITS"] == splits


def test_the_tiles_kv_dot_applies_to_bfloat16_queries_on_fp8_pages(monkeypatch):
    """A DECODE_TILES entry's kv_dot reaches the kernel for bf16 queries over FP8 pages only; float32 queries
    (the exact path) and bf16 pages get 0, and an explicit kv_dot (the sweep's) applies to any FP8 pages."""
    tile = DecodeTile(32, 4, 2, kv_dot=2)
    monkeypatch.setattr(paged, "DECODE_TILES", {False: (tile, tile), True: (tile, tile)})
    split = _Recorder()
    monkeypatch.setattr(paged, "_paged_decode_split_kernel", split)
    monkeypatch.setattr(paged, "_paged_decode_reduce_kernel", _Recorder())
    meta = build_meta([1, 1], [5, 9], "cpu", 2, 16, torch.float32)
    table = torch.arange(6).view(2, 3)
    pages = torch.randn(6, 4, 2, 16)
    for q_dtype, fp8, override, want in ((torch.bfloat16, True, None, 2), (torch.float32, True, None, 0),
                                         (torch.bfloat16, False, None, 0), (torch.float32, True, 3, 3),
                                         (torch.bfloat16, False, 3, 0)):
        q = torch.randn(2, 4, 16).to(q_dtype)
        k = quantize(pages, FP8, 1.0) if fp8 else pages.to(q_dtype)
        launch_paged_decode(q, k, k.clone(), table, meta, 0.25, torch.empty_like(q), kv_dot=override)
        assert split.launches[-1][1]["KV_DOT"] == want, (q_dtype, fp8, override)


def test_candidates_put_the_current_tile_first_and_cover_the_grid():
    grid = sweep.candidates(DecodeTile(32, 4, 2))
    assert grid[0] == DecodeTile(32, 4, 2) and len(grid) == 12 == len(set(grid))
    assert {(t.block_n, t.num_warps, t.num_stages, t.split_scale, t.kv_dot) for t in grid} == {
        (n, w, s, 1.0, 0) for n in (32, 64, 128) for w in (4, 8) for s in (2, 3)}
    # FP8 pages: the grid once for each way of reading them
    fp8 = sweep.candidates(DecodeTile(32, 4, 2), fp8=True)
    assert fp8[0] == DecodeTile(32, 4, 2) and len(fp8) == 12 * len(KV_DOTS) == len(set(fp8))
    assert {t.kv_dot for t in fp8} == set(KV_DOTS)
    # a current entry off the grid (4 stages, a pasted split scale) comes first, then the 12
    for current in (DecodeTile(64, 4, 4), DecodeTile(64, 8, 2, 2.0)):
        assert sweep.candidates(current)[0] == current and len(sweep.candidates(current)) == 13


def test_split_variants_halve_and_double_the_fastest_tiles_once():
    ranked = [DecodeTile(64, 8, 2), DecodeTile(32, 4, 2), DecodeTile(128, 4, 3), DecodeTile(64, 4, 3)]
    assert sweep.split_variants(ranked, 9, ranked) == [
        DecodeTile(64, 8, 2, 0.5), DecodeTile(64, 8, 2, 2.0), DecodeTile(32, 4, 2, 0.5), DecodeTile(32, 4, 2, 2.0),
        DecodeTile(128, 4, 3, 0.5), DecodeTile(128, 4, 3, 2.0)]
    # a kv_dot is kept, and tells tiles apart
    assert sweep.split_variants([DecodeTile(64, 8, 2, kv_dot=2)], 9, ranked) == [
        DecodeTile(64, 8, 2, 0.5, kv_dot=2), DecodeTile(64, 8, 2, 2.0, kv_dot=2)]
    # one split: halving it gives the split count already timed
    assert sweep.split_variants(ranked[:1], 1, ranked) == [DecodeTile(64, 8, 2, 2.0)]
    # a doubled current entry among the timed tiles: its plain form is only halved
    assert sweep.split_variants(ranked[:1], 9, [*ranked, DecodeTile(64, 8, 2, 2.0)]) == [DecodeTile(64, 8, 2, 0.5)]


def test_the_printed_table_line_is_the_source_line():
    """table_entry of the current table is a line of the launcher's source, so a printed pick pastes over it."""
    source = inspect.getsource(paged).splitlines()
    for fp8 in (True, False):
        assert sweep.table_entry(fp8, *DECODE_TILES[fp8]) in source
    assert sweep.table_entry(True, DecodeTile(64, 8, 3), DecodeTile(128, 4, 3, 2.0)) == (
        "    True: (DecodeTile(64, 8, 3), DecodeTile(128, 4, 3, 2.0)),")
    assert sweep.table_entry(True, DecodeTile(64, 8, 3, kv_dot=2), DecodeTile(32, 4, 2, 0.5, kv_dot=3)) == (
        "    True: (DecodeTile(64, 8, 3, kv_dot=2), DecodeTile(32, 4, 2, 0.5, kv_dot=3)),")


def test_report_prints_the_fastest_tiles_of_b1_and_b32(capsys):
    current_n, current_w = DECODE_TILES[True]
    bf16_n, bf16_w = DECODE_TILES[False]  # each page dtype is timed against its own current entry
    fast_n, fast_w = DecodeTile(64, 8, 2), DecodeTile(128, 4, 2, 2.0)

    def result(current, current_ms, *ranked):
        return sweep.Sweep({t: ms for t, ms in ranked}, current, current_ms, list(ranked))

    results = {
        (True, 1): result(current_n, 0.5, (fast_n, 0.4), (current_n, 0.5)),
        (False, 1): result(bf16_n, 0.6, (bf16_n, 0.6)),
        (True, 32): result(current_w, 0.9, (fast_w, 0.6), (current_w, 0.9)),
        (False, 32): result(bf16_w, 1.2, (bf16_w, 1.2), (fast_w, 1.3)),
        (True, 64): result(current_w, 0.3, (fast_w, 0.25), (current_w, 0.3)),
        (False, 64): None,
    }
    sweep.report(results, torch.bfloat16)
    out = capsys.readouterr().out
    assert "B32 x 32768: FP8 pages against bfloat16 pages: current tiles x1.33, best tiles x2.00" in out
    assert "B64 x 4096: FP8" not in out  # no bf16 result there
    assert "\n    True: (DecodeTile(64, 8, 2), DecodeTile(128, 4, 2, 2.0)),\n" in out
    assert "for bfloat16 pages (B1, B32 picks) (unchanged):\n" + sweep.table_entry(False, *DECODE_TILES[False]) in out
    assert "check B64 x 4096: the pick 0.2500 ms, current 0.3000 ms, current / pick x1.20" in out
    assert "check B64 x 4096: the pick was not timed" in out  # bf16 pages


def test_the_sweep_checks_with_the_kernel_tests_bounds():
    assert sweep.REL_TOL == REL_TOL


def _toy(monkeypatch):
    """The section at a toy size: Hq 4 / Hkv 2 / D 16 / page 4, B1 narrow and B2 wide swept, B3 checked,
    a grid of one tile."""
    monkeypatch.setattr(sweep, "HEADS", (4, 2, 16, 4))
    monkeypatch.setattr(sweep, "SHAPES", ((1, 40, 1), (2, 20, 1)))
    monkeypatch.setattr(sweep, "CHECKS", ((3, 9, 1),))
    monkeypatch.setattr(sweep, "TILE_GRID", {"block_n": (32,), "num_stages": (2,), "num_warps": (4,)})
    monkeypatch.setattr(sweep, "TOP_TILES", 1)
    monkeypatch.setattr(paged, "WIDE_PROGRAMS", 4)
    monkeypatch.setattr(sweep, "quick_bench", lambda fn: (fn(), 1.0)[1])
    # the counts below assume these current entries, whatever a sweep has pasted since
    monkeypatch.setitem(paged.DECODE_TILES, True, (DecodeTile(64, 4, 3), DecodeTile(32, 4, 2)))
    monkeypatch.setitem(paged.DECODE_TILES, False, (DecodeTile(64, 4, 3), DecodeTile(32, 4, 2)))


def test_a_wrong_result_is_skipped_not_timed(monkeypatch, capsys):
    _toy(monkeypatch)
    case = sweep.make_case(2, 24, 1, "cpu", torch.float32)
    ref = sweep.reference(case, True)
    tile = DecodeTile(32, 4, 2)
    assert sweep._checked_ms(case, True, tile, ref, None, "right") == 1.0
    assert sweep._checked_ms(case, True, tile, ref * 1.001, None, "scaled") is None
    assert sweep._checked_ms(case, True, tile, ref, "OutOfResources: shared memory", "big") is None
    out = capsys.readouterr().out
    assert "scaled: skipped (relative error" in out and "big: skipped (OutOfResources: shared memory)" in out


def test_the_section_runs_every_candidate_in_the_interpreter(monkeypatch, capsys):
    """tools/bench/bench_decode_fp8kv.py on fp32 and FP8 pages on a CPU, timings stubbed: every candidate
    of both steps matches the reference, and each page dtype prints its DECODE_TILES line (the GPU run
    must not be the first to execute the section's Python)."""
    _toy(monkeypatch)
    monkeypatch.setattr(bench_kernels, "ROWS", [])
    sweep.bench_decode_fp8kv(bench_kernels.row, lambda fn: (fn(), 1.0)[1], device="cpu", dtype=torch.float32)
    out = capsys.readouterr().out
    assert "skipped" not in out, out
    rows = [(r["kernel"], r["shape"].split()[0]) for r in bench_kernels.ROWS]
    for name, dots in (("float32", 1), ("fp8_e4m3", len(KV_DOTS))):
        # B1: the current (64, 4, 3) and the grid's (32, 4, 2) with each kv_dot on FP8 pages, then the current
        # halved and doubled (3 splits: 1 and 6); B2: the current, which is the grid's tile (kv_dot 0), the others
        # of the grid, then the current halved and doubled; B3: the current only (B2's pick); each shape's
        # re-timed best
        assert [rows.count((f"decode_fp8kv {name}", b)) for b in ("B1", "B2", "B3")] == [3 + dots, 2 + dots, 1]
        assert [rows.count((f"decode_fp8kv_best {name}", b)) for b in ("B1", "B2", "B3")] == [1, 1, 1]
    for fp8 in (True, False):
        assert sweep.table_entry(fp8, *DECODE_TILES[fp8]) in out.splitlines()
    assert out.count("check B3 x 9: the pick ") == 2
