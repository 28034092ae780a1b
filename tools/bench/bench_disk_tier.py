"""Benchmark the disk tier (hkv.cache.disk.DiskTier) against plain sequential file I/O.

Workload (defaults, Qwen3.5-9B-like): 512 KiB pages (16 tokens x 32 KiB of
full-attention KV), a 50.25 MiB linear-attention checkpoint on every 16th
page, enough pages for about 1 GiB of payload (256 MiB with --quick). Random
bytes, so a compressing or deduplicating file system cannot flatter either side.

Measured in one run, in one scratch directory:
  write     DiskTier.write of every page (header, crc32, temp file, fsync, rename)
            vs. the baseline: the same buffers written in the same order to one
            file with one fsync at the end.
  read cold DiskTier.read_into of every page (size, header and crc32 checks)
            vs. reading the baseline file back into the same buffers, after
            posix_fadvise(POSIX_FADV_DONTNEED) on every file so both come from
            the device (the residency check with mincore(2) is printed; a
            hypervisor may still cache below the guest).
  read warm the same reads again, from the page cache: the tier's own overhead.
  checksums single-thread GB/s of zlib.crc32 (the format's) and alternatives.

Throughput is payload bytes (kv + checkpoints, no headers) per wall second;
each phase runs --repeat times (baseline then tier, alternating) and the
median is printed, since a shared VM's disk varies by 2x from run to run.

Usage: python -m tools.bench.bench_disk_tier [--quick] [--dir D] [--pages N] [--page-kib K]
           [--state-mib S] [--state-every M] [--repeat R] [--threads T] [--json PATH]
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import mmap
import os
import shutil
import statistics
import tempfile
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from hkv.cache.disk import DiskTier

MIB = 1 << 20


@dataclass(frozen=True)
class Workload:
    pages: int
    page_bytes: int
    state_bytes: int  # 0: no checkpoints
    state_every: int  # a checkpoint at the end of pages M, 2M, ...

    def has_state(self, page: int) -> bool:
        return self.state_bytes > 0 and (page + 1) % self.state_every == 0

    @property
    def payload_bytes(self) -> int:
        checkpoints = sum(self.has_state(i) for i in range(self.pages))
        return self.pages * self.page_bytes + checkpoints * self.state_bytes


@dataclass
class Phase:
    name: str
    baseline_s: list[float]  # one sample per repeat
    tier_s: list[float]
    payload_bytes: int

    def row(self) -> str:
        base_s, tier_s = statistics.median(self.baseline_s), statistics.median(self.tier_s)
        base, tier = self.payload_bytes / base_s / 1e9, self.payload_bytes / tier_s / 1e9
        return f"{self.name:<12}{base_s:>9.3f}{base:>8.2f}{tier_s:>9.3f}{tier:>8.2f}{tier / base:>11.2f}"


def workload_from(args: argparse.Namespace) -> Workload:
    page_bytes, state_bytes = args.page_kib * 1024, round(args.state_mib * MIB)
    pages = args.pages
    if pages is None:
        target = (256 if args.quick else 1024) * MIB
        per_page = page_bytes + (state_bytes / args.state_every if state_bytes else 0)
        pages = max(args.state_every, round(target / per_page))
    return Workload(pages, page_bytes, state_bytes, args.state_every)


def page_keys(n: int) -> list[bytes]:
    return [hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest() for i in range(n)]


def write_baseline(path: str, work: Workload, kv: bytes, state: bytes) -> float:
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for i in range(work.pages):
            _write_all(fd, kv)
            if work.has_state(i):
                _write_all(fd, state)
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def read_baseline(path: str, work: Workload, kv_out: memoryview, state_out: memoryview) -> float:
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        for i in range(work.pages):
            f.readinto(kv_out)
            if work.has_state(i):
                f.readinto(state_out)
    return time.perf_counter() - start


def write_tier(tier: DiskTier, keys: list[bytes], work: Workload, kv: bytes, state: bytes, threads: int,
               latency: dict[bool, list[float]]) -> float:  # fmt: skip
    """Seconds to write every page; appends each call's seconds to latency[has_state]."""

    def one(i: int) -> None:
        with_state = work.has_state(i)
        start = time.perf_counter()
        assert tier.write(keys[i], kv, state if with_state else None) is True
        latency[with_state].append(time.perf_counter() - start)

    return _timed_each(one, work.pages, threads)


