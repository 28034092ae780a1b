"""Diagnostic: does programmatic dependent launch (PDL) over our own GEMMs shorten a decode step?

The decode step of the benchmark model is a chain of about 300 short kernels; at batch 64 the GEMMs
run at about 52% of copy bandwidth, and the N = 2,048 ones lose their time to each kernel's ramp
(docs/kernels.md: cuBLAS, cuBLASLt, Triton split-K and an L2 prefetch on a side stream all within
7%, or slower). PDL lets a kernel start while the one before it finishes: it loads what does not
depend on its input (its weights, a recurrent state) and then waits (`griddepcontrol.wait`). cuBLAS
does not offer that through torch, so every kernel of the chain here is a Triton kernel of this file.

A synthetic step of the benchmark model's shapes, 24 layers each with its own weights (3.4 GB, never
in L2), in one CUDA graph, timed by replays:

    add + RMSNorm -> in_proj GEMM (N 12,352) -> fp32 state pass (the GDN recurrence's traffic: read and
    write B x 32 x 128 x 128 fp32) -> out_proj GEMM (K 4,096, N 2,048, split K) -> add + RMSNorm (the
    split-K partials summed in a fixed order there) -> gate_up GEMM (N 12,288) -> SiLU-and-mul -> down
    GEMM (K 6,144, split K) -> add + RMSNorm

Variants, each a whole step:
- `cublas`: the GEMMs by torch.mm (cuBLAS), the other kernels ours (as the model's decode step runs
  today: GEMM, cuBLAS' own split-K reduce where it splits, then our add + RMSNorm);
- `cublas-pdl-late`: the same, our kernels PDL-launched (they may start as a GEMM's programs exit);
- `ours`: every GEMM ours, no PDL;
- `ours-pdl`: PDL launches; each kernel loads its first weight tile (or its state tile) before it
  waits, and lets its dependents launch as soon as it starts;
- `ours-pdl-late`: PDL launches, dependents launched only when a kernel's programs exit;
- `ours-pdl-l2`: as `ours-pdl`, and each GEMM program asks for its whole weight slice in L2 before it
  waits (`cp.async.bulk.prefetch.L2`);
- `fused-silu`, `fused-silu-pdl`: as `ours` / `ours-pdl` with SiLU-and-mul done in the down GEMM's loads.

    python -m tools.diag_pdl_chain [--batches 32,64] [--layers 24] [--sweep]

Prints the graph's median replay time per (batch, variant), its ratio to `cublas` and its share of
copy bandwidth for the step's weight and state bytes; `ours*` outputs must equal each other bit for
bit (same kernels, same order of sums) and `cublas` to bf16 rounding. --sweep first times each GEMM
shape's tiles alone (a graph of 24 of them) and uses the fastest. On one H200 (2026-12-04) the best
chain was 1.021x the cuBLAS step at B64 and every PDL chain was slower at B32 (docs/kernels.md): not
used by the model.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from hkv.engine.cuda_graphs import replay_seconds
from tools.bench_decode import copy_bandwidth

HIDDEN, INTER, IN_N, O_K, HEADS, DK, DV = 2048, 6144, 12352, 4096, 32, 128, 128


@triton.jit
def _pdl_wait(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def _pdl_launch(PDL: tl.constexpr, EARLY: tl.constexpr):
    if PDL and EARLY:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _l2_prefetch_rows(row_ptrs, nbytes):
    """Each element: ask for `nbytes` from its row pointer into L2 (Hopper bulk prefetch)."""
    tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;", "=r,l,r", [row_ptrs, nbytes],
        dtype=tl.int32, is_pure=False, pack=1,
    )


@triton.jit
def _a_tile(x_rows, k, rk, m_ok, up_off, SILU_MUL: tl.constexpr, dtype: tl.constexpr):
    """The GEMM input's [BLOCK_M, BLOCK_K] tile at column k: x, or silu(gate) * up rounded as the model does."""
    if SILU_MUL:
        g = tl.load(x_rows[:, None] + (k + rk)[None, :], mask=m_ok[:, None], other=0.0).to(tl.float32)
        u = tl.load(x_rows[:, None] + (up_off + k + rk)[None, :], mask=m_ok[:, None], other=0.0).to(tl.float32)
        return ((g * tl.sigmoid(g)).to(dtype).to(tl.float32) * u).to(dtype)
    return tl.load(x_rows[:, None] + (k + rk)[None, :], mask=m_ok[:, None], other=0.0)


