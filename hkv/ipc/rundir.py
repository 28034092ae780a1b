"""Private run directories: one per instance, for its ipc:// sockets and config.json.

    $TMPDIR/hkv-<instance>-<random>/     mode 0700, made by the launcher
        creator                           "<pid> <start ticks> <pid ns>": the launcher, written first
        config.json, *.sock

A directory whose creator is dead is an orphan (its launcher was killed, and
with it everything it started). `sweep_run_dirs` removes orphans at start, as
`sweep_orphans` does for shared memory; only directories of this user that
carry a readable creator marker are ever touched, and never one whose creator
lives or runs in another pid namespace.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from hkv.ipc.creator import Creator

RUN_DIR_PREFIX = "hkv-"
CREATOR_FILE = "creator"
_MARKER_MAX = 64  # bytes: three decimal integers


def create_run_dir(instance: str) -> str:
    """A fresh 0700 directory for `instance`, marked as made by this process."""
    path = tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}{instance}-")
    me = Creator.this_process()
    fd = os.open(os.path.join(path, CREATOR_FILE), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"{me.pid} {me.start_ticks} {me.pid_ns}\n")
    return path


def read_creator(path: str) -> Creator | None:
    """The creator a run directory's marker names; None when there is no valid marker."""
    try:
        fd = os.open(os.path.join(path, CREATOR_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        raw = f.read(_MARKER_MAX)
    fields = raw.split()
    if len(fields) != 3 or not all(x.isdigit() for x in fields):
        return None
    pid, start, pid_ns = (int(x) for x in fields)
    return Creator(pid, start, pid_ns) if pid > 0 else None


def remove_run_dir(path: str, creator: Creator) -> bool:
    """Remove `path` if its marker names `creator`; True if it was removed."""
    found = read_creator(path)
    if found is None or not creator.same_as(found.pid, found.start_ticks):
        return False
    shutil.rmtree(path, ignore_errors=True)
    return True


def sweep_run_dirs(parent: str | None = None) -> list[str]:
    """Remove this user's run directories whose creator is dead; returns their paths."""
    parent = parent or tempfile.gettempdir()
    removed: list[str] = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(RUN_DIR_PREFIX) or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
        except OSError:
            continue
        creator = read_creator(entry.path)
        if creator is not None and creator.alive() is False and remove_run_dir(entry.path, creator):
            removed.append(entry.path)
    return removed