def read_tier(tier: DiskTier, keys: list[bytes], work: Workload, threads: int) -> float:
    buffers = threading.local()  # each thread reads into its own buffers, as the worker's would

    def one(i: int) -> None:
        if not hasattr(buffers, "kv"):
            buffers.kv, buffers.state = bytearray(work.page_bytes), bytearray(work.state_bytes)
        with_state = work.has_state(i)
        assert tier.read_into(keys[i], buffers.kv, buffers.state if with_state else None) is with_state

    return _timed_each(one, work.pages, threads)


def _timed_each(fn, n: int, threads: int) -> float:
    start = time.perf_counter()
    if threads == 1:
        for i in range(n):
            fn(i)
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(fn, range(n)))
    return time.perf_counter() - start


def _write_all(fd: int, data) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def drop_from_page_cache(paths: list[str]) -> None:
    """Evict clean (fsynced) pages of these files: the unprivileged stand-in for drop_caches."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_fraction(paths: list[str]) -> float | None:
    """Fraction of these files' pages in the page cache (mincore(2)); None if it cannot be asked."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
        page = os.sysconf("SC_PAGE_SIZE")
        resident = total = 0
        for path in paths:
            size = os.path.getsize(path)
            pages = (size + page - 1) // page
            # ACCESS_COPY: a private writable mapping, so ctypes can take its address; mapping reads nothing.
            with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mapped:
                anchor = ctypes.c_char.from_buffer(mapped)
                vec = (ctypes.c_ubyte * pages)()
                rc = libc.mincore(ctypes.addressof(anchor), size, vec)
                del anchor  # the mapping cannot close while ctypes holds it
                if rc != 0:
                    return None
            resident += sum(v & 1 for v in vec)
            total += pages
        return resident / total if total else 0.0
    except (OSError, AttributeError, ValueError):
        return None


def tier_files(directory: str) -> list[str]:
    return [str(p) for p in Path(directory).glob("??/*.hkvp")]


def checksum_speeds(nbytes: int) -> dict[str, float]:
    """GB/s of each checksum over `nbytes` of random data (best of 3)."""
    data = os.urandom(nbytes)
    candidates = {
        "zlib.crc32 (used)": zlib.crc32,
        "zlib.adler32": zlib.adler32,
        "sha1": lambda b: hashlib.sha1(b).digest(),
        "blake2b": lambda b: hashlib.blake2b(b).digest(),
    }
    candidates.update(_optional_checksums())
    speeds = {}
    for name, fn in candidates.items():
        best = min(_timed(fn, data) for _ in range(3))
        speeds[name] = nbytes / best / 1e9
    return speeds


def _optional_checksums() -> dict:
    """Faster checksums from packages hkv does not depend on, measured only if importable."""
    found = {}
    try:
        import xxhash

        found["xxhash.xxh3_64"] = xxhash.xxh3_64_intdigest
    except ImportError:
        pass
    try:
        import google_crc32c

        found["google_crc32c"] = google_crc32c.value
    except ImportError:
        pass
    return found


def _timed(fn, data) -> float:
    start = time.perf_counter()
    fn(data)
    return time.perf_counter() - start


PHASES = ("write+fsync", "read cold", "read warm")


@dataclass
class Result:
    phases: list[Phase]
    resident: list[float | None]  # page-cache residency before each cold read
    latency_ms: dict[str, float]  # median DiskTier.write call: "page", "page+checkpoint"