@triton.jit
def _gemm_kernel(
    x_ptr, w_ptr, out_ptr, M, N, stride_xm, stride_wn, up_off,
    K_PER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SILU_MUL: tl.constexpr, SPLIT_OUT: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr,
    L2: tl.constexpr,
):
    """out[s] (fp32 partials [S, M, N]) or out (bf16 [M, N]) = x[:, s-th K_PER] @ w[:, s-th K_PER].T.

    SILU_MUL: x holds gate | up (up at column up_off), and the GEMM input is silu(gate) * up, rounded
    to bf16 as the separate kernel would."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    _pdl_launch(PDL, EARLY)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    k0 = pid_s * K_PER
    n_ok = rn < N
    w_rows = w_ptr + rn.to(tl.int64) * stride_wn + k0
    if L2:
        _l2_prefetch_rows(w_rows, K_PER * 2)
    w = tl.load(w_rows[:, None] + rk[None, :], mask=n_ok[:, None], other=0.0)  # before the wait: weights
    _pdl_wait(PDL)
    m_ok = rm < M
    x_rows = x_ptr + rm.to(tl.int64) * stride_xm + k0
    acc = tl.dot(_a_tile(x_rows, 0, rk, m_ok, up_off, SILU_MUL, w.dtype), tl.trans(w))  # the first tile, peeled
    for k in range(BLOCK_K, K_PER, BLOCK_K):
        w = tl.load(w_rows[:, None] + (k + rk)[None, :], mask=n_ok[:, None], other=0.0)
        acc = tl.dot(_a_tile(x_rows, k, rk, m_ok, up_off, SILU_MUL, w.dtype), tl.trans(w), acc)
    if SPLIT_OUT:
        o = out_ptr + (pid_s * M + rm[:, None]).to(tl.int64) * N + rn[None, :]
        tl.store(o, acc, mask=m_ok[:, None] & n_ok[None, :])
    else:
        o = out_ptr + rm[:, None].to(tl.int64) * N + rn[None, :]
        tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _add_norm_kernel(
    parts_ptr, x_ptr, w_ptr, h_ptr, M, eps,
    S: tl.constexpr, N: tl.constexpr, PARTS_F32: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr,
):
    """x += sum of S partials (fixed order; S = 0: none), rounded to bf16; h = RMSNorm(x) * (1 + w)."""
    row = tl.program_id(0)
    _pdl_launch(PDL, EARLY)
    cols = tl.arange(0, N)
    w = tl.load(w_ptr + cols).to(tl.float32)
    _pdl_wait(PDL)
    x = tl.load(x_ptr + row * N + cols).to(tl.float32)
    if S > 0:
        acc = tl.load(parts_ptr + row * N + cols).to(tl.float32)
        for s in range(1, S):
            acc += tl.load(parts_ptr + (s * M + row) * N + cols).to(tl.float32)
        if PARTS_F32:
            acc = acc.to(x_ptr.dtype.element_ty).to(tl.float32)  # the GEMM's output is bf16 in the model
        x = (x + acc).to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * N + cols, x)
        x = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 0) / N + eps)
    tl.store(h_ptr + row * N + cols, (x * rstd * (1.0 + w)).to(h_ptr.dtype.element_ty))


@triton.jit
def _state_kernel(
    proj_ptr, state_ptr, core_ptr, stride_pm,
    HEADS: tl.constexpr, DK: tl.constexpr, BLOCK_V: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr,
):
    """The GDN recurrence's memory traffic: state[b, h, v-block, :] read and written (fp32), one value
    per row out: core[b, h * Dv + v] = proj[b, same] + a small row sum of the new state."""
    bh = tl.program_id(0)
    vb = tl.program_id(1)
    _pdl_launch(PDL, EARLY)
    b = bh // HEADS
    h = bh % HEADS
    rv = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    rk = tl.arange(0, DK)
    s_ptrs = state_ptr + bh.to(tl.int64) * (DK * DK) + rv[:, None] * DK + rk[None, :]
    st = tl.load(s_ptrs)  # the state is this kernel's own: read before the wait
    _pdl_wait(PDL)
    col = h * DK + rv
    p = tl.load(proj_ptr + b * stride_pm + col).to(tl.float32)
    st = st * 0.999 + 1e-4 * p[:, None]
    tl.store(s_ptrs, st)
    tl.store(core_ptr + b * (HEADS * DK) + col, (p + 1e-3 * tl.sum(st, 1)).to(core_ptr.dtype.element_ty))


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, INTER: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    blk = tl.program_id(1)
    _pdl_launch(PDL, True)
    _pdl_wait(PDL)
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    g = tl.load(gu_ptr + row * 2 * INTER + cols).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * INTER + INTER + cols).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    tl.store(out_ptr + row * INTER + cols, ((g * tl.sigmoid(g)).to(dt).to(tl.float32) * u).to(dt))


class Tile:
    def __init__(self, block_n: int, block_k: int, split: int, warps: int, stages: int) -> None:
        self.block_n, self.block_k, self.split, self.warps, self.stages = block_n, block_k, split, warps, stages

    def __repr__(self) -> str:
        return f"n{self.block_n}k{self.block_k}s{self.split}w{self.warps}st{self.stages}"


def gemm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, tile: Tile, pdl: str, silu_mul: bool = False) -> None:
    """out: [S, M, N] fp32 when tile.split > 1, else [M, N] bf16; x: [M, K] (gate | up of 2K with silu_mul)."""
    m, n, k = x.shape[0], w.shape[0], w.shape[1]
    k_per = k // tile.split
    assert k_per % tile.block_k == 0, (k, tile)
    grid = (triton.cdiv(n, tile.block_n), tile.split)
    _gemm_kernel[grid](
        x, w, out, m, n, x.stride(0), w.stride(0), k,
        K_PER=k_per, BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        SILU_MUL=silu_mul, SPLIT_OUT=tile.split > 1, PDL=pdl != "", EARLY=pdl in ("early", "l2"), L2=pdl == "l2",
        num_warps=tile.warps, num_stages=tile.stages, launch_pdl=pdl != "",
    )


def add_norm(parts: torch.Tensor | None, splits: int, x: torch.Tensor, w: torch.Tensor, h: torch.Tensor,
             pdl: str) -> None:
    _add_norm_kernel[(x.shape[0],)](
        parts if parts is not None else x, x, w, h, x.shape[0], 1e-6,
        S=splits, N=x.shape[1], PARTS_F32=parts is not None and parts.dtype == torch.float32,
        PDL=pdl != "", EARLY=pdl in ("early", "l2"), num_warps=4, launch_pdl=pdl != "",
    )


def state_pass(proj: torch.Tensor, state: torch.Tensor, core: torch.Tensor, pdl: str) -> None:
    batch = proj.shape[0]
    _state_kernel[(batch * HEADS, DV // 64)](
        proj, state, core, proj.stride(0), HEADS=HEADS, DK=DK, BLOCK_V=64,
        PDL=pdl != "", EARLY=pdl in ("early", "l2"), num_warps=2, launch_pdl=pdl != "",
    )


def silu_mul(gu: torch.Tensor, out: torch.Tensor, pdl: str) -> None:
    _silu_mul_kernel[(gu.shape[0], INTER // 1024)](gu, out, INTER=INTER, BLOCK=1024, PDL=pdl != "",
                                                   num_warps=4, launch_pdl=pdl != "")


class Step:
    """One synthetic decode step over `layers` (dicts of weights) and per-layer fp32 states."""

    def __init__(self, layers: list[dict], batch: int, tiles: dict[str, Tile], dev: torch.device,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        self.layers, self.batch, self.tiles = layers, batch, tiles
        bf = dict(device=dev, dtype=dtype)
        self.x0 = torch.randn(batch, HIDDEN, **bf)
        self.x = torch.empty(batch, HIDDEN, **bf)
        self.h = torch.empty(batch, HIDDEN, **bf)
        self.proj = torch.empty(batch, IN_N, **bf)
        self.core = torch.empty(batch, O_K, **bf)
        self.gu = torch.empty(batch, 2 * INTER, **bf)
        self.act = torch.empty(batch, INTER, **bf)
        self.lin = torch.empty(batch, HIDDEN, **bf)
        s = max(tiles[k].split for k in ("o", "d", "fd"))
        self.parts = torch.empty(s, batch, HIDDEN, device=dev, dtype=torch.float32)
        self.states0 = [torch.randn(batch * HEADS * DK * DV, device=dev, dtype=torch.float32) * 0.1
                        for _ in layers]
        self.states = [t.clone() for t in self.states0]

    def reset(self) -> None:
        for s, s0 in zip(self.states, self.states0):
            s.copy_(s0)

    def run(self, variant: str) -> torch.Tensor:
        pdl = {"cublas": "", "cublas-pdl-late": "late", "ours": "", "ours-pdl": "early", "ours-pdl-late": "late",
               "ours-pdl-l2": "l2", "fused-silu": "", "fused-silu-pdl": "early"}[variant]
        t = self.tiles
        self.x.copy_(self.x0)
        add_norm(None, 0, self.x, self.layers[0]["n1"], self.h, pdl)
        for i, lay in enumerate(self.layers):
            if variant.startswith("cublas"):
                torch.mm(self.h, lay["w_in"].t(), out=self.proj)
                state_pass(self.proj, self.states[i], self.core, pdl)
                torch.mm(self.core, lay["w_o"].t(), out=self.lin)
                add_norm(self.lin.unsqueeze(0), 1, self.x, lay["n2"], self.h, pdl)
                torch.mm(self.h, lay["w_gu"].t(), out=self.gu)
                silu_mul(self.gu, self.act, pdl)
                torch.mm(self.act, lay["w_d"].t(), out=self.lin)
                nxt = self.layers[i + 1]["n1"] if i + 1 < len(self.layers) else lay["n1"]
                add_norm(self.lin.unsqueeze(0), 1, self.x, nxt, self.h, pdl)
                continue
            gemm(self.h, lay["w_in"], self.proj, t["in"], pdl)
            state_pass(self.proj, self.states[i], self.core, pdl)
            gemm(self.core, lay["w_o"], self.parts if t["o"].split > 1 else self.lin, t["o"], pdl)
            add_norm(self.parts if t["o"].split > 1 else self.lin.unsqueeze(0), t["o"].split, self.x, lay["n2"],
                     self.h, pdl)
            gemm(self.h, lay["w_gu"], self.gu, t["gu"], pdl)
            down = t["fd"] if variant.startswith("fused") else t["d"]
            if variant.startswith("fused"):  # SiLU-and-mul in the down GEMM's loads
                gemm(self.gu, lay["w_d"], self.parts if down.split > 1 else self.lin, down, pdl, silu_mul=True)
            else:
                silu_mul(self.gu, self.act, pdl)
                gemm(self.act, lay["w_d"], self.parts if down.split > 1 else self.lin, down, pdl)
            nxt = self.layers[i + 1]["n1"] if i + 1 < len(self.layers) else lay["n1"]
            add_norm(self.parts if down.split > 1 else self.lin.unsqueeze(0), down.split, self.x, nxt, self.h, pdl)
        return self.h


def replay_ms(fn, replays: int) -> tuple[float, torch.Tensor]:
    """fn warmed up, captured once and replayed: the median replay in ms, and fn's output."""
    for _ in range(2):
        out = fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    ms = replay_seconds(graph, replays, statistics.median) * 1e3
    del graph
    return ms, out


