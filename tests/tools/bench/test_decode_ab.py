"""tools/bench/decode_ab.py's CPU side: the per-step kernel table, the B1 graph row of either bench_decode's JSON
(025c52e's rows carry no kv_dtype and come with eager ones), the kernel diff and the summary of a results folder."""

from __future__ import annotations

import json

import pytest

from tools.bench import decode_ab
from tools.bench.decode_ab import bench_decode_name, graph_step_ms, kernel_diff, per_step_table, summary_lines


def _decode_doc(step_ms: float, old: bool) -> dict:
    """A `bench_decode --moe --batches 1 --json` document: 025c52e's (graphs and eager, no kv_dtype) or HEAD's."""
    if old:
        rows = [{"graphs": True, "batch": 1, "step_ms": step_ms}, {"graphs": False, "batch": 1, "step_ms": 9.0}]
    else:
        rows = [{"graphs": True, "batch": 1, "kv_dtype": "fp8_e4m3", "step_ms": 7.0},
                {"graphs": True, "batch": 1, "kv_dtype": "bfloat16", "step_ms": step_ms}]
    return {"copy_bandwidth": 3e12, "params": 7, "context": 576, "rows": rows}


def _kernels_doc(step_ms: float, by_kernel: dict) -> dict:
    return {"module": "x", "step_ms": step_ms, "kernels": 60, "h2d_copies": 1, "gpu_busy_ms": 0.41,
            "wall_ms": 0.9, "steps": 20, "by_kernel": by_kernel}


def _write(path, doc) -> None:
    path.write_text(json.dumps(doc), encoding="utf-8")


def test_per_step_table_counts_launches_and_time_per_step():
    events = [("gemm", 10.0), ("attn", 4.0), ("gemm", 12.0), ("gemm", 10.0), ("gemm", 12.0)]
    assert per_step_table(events, 2) == {"gemm": [2.0, 22.0], "attn": [0.5, 2.0]}


def test_graph_step_is_the_b1_graph_row_with_bf16_kv_in_either_format():
    assert graph_step_ms(_decode_doc(0.61, old=True)) == 0.61
    assert graph_step_ms(_decode_doc(0.64, old=False)) == 0.64
    with pytest.raises(ValueError, match="found 0"):
        graph_step_ms({"rows": [{"graphs": False, "batch": 1, "step_ms": 9.0}]})


def test_kernel_diff_keeps_changed_counts_and_times_past_both_thresholds():
    base = {"same": [1.0, 100.0], "noise": [4.0, 40.0], "slower": [4.0, 40.0], "count": [2.0, 3.0], "gone": [1.0, 5.0]}
    head = {"same": [1.0, 100.0], "noise": [4.0, 43.9], "slower": [4.0, 50.0], "count": [3.0, 3.0], "new": [1.0, 1.0]}
    got = kernel_diff(base, head)
    assert [name for name, _, _ in got] == ["slower", "gone", "new", "count"]
    assert got[1] == ("gone", [1.0, 5.0], [0.0, 0.0])


def test_summary_of_a_folder(tmp_path):
    for r, (b, h) in enumerate([(0.62, 0.60), (0.64, 0.66), (0.63, 0.65)], start=1):
        _write(tmp_path / f"decode_base_{r}.json", _decode_doc(b, old=True))
        _write(tmp_path / f"decode_head_{r}.json", _decode_doc(h, old=False))
    _write(tmp_path / "decode_base_10.json", _decode_doc(0.70, old=True))  # rounds sort by number, not text
    _write(tmp_path / "kernels_base.json", _kernels_doc(0.63, {"a": [1.0, 100.0], "b": [4.0, 20.0]}))
    _write(tmp_path / "kernels_head.json", _kernels_doc(0.65, {"a": [1.0, 100.5], "b": [4.0, 30.0], "c": [1.0, 2.5]}))
    assert summary_lines(str(tmp_path)) == [
        "decode base: graph step per round 0.620 0.640 0.630 0.700 ms (median 0.635)",
        "decode head: graph step per round 0.600 0.660 0.650 ms (median 0.650)",
        "decode head / base: 1.024",
        "profile base: step 0.630 ms; 60 kernels, 1 H2D, GPU busy 0.410 of 0.900 ms; over 20 steps 5.0 kernels and "
        "120.0 us a step",
        "profile head: step 0.650 ms; 60 kernels, 1 H2D, GPU busy 0.410 of 0.900 ms; over 20 steps 6.0 kernels and "
        "133.0 us a step",
        "kernels that differ per step (launches, us: base -> head): 2",
        "  4.00 -> 4.00      20.0 ->     30.0 us  b",
        "  0.00 -> 1.00       0.0 ->      2.5 us  c",
    ]


def test_summary_without_profiles_or_one_tree(tmp_path):
    _write(tmp_path / "decode_head_1.json", _decode_doc(0.6, old=False))
    assert summary_lines(str(tmp_path)) == ["decode head: graph step per round 0.600 ms (median 0.600)"]


def test_the_bench_decode_of_a_tree_before_and_after_the_tools_split(tmp_path):
    """The base tree (025c52e) has tools/bench_decode.py and no tools/bench/ package."""
    old, new = tmp_path / "old" / "tools", tmp_path / "new" / "tools"
    old.mkdir(parents=True)
    (new / "bench").mkdir(parents=True)
    (old / "bench_decode.py").write_text("", encoding="utf-8")
    (new / "bench" / "bench_decode.py").write_text("", encoding="utf-8")
    assert bench_decode_name(str(old)) == "tools.bench_decode"
    assert bench_decode_name(str(new)) == "tools.bench.bench_decode"
    assert decode_ab._bench_decode().__name__ == "tools.bench.bench_decode"  # this tree's
