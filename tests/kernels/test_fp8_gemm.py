"""Block FP8 (hkv_kernels/fp8_gemm/): the quantize/dequantize reference, the weight-only FP8 GEMM and the
MoE kernels' FP8 experts against the dequantizing reference."""

from dataclasses import replace

import pytest
import torch

from hkv_kernels.fp8_gemm.reference import FP8_MAX, dequantize, fp8_linear_ref, quantize, scale_shape
from hkv_kernels.fp8_gemm.triton_fp8_gemm import (DECODE_TILES, MIN_COUNTERS, Fp8Tile, fit_rows, fp8_linear,
                                                  fp8_tile, k_split, tile_counters)
from hkv_kernels.moe.reference import dequantize_experts, moe_experts_ref, moe_route_ref
from hkv_kernels.moe.triton_moe import moe_experts
from tests.kernels.helpers import assert_close, cases


def test_quantize_maps_each_block_amax_to_the_fp8_max_and_dequantizes_close():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=gen)
    w[:128, :128] *= 100.0  # blocks of very different ranges keep their own scales
    w[128:256, 128:] = 0.0  # an all-zero block gets scale 1
    q, scale = quantize(w)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (3, 2)
    assert scale_shape(300, 200) == (3, 2) and scale[1, 1] == 1.0
    assert q[:128, :128].float().abs().max() == FP8_MAX and q[256:, :128].float().abs().max() == FP8_MAX
    back = dequantize(q, scale, torch.float32)
    assert torch.all(back[128:256, 128:] == 0)
    # e4m3 keeps 3 mantissa bits: a relative error of at most 2^-4 per element (plus subnormals near 0)
    assert ((back - w).abs() <= w.abs() / 16 + scale.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
            * 2**-9).all()
    assert torch.equal(quantize(back)[0].float(), q.float())  # dequantized weights requantize to the same bytes


def test_dequantize_refuses_a_scale_grid_that_does_not_tile_the_weight():
    q, scale = quantize(torch.randn(256, 128))
    with pytest.raises(ValueError, match="does not tile"):
        dequantize(q, scale[:1], torch.float32)


def _fp8_weight(n, k, seed):
    gen = torch.Generator().manual_seed(seed)
    return quantize(torch.randn(n, k, generator=gen) * k**-0.5)


