"""Who created a resource (a shm segment, a run directory), told apart from a reused pid.

A creator is (pid, start time in clock ticks, pid namespace inode): the start
time is /proc/<pid>/stat field 22, so a pid reused by another process does
not pass for the creator; the namespace inode keeps a process in another pid
namespace (a container sharing /dev/shm or /tmp) from being judged dead here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


def process_start_ticks(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot; None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # comm (field 2) may hold spaces and ')', so split after the last ')'.
    fields = raw.rpartition(b")")[2].split()
    if len(fields) < 20 or fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def pid_namespace() -> int:
    """Inode of this process's pid namespace, 0 when /proc does not tell."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def creator_alive(pid: int, start_ticks: int, pid_ns: int) -> bool | None:
    """True/False for a creator in our pid namespace; None when it cannot be judged."""
    ours = pid_namespace()
    if pid_ns and ours and pid_ns != ours:
        return None
    return process_start_ticks(pid) == start_ticks


@dataclass(frozen=True)
class Creator:
    """One process's identity as recorded in the headers and markers it writes."""

    pid: int
    start_ticks: int
    pid_ns: int  # 0 if unknown

    @classmethod
    def of(cls, pid: int) -> Creator | None:
        """The live process `pid` (in this pid namespace); None if it is gone."""
        start = process_start_ticks(pid)
        return None if start is None else cls(pid, start, pid_namespace())

    @classmethod
    def this_process(cls) -> Creator:
        me = cls.of(os.getpid())
        if me is None:
            raise OSError("cannot read this process's start time from /proc")
        return me

    def alive(self) -> bool | None:
        """True/False when it can be judged from here, None for another pid namespace."""
        return creator_alive(self.pid, self.start_ticks, self.pid_ns)

    def same_as(self, pid: int, start_ticks: int) -> bool:
        return (pid, start_ticks) == (self.pid, self.start_ticks)
