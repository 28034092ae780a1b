"""Start real `hkv-launch` processes on loopback and tear them down checking for leftovers."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

LAUNCH = str(Path(sys.executable).with_name("hkv-launch"))
READY_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shm_segments(name: str) -> list[str]:
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith(f"hkv-{name}-"))


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1].split()[0] != "Z"
    except OSError:
        return False


def children_of(pid: int) -> list[int]:
    """Direct children of pid (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().split(") ")[-1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(entry))
    return out


def run_dirs(name: str) -> list[str]:
    """Run directories of instance `name` in the temp folder."""
    parent = tempfile.gettempdir()
    return sorted(f for f in os.listdir(parent) if f.startswith(f"hkv-{name}-"))


def cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    name: str
    log_path: Path
    stdout_lines: list[str] = field(default_factory=list)
    ready: threading.Event = field(default_factory=threading.Event)  # the ready line came, or stdout closed

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def actor_pids(self) -> list[int]:
        return children_of(self.proc.pid)

    def actor_pid(self, module: str) -> int:
        """The pid of the actor running `module` (e.g. "hkv.actors.router")."""
        for pid in self.actor_pids():
            if module in cmdline(pid):
                return pid
        raise AssertionError(f"no {module} child of {self.proc.pid}")

    def run_dir(self) -> str:
        """This instance's run directory, from an actor's --config-file argument."""
        args = cmdline(self.actor_pid("hkv.actors.api"))
        return os.path.dirname(args[args.index("--config-file") + 1])

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"hkv-launch did not exit within {timeout} s\n{self.log()}")


def launch(args: list[str], tmp_path: Path, env: dict | None = None, port: int | None = None,
           name: str | None = None) -> Server:
    """Start hkv-launch and wait for its ready line; raises with its log if it fails."""
    server = spawn(args, tmp_path, env, port, name)
    if not server.ready.wait(READY_TIMEOUT_S) or server.proc.poll() is not None:
        server.stop(signal.SIGKILL)
        raise AssertionError(f"hkv-launch did not become ready:\n{''.join(server.stdout_lines)}\n{server.log()}")
    return server


def spawn(args: list[str], tmp_path: Path, env: dict | None = None, port: int | None = None,
          name: str | None = None) -> Server:
    """Start hkv-launch and return at once (`ready` is set at its ready line, or when it exits)."""
    port = port or free_port()
    name = name or f"t{os.getpid()}_{port}"
    log_path = tmp_path / f"hkv-{port}.log"
    log_file = open(log_path, "a")
    proc = subprocess.Popen(
        [LAUNCH, "--port", str(port), "--name", name, "--device", "cpu", *args],
        stdout=subprocess.PIPE,
        stderr=log_file,
        text=True,
        env={**os.environ, **(env or {})},
    )
    server = Server(proc, port, name, log_path)

    def pump():
        for line in proc.stdout:
            server.stdout_lines.append(line)
            if "serving" in line:
                server.ready.set()
        server.ready.set()

    threading.Thread(target=pump, daemon=True).start()
    return server


def assert_clean(server: Server, actor_pids: list[int], timeout: float = 30.0) -> None:
    """Every actor process gone and no shared memory left behind."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(process_alive(p) for p in actor_pids) and not shm_segments(server.name):
            return
        time.sleep(0.2)
    alive = [p for p in actor_pids if process_alive(p)]
    raise AssertionError(f"left behind: processes {alive}, shm {shm_segments(server.name)}\n{server.log()}")


def listening_inodes() -> dict[int, str]:
    """Socket inode -> local address of every TCP socket in LISTEN state (/proc/net/tcp, tcp6)."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":  # TCP_LISTEN
                    out[int(fields[9])] = fields[1]
    return out


def bound_addresses(pids: list[int]) -> list[str]:
    """Local addresses (hex ip:port, as /proc/net/tcp writes them) the processes listen on."""
    listening, out = listening_inodes(), []
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            m = re.fullmatch(r"socket:\[(\d+)\]", target)
            if m and int(m.group(1)) in listening:
                out.append(listening[int(m.group(1))])
    return out