def _cases_with_fp16() -> list:
    """cases() plus fp16 in the interpreter (bf16 is wrong there; fp16 checks the rounding to a half dtype)."""
    cpu16 = pytest.param("cpu", torch.float16, id="interp-fp16",
                         marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only case"))
    return [*cases(), cpu16]


# every gemv and dot case runs as the reference rounds (dequantized weights) and with the step scale applied
# to the sums instead (Fp8Tile.scale_out), which skips the weights' rounding to dtype: within the same bound
SCALE_OUT = pytest.mark.parametrize("scale_out", [False, True], ids=["dequant", "scale-out"])


def _check_fp8_linear(device, dtype, m, n, k, bias, tile):
    q, scale = _fp8_weight(n, k, seed=m + n)
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    b = torch.randn(n, generator=gen).to(device, dtype) if bias else None
    out = fp8_linear(x, q.to(device), scale.to(device), b, tile=tile)
    want = fp8_linear_ref(x.float().cpu(), q, scale, None if b is None else b.float().cpu())
    assert out.dtype == dtype and out.shape == (m, n)
    assert_close(out, want, dtype)


@pytest.mark.parametrize("device,dtype", _cases_with_fp16())
@pytest.mark.parametrize("m,n,k,bias,tile", [
    (1, 256, 384, False, None), (5, 200, 300, True, None), (33, 130, 128, False, None),
    (3, 256, 512, True, Fp8Tile("mm", 16, 64, 64, 4, 2, 4)),  # the K split: fp32 partials added in order
    (70, 128, 200, False, Fp8Tile("mm", 32, 128, 128, 4, 2, 1)),
], ids=["decode", "ragged-bias", "one-k-block", "mm-split-k", "prefill"])
def test_fp8_linear_matches_the_dequantized_reference(device, dtype, m, n, k, bias, tile):
    _check_fp8_linear(device, dtype, m, n, k, bias, tile)


@SCALE_OUT
@pytest.mark.parametrize("device,dtype", _cases_with_fp16())
@pytest.mark.parametrize("m,n,k,bias,tile", [
    (1, 256, 512, False, Fp8Tile("gemv", 1, 16, 64, 4, 1, 1)),  # one row, every shape even
    (1, 200, 300, True, Fp8Tile("gemv", 1, 32, 64, 4, 1, 1)),  # N and K ragged
    (3, 72, 640, False, Fp8Tile("gemv", 4, 8, 32, 2, 1, 2)),  # an odd batch in one 4-row group, split K
    (5, 130, 384, True, Fp8Tile("gemv", 4, 32, 64, 4, 1, 3)),  # two row groups (one of a single row), 3 splits
    (2, 64, 1000, True, Fp8Tile("gemv", 2, 128, 128, 8, 1, 2)),  # a tile taller than N, K ends mid-step
    (6, 96, 256, False, Fp8Tile("gemv", 2, 32, 64, 4, 1, 8)),  # more splits asked than K has blocks
], ids=["m1", "m1-ragged-bias", "m3-split", "m5-two-groups-bias", "m2-tall-bias", "split-capped"])
def test_fp8_gemv_matches_the_dequantized_reference(device, dtype, m, n, k, bias, tile, scale_out):
    _check_fp8_linear(device, dtype, m, n, k, bias, replace(tile, scale_out=scale_out))


@SCALE_OUT
@pytest.mark.parametrize("device,dtype", _cases_with_fp16())
@pytest.mark.parametrize("m,n,k,bias,tile", [
    (1, 256, 256, False, Fp8Tile("dot", 16, 64, 128, 4, 2, 1)),  # one row padded to the dot's 16
    (7, 200, 300, True, Fp8Tile("dot", 16, 64, 64, 4, 2, 1)),  # odd M, N and K ragged, bias
    (19, 128, 512, True, Fp8Tile("dot", 16, 32, 128, 4, 2, 4)),  # two row blocks, split K with bias
    (40, 300, 384, False, Fp8Tile("dot", 32, 128, 32, 4, 2, 2)),  # K steps of 32 inside a scale block
], ids=["m1", "m7-ragged-bias", "m19-split-bias", "m40-split"])
def test_fp8_dot_matches_the_dequantized_reference(device, dtype, m, n, k, bias, tile, scale_out):
    _check_fp8_linear(device, dtype, m, n, k, bias, replace(tile, scale_out=scale_out))


@SCALE_OUT
@pytest.mark.parametrize("m", [1, 3, 4, 9, 33, 64])
def test_fp8_linear_default_tiles_run_every_decode_bucket(m, scale_out):
    """fp8_tile's own pick for bf16 (DECODE_TILES), run in fp32 in the interpreter on a CPU (the tile's
    shape is what is under test; a split needs an SM count, so the CPU gets none), as the sweep would
    paste it with and without scale_out."""
    tile = fp8_tile(m, 200, 384, torch.bfloat16, torch.device("cpu"))
    assert tile.kind == ("gemv" if m == 1 else "dot")
    _check_fp8_linear("cpu", torch.float32, m, 200, 384, True, replace(tile, scale_out=scale_out))


@pytest.fixture
def nan_empty():
    """torch.empty fills floats with NaN while this runs (deterministic mode), so an output element that a
    path never writes fails torch.equal instead of matching leftover memory."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(was)


@SCALE_OUT
@pytest.mark.parametrize("device,dtype", _cases_with_fp16())
@pytest.mark.parametrize("m,n,k,bias,tile", [
    (1, 200, 768, True, Fp8Tile("gemv", 1, 64, 64, 4, 1, 6)),  # one row, N ragged, 6 splits
    (5, 130, 1000, True, Fp8Tile("gemv", 4, 32, 64, 4, 1, 3)),  # two row groups, N and the last split's K ragged
    (3, 72, 640, False, Fp8Tile("gemv", 2, 32, 32, 2, 1, 5)),  # two 2-row groups, N ragged, 5 splits
    (19, 100, 900, True, Fp8Tile("dot", 16, 32, 64, 4, 2, 4)),  # two row blocks, ragged N and K, bias
    (40, 300, 512, False, Fp8Tile("dot", 32, 128, 32, 4, 2, 4)),  # K steps of 32 inside a scale block
], ids=["gemv-m1-bias", "gemv-m5-ragged-bias", "gemv-m3-groups", "dot-m19-ragged-bias", "dot-m40"])
def test_fused_sum_equals_the_two_kernel_split_sum_bit_for_bit(device, dtype, m, n, k, bias, tile, scale_out,
                                                               nan_empty):
    """The last split program's sum (Fp8Tile.fused_sum) adds the partials and the bias in the order the sum
    kernel does, so the output is the same bits; each tile's counter is back at zero after the launch, so a
    second launch sums again. (The interpreter runs programs one at a time: the GPU test below checks races.)"""
    q, scale = (t.to(device) for t in _fp8_weight(n, k, seed=m + n))
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    b = torch.randn(n, generator=gen).to(device, dtype) if bias else None
    tile = replace(tile, scale_out=scale_out)
    assert k_split(tile, m, n, k, x.device)[1] >= 3  # with two splits any order gives the same fp32 sum
    want = fp8_linear(x, q, scale, b, tile=tile)
    for launch in range(2):
        out = fp8_linear(x, q, scale, b, tile=replace(tile, fused_sum=True))
        assert torch.equal(out, want), f"launch {launch}: {(out.float() - want.float()).abs().max()} off"
        assert not tile_counters(x.device, 1).any()


def test_tile_counters_are_zeroed_shared_and_grow_keeping_the_old_buffer():
    cpu = torch.device("cpu")
    first = tile_counters(cpu, 1)
    assert first.dtype == torch.int32 and first.numel() >= MIN_COUNTERS and not first.any()
    assert tile_counters(cpu, first.numel()) is first  # every launch that fits shares it
    grown = tile_counters(cpu, first.numel() + 1)
    assert grown.numel() > first.numel() and not grown.any() and tile_counters(cpu, 1) is grown


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m,n,k,tile", [
    (1, 2048, 2048, Fp8Tile("gemv", 1, 128, 64, 4, 1)),  # the decode shape: 16 programs x 16 splits
    (1, 1000, 1280, Fp8Tile("gemv", 1, 128, 64, 4, 1, scale_out=True)),  # ragged N
    (16, 2048, 2048, Fp8Tile("dot", 16, 64, 128, 4, 4)),
    (64, 2048, 4096, Fp8Tile("dot", 64, 64, 128, 4, 4)),
], ids=["gemv-m1", "gemv-m1-ragged-so", "dot-m16", "dot-m64"])
def test_fused_sum_replays_in_a_cuda_graph_bit_for_bit(m, n, k, tile):
    """The gate for turning fused_sum on: a fused launch captured in a CUDA graph and replayed 500 times on
    inputs refreshed in place equals the two-kernel path bit for bit every time. A partial read before its
    store lands, or a counter left non-zero, would show on some replay; the interpreter cannot show races."""
    q, scale = (t.cuda() for t in _fp8_weight(n, k, seed=m))
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    b = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16)
    fused = replace(tile, fused_sum=True)
    assert k_split(fused, m, n, k, x.device)[1] >= 3
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and allocate the counters before the capture
        fp8_linear(x, q, scale, b, tile=fused)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_linear(x, q, scale, b, tile=fused)
    for replay in range(500):
        x.normal_(generator=gen)
        b.normal_(generator=gen)
        graph.replay()
        want = fp8_linear(x, q, scale, b, tile=tile)
        assert torch.equal(out, want), f"replay {replay}: {(out.float() - want.float()).abs().max()} off"
    assert not tile_counters(x.device, 1).any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 16, 17, 32, 64, 65])
@pytest.mark.parametrize("n,k", [(2048, 4096), (1000, 1280)], ids=["few-tiles-split", "ragged-n"])
def test_fp8_linear_default_tiles_on_cuda_are_close_and_deterministic(dtype, m, n, k):
    """fp8_tile's picks on the device: the automatic K split engages where N gives few programs (2048
    rows: 32..128 tiles for 132 SMs), the bias goes through the split sum, and two runs agree bit for bit
    (partials are added in a fixed order)."""
    q, scale = _fp8_weight(n, k, seed=m)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen).to("cuda", dtype)
    b = torch.randn(n, generator=gen).to("cuda", dtype)
    qd, sd = q.cuda(), scale.cuda()
    out = fp8_linear(x, qd, sd, b)
    assert_close(out, fp8_linear_ref(x.float().cpu(), q, scale, b.float().cpu()), dtype)
    assert torch.equal(out, fp8_linear(x, qd, sd, b))


def test_fp8_tile_picks_the_kind_by_batch_and_shrinks_rows_to_it():
    cpu = torch.device("cpu")
    assert fp8_tile(1, 4096, 2048, torch.bfloat16, cpu).block_m == 1
    assert fp8_tile(3, 4096, 2048, torch.bfloat16, cpu).block_m == 16
    assert fp8_tile(3, 4096, 2048, torch.float32, cpu).block_m == 4
    assert fp8_tile(2, 4096, 2048, torch.float32, cpu).block_m == 2
    assert fp8_tile(9, 4096, 2048, torch.bfloat16, cpu) == replace(DECODE_TILES[2][1], block_m=16)
    assert fp8_tile(33, 4096, 2048, torch.bfloat16, cpu).block_m == 64
    assert fp8_tile(65, 4096, 2048, torch.bfloat16, cpu).kind == "mm"
    assert fp8_tile(1, 4096, 2048, torch.float32, cpu).kind == "gemv"
    assert fit_rows(Fp8Tile("dot", 64, 64, 128, 4, 4), 5).block_m == 16


def test_k_split_keeps_whole_scale_blocks_and_steps():
    cpu = torch.device("cpu")
    assert k_split(Fp8Tile("dot", 16, 64, 64, 4, 2, 3), 1, 64, 1000, cpu) == (384, 3)  # 8 blocks: 3 + 3 + 2
    assert k_split(Fp8Tile("gemv", 1, 16, 64, 4, 1, 2), 1, 64, 1000, cpu) == (512, 2)
    assert k_split(Fp8Tile("gemv", 1, 16, 64, 4, 1, 64), 1, 64, 300, cpu) == (128, 3)  # capped at the blocks
    # no split_k: doubles while programs * split < per_sm * SMs (1 SM on a CPU)
    assert k_split(Fp8Tile("gemv", 1, 16, 64, 4, 1, None, per_sm=8), 1, 32, 2048, cpu) == (512, 4)
    assert k_split(Fp8Tile("dot", 16, 64, 128, 4, 4), 1, 4096, 2048, cpu) == (2048, 1)


@pytest.mark.parametrize("args", [("wide", 16, 64, 128, 4, 4), ("gemv", 8, 16, 128, 4, 1),
                                  ("gemv", 1, 48, 128, 4, 1), ("dot", 8, 64, 128, 4, 4), ("dot", 16, 64, 256, 4, 4),
                                  ("gemv", 1, 16, 96, 4, 1), ("mm", 16, 48, 64, 4, 2), ("gemv", 1, 16, 128, 3, 1),
                                  ("gemv", 1, 16, 128, 4, 1)])
def test_fp8_tile_refuses_shapes_its_kernel_cannot_run(args):
    with pytest.raises(ValueError):
        Fp8Tile(*args)


@pytest.mark.parametrize("flag", ["scale_out", "fused_sum"])
def test_fp8_tile_takes_the_decode_variants_on_the_decode_kinds_only(flag):
    assert getattr(Fp8Tile("gemv", 1, 128, 64, 4, 1, **{flag: True}), flag)
    assert getattr(Fp8Tile("dot", 16, 64, 128, 4, 4, **{flag: True}), flag)
    with pytest.raises(ValueError, match=flag):
        Fp8Tile("mm", 64, 128, 128, 8, 3, 1, **{flag: True})


def _fp8_experts(num_experts, hidden, inter, seed):
    gen = torch.Generator().manual_seed(seed)
    gate, up = (torch.randn(num_experts, inter, hidden, generator=gen) * hidden**-0.5 for _ in range(2))
    down = torch.randn(num_experts, hidden, inter, generator=gen) * inter**-0.5
    (qg, sg), (qu, su), (q2, s2) = quantize(gate), quantize(up), quantize(down)
    return torch.cat([qg, qu], 1), q2, (torch.cat([sg, su], 1), s2)


@pytest.mark.parametrize("device,dtype", cases())
@pytest.mark.parametrize("tokens,hidden,inter", [(3, 256, 128), (9, 160, 200)], ids=["aligned", "ragged"])
def test_moe_fp8_experts_match_the_dequantized_reference(device, dtype, tokens, hidden, inter):
    num_experts, top_k = 6, 2
    w13, w2, scales = _fp8_experts(num_experts, hidden, inter, seed=tokens)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(tokens, hidden, generator=gen)
    weights, ids = moe_route_ref(torch.randn(tokens, num_experts, generator=gen), top_k, True)
    shared, shared_gate = torch.randn(tokens, hidden, generator=gen), torch.randn(tokens, 1, generator=gen)
    d13, d2 = dequantize_experts(w13, w2, scales, torch.float32)
    want = moe_experts_ref(x, d13, d2, weights, ids, shared, shared_gate)
    to = lambda t: t.to(device, dtype)  # noqa: E731
    out = moe_experts(to(x), w13.to(device), w2.to(device), to(weights), ids.to(device), to(shared), to(shared_gate),
                      scales=tuple(s.to(device) for s in scales))
    assert_close(out, want, dtype)


def test_dequantize_experts_tiles_gate_and_up_halves_separately():
    w13, w2, (s13, s2) = _fp8_experts(2, 130, 70, seed=1)
    d13, d2 = dequantize_experts(w13, w2, (s13, s2), torch.float32)
    assert s13.shape == (2, 2, 2) and torch.equal(d13[:, 70:], dequantize(w13[:, 70:], s13[:, 1:], torch.float32))
    assert torch.equal(d2, dequantize(w2, s2, torch.float32))


def test_the_fp8_bench_section_runs_every_candidate_in_the_interpreter(monkeypatch, capsys):
    """tools/bench/bench_fp8_kernels.py on two small shapes in fp32 on a CPU, timings stubbed: every sweep
    candidate and the default tiles run and match the reference, each device timing calls the op on every
    weight copy's own weights, rows carry device time with host-inclusive beside, the sweep ranks by device
    time, and each bucket prints its step totals and DECODE_TILES entry (the GPU run must not be the first
    to execute the section's Python). The 60-row shape gives one output tile, so the CPU's one "SM" splits
    K there and the fused_sum twins take their fused path."""
    from tools.bench import bench_fp8_kernels as fp8_bench
    from tools.bench import bench_kernels

    def two_sets(weights):
        # the second copy's output is exactly twice the first's: its last tensor (bf16 weight, FP8 scales) doubled
        return [weights, (*weights[:-1], weights[-1] * 2)]

    device_ms = iter(1 / (1 + i) for i in range(10**6))  # each timing faster than the one before

    def graph_ms(op, sets):
        first, second = (op(*weights) for weights in sets)
        assert torch.equal(second, 2 * first)
        return next(device_ms)

    monkeypatch.setattr(bench_kernels, "DECODE_GEMMS", [("even", 256, 256, 2), ("ragged", 60, 384, 1)])
    monkeypatch.setattr(bench_kernels, "ROWS", [])
    monkeypatch.setattr(bench_kernels, "CEIL", {"copy": 1.0})
    monkeypatch.setattr(fp8_bench, "ROWS", (1, 5))
    monkeypatch.setattr(fp8_bench, "SWEEP_ROWS", (1, 16))
    monkeypatch.setattr(fp8_bench, "quick_bench", lambda fn: 2.0)
    monkeypatch.setattr(fp8_bench, "weight_sets", two_sets)
    monkeypatch.setattr(fp8_bench, "graph_ms", graph_ms)
    fp8_bench.bench_fp8(bench_kernels.row, lambda fn: 3.0, device="cpu", dtype=torch.float32)
    out = capsys.readouterr().out
    assert "relative error" not in out and "failed" not in out, out
    sweep_rows = [r for r in bench_kernels.ROWS if r["kernel"].startswith("fp8_sweep_") and "step" not in r["kernel"]]
    assert len(sweep_rows) == 2 * sum(len(fp8_bench.candidates(rows)) for rows in (1, 16))
    assert all(r["ms"] < 1 and r["host_ms"] == 2.0 for r in sweep_rows)
    headline = [r for r in bench_kernels.ROWS if r["kernel"] in ("fp8_gemm_even", "fp8_gemm_ragged")]
    assert len(headline) == 4 and all(r["ms"] < 1 and r["host_ms"] == 3.0 for r in headline)
    # the last candidate (a scale_out and fused_sum variant) was timed last on every shape, so it has the lowest
    # step total in device time, and its printed entry is what DECODE_TILES would hold for it
    for rows in (1, 16):
        last = fp8_bench.candidates(rows)[-1]
        assert k_split(last, rows, 60, 384, torch.device("cpu"))[1] > 1
        entry = out.split(f"DECODE_TILES entry for M <= {rows}: ", 1)[1].splitlines()[0]
        assert last.scale_out and last.fused_sum and eval(entry.rstrip(","), {"Fp8Tile": Fp8Tile}) == (rows, last)  # noqa: S307
        step = next(r for r in bench_kernels.ROWS if r["kernel"] == "fp8_sweep_step_best" and r["shape"] == f"M{rows}")
        assert step["host_ms"] == 3 * 2.0 and step["ms"] < 3 * 1
    assert out.count("acceptance 3 at M = 1:") == 1


def test_the_fp8_sweep_tries_the_current_tile_and_the_next_two_with_scale_out_flipped():
    """Whichever way the current DECODE_TILES entry sets scale_out and fused_sum, the sweep times the next two
    tiles with scale_out flipped and the current one with each flag flipped and with both (and the label tells
    them apart)."""
    from tools.bench.bench_fp8_kernels import SWEEP_ROWS, candidates, tile_label

    for rows in SWEEP_ROWS:
        tiles = candidates(rows)
        current = tiles[0]
        assert current == fit_rows(dict(DECODE_TILES)[rows], rows) and len(set(tiles)) == len(tiles) <= 15
        assert all(replace(t, scale_out=not t.scale_out) in tiles for t in tiles[:3])
        twin = replace(current, scale_out=not current.scale_out)
        assert {replace(t, fused_sum=not t.fused_sum) for t in (current, twin)} <= set(tiles)
        assert all(tile_label(replace(t, scale_out=True, fused_sum=False))
                   == tile_label(replace(t, scale_out=False, fused_sum=False)) + " so" for t in tiles if t.kind != "mm")
        assert all(tile_label(replace(t, fused_sum=True)) == tile_label(replace(t, fused_sum=False)) + " fs"
                   for t in tiles if t.kind != "mm")
