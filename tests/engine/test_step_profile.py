"""hkv/engine/step_profile.py: which plans a window counts, when it opens and closes, what it reports, with a stand-in
for torch.profiler (the real one runs in tests/e2e/test_step_profile.py)."""

from __future__ import annotations

import json

import pytest
import torch

from hkv.engine.step_profile import SKIP, TRIES, WINDOW, StepProfiler, decode_rows, is_comm, summarize
from hkv.cache.types import SaveCheckpoint
from hkv.ipc.messages import Chunk, StepPlan


def plan(rows: int, prefill: int = 0) -> StepPlan:
    chunks = [Chunk(slot, [7], 10, True) for slot in range(rows)]
    chunks += [Chunk(rows + i, list(range(20)), 0, True) for i in range(prefill)]
    return StepPlan(1, [], chunks, [])


def test_decode_rows_counts_plain_decode_steps_only():
    assert decode_rows(plan(4)) == 4
    assert decode_rows(plan(4, prefill=1)) == 0
    assert decode_rows(StepPlan(1, [], [], [])) == 0
    assert decode_rows(StepPlan(1, [], [Chunk(0, [7, 8, 9], 10, True, drafts=2)], [])) == 0  # a verify chunk
    # a hybrid's rolling checkpoint moves at each page a sequence fills: still its steady decode step
    assert decode_rows(StepPlan(1, [], [Chunk(0, [7], 10, True), Chunk(1, [8], 5, True)], [],
                                [SaveCheckpoint(3, 9, 16)])) == 2


def test_collectives_are_told_by_name():
    assert is_comm("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)")
    assert is_comm("c10d::allreduce_") and is_comm("gloo:all_reduce") and is_comm("c10d::_allgather_base_")
    assert not is_comm("_paged_decode_split_kernel") and not is_comm("sm90_xmma_gemm_bf16bf16_bf16f32")


def test_summarize_reports_per_step_milliseconds_and_the_collectives_share():
    events = [("gemm", 3000.0), ("ncclDevKernel_AllReduce", 1000.0), ("gemm", 1000.0), ("norm", 500.0)]
    report = summarize(events, steps=2, wall_s=0.004)
    assert report["steps"] == 2 and report["wall_ms"] == pytest.approx(2.0)
    assert report["busy_ms"] == pytest.approx(2.75) and report["comm_ms"] == pytest.approx(0.5)
    assert report["comm_share"] == pytest.approx(0.5 / 2.75)
    assert report["top"] == [["gemm", 2.0], ["ncclDevKernel_AllReduce", 0.5], ["norm", 0.25]]


class FakeProf:
    def __init__(self, log: list):
        self.log = log
        log.append("start")

    def __exit__(self, *exc):
        self.log.append("stop")


def profiler(tmp_path, rows=(2, 4)) -> tuple[StepProfiler, list]:
    log: list = []
    prof = StepProfiler(rows, str(tmp_path / "out"), rank=1, tp=2, device=torch.device("cpu"),
                        start=lambda device: FakeProf(log),
                        events=lambda prof, device: [("gemm", 1000.0 * WINDOW), ("c10d::allreduce_", 250.0 * WINDOW)])
    return prof, log


def test_a_window_opens_after_the_skipped_steps_and_closes_before_the_next_launch(tmp_path):
    prof, log = profiler(tmp_path)
    for _ in range(SKIP):
        prof.before_launch(plan(2))
    assert log == []
    for _ in range(WINDOW):
        prof.before_launch(plan(2))
    assert log == ["start"]  # the window holds WINDOW steps, still open
    prof.before_launch(plan(2, prefill=1))  # the next launch, whatever it is, closes a full window
    assert log == ["start", "stop"] and not prof.finished  # 4 rows still to do
    report = json.loads((tmp_path / "out" / "profile_rank1_rows2.json").read_text())
    assert (report["rank"], report["tp"], report["rows"], report["steps"]) == (1, 2, 2, WINDOW)
    assert report["busy_ms"] == pytest.approx(1.25) and report["comm_share"] == pytest.approx(0.2)
    for _ in range(WINDOW * 3):  # a size done is not profiled again
        prof.before_launch(plan(2))
    assert log == ["start", "stop"]


def test_a_step_of_another_kind_abandons_the_window_and_the_size_tries_again(tmp_path):
    prof, log = profiler(tmp_path, rows=(4,))
    for _ in range(SKIP + 3):
        prof.before_launch(plan(4))
    prof.before_launch(plan(3))  # a request finished: another size mid-window
    assert log == ["start", "stop"] and prof.reports == []
    for _ in range(WINDOW):
        prof.before_launch(plan(4))
    prof.idle()  # a full window also ends when the rank goes idle
    assert log == ["start", "stop", "start", "stop"] and prof.finished
    assert [r["rows"] for r in prof.reports] == [4]


def test_a_partial_window_at_idle_is_dropped_and_tries_run_out(tmp_path, caplog):
    prof, log = profiler(tmp_path, rows=(4,))
    for _ in range(SKIP):
        prof.before_launch(plan(4))
    for _ in range(TRIES):
        prof.before_launch(plan(4))
        prof.idle()
    assert prof.finished and prof.reports == [] and log.count("start") == TRIES
    assert "no window of" in caplog.text
    assert not (tmp_path / "out").exists()


def test_an_unwritable_folder_is_logged_not_raised(tmp_path, caplog):
    (tmp_path / "out").write_text("a file where the folder should be")
    prof, _ = profiler(tmp_path, rows=(2,))
    for _ in range(SKIP + WINDOW):
        prof.before_launch(plan(2))
    prof.idle()
    assert prof.finished and len(prof.reports) == 1 and "cannot write" in caplog.text
