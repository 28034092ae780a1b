"""Diagnostic: does prefetching the next GEMM's weights into L2 on a side stream shorten a decode step?

A synthetic decode step of the benchmark model's shapes (24 layers of: in_proj GEMM, an fp32 state
pass standing in for the GDN recurrence, out_proj, gate_up, SiLU-and-mul, down), every layer with its
own weights (3.4 GB, never in L2), captured in one CUDA graph and timed by replays. Variants fork a
side stream that prefetches the weights of the N = 2,048 GEMMs (out_proj, down) into L2 while the
kernels before them run: plain loads, or Hopper's bulk L2 prefetch (`cp.async.bulk.prefetch.L2`).

    python -m tools.diag_l2_prefetch [--batches 32,64] [--layers 24]

Prints one line per (batch, variant): the graph's median replay time and its ratio to the baseline.
On one H200 (2026-12-04) every variant was slower, 0.84-0.99x (docs/kernels.md): not used by the model.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from hkv.engine.cuda_graphs import replay_seconds
from tools.bench_decode import copy_bandwidth


@triton.jit
def _bulk_prefetch(ptr, nbytes, CHUNK: tl.constexpr):
    """Program p asks the TMA unit to bring bytes [p * CHUNK, (p + 1) * CHUNK) of ptr into L2 (thread 0 only:
    a Triton scalar is computed by every thread)."""
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * CHUNK
    size = tl.minimum(nbytes - start, CHUNK).to(tl.int32)
    p = ptr.to(tl.pointer_type(tl.int8)) + start
    tl.inline_asm_elementwise(
        "{ .reg .pred one; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 one, t, 0; "
        "@one cp.async.bulk.prefetch.L2.global [$1], $2; } mov.u32 $0, 0;", "=r,l,r", [p, size],
        dtype=tl.int32, is_pure=False, pack=1,
    )


@triton.jit
def _load_prefetch(ptr, dummy, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Loads every element once (kept in L2 with evict_last); writes one sum per program."""
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    base = pid.to(tl.int64) * BLOCK * ITERS
    for i in range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(ptr + offs, mask=offs < n, other=0.0, eviction_policy="evict_last").to(tl.float32)
    tl.store(dummy + pid, tl.sum(acc))


def prefetch(w: torch.Tensor, how: str, dummy: torch.Tensor) -> None:
    if how == "bulk":
        chunk = 1 << 16
        nbytes = w.numel() * w.element_size()
        _bulk_prefetch[(triton.cdiv(nbytes, chunk),)](w, nbytes, CHUNK=chunk, num_warps=1)
    else:
        block, iters = 4096, 16
        n = w.numel()
        grid = triton.cdiv(n, block * iters)
        _load_prefetch[(grid,)](w, dummy, n, BLOCK=block, ITERS=iters, num_warps=8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="32,64")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--replays", type=int, default=30)
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    hidden, inter, in_n, o_k, heads = 2048, 6144, 12352, 4096, 32
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device=dev, dtype=torch.float32, generator=g) * 0.02).to(dt)

    layers = [dict(w_in=rnd(in_n, hidden), w_o=rnd(hidden, o_k), w_gu=rnd(2 * inter, hidden),
                   w_d=rnd(hidden, inter)) for _ in range(args.layers)]
    gib = sum(t.numel() * 2 for lay in layers for t in lay.values()) / 2**30
    bw_copy = copy_bandwidth()
    print(f"weights {gib:.2f} GiB over {args.layers} layers; copy bandwidth {bw_copy / 1e12:.2f} TB/s")
    dummy = torch.zeros(1 << 20, device=dev, dtype=torch.float32)
    side = torch.cuda.Stream(device=dev)
    variants = ["base", "bulk-o", "bulk-d", "bulk-od", "bulk-od-early", "load-od"]
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        x0 = torch.randn(batch, hidden, device=dev, dtype=dt)
        states = [torch.randn(batch * heads * 128 * 128, device=dev, dtype=torch.float32)
                  for _ in range(args.layers)]
        state_bytes = sum(s.numel() * 8 for s in states)

        def step(variant: str) -> torch.Tensor:
            how = "load" if variant.startswith("load") else "bulk"
            want_o = variant != "base" and ("o" in variant.split("-")[1])
            want_d = variant != "base" and ("d" in variant.split("-")[1])
            early = variant.endswith("early")
            main = torch.cuda.current_stream()
            x, events = x0, []

            def fork(w: torch.Tensor) -> None:
                ev = torch.cuda.Event()
                ev.record(main)
                with torch.cuda.stream(side):
                    side.wait_event(ev)
                    prefetch(w, how, dummy)
                    done = torch.cuda.Event()
                    done.record(side)
                events.append(done)

            for i, lay in enumerate(layers):
                h = F.rms_norm(x, (hidden,))
                if want_o and early:
                    fork(lay["w_o"])
                proj = F.linear(h, lay["w_in"])
                if want_o and not early:
                    fork(lay["w_o"])
                states[i].mul_(0.999)  # the recurrence's state read and write
                core = proj[:, :o_k].contiguous()
                x = x + F.linear(core, lay["w_o"])
                h = F.rms_norm(x, (hidden,))
                if want_d:
                    fork(lay["w_d"])
                gate, up = F.linear(h, lay["w_gu"]).chunk(2, dim=-1)
                x = x + F.linear(F.silu(gate) * up, lay["w_d"])
            for ev in events:
                main.wait_event(ev)
            return x

        ref = None
        for variant in variants:
            for _ in range(2):  # warm: compile the kernels, pick cuBLAS algorithms
                step(variant)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = step(variant)
            graph.replay()
            torch.cuda.synchronize()
            if ref is None:
                ref = out.float().clone()
            err = ((out.float() - ref).norm() / ref.norm()).item()
            med = replay_seconds(graph, args.replays, statistics.median) * 1e3
            rows.append((batch, variant, med, err))
            del graph
        base = next(r[2] for r in rows if r[0] == batch and r[1] == "base")
        roof = (gib * 2**30 + state_bytes) / bw_copy * 1e3
        print(f"B{batch}: weights + state {(gib * 2**30 + state_bytes) / 1e9:.2f} GB, at copy bandwidth {roof:.3f} ms")
        for b_, v, med, err in rows:
            if b_ == batch:
                print(f"  B{batch:<3} {v:<14} {med:7.3f} ms  x{base / med:5.3f} of base  "
                      f"{roof / med * 100:5.1f}% of copy bw  rel err {err:.1e}")


if __name__ == "__main__":
    main()
