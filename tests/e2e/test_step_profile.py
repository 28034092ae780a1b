"""$HKV_PROFILE_STEPS through real processes (hkv/engine/step_profile.py): two gloo ranks of a --tp 2 instance each
profile a window of served one-row decode steps and write its report, the all-reduces' share included (the
variables themselves: tests/test_config.py; the window logic: tests/engine/test_step_profile.py)."""

from __future__ import annotations

import asyncio
import json
import signal

from tests.e2e.harness import assert_clean, launch
from tests.e2e.test_prefix_cache import _body, _complete_all

SKIP, WINDOW = 8, 16  # hkv/engine/step_profile.py's


def test_both_ranks_report_a_window_of_decode_steps_with_their_all_reduces(qwen3_dir, tmp_path):
    out = tmp_path / "profiles"
    server = launch(["--model", str(qwen3_dir), "--tp", "2"], tmp_path,
                    env={"HKV_PROFILE_STEPS": "1,2", "HKV_PROFILE_DIR": str(out)})
    pids = server.actor_pids()
    try:
        # one request alone: its decode steps are one-row steps, SKIP + WINDOW of them and more
        [answer] = asyncio.run(_complete_all(server.url, [_body([5, 6, 7, 8], SKIP + WINDOW + 8)]))
        assert len(answer["choices"][0]["token_ids"]) == SKIP + WINDOW + 8
    finally:
        assert server.stop(signal.SIGTERM) == 0, server.log()
    assert_clean(server, pids)
    reports = [json.loads((out / f"profile_rank{rank}_rows1.json").read_text()) for rank in (0, 1)]
    for rank, report in enumerate(reports):
        assert (report["rank"], report["tp"], report["rows"], report["steps"], report["device"]) == (
            rank, 2, 1, WINDOW, "cpu")
        assert report["wall_ms"] > 0 and report["busy_ms"] > 0
        assert 0 < report["comm_ms"] <= report["busy_ms"], report  # every layer all-reduces across the two ranks
        assert "c10d::allreduce_" in dict(report["top"]), report["top"]  # torch's op for dist.all_reduce
    assert not (out / "profile_rank0_rows2.json").exists()  # no two-row decode step ever ran
    assert "step profile, rank 0, 1 rows" in server.log()



def test_a_hybrid_with_the_prefix_cache_completes_its_windows_through_page_checkpoints(builtin_dir, tmp_path):
    """The trained tiny-hybrid, prefix cache on: two decoding sequences move their rolling checkpoints at every page
    they fill (SaveCheckpoint ops in decode plans), and the profile of two-row steps still completes."""
    from hkv.models.tiny import builtin_folder

    folder = builtin_folder("tiny-hybrid", builtin_dir)
    out = tmp_path / "profiles"
    server = launch(["--model", str(folder), "--page-size", "16"], tmp_path,
                    env={"HKV_PROFILE_STEPS": "2", "HKV_PROFILE_DIR": str(out)})
    pids = server.actor_pids()
    try:
        bodies = [_body([5, 6, 7, 8 + i], SKIP + WINDOW + 24) for i in range(2)]
        answers = asyncio.run(_complete_all(server.url, bodies))
        assert all(len(a["choices"][0]["token_ids"]) == SKIP + WINDOW + 24 for a in answers)
    finally:
        assert server.stop(signal.SIGTERM) == 0, server.log()
    assert_clean(server, pids)
    report = json.loads((out / "profile_rank0_rows2.json").read_text())
    assert (report["rows"], report["steps"], report["tp"]) == (2, WINDOW, 1) and report["comm_ms"] == 0
    assert "no window of" not in server.log()
