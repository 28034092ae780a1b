"""Issue 13's workload at a tiny scale on CPU: tools/bench/bench_tier_coverage.py against two tiny-hybrid-random servers.

A 320-token prompt, pushed off a 1,024-token device by 6 and then by 30 other
prompts, comes back whole from the CPU tier (0.02 GiB), and the output equals
the `--no-prefix-cache` server's. The coverage the tool reads from /metrics
and hkv-inspect agree: at rest, every page the CPU tier holds is reachable by
a hit.
"""

from __future__ import annotations

import signal

import pytest

from tests.e2e.harness import assert_clean, launch
from tests.e2e.test_tiers import _settled_inspect
from tools.bench import bench_tier_coverage

pytestmark = pytest.mark.e2e
PROMPT, TAIL = 320, 16


def test_the_evicted_prompt_comes_back_whole_from_the_cpu_tier(tmp_path):
    model = ["--model", "tiny-hybrid-random"]
    server = launch([*model, "--max-total-tokens", "1024", "--cpu-cache-gb", "0.02"], tmp_path)
    baseline = launch([*model, "--max-total-tokens", "1024", "--no-prefix-cache"], tmp_path)
    pids = server.actor_pids() + baseline.actor_pids()
    try:
        args = bench_tier_coverage.parse_args(["--url", server.url, "--baseline-url", baseline.url,
                                               "--prompt-tokens", str(PROMPT), "--others", "6", "30",
                                               "--tail", str(TAIL), "--output-tokens", "4", "--settle-s", "0.5"])
        rounds = bench_tier_coverage.run(args)
        report = _settled_inspect(server.name, lambda r: r["tiers"]["cpu"]["held_tokens"]
                                  == r["tiers"]["cpu"]["reachable_tokens"])
    finally:
        for s in (server, baseline):
            assert s.stop(signal.SIGTERM) == 0, s.log()
    assert_clean(server, pids)
    assert_clean(baseline, [])
    for r in rounds:
        # pages wholly inside prompt[:-1] up to A's prompt-end checkpoint: all of A
        assert r.cache == {"gpu": 0, "cpu": PROMPT, "disk": 0, "peer": 0}, r
        assert r.outputs_equal and r.prompt_tokens == PROMPT + TAIL
        assert r.coverage["cpu"]["held"] >= r.coverage["cpu"]["reachable"] >= (1 + r.others) * PROMPT
        assert r.coverage["gpu"]["held"] >= r.coverage["gpu"]["reachable"]
    cpu = report["tiers"]["cpu"]
    assert cpu["held_tokens"] == cpu["reachable_tokens"] >= rounds[-1].coverage["cpu"]["reachable"]
    assert {"held_tokens", "reachable_tokens", "cached_tokens_served"} <= set(report["tiers"]["gpu"])
    assert report["pools"]["cpu_pages"]["total"] > 0  # the public keys are still there
