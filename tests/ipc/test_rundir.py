"""Run directories: marked with their creator, swept when it is dead, removed only by it (issue 16, item 6)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hkv.ipc.creator import Creator
from hkv.ipc.rundir import CREATOR_FILE, create_run_dir, read_creator, remove_run_dir, sweep_run_dirs

REPO = Path(__file__).resolve().parents[2]


def _in(parent: Path, monkeypatch) -> None:
    monkeypatch.setenv("TMPDIR", str(parent))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR


def _dead_run_dir(parent: Path) -> str:
    """A run directory made by a child process that exits without removing it."""
    code = "import sys; from hkv.ipc.rundir import create_run_dir; print(create_run_dir(sys.argv[1]))"
    env = {**os.environ, "TMPDIR": str(parent), "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code, "dead"], cwd=REPO, env=env, check=True,
                         capture_output=True, text=True)
    return out.stdout.strip()


def test_a_run_dir_is_private_and_names_its_creator(tmp_path, monkeypatch):
    _in(tmp_path, monkeypatch)
    path = create_run_dir("inst")
    assert Path(path).parent == tmp_path and Path(path).name.startswith("hkv-inst-")
    assert os.stat(path).st_mode & 0o777 == 0o700
    assert read_creator(path) == Creator.this_process()


def test_sweep_removes_only_dead_creators_dirs(tmp_path, monkeypatch):
    _in(tmp_path, monkeypatch)
    dead = _dead_run_dir(tmp_path)
    alive = create_run_dir("alive")
    unmarked = tmp_path / "hkv-unmarked-x"
    unmarked.mkdir()
    foreign = tmp_path / "hkv-foreign-x"
    foreign.mkdir()
    (foreign / CREATOR_FILE).write_text("1 2 3\n")  # another pid namespace: cannot be judged
    garbage = tmp_path / "hkv-garbage-x"
    garbage.mkdir()
    (garbage / CREATOR_FILE).write_text("not a marker")
    assert sweep_run_dirs() == [dead]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [Path(alive).name, "hkv-unmarked-x", "hkv-foreign-x", "hkv-garbage-x"])


def test_remove_run_dir_needs_the_creator(tmp_path, monkeypatch):
    _in(tmp_path, monkeypatch)
    path = create_run_dir("inst")
    me = Creator.this_process()
    assert not remove_run_dir(path, Creator(me.pid, me.start_ticks + 1, me.pid_ns))
    assert os.path.isdir(path)
    assert remove_run_dir(path, me) and not os.path.exists(path)
