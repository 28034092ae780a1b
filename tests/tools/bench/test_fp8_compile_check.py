"""tools/bench/fp8_compile_check.py: the FP8 GEMM's default decode tiles compile for sm_90 on a machine
without a GPU (Triton's CUDA backend ahead of time), which the interpreter tests cannot show."""

import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")

SCRIPT = """
from hkv_kernels.fp8_gemm.triton_fp8_gemm import DECODE_TILES, fit_rows
from tools.bench.fp8_compile_check import _sass, compile_tile
import re
for rows in (1, 64):
    tile = fit_rows(dict(DECODE_TILES)[rows], rows)
    for split in (False, True):
        compiled = compile_tile(tile, split=split)
        sass = _sass(compiled)
        print(rows, tile.kind, split, re.search(r"STACK:(\\d+)", sass).group(1),
              "warp_group_dot" in compiled.asm["ttgir"])
"""


@pytest.mark.skipif(not os.path.exists(PTXAS), reason="triton without its CUDA backend binaries")
def test_the_default_gemv_and_dot_tiles_compile_for_sm90_without_spills():
    # a fresh interpreter: tests/kernels' conftest sets TRITON_INTERPRET, under which @triton.jit
    # kernels cannot be compiled ahead of time
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    # (rows, kind, K-split partials, stack bytes: 0 = no spills, wgmma)
    assert sorted(line.split() for line in done.stdout.splitlines() if line.strip()) == [
        ["1", "gemv", "False", "0", "False"], ["1", "gemv", "True", "0", "False"],
        ["64", "dot", "False", "0", "True"], ["64", "dot", "True", "0", "True"]]
