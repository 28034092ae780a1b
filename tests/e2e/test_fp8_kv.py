"""FP8 KV pages end to end (issue 39 acceptance 2): with --kv-cache-dtype fp8_e4m3, a device prefix
hit, a CPU-tier hit and a disk-tier hit give exactly the tokens of an FP8-KV instance without
the prefix cache; an instance with model-dtype pages reads none of the FP8 instance's disk pages.

One disk directory lives through the module, in order (tests/e2e/test_tiers.py's pattern).
"""

from __future__ import annotations

import random
import signal
from pathlib import Path

import pytest

from tests.e2e.harness import assert_clean, launch
from tests.e2e.test_prefix_cache import _body, _complete

pytestmark = pytest.mark.e2e
VOCAB = 1536
FP8 = ["--model", "tiny-hybrid-random", "--max-total-tokens", "2048", "--kv-cache-dtype", "fp8_e4m3"]
OUT_TOKENS = 8


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


PROMPT_A, *OTHERS = _prompts(60, [600] * 7)
PROMPT_A30 = PROMPT_A + _prompts(61, [30])[0]
BRANCH = PROMPT_A[:320] + _prompts(62, [20])[0]  # shares A's first 320 tokens


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fp8-disk-tier")


def _serve_all(args: list[str], tmp_path: Path, prompts: list[list[int]]) -> list[dict]:
    server = launch(args, tmp_path)
    pids = server.actor_pids()
    try:
        results = [_complete(server.url, _body(p, OUT_TOKENS)) for p in prompts]
        log = server.log()
    finally:
        assert server.stop(signal.SIGTERM) == 0, server.log()
        assert_clean(server, pids)
    assert "float8_e4m3fn KV, 256 bytes a token" in log or "--kv-cache-dtype" not in " ".join(args), log[-2000:]
    return results


def _tokens(result: dict) -> list[int]:
    return result["choices"][0]["token_ids"]


def _tiers(result: dict) -> tuple[int, int, int]:
    cache = result["usage"]["cache"]
    return cache["gpu"], cache["cpu"], cache["disk"]


@pytest.fixture(scope="module")
def cold(tmp_path_factory) -> dict:
    """Every prompt's tokens from an FP8-KV instance with the prefix cache off."""
    prompts = [PROMPT_A30, BRANCH]
    results = _serve_all([*FP8, "--no-prefix-cache"], tmp_path_factory.mktemp("cold"), prompts)
    assert all(sum(_tiers(r)) == 0 for r in results)
    return {"a30": _tokens(results[0]), "branch": _tokens(results[1])}


def test_1_device_and_cpu_tier_hits_equal_the_cold_fp8_run(cold, disk_dir, tmp_path):
    prompts = [PROMPT_A, *OTHERS, PROMPT_A30, PROMPT_A30, BRANCH]
    results = _serve_all([*FP8, "--cpu-cache-gb", "0.05", "--disk-cache-dir", str(disk_dir)], tmp_path, prompts)
    a30, again, branch = results[-3:]
    gpu, cpu, disk = _tiers(a30)
    assert cpu + disk >= 512, a30["usage"]  # A was pushed off the device by the others
    assert _tokens(a30) == cold["a30"]
    assert _tiers(again)[0] >= 512, again["usage"]  # A30's pages came back to the device: a device hit
    assert _tokens(again) == cold["a30"]
    assert sum(_tiers(branch)) >= 256, branch["usage"]  # a shorter shared prefix, from whichever tier holds it
    assert _tokens(branch) == cold["branch"]
    assert len(list(disk_dir.rglob("*.hkvp"))) >= 37, "the drained stop leaves the stored pages on disk"


def test_2_disk_tier_hit_after_a_restart_equals_the_cold_fp8_run(cold, disk_dir, tmp_path):
    (result,) = _serve_all([*FP8, "--cpu-cache-gb", "0.05", "--disk-cache-dir", str(disk_dir)], tmp_path,
                           [PROMPT_A30])
    assert _tiers(result)[2] >= 512, result["usage"]
    assert _tokens(result) == cold["a30"]


def test_3_model_dtype_pages_never_read_fp8_pages(disk_dir, tmp_path):
    args = ["--model", "tiny-hybrid-random", "--max-total-tokens", "2048", "--cpu-cache-gb", "0.05",
            "--disk-cache-dir", str(disk_dir)]
    (result,) = _serve_all(args, tmp_path, [PROMPT_A30])
    assert _tiers(result) == (0, 0, 0), result["usage"]
