"""Start-up progress: the status-pipe message that reports it and the `startup` block the api reads.

    rank --StartupProgress (status pipe)--> launcher --prints a line
                                               '--writes the latest--> [startup block] --read by--> api /ready

A rank reports each start-up phase (loading weights, sizing the pools, compiling
kernels, capturing each set of CUDA graphs) when it starts, when another
quarter of its parts is done, and when it ends (hkv/engine/startup.py). The
launcher prints one line for each and keeps the latest in the `startup`
json_block, so that `/ready` can say what the instance is doing until it is
ready. Writer: the launcher. Readers: the api (`/ready`, 503 answers).
"""

from __future__ import annotations

import msgspec

from hkv.ipc import json_block

REGION = "startup"
NBYTES = 4096
VERSION = 1  # the block's document layout


class StartupProgress(msgspec.Struct, frozen=True):
    """One phase of an actor's start-up, begun, advanced or ended (a status-pipe line `{"progress": ...}`)."""

    phase: str  # what it does, e.g. "loading weights", "capturing decode graphs"
    done: int = 0  # parts done so far
    total: int = 0  # parts in all; 0: a phase without parts
    unit: str = ""  # what a part is: "tensors", "graphs", "steps"
    elapsed_s: float = 0.0  # seconds since the phase began, as of this report
    ended: bool = False  # the phase is over
    actor: str = ""  # the reporting actor's name ("rank0"): set by the launcher, which knows who wrote it


class StartupBlock(msgspec.Struct, frozen=True):
    """The `startup` block's document: the latest report and when its phase began."""

    progress: StartupProgress
    began_at: float  # time.monotonic() when the phase began (one clock for every process of the host)


def describe(progress: StartupProgress, elapsed_s: float | None = None) -> str:
    """One line of text: "loading weights (120/311 tensors, 2.0 s)", "sizing the KV pool: done in 0.8 s".

    elapsed_s: the phase's age now (the api's live view), else the report's own; a phase just begun shows none.
    """
    p = progress
    seconds = p.elapsed_s if elapsed_s is None else elapsed_s
    parts = f"{p.done}/{p.total} {p.unit}".rstrip() if p.total else ""
    if p.ended:
        return f"{p.phase}: done in {seconds:.1f} s" + (f" ({parts})" if parts else "")
    if elapsed_s is None and p.done == 0:  # the phase's first report
        return f"{p.phase} ({parts})" if parts else p.phase
    return f"{p.phase} ({parts}, {seconds:.1f} s)" if parts else f"{p.phase} ({seconds:.1f} s)"


def write(payload: memoryview, block: StartupBlock) -> None:
    """Launcher only: store the latest report (a report never outgrows the block; one that did is dropped)."""
    json_block.write(payload, msgspec.to_builtins(block))


def read(payload: memoryview) -> StartupBlock | None:
    """The latest report, or None before the first (or while the writer keeps the block busy)."""
    try:
        doc = json_block.read(payload)
        return None if doc is None else msgspec.convert(doc, StartupBlock)
    except (json_block.JsonBlockBusy, msgspec.ValidationError):
        return None
