"""tools/bench/fp8_compile_check.py: the FP8 GEMM's default decode tiles, with and without scale_out and
fused_sum (which the sweep may pick), compile for sm_90 on a machine without a GPU (Triton's CUDA backend
ahead of time), which the interpreter tests cannot show."""

import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")

SCRIPT = """
from dataclasses import replace
from hkv_kernels.fp8_gemm.triton_fp8_gemm import DECODE_TILES, fit_rows
from tools.bench.fp8_compile_check import _sass, compile_tile
import re
for rows in (1, 64):
    for scale_out in (False, True):
        for split, fused_sum in ((False, False), (True, False), (True, True)):
            tile = replace(fit_rows(dict(DECODE_TILES)[rows], rows), scale_out=scale_out, fused_sum=fused_sum)
            compiled = compile_tile(tile, split=split)
            sass = _sass(compiled)
            print(rows, tile.kind, scale_out, split, fused_sum, re.search(r"STACK:(\\d+)", sass).group(1),
                  "warp_group_dot" in compiled.asm["ttgir"])
"""


@pytest.mark.skipif(not os.path.exists(PTXAS), reason="triton without its CUDA backend binaries")
def test_the_default_gemv_and_dot_tiles_compile_for_sm90_without_spills():
    # a fresh interpreter: tests/kernels' conftest sets TRITON_INTERPRET, under which @triton.jit
    # kernels cannot be compiled ahead of time
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    # (rows, kind, scale_out, K-split partials, fused_sum, stack bytes: 0 = no spills, wgmma)
    assert sorted(line.split() for line in done.stdout.splitlines() if line.strip()) == [
        [str(rows), kind, scale_out, split, fused_sum, "0", str(kind == "dot")]
        for rows, kind in ((1, "gemv"), (64, "dot")) for scale_out in ("False", "True")
        for split, fused_sum in (("False", "False"), ("True", "False"), ("True", "True"))]


# cuobjdump -sass's layout: a predicated forward branch, a two-FFMA loop closed by a backward branch, the
# trailing self-branch every kernel ends with
SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;                 /* 0x00000a0000017a02 */
        /*0010*/              @!P0 BRA 0x60 ;                             /* 0x0000004000008947 */
        /*0020*/                   FFMA R2, R3, R4, R2 ;                  /* 0x0000000403027223 */
        /*0030*/                   F2F.BF16.F32 R5, R2 ;                  /* 0x0000000200057304 */
        /*0040*/                   FFMA R2, R3, R4, R2 ;                  /* 0x0000000403027223 */
        /*0050*/               @P1 BRA 0x20 ;                             /* 0xffffffc000001947 */
        /*0060*/                   EXIT ;                                 /* 0x000000000000794d */
        /*0070*/                   BRA 0x70;                              /* 0xfffffffc00fc7947 */
"""


def test_loop_cost_counts_the_backward_branch_span_per_weight_element():
    from hkv_kernels.fp8_gemm.triton_fp8_gemm import Fp8Tile
    from tools.bench.fp8_compile_check import loop_cost, loop_ops

    assert loop_ops(SASS) == {"FFMA": 2, "F2F.BF16.F32": 1, "BRA": 1}
    # 32 x 16 weights over one warp: 16 a thread a step, 4 loop instructions
    assert loop_cost(Fp8Tile("gemv", 1, 32, 16, 1, 1), SASS) == "loop 0.25 a weight (F2F.BF16.F32 1 FFMA 2)"
