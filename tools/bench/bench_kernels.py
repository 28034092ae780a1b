"""Kernel benchmark on one CUDA GPU: every hkv kernel against the ceilings and the best baseline.

    python3 -m tools.bench.bench_kernels [--json out.json] [--only decode,prefill,moe,fp8,...]

(as a module: tools/inspect.py would shadow the standard library run as a script).

Ceilings are measured in the same run: device-to-device copy bandwidth (bytes
read + written), the bf16 matmul rate, and a plain pinned host<->device copy_.
Each row prints time (median of triton's do_bench), achieved GB/s or TFLOP/s,
the fraction of the matching ceiling, and speed relative to the baseline
(>1 means hkv is faster). The fp8 section's time is device time from CUDA graph
replays instead (tools/bench/device_time.py), with do_bench in a host-incl column.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton

from hkv_kernels.cache_copy.runs import copy_runs
from hkv_kernels.cache_copy.triton_cache_copy import copy_blocks
from hkv_kernels.conv1d.triton_conv1d import causal_conv1d
from hkv_kernels.gdn.fla_chunk import fla_available, gated_delta_rule_chunked
from hkv_kernels.gdn.triton_recurrent import gated_delta_rule_recurrent
from hkv_kernels.meta import StepArena, build_meta, kernel_meta, meta_arrays
from hkv_kernels.paged_attention.triton_paged_attention import paged_attention

GB = 1e9
ROWS: list[dict] = []
CEIL: dict[str, float] = {}


def bench(fn: Callable[[], object]) -> float:
    """Median milliseconds of fn over ~200 ms of repeats, after warm-up."""
    return triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")


def row(name: str, shape: str, ms: float, *, gbytes: float = 0.0, tflop: float = 0.0,
        base_name: str = "", base_ms: float | None = None, ceiling: str = "copy",
        host_ms: float | None = None, base_host_ms: float | None = None) -> None:
    """Record and print one result; rate is GB/s for memory-bound rows, TFLOP/s for compute-bound ones.
    host_ms / base_host_ms: where ms is device time (bench_fp8_kernels' CUDA graph replays), the same op and
    baseline timed per call from the host (do_bench), printed in a last column."""
    if tflop:
        rate, unit = tflop / ms * 1e3, "TFLOP/s"
    else:
        rate, unit = gbytes / ms * 1e3, "GB/s"
    frac = rate / CEIL[ceiling] if CEIL.get(ceiling) else float("nan")
    speed = base_ms / ms if base_ms else float("nan")
    entry = dict(kernel=name, shape=shape, ms=ms, rate=rate, unit=unit, ceiling=ceiling,
                 ceiling_rate=CEIL.get(ceiling), frac_of_ceiling=frac, baseline=base_name,
                 baseline_ms=base_ms, speedup_vs_baseline=speed, host_ms=host_ms, baseline_host_ms=base_host_ms)
    ROWS.append(entry)
    host = "" if host_ms is None else f" | host-incl {host_ms:9.4f} ms"
    host += "" if base_host_ms is None else f", base {base_host_ms:9.4f} ms"
    print(f"{name:<28} {shape:<34} {ms:9.4f} ms {rate:9.1f} {unit:<7} {100 * frac:6.1f}% of {ceiling:<6}"
          f" | {base_name:<22} {base_ms if base_ms else float('nan'):9.4f} ms  x{speed:5.2f}{host}", flush=True)


def measure_ceilings() -> None:
    """Device copy bandwidth, bf16 matmul rate and pinned host<->device copy bandwidth."""
    src = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    CEIL["copy"] = 2 * src.numel() / GB / ms * 1e3
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = bench(lambda: a @ b)
    CEIL["matmul"] = 2 * 8192**3 / 1e12 / ms * 1e3
    host = torch.empty(512 * 1024**2, dtype=torch.uint8).pin_memory()
    dev = torch.empty(host.numel(), dtype=torch.uint8, device="cuda")
    CEIL["h2d"] = host.numel() / GB / bench(lambda: dev.copy_(host, non_blocking=True)) * 1e3
    CEIL["d2h"] = host.numel() / GB / bench(lambda: host.copy_(dev, non_blocking=True)) * 1e3
    del src, dst, a, b, host, dev
    print("ceilings: " + ", ".join(f"{k} {v:.1f}" for k, v in CEIL.items()) + " (GB/s; matmul TFLOP/s)", flush=True)


def _paged_kv(batch: int, ctx: int, kv_heads: int, dim: int, page: int, dtype: torch.dtype):
    pages_per_seq = -(-ctx // page)
    num_pages = batch * pages_per_seq
    k = torch.randn(num_pages, page, kv_heads, dim, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    table = torch.randperm(num_pages, device="cuda").view(batch, pages_per_seq).to(torch.int32)
    return k, v, table


def _best_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[str, float]:
    """Fastest torch SDPA backend on [B, H, L, D] inputs (GQA through enable_gqa or expanded heads)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = q.shape[1] // k.shape[1]
    k_full, v_full = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    best = ("none", float("inf"))
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        for gqa in (True, False):
            kk, vv = (k, v) if gqa else (k_full, v_full)

            def run(kk=kk, vv=vv, gqa=gqa, backend=backend):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, kk, vv, is_causal=causal, enable_gqa=gqa)

            try:
                run()
                ms = bench(run)
            except RuntimeError:
                continue
            if ms < best[1]:
                best = (f"sdpa-{backend.name.lower().split('_')[0]}{'-gqa' if gqa else ''}", ms)
    return best


