"""Issue 38, item 1: a start-up says what it does, and probes answer while it does it.

- the launcher prints each start-up phase of the rank on stderr, in order, with its parts and seconds;
- while the ranks start, /health is 200, /ready 503 with `starting` and the phase, generation 503;
- a signal during start-up stops every actor and exits 0; a rank that dies then stops the rest, exit 1.

$HKV_STARTUP_STALL_S holds the rank inside its weights phase, so the tests see the instance starting.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.error
import urllib.request

import pytest

from tests.e2e.harness import assert_clean, spawn

pytestmark = pytest.mark.e2e


def _get(url: str) -> tuple[int, dict] | None:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    except OSError:
        return None  # not listening yet


def _wait_starting(server, phase: str = "loading weights", timeout: float = 60.0) -> dict:
    """The /ready body once it reports the instance starting in `phase`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert server.proc.poll() is None, server.log()
        answer = _get(f"{server.url}/ready")
        if answer is not None and answer[0] == 503 and phase in (answer[1].get("phase") or ""):
            return answer[1]
        time.sleep(0.05)
    raise AssertionError(f"/ready never reported {phase!r}\n{server.log()}")


def _launcher_lines(server) -> list[str]:
    return [line for line in server.log().splitlines() if line.startswith("hkv-launch:")]


def test_start_up_phases_are_printed_in_order_and_probes_answer_meanwhile(tmp_path):
    compile_dir = tmp_path / "kernels"
    server = spawn(["--compile-cache-dir", str(compile_dir)], tmp_path,  # the built-in model, tiny-hybrid
                   env={"HKV_STARTUP_STALL_S": "4"})
    try:
        body = _wait_starting(server)
        assert body["starting"] is True and body["ready"] is False
        assert re.fullmatch(r"rank0: loading weights \(\d+/\d+ tensors, \d+\.\d s\)", body["phase"]), body
        assert _get(f"{server.url}/health") == (200, {"status": "ok"})
        req = urllib.request.Request(f"{server.url}/v1/completions", json.dumps({"prompt": "x"}).encode(),
                                     {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=10)
        error = json.loads(refused.value.read())["error"]
        assert refused.value.code == 503 and error["code"] == "not_ready"
        assert error["message"].startswith("the server is starting (rank0: loading weights")
        assert server.ready.wait(120) and server.proc.poll() is None, server.log()
        status, body = _get(f"{server.url}/ready")
        assert status == 200 and (body["starting"], body["phase"]) == (False, None)
        pids = server.actor_pids()
    finally:
        code = server.stop(signal.SIGTERM)
    assert code == 0, server.log()
    assert_clean(server, pids)
    lines = _launcher_lines(server)
    progress = [line.removeprefix("hkv-launch: rank0: ") for line in lines if line.startswith("hkv-launch: rank0:")]
    # a loaded machine may take over LINE_GAP_S to read the weights before the hold: the phase then reports a
    # quarter on the way (hkv/engine/startup.py), a line this test does not count; the last before the hold stays
    tick = re.compile(r"loading weights \(\d+/\d+ tensors, \d+\.\d s\)")
    progress = [line for line, after in zip(progress, [*progress[1:], ""])
                if not (tick.fullmatch(line) and tick.fullmatch(after))]
    expected = [
        r"loading weights \(0/(\d+) tensors\)",
        r"loading weights \((\d+)/\1 tensors, \d+\.\d s\)",  # where the stall holds it: every tensor read
        r"loading weights: done in (\d+\.\d) s \((\d+)/\2 tensors\)",
        r"allocating the state pool",
        r"allocating the state pool: done in \d+\.\d s",
        r"allocating the KV pool",
        r"allocating the KV pool: done in \d+\.\d s",
    ]
    assert len(progress) == len(expected), lines
    for line, pattern in zip(progress, expected):
        assert re.fullmatch(pattern, line), (line, pattern)
    assert float(re.fullmatch(expected[2], progress[2]).group(1)) >= 4.0  # the phase's time includes the stall
    assert lines[-1] == "hkv-launch: drained and stopped"
    assert compile_dir.stat().st_mode & 0o777 == 0o700  # (CPU ranks compile nothing into it)


def test_sigterm_during_start_up_stops_every_actor_and_exits_0(tmp_path):
    server = spawn(["--model", "tiny-dense"], tmp_path, env={"HKV_STARTUP_STALL_S": "120"})
    try:
        _wait_starting(server)
        pids = server.actor_pids()
        stopped = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(30)
    finally:
        server.stop(signal.SIGKILL)
    assert code == 0 and time.monotonic() - stopped < 10, server.log()  # the rank stops at once, not in 120 s
    assert_clean(server, pids)
    assert _launcher_lines(server)[-1] == "hkv-launch: stopped during start-up"
    assert "Traceback" not in server.log()


def test_a_rank_dying_during_start_up_stops_the_rest_and_exits_1_with_one_line(tmp_path):
    server = spawn(["--model", "tiny-dense"], tmp_path, env={"HKV_STARTUP_STALL_S": "120"})
    try:
        _wait_starting(server)
        pids = server.actor_pids()
        os.kill(server.actor_pid("hkv.actors.rank"), signal.SIGKILL)
        code = server.proc.wait(30)
    finally:
        server.stop(signal.SIGKILL)
    assert code == 1, server.log()
    assert_clean(server, pids)
    failures = [line for line in _launcher_lines(server) if "failed to start" in line or "stopped" in line]
    assert failures == ["hkv-launch: failed to start: rank0 exited with code -9"], server.log()
    assert _launcher_lines(server)[-1] == failures[0]
