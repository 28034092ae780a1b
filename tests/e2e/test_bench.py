"""Issue 11: `hkv-bench --small` against a real CPU server on tiny-hybrid-random reports every metric, sanely.

The bench runs as a real subprocess: the console script beside this Python,
or `python -m tools.hkv_bench` where the editable install predates the entry point.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.harness import assert_clean, launch

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
BENCH = Path(sys.executable).with_name("hkv-bench")
# --small: 2 groups x 4 prompts of 256 system + 16 question tokens, 8 output tokens each
REQUESTS, PROMPT_LEN, OUTPUT_LEN = 8, 272, 8
IDEAL_RATE = 6 * 256 / (REQUESTS * PROMPT_LEN)


def _bench_command() -> list[str]:
    return [str(BENCH)] if BENCH.exists() else [sys.executable, "-m", "tools.hkv_bench"]


def _run_tool(tmp_path: Path, flags: list[str], command) -> tuple[str, dict]:
    """A fresh tiny-hybrid-random server with `flags`, the tool `command(server, json_path)` run against it
    as a subprocess; its stdout (printed) and its JSON report."""
    server = launch(["--model", "tiny-hybrid-random", *flags], tmp_path)
    pids = server.actor_pids()
    out = tmp_path / "report.json"
    try:
        proc = subprocess.run(command(server, out), cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{server.log()}"
    finally:
        code = server.stop(signal.SIGTERM)
    assert code == 0, server.log()
    assert_clean(server, pids)
    print(proc.stdout)
    return proc.stdout, json.loads(out.read_text())


def _run_small(tmp_path: Path) -> dict:
    """hkv-bench --small against a fresh tiny-hybrid-random server; its JSON report (the table is printed)."""
    stdout, report = _run_tool(tmp_path, [], lambda server, out: [
        *_bench_command(), "--small", "--url", server.url, "--json", str(out), "--no-progress"])
    assert "hit rate measured / ideal" in stdout
    return report


def test_small_run_reports_every_metric(tmp_path):
    report = _run_small(tmp_path)
    assert report["requests"] == {"sent": REQUESTS, "completed": REQUESTS, "failed": 0, "first_error": None,
                                  "output_tokens": REQUESTS * OUTPUT_LEN,
                                  "expected_output_tokens": REQUESTS * OUTPUT_LEN}
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        stats = report["latency"][key]
        assert 0 < stats["median"] <= stats["p99"] and stats["mean"] > 0, key
    tput = report["throughput"]
    assert all(tput[k] > 0 for k in ("duration_s", "requests_per_s", "input_tokens_per_s", "output_tokens_per_s",
                                     "total_tokens_per_s"))

    cache = report["cache"]
    assert cache["prompt_tokens"] == REQUESTS * PROMPT_LEN
    assert cache["ideal_rate"] == pytest.approx(IDEAL_RATE)
    assert 0 <= cache["measured_rate"] <= cache["ideal_rate"] + 1e-9
    assert set(cache["per_tier"]) == {"gpu", "cpu", "disk", "peer"}
    assert sum(t["tokens"] for t in cache["per_tier"].values()) == cache["cached_tokens"]

    server = report["server"]
    assert server["steps"] > 0 and 0 < server["forward_seconds_mean"] <= server["step_seconds_mean"]
    assert server["generation_tokens"] == REQUESTS * OUTPUT_LEN
    assert server["cache_hit_tokens"]["gpu"] == cache["per_tier"]["gpu"]["tokens"]
    assert report["speculative"] is None and report["baseline"] is None


def test_bench_burst_lands_its_burst_in_one_step(tmp_path):
    """tools/bench/bench_burst against a CPU server: each round's burst waits for one prefill of its prefix."""
    _, report = _run_tool(tmp_path, ["--chunked-prefill-size", "4096"], lambda server, out: [
        sys.executable, "-m", "tools.bench.bench_burst", "--url", server.url, "--rank-pid",
        str(server.actor_pid("hkv.actors.rank")), "--requests", "3", "--shared", "512", "--own", "16", "--output", "4",
        "--rounds", "2", "--gather-s", "0.5", "--json", str(out)])
    rounds = report["rounds"]
    assert len(rounds) == 2
    for r in rounds:  # the cache is flushed before each round, so both find nothing but what the burst made
        assert sorted(r["cached_tokens"]) == [0, 512, 512] and r["prefix_waits"] == 2, r
        assert r["hit_rate"] == r["ideal_hit_rate"] and 0 < r["ttft_ms"]["median"] <= r["ttft_ms"]["max"], r
