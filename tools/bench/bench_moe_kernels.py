"""The MoE section of tools/bench/bench_kernels.py (`--only moe`, `--only moe_sweep`): hkv's fused MoE
against the per-expert loop and against torch._grouped_mm, on one Qwen3-Next-80B layer's experts.

Shapes: hidden 2048, 512 experts of width 512, top-10, at 1, 32 and 64 tokens (decode) and 512 and
2,048 (prefill). Each implementation runs the routed experts only (routing is timed on its own row),
captured in a CUDA graph of ROTATE calls over different routings, so that launch gaps and the L2 do
not flatter it (ten experts' weights, 63 MB, about fill the H200's L2). Bytes counted: the weights of
the experts the routings touch, x and the output once. Every implementation's output is compared with
hkv's before it is timed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from hkv_kernels.moe.reference import moe_experts_ref
from hkv_kernels.moe.triton_moe import MoeTile, moe_experts, moe_route, moe_tile

GB = 1e9

HIDDEN, EXPERTS, TOP_K, INTER = 2048, 512, 10, 512
ROTATE = 8  # routings per timed graph


def _routings(tokens: int, gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """ROTATE (weights, ids) pairs from random router logits, as the model's routing produces them."""
    out = []
    for _ in range(ROTATE):
        logits = torch.randn(tokens, EXPERTS, device="cuda", generator=gen).to(torch.bfloat16)
        out.append(moe_route(logits, TOP_K, True))
    return out


def grouped_mm_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                       ids: torch.Tensor) -> torch.Tensor:
    """The routed experts through torch._grouped_mm: pairs sorted by expert (no padding), two grouped
    GEMMs over the stacked weights, SiLU-and-mul between, the weights applied and summed over k."""
    num_tokens, top_k = ids.shape
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(w13.shape[0], dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    h = torch._grouped_mm(x[order // top_k], w13.transpose(1, 2), offs=offs)  # [N, 2I]
    inter = w13.shape[1] // 2
    act = F.silu(h[:, :inter]) * h[:, inter:]
    y = torch._grouped_mm(act, w2.transpose(1, 2), offs=offs) * weights.reshape(-1)[order, None]  # [N, H]
    pairs = torch.empty_like(y).index_copy_(0, order, y)
    return pairs.view(num_tokens, top_k, -1).sum(1, dtype=torch.float32).to(x.dtype)


def _graph_ms(call: Callable[[int], object], bench: Callable) -> float:
    """Median ms of one call, from a CUDA graph of ROTATE calls (call(i) uses routing i)."""
    for i in range(ROTATE):
        call(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(ROTATE):
            call(i)
    return bench(graph.replay) / ROTATE


def _weights(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w13 = (0.02 * torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", generator=gen)).to(torch.bfloat16)
    w2 = (0.02 * torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", generator=gen)).to(torch.bfloat16)
    return w13, w2


def _touched_gbytes(routings, tokens: int) -> float:
    experts = sum(torch.unique(ids).numel() for _, ids in routings) / len(routings)
    return (experts * 3 * INTER * HIDDEN + 2 * tokens * HIDDEN) * 2 / GB


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def bench_moe(row: Callable, bench: Callable) -> None:
    """row, bench: tools.bench.bench_kernels' recorder and timer (the running module's, with its ceilings)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13, w2 = _weights(gen)
    for tokens in (1, 32, 64, 512, 2048):
        x = torch.randn(tokens, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)
        routings = _routings(tokens, gen)
        gbytes = _touched_gbytes(routings, tokens)
        shape = f"T{tokens} E{EXPERTS} k{TOP_K} H{HIDDEN} I{INTER}"
        ours = moe_experts(x, w13, w2, *routings[0])
        loop = moe_experts_ref(x, w13, w2, *routings[0])
        print(f"moe T{tokens}: hkv vs the per-expert loop rel err {_rel(ours, loop):.2e}", flush=True)
        loop_ms = bench(lambda: moe_experts_ref(x, w13, w2, *routings[0]))  # reads the routing: no graph
        ms = _graph_ms(lambda i: moe_experts(x, w13, w2, *routings[i]), bench)
        row("moe_experts_hkv", shape, ms, gbytes=gbytes, base_name="per-expert loop", base_ms=loop_ms)
        if hasattr(torch, "_grouped_mm"):
            try:
                grouped = grouped_mm_experts(x, w13, w2, *routings[0])
                print(f"moe T{tokens}: torch._grouped_mm vs hkv rel err {_rel(grouped, ours):.2e}", flush=True)
                g_ms = _graph_ms(lambda i: grouped_mm_experts(x, w13, w2, *routings[i]), bench)
                row("moe_experts_grouped_mm", shape, g_ms, gbytes=gbytes, base_name="hkv", base_ms=ms)
            except RuntimeError as exc:
                print(f"moe T{tokens}: torch._grouped_mm failed: {exc}", flush=True)
        logits = torch.randn(tokens, EXPERTS, device="cuda", generator=gen).to(torch.bfloat16)
        route_ms = _graph_ms(lambda i: moe_route(logits, TOP_K, True), bench)
        ref_ms = bench(lambda: torch.topk(torch.softmax(logits, -1, dtype=torch.float32), TOP_K, -1))
        row("moe_route_hkv", f"T{tokens} E{EXPERTS} k{TOP_K}", route_ms, gbytes=logits.numel() * 2 / GB,
            base_name="torch softmax+topk", base_ms=ref_ms)
        del x, routings


def bench_moe_sweep(row: Callable, bench: Callable) -> None:
    """The grouped GEMMs' tiles at the decode shapes: gate_up's tile with the default down tile, then
    down's with the best gate_up; the five best of each per batch."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    w13, w2 = _weights(gen)
    for tokens in (1, 32, 64):
        x = torch.randn(tokens, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)
        routings = _routings(tokens, gen)
        gbytes = _touched_gbytes(routings, tokens)
        default = moe_tile(tokens * TOP_K, EXPERTS, torch.bfloat16)
        base_ms = _graph_ms(lambda i: moe_experts(x, w13, w2, *routings[i], tile=default), bench)
        best = default
        for which in ("gate_up", "down"):
            results = []
            for bn in (32, 64, 128):
                for bk in (64, 128, 256):
                    for warps, stages in ((4, 3), (4, 4)):
                        gemm = (bn, bk, warps, stages)
                        tile = MoeTile(best.block_m, gemm if which == "gate_up" else best.gate_up,
                                       gemm if which == "down" else best.down)
                        try:
                            ms = _graph_ms(lambda i: moe_experts(x, w13, w2, *routings[i], tile=tile), bench)
                        except Exception as exc:  # out of shared memory or registers
                            print(f"  moe_sweep T{tokens} {which} {gemm}: {type(exc).__name__}", flush=True)
                            continue
                        results.append((ms, gemm, tile))
            results.sort(key=lambda r: r[0])
            for ms, gemm, _ in results[:5]:
                row(f"moe_sweep {which} n{gemm[0]} k{gemm[1]} w{gemm[2]} st{gemm[3]}", f"T{tokens}", ms,
                    gbytes=gbytes, base_name="moe_tile default", base_ms=base_ms)
            best = results[0][2]
        print(f"moe_sweep T{tokens}: best {best}", flush=True)
        del x, routings
