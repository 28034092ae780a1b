"""Shared-memory helpers for tests: unique instance names that clean up, and orphaned segments."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

from hkv.ipc.shm import SHM_DIR, unlink_instance

REPO = Path(__file__).resolve().parents[1]
_names = itertools.count()


def fresh_instance(prefix: str):
    """Yield a fresh instance name; every segment under it is unlinked after (use in a fixture)."""
    name = f"{prefix}{os.getpid()}_{next(_names)}"
    yield name
    unlink_instance(name)
    assert not [f for f in os.listdir(SHM_DIR) if f.startswith(f"hkv-{name}-")]


def make_dead_segment(instance: str, region: str) -> None:
    """Create a segment from a child process that exits without unlinking it."""
    code = ("import sys; from hkv.ipc.shm import ShmRegion; "
            "ShmRegion.create(sys.argv[1], sys.argv[2], 64, 'child')")
    subprocess.run([sys.executable, "-c", code, instance, region], cwd=REPO, check=True)
