"""tools/bench/bench_decode_fp8kv.py's premise for its tile grid: 3 and 4 stages give the same split decode
kernel on sm_90, so the sweep stops at 3 (compiled ahead of time, no GPU needed)."""

import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")

SCRIPT = """
import re
from hkv_kernels.paged_attention.triton_paged_attention import DecodeTile
from tools.bench.bench_decode_fp8kv import compile_sm90
for fp8 in (False, True):
    ptx = [re.sub(r"//.*", "", compile_sm90(fp8, DecodeTile(32, 4, stages), 9).asm["ptx"]) for stages in (3, 4)]
    print(fp8, ptx[0] == ptx[1], "cp.async.cg" in ptx[0])
"""


@pytest.mark.skipif(not os.path.exists(PTXAS), reason="triton without its CUDA backend binaries")
def test_three_and_four_stages_compile_to_the_same_split_decode_kernel_on_sm90():
    """The K/V loads are pipelined (cp.async) yet a fourth stage changes nothing; if a Triton upgrade makes
    it differ, the sweep's TILE_GRID should take 4 stages again."""
    # a fresh interpreter: tests/kernels' conftest sets TRITON_INTERPRET, under which @triton.jit
    # kernels cannot be compiled ahead of time
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    # (FP8 pages, the same PTX for 3 and 4 stages, asynchronous copies)
    assert done.stdout.split() == ["False", "True", "True", "True", "True", "True"]
