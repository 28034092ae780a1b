"""Issue 16, acceptance 2 and item 6: kill -9 of the whole process tree, then a restart under the same
name and port, cycle after cycle: every start succeeds, no key is on disk or on a command line, and
after a clean stop no segment and no run directory is left.

HKV_RESTART_CYCLES sets the cycle count: 2 in CI; the acceptance run uses 20
(`HKV_RESTART_CYCLES=20 pytest tests/e2e/test_restart_cycles.py`, about 3 minutes on 2 cores).
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request

import pytest

from tests.e2e.harness import children_of, cmdline, free_port, launch, process_alive, run_dirs, shm_segments

pytestmark = pytest.mark.e2e
CYCLES = int(os.environ.get("HKV_RESTART_CYCLES", "2"))
KEY = "cycle-key-0123456789"


def _tree(pid: int) -> list[int]:
    out = [pid]
    for child in children_of(pid):
        out += _tree(child)
    return out


def _completion(server) -> dict:
    req = urllib.request.Request(f"{server.url}/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2}).encode(),
                                 {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def _no_key_anywhere(server, tree: list[int]) -> None:
    for pid in tree:
        assert KEY not in " ".join(cmdline(pid))
    run_dir = server.run_dir()
    for name in os.listdir(run_dir):
        path = os.path.join(run_dir, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                assert KEY.encode() not in f.read(), name


def test_kill_9_of_everything_and_restart_under_the_same_name(tmp_path):
    key_file = tmp_path / "api-key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    port, name = free_port(), f"r{os.getpid()}"
    args = ["--model", "tiny-dense", "--api-key-file", str(key_file)]
    started = time.monotonic()
    for cycle in range(CYCLES):
        server = launch(args, tmp_path, port=port, name=name)
        assert _completion(server)["usage"]["completion_tokens"] == 2
        tree = _tree(server.proc.pid)
        assert len(tree) >= 5  # launcher, rank, router, api, the api's tokenizer
        _no_key_anywhere(server, tree)
        if cycle == 0:
            assert len(run_dirs(name)) == 1
        for pid in tree:
            os.kill(pid, signal.SIGKILL)
        server.proc.wait(10)
        deadline = time.monotonic() + 10
        while any(process_alive(p) for p in tree):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert shm_segments(name) and len(run_dirs(name)) == 1  # left behind; the next start sweeps them
    server = launch(args, tmp_path, port=port, name=name)
    assert len(run_dirs(name)) == 1 and _completion(server)
    tree = _tree(server.proc.pid)
    assert server.stop() == 0, server.log()
    deadline = time.monotonic() + 10
    while any(process_alive(p) for p in tree):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert shm_segments(name) == [] and run_dirs(name) == []
    print(f"\n{CYCLES} kill -9 cycles and a clean stop in {time.monotonic() - started:.0f} s")
