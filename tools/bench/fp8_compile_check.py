"""Compile the FP8 GEMM's tiles for an H100/H200 (sm_90) on a machine without a GPU, and print what the
compiler made of each: registers, shared memory, wgmma use, layout conversions, the main loop's
instructions per weight element with its conversions and multiplies, and the order of the gemv loop's
weight loads against its arithmetic.

    python3 -m tools.bench.fp8_compile_check [--rows 1,4,16,32,64]

It runs Triton's CUDA backend ahead of time (the ptxas and cuobjdump shipped in the triton wheel), so a
tile that fails to compile, spills, or loses its load pipelining shows up before a GPU session. It
does not time anything: bench_fp8_kernels.py does, on the device.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend

from hkv_kernels.fp8_gemm import triton_fp8_gemm as fp8
from tools.bench.bench_fp8_kernels import candidates, tile_label

TARGET = GPUTarget("cuda", 90, 32)
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
# the non-constexpr arguments' types; all but M are 16-divisible on the benchmark shapes, which Triton's
# launcher specializes on (16-byte aligned pointers, sizes and strides that 16 divides)
TYPES = dict(x_ptr="*bf16", w_ptr="*fp8e4nv", s_ptr="*fp32", bias_ptr="*bf16", M="i32", N="i32", K="i32",
             k_per_split="i32", stride_xm="i32", stride_wn="i32", stride_sn="i32", stride_om="i32", stride_os="i32",
             sum_ptr="*bf16", count_ptr="*i32")

def compile_tile(tile: fp8.Fp8Tile, split: bool = False):
    """tile's kernel compiled for sm_90 with bf16 activations, as fp8_linear launches it on an even K (with
    fp32 partials where split; a fused_sum tile always splits, since fp8_linear runs it fused only then)."""
    split = split or tile.fused_sum
    if tile.kind == "gemv":
        fn = fp8._fp8_gemv_kernel
        consts = dict(ROWS=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k)
    else:
        fn = fp8._fp8_dot_kernel if tile.kind == "dot" else fp8._fp8_mm_kernel
        consts = dict(BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, PRECISION="tf32")
    if tile.kind != "mm":
        consts.update(SCALE_OUT=tile.scale_out, FUSED_SUM=tile.fused_sum)
    consts.update(SCALE_BLOCK=fp8.BLOCK, EVEN_K=True, HAS_BIAS=False)
    types = {**TYPES, "out_ptr": "*fp32" if split else "*bf16"}  # K-split partials are fp32
    signature = {name: "constexpr" if name in consts else types[name] for name in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if name not in consts and name != "M"}
    backend = make_backend(TARGET)
    options = backend.parse_options({"num_warps": tile.num_warps, "num_stages": tile.num_stages})
    return triton.compile(ASTSource(fn, signature, consts, attrs), target=TARGET, options=options.__dict__)


def _sass(compiled) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([os.path.join(BIN, "cuobjdump"), "--dump-resource-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", f.name],
                              capture_output=True, text=True, check=True).stdout
    return usage + sass


def loop_order(sass: str) -> str:
    """The main loop's global loads (L), float arithmetic (F) and shuffles (S), run-length coded: loads
    bunched at the loop's top keep several tiles in flight, loads spread among the arithmetic do not."""
    body = sass[sass.find("BRA"):]  # after the prologue's branch
    ops = re.findall(r"\b(LDG|FFMA|F2F|SHFL)\b", body[: body.find("BAR")] if "BAR" in body else body)
    runs: list[list] = []
    for op in ops:
        code = {"LDG": "L", "SHFL": "S"}.get(op, "F")
        if runs and runs[-1][0] == code:
            runs[-1][1] += 1
        else:
            runs.append([code, 1])
    return " ".join(f"{c}{n}" for c, n in runs[:24]) + (" ..." if len(runs) > 24 else "")


def loop_ops(sass: str) -> Counter:
    """Opcodes of the kernel's main loop: the longest span from a backward branch's target to the branch."""
    line = r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][^;]*);"  # address, opcode and operands, no predicate
    ins = [(int(addr, 16), op) for addr, op in re.findall(line, sass)]
    body: list[str] = []
    for addr, op in ins:
        target = re.match(r"BRA\b.*?0x([0-9a-f]+)", op)
        if target and int(target.group(1), 16) < addr:
            span = [o for a, o in ins if int(target.group(1), 16) <= a <= addr]
            body = max(body, span, key=len)
    return Counter(op.split()[0] for op in body)


def loop_cost(tile: fp8.Fp8Tile, sass: str) -> str:
    """The main loop's instructions per weight element a thread handles each step, and its conversions and
    float multiplies: what dequantizing costs per weight byte (scale_out's reason to exist)."""
    ops = loop_ops(sass)
    per_thread = tile.block_n * tile.block_k / (32 * tile.num_warps)
    picked = " ".join(f"{op} {n}" for op, n in sorted(ops.items())
                      if op.startswith(("F2F", "HADD2.F32", "FMUL", "FFMA")))
    return f"loop {sum(ops.values()) / per_thread:.2f} a weight ({picked})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(str(r) for r, _ in fp8.DECODE_TILES))
    args = parser.parse_args(argv)
    failed = 0
    for rows in (int(r) for r in args.rows.split(",")):
        for tile in candidates(rows):
            try:
                compiled = compile_tile(tile)
            except Exception as exc:  # the point of the check: say which tile and go on
                failed += 1
                print(f"M{rows} {tile_label(tile)}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                continue
            sass = _sass(compiled)
            regs = re.search(r"REG:(\d+)", sass)
            stack = re.search(r"STACK:(\d+)", sass)
            ttgir = compiled.asm["ttgir"]
            print(f"M{rows} {tile_label(tile)}: regs {regs.group(1) if regs else '?'} stack "
                  f"{stack.group(1) if stack else '?'} smem {compiled.metadata.shared} wgmma "
                  f"{'yes' if 'warp_group_dot' in ttgir else 'no'} convert_layout {ttgir.count('ttg.convert_layout')} "
                  + loop_cost(tile, sass) + (f" order {loop_order(sass)}" if tile.kind == "gemv" else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
