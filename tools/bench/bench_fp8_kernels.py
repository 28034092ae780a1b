"""The FP8 section of tools/bench/bench_kernels.py (`--only fp8`): block-FP8 GEMMs on the benchmark
model's projections (bench_kernels.DECODE_GEMMS) at M = 1, 32, 64 (decode) and 2048 (a prefill chunk:
does FP8 cost prefill time?), against cuBLAS bf16.

Two FP8 implementations, each checked against the dequantizing reference before it is timed:
- hkv's Triton weight-only GEMM (hkv_kernels/fp8_gemm): bf16 activations, the weights dequantized in
  registers;
- torch's block-scaled cuBLAS GEMM (torch.nn.functional.scaled_mm, 1 x 128 activation groups by
  128 x 128 weight blocks) where the installed torch has it, with the activations quantized per
  1 x 128 group first: timed alone (`scaled_mm`) and with that quantization (`scaled_mm+quant`, what a
  model would pay).

Rows: GB/s on the FP8 weight bytes (with their scales), % of copy bandwidth, and the speed-up over
bf16 F.linear on the same shape (acceptance: >= 60% of copy bandwidth at M = 1, >= 1.3x bf16 at
M = 64). Per M, the decode step's GEMM total (each shape times its count) for bf16 and for hkv's FP8.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from hkv_kernels.fp8_gemm.reference import FP8_MAX, fp8_linear_ref, quantize
from hkv_kernels.fp8_gemm.triton_fp8_gemm import fp8_linear

GB = 1e9
ROWS = (1, 32, 64, 2048)  # decode batches, then one prefill chunk


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 128) -> (fp8 [M, K], fp32 scales [M, K/128] stored outer-dim-major):
    one multiplier per token and 128 columns, DeepSeek's dynamic activation scheme."""
    groups = x.float().unflatten(-1, (-1, 128))  # [M, K/128, 128]
    scale = groups.abs().amax(-1).clamp_min(1e-12) / FP8_MAX  # [M, K/128]
    q = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).flatten(-2).to(torch.float8_e4m3fn)
    return q, scale.t().contiguous().t()


def scaled_mm_blockwise() -> Callable | None:
    """torch's block-scaled FP8 GEMM as f(xq, x_scale, q, q_scale) -> bf16 [M, N], or None without it."""
    scaled_mm = getattr(F, "scaled_mm", None)
    scaling = getattr(F, "ScalingType", None)
    if scaled_mm is None or scaling is None or not hasattr(scaling, "BlockWise128x128"):
        return None

    def run(xq, x_scale, q, q_scale):
        return scaled_mm(xq, q.t(), x_scale, scaling.BlockWise1x128, q_scale.t(), scaling.BlockWise128x128,
                         output_dtype=torch.bfloat16)

    return run


def bench_fp8(row: Callable, bench: Callable) -> None:
    from tools.bench.bench_kernels import DECODE_GEMMS

    blockwise = scaled_mm_blockwise()
    if blockwise is None:
        print(f"fp8: torch {torch.__version__} has no block-scaled scaled_mm; timing hkv's kernel only", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    totals: dict[tuple[int, str], float] = {}
    for rows in ROWS:
        for name, n, k, count in DECODE_GEMMS:
            w = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
            q, scale = quantize(w)
            x = torch.randn(rows, k, device="cuda", generator=gen, dtype=torch.bfloat16)
            shape = f"M{rows} N{n} K{k} x{count}"
            gbytes = (q.numel() + scale.numel() * 4 + rows * (n + k) * 2) / GB
            ref = fp8_linear_ref(x, q, scale)
            err = _rel(fp8_linear(x, q, scale), ref)
            assert err < 2e-2, f"fp8_linear {shape}: relative error {err:.2e}"
            bf16_ms = bench(lambda: F.linear(x, w))
            ms = bench(lambda: fp8_linear(x, q, scale))
            row(f"fp8_gemm_{name}", shape, ms, gbytes=gbytes, base_name="bf16 F.linear", base_ms=bf16_ms)
            totals[rows, "bf16"] = totals.get((rows, "bf16"), 0.0) + count * bf16_ms
            totals[rows, "fp8"] = totals.get((rows, "fp8"), 0.0) + count * ms
            if blockwise is not None:
                _bench_scaled_mm(row, bench, blockwise, (x, q, scale, ref), shape, gbytes, bf16_ms, name)
            del w, q, scale, x, ref
    for rows in ROWS:
        bf16, fp8 = totals[rows, "bf16"], totals[rows, "fp8"]
        print(f"a step's GEMMs, M{rows}: bf16 {bf16:.3f} ms, hkv FP8 {fp8:.3f} ms (x{bf16 / fp8:.2f})", flush=True)
        row("fp8_gemm_step_total", f"M{rows}", fp8, base_name="bf16 F.linear", base_ms=bf16)


def _bench_scaled_mm(row, bench, blockwise, tensors, shape: str, gbytes: float, bf16_ms: float, name: str) -> None:
    x, q, scale, ref = tensors
    try:
        xq, x_scale = quantize_activations(x)
        err = _rel(blockwise(xq, x_scale, q, scale), ref)
        if err > 5e-2:  # activation rounding adds ~2^-4 relative per element; more means a wrong layout
            print(f"fp8 scaled_mm {shape}: relative error {err:.2e}, not timed", flush=True)
            return
        ms = bench(lambda: blockwise(xq, x_scale, q, scale))
        row(f"fp8_scaled_mm_{name}", shape, ms, gbytes=gbytes, base_name="bf16 F.linear", base_ms=bf16_ms)
        ms = bench(lambda: blockwise(*quantize_activations(x), q, scale))
        row(f"fp8_scaled_mm+quant_{name}", shape, ms, gbytes=gbytes, base_name="bf16 F.linear", base_ms=bf16_ms)
    except RuntimeError as exc:  # an unsupported shape (M, alignment) or architecture
        print(f"fp8 scaled_mm {shape}: {str(exc).splitlines()[0]}", flush=True)
