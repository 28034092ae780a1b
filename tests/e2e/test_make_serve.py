"""Issue 2, acceptance 3: `make serve` starts the server and a curl completion streams.

Runs the Makefile's serve target with this test run's virtual environment (its
set-up stamp is fresh, so nothing is reinstalled) on a free port.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.e2e.harness import free_port, shm_segments

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed on this machine")
def test_make_serve_then_curl_streams(tmp_path):
    venv = Path(sys.prefix)
    if not (venv / ".installed").exists():
        pytest.skip("this test runs inside the venv that `make test` set up (no .installed stamp here)")
    port, name = free_port(), f"mk{os.getpid()}"
    proc = subprocess.Popen(
        ["make", "-s", "-C", str(ROOT), "serve", f"VENV={venv}",
         f"SERVE_ARGS=--port {port} --name {name} --device cpu"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    lines, ready = [], threading.Event()

    def pump():
        for line in proc.stdout:
            lines.append(line)
            if "serving" in line:
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        assert ready.wait(180) and proc.poll() is None, "".join(lines)
        curl = subprocess.run(
            ["curl", "-sN", "-m", "60", f"http://127.0.0.1:{port}/v1/completions",
             "-H", "Content-Type: application/json",
             "-d", '{"prompt": "Hello", "max_tokens": 8, "stream": true}'],
            capture_output=True, text=True, timeout=90,
        )
        events = [ln for ln in curl.stdout.splitlines() if ln.startswith("data: ")]
        assert len(events) >= 2 and events[-1] == "data: [DONE]", curl.stdout
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    deadline = time.monotonic() + 20
    while shm_segments(name) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not shm_segments(name)
