"""CPU-tier copy bandwidth: device pool <-> the shm page pool, through the rank's own op code.

    python -m tools.bench.bench_tiers [--device cuda|cpu] [--json out.json] [--quick]

Layout: Qwen3.5-9B's (tools/bench/cache_sizing.py): 8 full-attention layers, 4 KV
heads x 256, bf16, 16-token pages = 512 KiB per page; 24 GDN layers, a
50.25 MiB fp32 checkpoint. The host pool is a POSIX shm segment registered
with cudaHostRegister, exactly as a rank maps it; pages are copied in batches
at random, non-adjacent ids on both sides by `ModelRunner._copy_pages` /
`_copy_state` (the code StorePages/LoadPages/StoreState/LoadState run).

Baseline, measured in the same run: a plain `copy_` of the same number of
bytes between one contiguous device tensor and one pinned host tensor.
Each row prints milliseconds (median of CUDA-event-timed repeats), GB/s and
the ratio to the baseline. On CPU (`--device cpu`, small) it only proves the
script runs.
"""

from __future__ import annotations

import argparse
import json
import mmap
import statistics
import sys
import time

import torch

from hkv.engine.model_runner import ModelRunner
from hkv.models.loader import meta_model_of
from hkv.storage.host_pool import HostLayout, HostPool
from hkv.storage.kv_pool import KVLayout, KVPool
from hkv.storage.state_pool import StateLayout, StatePool
from tools.bench.cache_sizing import QWEN3_5_9B

GB = 1e9


def _layouts(device: str, quick: bool) -> tuple[KVLayout, StateLayout]:
    model = meta_model_of(QWEN3_5_9B)
    pages = 256 if quick else 2048
    kv = model.kv_layout(pages, 16, "bfloat16", device)
    state = model.state_layout(4, device=device, dtype="float32")
    return kv, state


def _shm_buffer(nbytes: int) -> mmap.mmap:
    """A shared anonymous mapping: the same kind of memory the tier's shm segment is."""
    return mmap.mmap(-1, nbytes, flags=mmap.MAP_SHARED)


def _register(buffer: mmap.mmap) -> torch.Tensor:
    base = torch.frombuffer(buffer, dtype=torch.uint8)
    err = torch.cuda.cudart().cudaHostRegister(base.data_ptr(), base.numel(), 3)  # portable | mapped
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister failed: {err}")
    return base


def _time(fn, device: str, repeats: int) -> float:
    """Median milliseconds of `fn` after a warm-up."""
    for _ in range(3):
        fn()
    samples = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def run(device: str, quick: bool, repeats: int) -> list[dict]:
    torch.manual_seed(0)
    kv_layout, state_layout = _layouts(device, quick)
    kv = KVPool(kv_layout)
    kv.k.normal_()
    kv.v.normal_()
    state = StatePool(state_layout)
    state.recurrent.normal_()
    state.conv.normal_()
    host_pages = kv_layout.num_pages  # as many entries as device pages
    kv_cpu = KVLayout(kv_layout.num_layers, 1, kv_layout.page_size, kv_layout.kv_heads, kv_layout.head_dim,
                      kv_layout.dtype, "cpu")
    st_cpu = StateLayout(state_layout.lin_layers, 1, state_layout.conv_dim, state_layout.kernel_size,
                         state_layout.v_heads, state_layout.k_dim, state_layout.v_dim)
    probe = HostLayout.for_model(kv_cpu, st_cpu, 1 << 40)  # only its shapes: the unit count is set below
    k = probe.state_units
    units = -(-max(host_pages, 3 * k) // k) * k  # every page entry a device page can go to, and 3 checkpoints
    layout = HostLayout(**{**probe.to_dict(), "num_pages": units})
    buffer = _shm_buffer(layout.nbytes)
    if device == "cuda":
        _register(buffer)
    host = HostPool(layout, memoryview(buffer))
    runner = ModelRunner(None, kv, state, None, kv_layout.page_size, device, host)
    rows: list[dict] = []
    batches = (16, 64) if quick else (16, 64, 256, 1024)
    for batch in batches:
        src = torch.randperm(kv_layout.num_pages)[:batch].tolist()
        dst = torch.randperm(host_pages)[:batch].tolist()
        nbytes = batch * layout.page_bytes
        dev_flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
        host_flat = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
        plain_d2h = _time(lambda: host_flat.copy_(dev_flat, non_blocking=True), device, repeats)
        plain_h2d = _time(lambda: dev_flat.copy_(host_flat, non_blocking=True), device, repeats)
        store = _time(lambda: runner._copy_pages(to_host=True, pages=src, entries=dst), device, repeats)
        load = _time(lambda: runner._copy_pages(to_host=False, pages=src, entries=dst), device, repeats)
        shape = f"{batch} pages x {layout.page_bytes // 1024} KiB"
        rows.append(_row("StorePages d2h", shape, nbytes, store, plain_d2h))
        rows.append(_row("LoadPages h2d", shape, nbytes, load, plain_h2d))
        del dev_flat, host_flat
    _check_round_trip(runner, kv, host)
    nbytes = layout.state_bytes
    dev_flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host_flat = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
    plain_d2h = _time(lambda: host_flat.copy_(dev_flat, non_blocking=True), device, repeats)
    plain_h2d = _time(lambda: dev_flat.copy_(host_flat, non_blocking=True), device, repeats)
    store = _time(lambda: runner._copy_state(to_host=True, slot=1, entry=2), device, repeats)
    load = _time(lambda: runner._copy_state(to_host=False, slot=3, entry=2), device, repeats)
    shape = f"1 checkpoint x {nbytes / 2**20:.2f} MiB"
    rows.append(_row("StoreState d2h", shape, nbytes, store, plain_d2h))
    rows.append(_row("LoadState h2d", shape, nbytes, load, plain_h2d))
    assert torch.equal(state.recurrent[:, 1], state.recurrent[:, 3]) and torch.equal(state.conv[:, 1], state.conv[:, 3])
    host.release()
    return rows


def _check_round_trip(runner: ModelRunner, kv: KVPool, host: HostPool) -> None:
    """Pages stored and loaded back land bit-exact (a benchmark of a wrong copy is worthless)."""
    src, entries, back = [3, 7, 11], [5, 0, 9], [1, 2, 4]
    runner._copy_pages(to_host=True, pages=src, entries=entries)
    runner._copy_pages(to_host=False, pages=back, entries=entries)
    if kv.k.is_cuda:
        torch.cuda.synchronize()
    assert torch.equal(kv.k[:, src], kv.k[:, back]) and torch.equal(kv.v[:, src], kv.v[:, back])


def _row(op: str, shape: str, nbytes: int, ms: float, plain_ms: float) -> dict:
    row = {"op": op, "shape": shape, "bytes": nbytes, "ms": ms, "gb_s": nbytes / GB / (ms / 1e3),
           "plain_ms": plain_ms, "plain_gb_s": nbytes / GB / (plain_ms / 1e3), "ratio": plain_ms / ms}
    print(f"{op:<16} {shape:<30} {ms:9.3f} ms {row['gb_s']:7.1f} GB/s | plain pinned copy_ "
          f"{plain_ms:9.3f} ms {row['plain_gb_s']:7.1f} GB/s | {100 * row['ratio']:6.1f}% of plain", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="small pools and batches (CPU smoke runs)")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(1)
    rows = run(args.device, args.quick, args.repeats)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "rows": rows}, f,
                      indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
