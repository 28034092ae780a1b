"""Autotuners compile their configs in parallel (issue 38: the first start on a fresh machine).

A Triton autotuner that meets a new key benchmarks every config one after another, and each config's
first benchmark call compiles it: fla-core's chunked GDN kernels have many configs each, and on a
fresh machine those compiles are most of the prefill warm-up (docs/benchmarks.md, "Start-up time").
`install()` wraps `triton.runtime.autotuner.Autotuner._bench` (fla-core's CachedAutotuner benchmarks
through it) so that, when a benchmark starts, every config is compiled first on a thread pool
(`JITFunction.run(..., warmup=True)`: compiled, written to the compile cache, not launched); the
benchmark then times each config as before, its compiles now cache hits. Which config wins is the
benchmark's choice, unchanged: nothing is timed while the pool runs, and the pool is done before
the first config is timed. A config that fails to compile on the pool is left to the benchmark,
which handles it as it always did (an infinite time).

Threads, not processes: Triton's compile runs ptxas as a subprocess and its passes in native code, and
a thread shares the rank's CUDA context (each sets the rank's device first).
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger(__name__)

_lock = threading.Lock()
_installed: dict[str, object] = {}  # "_bench": the Autotuner._bench this module wrapped


def default_workers() -> int:
    """Compile threads: the cores this process may use, at most 16 (ptxas runs one per thread)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(16, cores))


def _tuning_key(tuner, args: tuple, kwargs: dict) -> tuple:
    """The key Autotuner.run looks its cache up by (the same computation as triton 3.6's)."""
    all_args = {**dict(zip(tuner.arg_names, args)), **kwargs}
    named = {k: v for k, v in all_args.items() if k in tuner.arg_names}
    key = [named[k] for k in tuner.keys if k in named]
    key += [str(v.dtype) for v in named.values() if hasattr(v, "dtype")]
    return tuple(key)


def precompile(tuner, configs: list, args: tuple, kwargs: dict, workers: int, set_device=None) -> int:
    """Compile each of `configs` of `tuner` for this call (`kwargs` as the autotuner's benchmark passes
    them), `workers` at a time; returns how many compiled. set_device: run first in each worker thread."""

    def compile_one(config) -> bool:
        if set_device is not None:
            set_device()
        try:
            tuner.fn.run(*args, **{**kwargs, **config.all_kwargs(), "warmup": True})
        except Exception as exc:  # the benchmark meets it again and handles it
            log.debug("precompiling %s with %s failed: %s", getattr(tuner.base_fn, "__name__", "?"), config, exc)
            return False
        return True

    if not configs:
        return 0
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(configs))), thread_name_prefix="hkv-compile") as pool:
        return sum(pool.map(compile_one, configs))


def install(workers: int | None = None, device: int | None = None) -> None:
    """Wrap Autotuner._bench for this process (idempotent): a benchmark's first config call compiles
    all of its configs in parallel first. An autotuner that finds its result in the compile cache
    (TRITON_CACHE_AUTOTUNING, a restart) benchmarks nothing and so compiles nothing more. device: the
    CUDA device index the compile threads set (a rank's own GPU under --tp); None leaves their default."""
    from triton.runtime.autotuner import Autotuner

    workers = workers or default_workers()
    with _lock:
        if "_bench" in _installed:
            return
        original = Autotuner._bench

        def set_device() -> None:
            import torch

            torch.cuda.set_device(device)

        def _bench(self, *args, config, **meta):
            done_keys = self.__dict__.setdefault("_hkv_precompiled", set())  # keys whose benchmark compiled
            key = _tuning_key(self, args, meta)
            if key not in done_keys:
                done_keys.add(key)
                configs = self.prune_configs(meta)  # run() set self.nargs: the list its benchmark walks
                done = precompile(self, configs, args, meta, workers, set_device if device is not None else None)
                log.debug("%s: %d of %d configs compiled in parallel before its benchmark",
                          getattr(self.base_fn, "__name__", "?"), done, len(configs))
            return original(self, *args, config=config, **meta)

        Autotuner._bench = _bench
        _installed["_bench"] = original
    log.info("autotuners compile their configs on %d threads before benchmarking them", workers)


def uninstall() -> None:
    """Put Autotuner._bench back (tests)."""
    from triton.runtime.autotuner import Autotuner

    with _lock:
        original = _installed.pop("_bench", None)
        if original is not None:
            Autotuner._bench = original