def bench_decode_attention() -> None:
    for batch, ctx, q_heads in ((64, 4096, 32), (64, 4096, 64), (8, 4096, 32), (256, 1024, 32)):
        kv_heads, dim, page = 8, 128, 16
        k, v, table = _paged_kv(batch, ctx, kv_heads, dim, page, torch.bfloat16)
        q = torch.randn(batch, q_heads, dim, device="cuda", dtype=torch.bfloat16)
        q_lens, kv_lens = [1] * batch, [ctx] * batch
        meta = build_meta(q_lens, kv_lens, "cuda", q_heads // kv_heads, dim, torch.bfloat16)
        ms = bench(lambda: paged_attention(q, k, v, table, meta, dim**-0.5))
        gbytes = (2 * batch * ctx * kv_heads * dim * 2 + 2 * q.numel() * 2) / GB
        kc = k[table.long()].flatten(1, 2).transpose(1, 2).contiguous()  # [B, Hkv, L, D] unpaged
        vc = v[table.long()].flatten(1, 2).transpose(1, 2).contiguous()
        base, base_ms = _best_sdpa(q[:, :, None], kc, vc, causal=False)
        row("paged_decode_attention", f"B{batch} L{ctx} Hq{q_heads} Hkv{kv_heads} D{dim}", ms,
            gbytes=gbytes, base_name=base + "(unpaged)", base_ms=base_ms)
        del k, v, kc, vc


def bench_prefill_attention() -> None:
    for tokens, q_heads, kv_heads in ((8192, 32, 8), (8192, 16, 2), (4096, 32, 8)):
        dim, page = 128, 16
        k, v, table = _paged_kv(1, tokens, kv_heads, dim, page, torch.bfloat16)
        q = torch.randn(tokens, q_heads, dim, device="cuda", dtype=torch.bfloat16)
        meta = build_meta([tokens], [tokens], "cuda", q_heads // kv_heads, dim, torch.bfloat16)
        ms = bench(lambda: paged_attention(q, k, v, table, meta, dim**-0.5))
        tflop = 4 * q_heads * dim * tokens * tokens / 2 / 1e12  # causal: half the score matrix
        kc = k[table[0].long()].flatten(0, 1)[None].transpose(1, 2).contiguous()  # [1, Hkv, T, D]
        vc = v[table[0].long()].flatten(0, 1)[None].transpose(1, 2).contiguous()
        base, base_ms = _best_sdpa(q[None].transpose(1, 2), kc, vc, causal=True)
        row("prefill_attention", f"T{tokens} Hq{q_heads} Hkv{kv_heads} D{dim} causal", ms,
            tflop=tflop, base_name=base + "(unpaged)", base_ms=base_ms, ceiling="matmul")


def _gdn_inputs(tokens: int, k_heads: int, v_heads: int, dim: int, slots: int):
    q = torch.randn(tokens, k_heads, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn_like(q)
    v = torch.randn(tokens, v_heads, dim, device="cuda", dtype=torch.bfloat16)
    g = -torch.rand(tokens, v_heads, device="cuda") * 0.1
    beta = torch.rand(tokens, v_heads, device="cuda", dtype=torch.bfloat16)
    state = torch.randn(slots, v_heads, dim, dim, device="cuda") * 0.01
    return q, k, v, g, beta, state


def _transformers_chunk() -> Callable | None:
    try:
        from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule
    except ImportError:
        return None
    return torch_chunk_gated_delta_rule


def bench_gdn_prefill() -> None:
    for tokens, k_heads, v_heads in ((8192, 32, 32), (8192, 16, 32)):
        dim = 128
        q, k, v, g, beta, state = _gdn_inputs(tokens, k_heads, v_heads, dim, 4)
        slots = torch.zeros(1, dtype=torch.long, device="cuda")
        shape = f"T{tokens} Hk{k_heads} Hv{v_heads} {dim}x{dim}"
        meta = build_meta([tokens], [tokens], "cuda", 1, 64, torch.bfloat16)
        ours = bench(lambda: gated_delta_rule_recurrent(q, k, v, g, beta, state, slots, meta))
        fla_ms = bench(lambda: gated_delta_rule_chunked(q, k, v, g, beta, state, slots, meta)) if fla_available() else None
        gbytes = (q.numel() * 2 * 2 + v.numel() * 2 * 2 + g.numel() * 6) / GB
        row("gdn_prefill_hkv_recurrent", shape, ours, gbytes=gbytes, base_name="fla-core chunk", base_ms=fla_ms)
        if fla_ms is not None:
            row("gdn_prefill_fla_chunk(used)", shape, fla_ms, gbytes=gbytes, base_name="fla-core chunk", base_ms=fla_ms)
        fallback = _transformers_chunk()
        if fallback is not None:
            group = v_heads // k_heads
            qf, kf = (x.repeat_interleave(group, 1)[None] for x in (q, k))
            init = state[:1].clone()
            t_ms = bench(lambda: fallback(qf, kf, v[None], g[None], beta[None], initial_state=init,
                                          output_final_state=True, use_qk_l2norm_in_kernel=True))
            if fla_ms is not None:
                # the baseline must compute the same function: compare its output with fla's
                t_out = fallback(qf, kf, v[None], g[None], beta[None], initial_state=init.clone(),
                                 output_final_state=True, use_qk_l2norm_in_kernel=True)[0][0].float()
                st = state.clone()
                f_out = gated_delta_rule_chunked(q, k, v, g, beta, st, slots, meta).float()
                err = ((t_out - f_out).norm() / f_out.norm()).item()
                print(f"transformers fallback vs fla: out {tuple(t_out.shape)} rel err {err:.2e}", flush=True)
            row("gdn_prefill_transformers", shape, t_ms, gbytes=gbytes, base_name="fla-core chunk", base_ms=fla_ms)


def bench_gdn_decode() -> None:
    for batch, k_heads, v_heads in ((64, 16, 32), (256, 16, 32), (64, 32, 32)):
        dim = 128
        q, k, v, g, beta, state = _gdn_inputs(batch, k_heads, v_heads, dim, batch * 2)
        slots = torch.randperm(batch * 2, device="cuda")[:batch]
        meta = build_meta([1] * batch, [1] * batch, "cuda", 1, 64, torch.bfloat16)
        ms = bench(lambda: gated_delta_rule_recurrent(q, k, v, g, beta, state, slots, meta))
        gbytes = 2 * batch * v_heads * dim * dim * 4 / GB  # fp32 state read + write
        base_name, base_ms = "fla fused_recurrent", None
        if fla_available():
            from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

            h0 = state[slots].contiguous()
            base_ms = bench(lambda: fused_recurrent_gated_delta_rule(
                q[None], k[None], v[None], g[None], beta[None], initial_state=h0, output_final_state=True,
                use_qk_l2norm_in_kernel=True, cu_seqlens=torch.arange(batch + 1, device="cuda")))
        row("gdn_decode_recurrent", f"B{batch} Hk{k_heads} Hv{v_heads} {dim}x{dim}", ms, gbytes=gbytes,
            base_name=base_name, base_ms=base_ms)
        keep = torch.arange(4 * batch, device="cuda").view(batch, 4)
        state_k = torch.randn(batch * 5, v_heads, dim, dim, device="cuda") * 0.01
        qk, kk, vk, gk, bk, _ = _gdn_inputs(4 * batch, k_heads, v_heads, dim, 1)
        live = torch.arange(4 * batch, 5 * batch, device="cuda")
        meta4 = build_meta([4] * batch, [4] * batch, "cuda", 1, 64, torch.bfloat16)
        ms = bench(lambda: gated_delta_rule_recurrent(qk, kk, vk, gk, bk, state_k, live, meta4, keep_slots=keep))
        row("gdn_verify_k3_keep4", f"B{batch} Hv{v_heads} {dim}x{dim}", ms, gbytes=gbytes * 5 / 2)


def bench_conv1d() -> None:
    channels, ksize = 8192, 4
    weight = torch.randn(channels, ksize, device="cuda", dtype=torch.bfloat16)
    for batch, tokens in ((1, 8192), (64, 1), (256, 1)):
        num_tokens = batch * tokens
        x = torch.randn(num_tokens, channels, device="cuda", dtype=torch.bfloat16)
        state = torch.randn(batch * 2, channels, ksize - 1, device="cuda")
        slots = torch.arange(batch, device="cuda")
        meta = build_meta([tokens] * batch, [tokens] * batch, "cuda", 1, 64, torch.bfloat16)
        ms = bench(lambda: causal_conv1d(x, state, weight, slots, meta))
        gbytes = (2 * x.numel() * 2 + 2 * batch * channels * (ksize - 1) * 4) / GB
        if tokens > 1:
            xt = x.t()[None].contiguous()  # [1, C, T] the layout F.conv1d wants

            def base():
                return F.silu(F.conv1d(F.pad(xt, (ksize - 1, 0)), weight[:, None], groups=channels))
            base_name = "F.conv1d+silu (no state)"
        else:
            st = state[:batch].to(torch.bfloat16)

            def base():
                window = torch.cat([st, x[:, :, None]], dim=-1)  # transformers' torch update path
                st.copy_(window[:, :, 1:])
                return F.silu((window * weight[None]).sum(-1))
            base_name = "torch update (cat+sum)"
        row("causal_conv1d", f"B{batch} T{tokens} C{channels} K{ksize}", ms, gbytes=gbytes,
            base_name=base_name, base_ms=bench(base))


def bench_cache_copies() -> None:
    layers, page, kv_heads, dim = 16, 16, 8, 128
    pages, moved = 2048, 512
    dev_pool = torch.randn(layers, pages, page, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    host_pool = torch.empty(layers, pages, page, kv_heads, dim, dtype=torch.bfloat16).pin_memory()
    src = torch.randperm(pages, device="cuda")[:moved]
    dst = torch.randperm(pages, device="cuda")[:moved]
    gbytes = layers * moved * page * kv_heads * dim * 2 / GB
    shape = f"{moved} pages x {layers} layers x {page * kv_heads * dim * 2 // 1024} KiB"
    host_flat = torch.empty(int(gbytes * GB), dtype=torch.uint8).pin_memory()
    dev_flat = torch.empty(host_flat.numel(), dtype=torch.uint8, device="cuda")
    d2h_plain = bench(lambda: host_flat.copy_(dev_flat, non_blocking=True))
    h2d_plain = bench(lambda: dev_flat.copy_(host_flat, non_blocking=True))
    row("page_copy_d2h", shape, bench(lambda: copy_blocks(dev_pool, host_pool, src, dst)), gbytes=gbytes,
        ceiling="d2h", base_name="plain pinned copy_", base_ms=d2h_plain)
    row("page_copy_h2d", shape, bench(lambda: copy_blocks(host_pool, dev_pool, src, dst)), gbytes=gbytes,
        ceiling="h2d", base_name="plain pinned copy_", base_ms=h2d_plain)

    def base_d2d():
        dev_pool.index_copy_(1, dst, dev_pool.index_select(1, src))
    row("page_copy_d2d", shape, bench(lambda: copy_blocks(dev_pool, dev_pool, src, dst)), gbytes=2 * gbytes,
        base_name="index_select+index_copy_", base_ms=bench(base_d2d))
    del dev_pool, host_pool, host_flat, dev_flat
    # a prefill/decode transfer: a 32k-token prompt's pages of the benchmark model (12 storage layers of
    # 16 x 2 x 256 bf16), consecutive on both sides; one strided copy against one copy_blocks launch
    n, layers = 2047, 12
    peer_src = torch.randn(layers, 2 * n + 64, 16, 2, 256, device="cuda", dtype=torch.bfloat16)
    peer_dst = torch.empty_like(peer_src)
    runs = [(0, n + 64, n)]
    s_idx, d_idx = torch.arange(0, n, device="cuda"), torch.arange(n + 64, 2 * n + 64, device="cuda")
    gbytes = layers * n * 16 * 2 * 256 * 2 / GB
    shape = f"{n} consecutive pages x {layers} layers x 16 KiB"
    blocks_ms = bench(lambda: copy_blocks(peer_src, peer_dst, s_idx, d_idx))
    row("peer_copy_blocks", shape, blocks_ms, gbytes=2 * gbytes)
    row("peer_copy_runs", shape, bench(lambda: copy_runs(peer_src, peer_dst, runs)), gbytes=2 * gbytes,
        base_name="copy_blocks", base_ms=blocks_ms)
    for name, fn in (("copy_blocks", lambda: copy_blocks(peer_src, peer_dst, s_idx, d_idx)),
                     ("copy_runs", lambda: copy_runs(peer_src, peer_dst, runs))):
        host = []
        for _ in range(20):  # the Python launch alone, the GPU idle before each (as an idle decode rank's is)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            host.append(time.perf_counter() - t0)
        print(f"  host launch of {name}: median {sorted(host)[10] * 1e6:.0f} us", flush=True)
    del peer_src, peer_dst
    recurrent = torch.randn(8, 96, 32, 128, 128, device="cuda")
    s_src, s_dst = torch.arange(0, 32, device="cuda"), torch.arange(64, 96, device="cuda")
    gbytes = 2 * 8 * 32 * 32 * 128 * 128 * 4 / GB

    def base_slots():
        recurrent.index_copy_(1, s_dst, recurrent.index_select(1, s_src))
    row("state_slot_copy", "32 slots x 8 layers x 2 MiB", bench(lambda: copy_blocks(recurrent, recurrent, s_src, s_dst)),
        gbytes=gbytes, base_name="index_select+index_copy_", base_ms=bench(base_slots))


def _meta_for_block_m(q_lens: list[int], kv_lens: list[int], block_m: int, group: int):
    """KernelMeta whose attention blocks fit a swept tile's BLOCK_M (not the default tile's)."""
    import numpy as np

    q = np.asarray(q_lens)
    block_t = max(1, block_m // group)
    arrays = meta_arrays(q, np.asarray(kv_lens), np.arange(len(q)), block_t)
    arena = StepArena(sum(len(a) + 2 for a in arrays.values()) + 2, torch.device("cuda"))
    return kernel_meta(arena.pack(arrays), q, (block_m, 64, 4, 2), block_t)


def bench_fused_ops() -> None:
    """The fused small ops of a decode step against the torch sequences they replace (batch 64)."""
    from hkv_kernels.activation.reference import silu_mul_ref
    from hkv_kernels.activation.triton_activation import silu_mul
    from hkv_kernels.norm.reference import add_rms_norm_ref, gated_rms_norm_ref
    from hkv_kernels.norm.triton_norm import gated_rms_norm, rms_norm
    from hkv_kernels.rope.reference import attention_prep_ref
    from hkv_kernels.rope.triton_rope import attention_prep

    bf16, dev = torch.bfloat16, "cuda"
    x, res = (torch.randn(64, 2048, device=dev, dtype=bf16) for _ in range(2))
    w = torch.randn(2048, device=dev, dtype=bf16)
    gbytes = 3 * x.numel() * 2 / GB
    row("add_rms_norm", "T64 H2048", bench(lambda: rms_norm(x, w, 1e-6, True, residual=res.clone())), gbytes=gbytes,
        base_name="torch add + norm", base_ms=bench(lambda: add_rms_norm_ref(x, res, w, 1e-6, True)))
    core = torch.randn(64, 32, 128, device=dev, dtype=bf16)
    z = torch.randn(64, 32, 128, device=dev, dtype=bf16)
    wn = torch.randn(128, device=dev, dtype=bf16)
    row("gated_rms_norm", "T64 Hv32 D128", bench(lambda: gated_rms_norm(core, z, wn, 1e-6)),
        gbytes=3 * core.numel() * 2 / GB, base_name="torch", base_ms=bench(lambda: gated_rms_norm_ref(core, z, wn, 1e-6)))
    gate_up = torch.randn(64, 2 * 6144, device=dev, dtype=bf16)
    g, u = gate_up.split(6144, dim=-1)
    row("silu_mul", "T64 I6144", bench(lambda: silu_mul(g, u)), gbytes=3 * g.numel() * 2 / GB,
        base_name="torch", base_ms=bench(lambda: silu_mul_ref(g, u)))
    q = torch.randn(64, 16, 512, device=dev, dtype=bf16)[..., :256]
    kk, vv = (torch.randn(64, 2, 256, device=dev, dtype=bf16) for _ in range(2))
    cos, sin = (torch.randn(8192, 64, device=dev, dtype=bf16) for _ in range(2))
    pos = torch.randint(0, 8192, (64,), device=dev)
    slots = torch.randperm(64 * 16, device=dev)[:64]
    kc, vc = (torch.zeros(64, 16, 2, 256, device=dev, dtype=bf16) for _ in range(2))
    qn, kn = (torch.randn(256, device=dev, dtype=bf16) for _ in range(2))
    row("attention_prep", "T64 Hq16 Hkv2 D256 rot64", bench(lambda: attention_prep(
        q, kk, vv, cos, sin, pos, qn, kn, 1e-6, True, kc, vc, slots)), gbytes=3 * q.numel() * 2 / GB,
        base_name="torch norm+rope+write", base_ms=bench(lambda: attention_prep_ref(
            q, kk, vv, cos[pos], sin[pos], qn, kn, 1e-6, True, kc, vc, slots)))


def bench_sweep() -> None:
    """Tile sweeps for the defaults: decode and prefill attention, recurrent GDN decode."""
    from hkv_kernels.paged_attention.triton_paged_attention import launch_paged_attention

    k, v, table = _paged_kv(64, 4096, 8, 128, 16, torch.bfloat16)
    q = torch.randn(64, 32, 128, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    gbytes = 2 * 64 * 4096 * 8 * 128 * 2 / GB
    meta = build_meta([1] * 64, [4096] * 64, "cuda", 4, 128, torch.bfloat16)
    for tile in [(16, bn, w, st) for bn in (64, 128, 256) for w in (4, 8) for st in (2, 3, 4)]:
        ms = bench(lambda: launch_paged_attention(q, k, v, table, meta, 0.088, out, tile=tile))
        row(f"sweep_decode{tile}", "B64 L4096 Hq32 Hkv8", ms, gbytes=gbytes)
    k, v, table = _paged_kv(1, 8192, 8, 128, 16, torch.bfloat16)
    q = torch.randn(8192, 32, 128, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    tflop = 4 * 32 * 128 * 8192 * 8192 / 2 / 1e12
    tiles = [(128, bn, w, st) for bn in (64, 128) for w in (4, 8) for st in (2, 3)] + [(64, 64, 4, 3), (256, 64, 8, 2)]
    for tile in tiles:
        try:
            tile_meta = _meta_for_block_m([8192], [8192], tile[0], 4)
            ms = bench(lambda: launch_paged_attention(q, k, v, table, tile_meta, 0.088, out, tile=tile))
        except Exception as exc:  # e.g. out of shared memory for a large tile
            print(f"tile {tile} failed: {type(exc).__name__}", flush=True)
            continue
        row(f"sweep_prefill{tile}", "T8192 Hq32 Hkv8", ms, tflop=tflop, ceiling="matmul")
    del k, v
    q, kk, vv, g, beta, state = _gdn_inputs(64, 16, 32, 128, 128)
    slots = torch.randperm(128, device="cuda")[:64]
    meta = build_meta([1] * 64, [1] * 64, "cuda", 1, 64, torch.bfloat16)
    for tile in [(bv, w) for bv in (16, 32, 64, 128) for w in (1, 2, 4, 8)]:
        ms = bench(lambda: gated_delta_rule_recurrent(q, kk, vv, g, beta, state, slots, meta, tile=tile))
        row(f"sweep_gdn_decode{tile}", "B64 Hk16 Hv32", ms, gbytes=2 * 64 * 32 * 128 * 128 * 4 / GB)


def bench_decode_short() -> None:
    """The benchmark model's decode attention (Hq 16, Hkv 2, D 256, page 16) at short and long contexts:
    the 6 attention layers of a step, each over its own KV (so not from L2), in one CUDA graph, for
    split counts and tiles around the default (decode_splits, BLOCK_N 64, 4 warps, 3 stages)."""
    from hkv_kernels.paged_attention.triton_paged_attention import decode_splits, launch_paged_decode

    hq, hkv, dim, page, layers = 16, 2, 256, 16, 6
    for batch, ctx in ((32, 576), (64, 576), (64, 4096)):
        pools = [_paged_kv(batch, ctx, hkv, dim, page, torch.bfloat16) for _ in range(layers)]
        q = torch.randn(batch, hq, dim, device="cuda", dtype=torch.bfloat16)
        gate = torch.randn_like(q)
        out = torch.empty_like(q)
        meta = build_meta([1] * batch, [ctx] * batch, "cuda", hq // hkv, dim, torch.bfloat16)
        gbytes = layers * 2 * batch * ctx * hkv * dim * 2 / GB
        default = decode_splits(batch, hkv, q.device)
        results = []
        for splits in sorted({1, 8, 12, 16, default}):  # (B1 L576, 2026-12-04: s12 n64 w8 st2 1.17x the default)
            for block_n in (32, 64):
                for warps in (4, 8):
                    for stages in (2, 3):
                        def step(splits=splits, block_n=block_n, warps=warps, stages=stages):
                            for k, v, table in pools:
                                launch_paged_decode(q, k, v, table, meta, dim**-0.5, out, gate, block_n=block_n,
                                                    splits=splits, num_warps=warps, num_stages=stages)
                        try:
                            step()
                            torch.cuda.synchronize()
                            graph = torch.cuda.CUDAGraph()
                            with torch.cuda.graph(graph):
                                step()
                            ms = bench(graph.replay)
                        except Exception as exc:  # a tile out of shared memory or registers
                            print(f"  decode_short B{batch} L{ctx} s{splits} n{block_n} w{warps} st{stages}: "
                                  f"{type(exc).__name__}", flush=True)
                            continue
                        results.append((ms, splits, block_n, warps, stages))
                        del graph
        base = next(r[0] for r in results if r[1:] == (default, 64, 4, 3))
        results.sort()
        for ms, splits, block_n, warps, stages in results[:5]:
            row(f"decode_short s{splits} n{block_n} w{warps} st{stages}", f"B{batch} L{ctx} x{layers} layers", ms,
                gbytes=gbytes, base_name=f"default s{default} n64 w4 st3", base_ms=base)
        del pools


# the benchmark model's projections per decode step: (name, N, K, GEMMs per step)
DECODE_GEMMS = [("gdn_in_proj", 12352, 2048, 18), ("gdn_out_proj", 2048, 4096, 18), ("attn_qkv", 9216, 2048, 6),
                ("attn_o_proj", 2048, 4096, 6), ("mlp_gate_up", 12288, 2048, 24), ("mlp_down", 2048, 6144, 24),
                ("lm_head", 151936, 2048, 1)]


def bench_gemm() -> None:
    """cuBLAS (F.linear) on the benchmark model's decode projections at M = 1, 32, 64: where a decode
    step's GEMM time goes (the N = 2,048 shapes run split-K kernels far below copy bandwidth)."""
    totals: dict[int, float] = {}
    for rows in (1, 32, 64):
        for name, n, k, count in DECODE_GEMMS:
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            ms = bench(lambda: F.linear(x, w))
            row(f"gemm_{name}", f"M{rows} N{n} K{k} x{count}", ms, gbytes=(n * k + rows * (n + k)) * 2 / GB)
            totals[rows] = totals.get(rows, 0.0) + count * ms
            del w, x
    for rows, ms in sorted(totals.items()):
        print(f"decode step GEMMs, M{rows}: {ms:.3f} ms (each timed alone, L2 flushed)", flush=True)
        ROWS.append(dict(kernel="gemm_step_total", shape=f"M{rows}", ms=ms))


def bench_moe() -> None:
    """The fused MoE against the per-expert loop and torch._grouped_mm (tools/bench/bench_moe_kernels.py)."""
    from tools.bench.bench_moe_kernels import bench_moe as run

    run(row, bench)


def bench_fp8() -> None:
    """Block-FP8 GEMMs (hkv's Triton kernel, torch's block-scaled scaled_mm) against bf16 (tools/bench/bench_fp8_kernels.py)."""
    from tools.bench.bench_fp8_kernels import bench_fp8 as run

    run(row, bench)


def bench_decode_fp8kv() -> None:
    """Decode attention over bf16 and FP8 pages across tiles and split counts (tools/bench/bench_decode_fp8kv.py)."""
    from tools.bench.bench_decode_fp8kv import bench_decode_fp8kv as run

    run(row, bench)


def bench_moe_sweep() -> None:
    from tools.bench.bench_moe_kernels import bench_moe_sweep as run

    run(row, bench)


SECTIONS = {
    "sweep": bench_sweep, "gemm": bench_gemm, "decode_short": bench_decode_short,
    "decode": bench_decode_attention, "prefill": bench_prefill_attention, "gdn_prefill": bench_gdn_prefill,
    "gdn_decode": bench_gdn_decode, "conv": bench_conv1d, "copy": bench_cache_copies, "fused": bench_fused_ops,
    "moe": bench_moe, "moe_sweep": bench_moe_sweep, "fp8": bench_fp8, "decode_fp8kv": bench_decode_fp8kv,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write all rows and ceilings to this file")
    parser.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections: " + ",".join(SECTIONS))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels needs a CUDA device", file=sys.stderr)
        return 2
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"fla-core {'yes' if fla_available() else 'no'}", flush=True)
    # SDPA explains every backend it skips, once per call; the table is what matters here
    warnings.filterwarnings("ignore", category=UserWarning)
    measure_ceilings()
    failed = 0
    for name in args.only.split(","):
        try:
            with torch.inference_mode():
                SECTIONS[name]()
        except Exception as exc:  # one broken section must not hide the others' numbers
            failed += 1
            print(f"section {name} failed: {type(exc).__name__}: {exc}", flush=True)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ceilings": CEIL, "rows": ROWS}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