def run(work: Workload, scratch: str, repeat: int, threads: int) -> Result:
    kv, state = os.urandom(work.page_bytes), os.urandom(work.state_bytes)
    kv_out, state_out = memoryview(bytearray(work.page_bytes)), memoryview(bytearray(work.state_bytes))
    baseline = os.path.join(scratch, "baseline.bin")
    tier = DiskTier(os.path.join(scratch, "tier"), 2 * work.payload_bytes + MIB, bytes(16), "bench", work.page_bytes,
                    work.state_bytes)  # fmt: skip
    tier.open()
    keys = page_keys(work.pages)
    samples = {name: ([], []) for name in PHASES}  # name -> (baseline seconds, tier seconds)
    latency: dict[bool, list[float]] = {False: [], True: []}
    resident = []
    for _ in range(repeat):
        tier.flush()
        samples["write+fsync"][0].append(write_baseline(baseline, work, kv, state))
        samples["write+fsync"][1].append(write_tier(tier, keys, work, kv, state, threads, latency))
        files = [baseline, *tier_files(tier.directory)]
        drop_from_page_cache(files)
        resident.append(resident_fraction(files))
        for name in ("read cold", "read warm"):
            samples[name][0].append(read_baseline(baseline, work, kv_out, state_out))
            samples[name][1].append(read_tier(tier, keys, work, threads))
    assert tier.stats()["corrupt"] == 0
    phases = [Phase(name, base, tier_s, work.payload_bytes) for name, (base, tier_s) in samples.items()]
    medians = {"page": latency[False], "page+checkpoint": latency[True]}
    return Result(phases, resident, {k: statistics.median(v) * 1e3 for k, v in medians.items() if v})


def report(work: Workload, scratch: str, repeat: int, threads: int, result: Result,
           checksums: dict[str, float]) -> None:  # fmt: skip
    checkpoints = sum(work.has_state(i) for i in range(work.pages))
    print(f"disk tier: {work.pages} pages x {work.page_bytes // 1024} KiB, {checkpoints} checkpoints x "
          f"{work.state_bytes / MIB:.2f} MiB (every {work.state_every}th page); payload "
          f"{work.payload_bytes / MIB:.1f} MiB in {scratch}")  # fmt: skip
    print(f"tier called from {threads} thread(s); each phase's median of {repeat} runs")
    known = [r for r in result.resident if r is not None]
    cached = f"at most {max(known):.1%} resident (mincore)" if known else "residency unknown (no mincore)"
    print(f"cold reads: page cache dropped with posix_fadvise(DONTNEED) after fsync; {cached}")
    print(f"{'':<12}{'base s':>9}{'GB/s':>8}{'tier s':>9}{'GB/s':>8}{'tier/base':>11}")
    for phase in result.phases:
        print(phase.row())
    print("DiskTier.write, median ms per call: " + ", ".join(f"{k} {v:.1f}" for k, v in result.latency_ms.items()))
    print("checksums, GB/s on one core: " + ", ".join(f"{k} {v:.2f}" for k, v in checksums.items()))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", help="parent of the scratch directory (default: the system temp dir)")
    parser.add_argument("--pages", type=int, help="pages to write (default: ~1 GiB of payload, 256 MiB --quick)")
    parser.add_argument("--page-kib", type=int, default=512)
    parser.add_argument("--state-mib", type=float, default=50.25, help="checkpoint size; 0 for none")
    parser.add_argument("--state-every", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="256 MiB of payload and smaller checksum buffers")
    parser.add_argument("--repeat", type=int, default=3, help="runs of every phase; medians are printed")
    parser.add_argument("--threads", type=int, default=1, help="threads calling the tier (the baseline stays 1)")
    parser.add_argument("--json", metavar="PATH", help="also write the results (every sample) as JSON")
    args = parser.parse_args(argv)
    if min(args.pages or 1, args.page_kib, args.state_every, args.repeat, args.threads) < 1 or args.state_mib < 0:
        parser.error("--pages, --page-kib, --state-every, --repeat and --threads must be >= 1; --state-mib >= 0")
    work = workload_from(args)
    scratch = tempfile.mkdtemp(prefix="hkv-bench-disk-", dir=args.dir)
    try:
        result = run(work, scratch, args.repeat, args.threads)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    checksums = checksum_speeds((16 if args.quick else 64) * MIB)
    report(work, scratch, args.repeat, args.threads, result, checksums)
    if args.json:
        out = {"workload": asdict(work), "payload_bytes": work.payload_bytes, "repeat": args.repeat,
               "threads": args.threads, **asdict(result), "checksums_gbps": checksums}  # fmt: skip
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
