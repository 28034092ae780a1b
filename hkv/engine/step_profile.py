"""Served decode steps under the profiler: $HKV_PROFILE_STEPS (decode batch sizes, e.g. `1,32,64`) makes every rank
profile, for each size, WINDOW consecutive decode steps of exactly that many rows, after SKIP of them (graph warm-up,
the first steps of a load). Steps are what a served run replays (CUDA graphs, the rank's own pipelining), which an
in-process bench does not show: the launches between steps, and with `--tp N` the all-reduces of every rank.

A window starts before its first step's launch and ends before the next plan's launch (or when the rank goes idle),
each edge after a device synchronize, so its kernels are exactly its steps'. A plan of another kind (a prefill, a
batch of another size) in the middle abandons the window; the size is tried again at its next step, up to TRIES
windows. What a finished window reports, per step (ms): wall time, busy time (the device's kernels on CUDA, the ops'
self time on a CPU rank), the collectives' part of it (NCCL kernels; gloo and c10d ops on CPU) and the top kernels.
It goes to the rank's log as one line and, with $HKV_PROFILE_DIR, to `profile_rank<r>_rows<n>.json` there
(tools/gpu/gpu_tp_speed.sh reads those). Off (no profiler imported, one attribute test a step) unless set.
"""

from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from hkv.ipc.messages import StepPlan

log = logging.getLogger("hkv.rank")

SKIP = 8  # matching steps let go by before the first window of a size
WINDOW = 16  # consecutive decode steps a window profiles
TRIES = 8  # windows a size may start (a prefill or another batch size mid-window abandons one)
TOP = 15  # kernels (ops on CPU) a report lists
# collectives by event name: NCCL kernels (ncclDevKernel_AllReduce_...), c10d ops and gloo's record functions on CPU
COMM_WORDS = ("nccl", "allreduce", "all_reduce", "allgather", "all_gather", "gloo", "c10d::")


def decode_rows(plan: StepPlan) -> int:
    """The plan's sequences when it is a plain decode step (one sampled token a sequence, no drafts to verify),
    else 0. Its cache copies count as part of it: on a hybrid with the prefix cache every decoding sequence moves
    its rolling checkpoint at each page it fills (a SaveCheckpoint op, docs/cache.md), one step in every 16 at the
    default page size, so a served steady state has them (an admission's loads come with its prefill chunk)."""
    if not plan.chunks:
        return 0
    if any(len(c.token_ids) != 1 or not c.sample or c.drafts or c.checkpoints for c in plan.chunks):
        return 0
    return len(plan.chunks)


def is_comm(name: str) -> bool:
    """An event of a collective (the all-reduces and gathers of tensor parallelism)."""
    lowered = name.lower()
    return any(word in lowered for word in COMM_WORDS)


@dataclass
class _Size:
    """One requested decode batch size's progress."""

    rows: int
    skip: int = SKIP
    tries: int = TRIES
    done: bool = False


@dataclass
class _Window:
    size: _Size
    prof: object  # the running torch.profiler.profile
    started: float  # perf_counter after the opening synchronize
    steps: int = 0


def summarize(events: list[tuple[str, float]], steps: int, wall_s: float) -> dict:
    """A window's report from its (name, self microseconds) events: per step ms of wall, busy and collective time,
    the collectives' share of busy time, and the TOP names by time."""
    by_name: dict[str, float] = defaultdict(float)
    for name, us in events:
        by_name[name] += us
    busy = sum(by_name.values()) / 1e3 / steps
    comm = sum(us for name, us in by_name.items() if is_comm(name)) / 1e3 / steps
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:TOP]
    return {"steps": steps, "wall_ms": wall_s * 1e3 / steps, "busy_ms": busy, "comm_ms": comm,
            "comm_share": comm / busy if busy else 0.0,
            "top": [[name, us / 1e3 / steps] for name, us in top]}


def _events(prof, device: torch.device) -> list[tuple[str, float]]:
    """(name, self microseconds) of the device's kernels (CUDA) or of the ops (CPU) a profile recorded."""
    if device.type == "cuda":
        return [(e.name, e.device_time) for e in prof.events() if e.device_type.name == "CUDA"]
    return [(e.name, e.self_cpu_time_total) for e in prof.events() if e.device_type.name == "CPU"]


def _start_profiler(device: torch.device):
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    prof = profile(activities=activities)
    prof.__enter__()
    return prof


class StepProfiler:
    """The rank's step profiles (module docstring). `before_launch(plan)` before every launch, `idle()` when the rank
    has answered every step and waits for a plan."""

    def __init__(self, rows: tuple[int, ...], folder: str, rank: int, tp: int, device: torch.device,
                 start: Callable[[torch.device], object] = _start_profiler,
                 events: Callable[[object, torch.device], list[tuple[str, float]]] = _events):
        self.sizes = {n: _Size(n) for n in rows}
        self.folder = Path(folder) if folder else None
        self.rank, self.tp, self.device = rank, tp, device
        self._start, self._events = start, events
        self._window: _Window | None = None
        self.reports: list[dict] = []  # finished windows, in order

    @property
    def finished(self) -> bool:
        return all(size.done for size in self.sizes.values())

    def before_launch(self, plan: StepPlan) -> None:
        rows = decode_rows(plan)
        window = self._window
        if window is not None:
            if window.steps == WINDOW:
                self._close(keep=True)
            elif rows == window.size.rows:
                window.steps += 1
                return
            else:
                self._close(keep=False)  # a prefill or another size in the middle: not that size's steady step
        size = self.sizes.get(rows)
        if size is None or size.done:
            return
        if size.skip:
            size.skip -= 1
            return
        size.tries -= 1
        self._sync()
        self._window = _Window(size, self._start(self.device), time.perf_counter(), steps=1)

    def idle(self) -> None:
        """Every launched step is answered and no plan waits: a full window ends here, a partial one is dropped
        (its steps had a gap the served steady state does not have)."""
        if self._window is not None:
            self._close(keep=self._window.steps == WINDOW)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _close(self, keep: bool) -> None:
        window, self._window = self._window, None
        self._sync()
        wall = time.perf_counter() - window.started
        window.prof.__exit__(None, None, None)
        size = window.size
        if not keep:
            if size.tries <= 0:
                size.done = True
                log.warning("step profile: no window of %d consecutive %d-row decode steps after %d tries", WINDOW,
                            size.rows, TRIES)
            return
        size.done = True
        report = {"rank": self.rank, "tp": self.tp, "rows": size.rows, "device": self.device.type,
                  **summarize(self._events(window.prof, self.device), window.steps, wall)}
        self.reports.append(report)
        top = ", ".join(f"{name[:60]} {ms:.3f}" for name, ms in report["top"][:3])
        log.info("step profile, rank %d, %d rows, %d steps: wall %.3f ms, busy %.3f ms, collectives %.3f ms (%.1f%%); "
                 "top: %s", self.rank, size.rows, window.steps, report["wall_ms"], report["busy_ms"],
                 report["comm_ms"], 100 * report["comm_share"], top)
        if self.folder is not None:
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                path = self.folder / f"profile_rank{self.rank}_rows{size.rows}.json"
                path.write_text(json.dumps(report, indent=1), encoding="utf-8")
            except OSError as exc:
                log.warning("step profile: cannot write to %s: %s", self.folder, exc)