def sweep(layers: list[dict], batch: int, dev: torch.device, replays: int) -> dict[str, Tile]:
    """Each GEMM shape alone, 24 of them back to back (own weights), for each candidate tile."""
    cands = {
        "in": [Tile(n, k, 1, 4, st) for n in (64, 128) for k in (128, 256) for st in (3, 4)],
        "o": [Tile(n, k, s, 4, 4) for n in (32, 64) for k in (128, 256) for s in (4, 8)],
    }
    cands["gu"], cands["d"], cands["fd"] = cands["in"], cands["o"], cands["o"][:4]
    keys = {"in": "w_in", "o": "w_o", "gu": "w_gu", "d": "w_d", "fd": "w_d"}
    best: dict[str, Tile] = {}
    for name, tiles in cands.items():
        w0 = layers[0][keys[name]]
        n, k = w0.shape
        x = torch.randn(batch, 2 * k if name == "fd" else k, device=dev, dtype=torch.bfloat16)
        times = []
        for tile in tiles:
            if (k // tile.split) % tile.block_k:
                continue
            out = (torch.empty(tile.split, batch, n, device=dev, dtype=torch.float32) if tile.split > 1
                   else torch.empty(batch, n, device=dev, dtype=torch.bfloat16))

            def chain() -> torch.Tensor:
                for lay in layers:
                    gemm(x, lay[keys[name]], out, tile, "", silu_mul=name == "fd")
                return out
            try:
                ms, _ = replay_ms(chain, replays)
            except Exception as exc:  # a tile that does not fit (shared memory): skip it
                print(f"  {name} {tile}: {type(exc).__name__}", file=sys.stderr)
                continue
            times.append((ms, tile))
        ref, _ = replay_ms(lambda: [torch.mm(x[:, :k], lay[keys[name]].t()) for lay in layers][-1], replays)
        times.sort(key=lambda r: r[0])
        best[name] = times[0][1]
        gb = len(layers) * n * k * 2 / 1e9
        print(f"  B{batch} {name} (N {n}, K {k}, x{len(layers)}): cuBLAS {ref:.3f} ms; best ours "
              + ", ".join(f"{t} {ms:.3f}" for ms, t in times[:4]) + f"  ({gb / times[0][0]:.2f} TB/s)", flush=True)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="32,64", help="decode batch sizes (default: 32,64)")
    ap.add_argument("--layers", type=int, default=24, help="layers, each with its own weights (default: 24)")
    ap.add_argument("--replays", type=int, default=30, help="timed graph replays (default: 30)")
    ap.add_argument("--sweep", action="store_true", help="pick each GEMM's tile by timing it alone first")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("diag_pdl_chain needs a CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape: int, scale: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, device=dev, dtype=torch.float32, generator=g) * scale).to(torch.bfloat16)

    layers = [dict(w_in=rnd(IN_N, HIDDEN), w_o=rnd(HIDDEN, O_K), w_gu=rnd(2 * INTER, HIDDEN), w_d=rnd(HIDDEN, INTER),
                   n1=rnd(HIDDEN, scale=0.1), n2=rnd(HIDDEN, scale=0.1)) for _ in range(args.layers)]
    wbytes = sum(lay[k].numel() * 2 for lay in layers for k in ("w_in", "w_o", "w_gu", "w_d"))
    bw = copy_bandwidth()
    print(f"weights {wbytes / 1e9:.2f} GB over {args.layers} layers; copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    default = {"in": Tile(64, 128, 1, 4, 4), "o": Tile(64, 128, 4, 4, 4), "gu": Tile(64, 128, 1, 4, 4),
               "d": Tile(64, 128, 4, 4, 4), "fd": Tile(64, 128, 4, 4, 4)}
    for batch in [int(b) for b in args.batches.split(",")]:
        tiles = sweep(layers, batch, dev, args.replays) if args.sweep else default
        step = Step(layers, batch, tiles, dev)
        sbytes = 2 * sum(s.numel() * 4 for s in step.states)
        roof = (wbytes + sbytes) / bw * 1e3
        print(f"B{batch}: tiles {tiles}; weights + state {(wbytes + sbytes) / 1e9:.2f} GB, {roof:.3f} ms at copy "
              "bandwidth", flush=True)
        rows, outs = [], {}
        for variant in ("cublas", "cublas-pdl-late", "ours", "ours-pdl", "ours-pdl-late", "ours-pdl-l2", "fused-silu",
                        "fused-silu-pdl"):
            try:
                step.reset()
                ms, out = replay_ms(lambda: step.run(variant), args.replays)
                step.reset()  # one replay from the initial state, for the comparison
                with torch.cuda.graph(graph := torch.cuda.CUDAGraph()):
                    step.run(variant)
                graph.replay()
                torch.cuda.synchronize()
                outs[variant] = step.h.float().clone()
                del graph
            except Exception as exc:
                print(f"  B{batch:<3} {variant:<14} failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                continue
            rows.append((variant, ms))
        base = next((ms for v, ms in rows if v == "cublas"), None)
        for variant, ms in rows:
            same = torch.equal(outs[variant], outs["ours"]) if "ours" in outs and variant.startswith("ours") else None
            err = ((outs[variant] - outs["cublas"]).norm() / outs["cublas"].norm()).item() if "cublas" in outs else 0.0
            print(f"  B{batch:<3} {variant:<14} {ms:7.3f} ms  x{(base or ms) / ms:5.3f} of cublas  "
                  f"{roof / ms * 100:5.1f}% of copy bw  vs cublas rel {err:.1e}"
                  + ("" if same is None else f"  equal to ours: {same}"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
