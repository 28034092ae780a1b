"""tools/bench/tp_report.py: issue 41's tables from hkv-bench reports and step profiles, both written here by their
own producers (tools/hkv_bench.build_report, hkv/engine/step_profile.summarize), so the shapes are the real ones."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from hkv.engine.step_profile import summarize
from tools.bench.bench_client import RequestResult
from tools.bench.tp_report import main, report
from tools.hkv_bench import Run, build_report

TOKENS = 5  # output tokens of every synthetic request


def _bench_json(folder: Path, name: str, itl_s: float, duration_s: float, requests: int = 4, failed: int = 0):
    """An hkv-bench report of `requests` requests of TOKENS tokens, one every itl_s after the first (TPOT and median
    ITL are itl_s), in a timed phase of duration_s; the last `failed` requests failed."""
    results = []
    for i in range(requests):
        result = RequestResult(prompt=[16 + i] * 8, sent_at=0.0)
        if i >= requests - failed:
            result.error = "HTTP 503: engine_failed"
        else:
            result.events = [(0.5 + k * itl_s, 1) for k in range(TOKENS)]
            result.output = [20 + k for k in range(TOKENS)]
            result.finished_at = result.events[-1][0]
            result.usage = {"prompt_tokens": 8, "completion_tokens": TOKENS}
        results.append(result)
    run = Run(model={"id": "bench"}, workload={"name": "random"}, results=results, started=0.0, ended=duration_s,
              metrics_before=None, metrics_after=None)
    args = argparse.Namespace(url="http://127.0.0.1:8100", vocab=1024, vocab_source="default", seed=0,
                              concurrency=requests, request_rate=float("inf"), warmup=2, page_size=16, no_flush=False,
                              output_len=TOKENS)
    (folder / f"{name}.json").write_text(json.dumps(build_report(args, run), indent=2))


def _profile_json(folder: Path, rank: int, tp: int, rows: int, comm_us: float, names: tuple[str, ...] = ()):
    """A rank's 16-step profile: 3 ms wall a step, 2 ms busy of which comm_us / 1000 collectives."""
    steps = 16
    gemm, *others = names or ("gemm",)
    events = [(f"ncclDevKernel_AllReduce_Sum_f32_RING_LL_{rank}", comm_us * steps),
              (gemm, (1200 - 100 * len(others)) * steps), ("gdn_recurrent", (800 - comm_us) * steps)]
    events += [(name, 100 * steps) for name in others]
    doc = {"rank": rank, "tp": tp, "rows": rows, "device": "cuda", **summarize(events, steps, 3e-3 * steps)}
    path = folder / f"prof_bench_tp{tp}" / f"profile_rank{rank}_rows{rows}.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))


def _row(text: str, start: str) -> list[str]:
    """The cells of the one line of `text` that starts with `start`."""
    [line] = [line for line in text.splitlines() if line.startswith(start)]
    return [cell.strip() for cell in line.strip("|").split("|")]


def _tables(text: str) -> tuple[str, str]:
    """(the served table's part of a report, the profiled steps' part): their rows start alike."""
    served, profiled = text.split("Decode steps under the profiler")
    return served, profiled


def test_served_figures_and_speed_ups_against_tp1(tmp_path):
    _bench_json(tmp_path, "tp_bench_tp1_c1", itl_s=0.004, duration_s=2.0)  # 20 tokens in 2 s
    _bench_json(tmp_path, "tp_bench_tp2_c1", itl_s=0.0025, duration_s=1.0)
    _bench_json(tmp_path, "tp_bench_tp2_c32", itl_s=0.002, duration_s=0.5, requests=64)
    text, _ = _tables(report(tmp_path, "bench", [1, 2, 4], [1, 32], [1]))
    assert _row(text, "| 1 | 1 |") == ["1", "1", "4.000 ms", "4.000 ms", "10.0", "1.00x", "1.00x"]
    # tokens/s: 20 / 10; median ITL: 4 ms / 2.5 ms
    assert _row(text, "| 1 | 2 |") == ["1", "2", "2.500 ms", "2.500 ms", "20.0", "2.00x", "1.60x"]
    assert _row(text, "| 1 | 4 |") == ["1", "4", "not run", "", "", "", ""]
    # no tp 1 at c = 32: no speed-up, the figures still shown (320 tokens in 0.5 s)
    assert _row(text, "| 32 | 2 |") == ["32", "2", "2.000 ms", "2.000 ms", "640.0", "-", "-"]
    assert _row(text, "| 32 | 1 |")[2] == "not run"
    assert "failed" not in text


def test_failed_requests_are_named_under_the_table(tmp_path):
    _bench_json(tmp_path, "tp_bench_tp2_c1", itl_s=0.004, duration_s=1.0, failed=1)
    text, _ = _tables(report(tmp_path, "bench", [1, 2], [1], [1]))
    assert _row(text, "| 1 | 2 |")[4] == "15.0"  # the 3 requests that finished
    assert "- tp 2, c = 1: 1 of 4 requests failed, first: HTTP 503: engine_failed" in text


def test_profiled_steps_give_wall_busy_and_the_collectives_share_of_every_rank(tmp_path):
    long_name = "void cutlass::Kernel2<cutlass_80_tensorop|bf16_s16816gemm_relu_bf16_256x128_32x3_nn_align8>(Params)"
    _profile_json(tmp_path, 0, 2, 64, comm_us=300, names=(long_name, "rms_norm", "silu"))
    _profile_json(tmp_path, 1, 2, 64, comm_us=500)
    _profile_json(tmp_path, 0, 2, 1, comm_us=200)  # rank 1's window never finished
    _, text = _tables(report(tmp_path, "bench", [1, 2], [1], [1, 32, 64]))
    row = _row(text, "| 2 | 64 |")
    assert row[:7] == ["2", "64", "3.000 ms", "2.000 ms", "0.300 ms", "15.0%", "25.0%"]
    # rank 0's top 3 by time a step: the long GEMM name cut, a '|' that would split the cell replaced
    assert row[7] == (f"`{long_name[:60].replace('|', '/')}...` 1.000; `gdn_recurrent` 0.500; "
                      "`ncclDevKernel_AllReduce_Sum_f32_RING_LL_0` 0.300")
    assert _row(text, "| 2 | 1 |")[5:7] == ["10.0%", "10.0% (1 of 2 ranks)"]
    assert _row(text, "| 2 | 32 |")[2] == "not run"
    assert _row(text, "| 1 | 64 |")[2] == "not run"


def test_an_unreadable_file_is_named_and_the_rest_still_shows(tmp_path):
    _bench_json(tmp_path, "tp_bench_tp1_c1", itl_s=0.004, duration_s=2.0)
    (tmp_path / "tp_bench_tp2_c1.json").write_text('{"latency": ')  # cut short
    (tmp_path / "tp_bench_tp4_c1.json").write_text('{"rank": 0}')  # another format
    _profile_json(tmp_path, 0, 2, 1, comm_us=200)
    (tmp_path / "prof_bench_tp2" / "profile_rank1_rows1.json").write_text("[]")
    served, profiled = _tables(report(tmp_path, "bench", [1, 2, 4], [1], [1]))
    assert _row(served, "| 1 | 1 |")[4] == "10.0"
    assert _row(served, "| 1 | 2 |")[2].startswith("unreadable: tp_bench_tp2_c1.json: Expecting value")
    assert _row(served, "| 1 | 4 |")[2] == "unreadable: tp_bench_tp4_c1.json: no 'latency' (not an hkv-bench report)"
    assert _row(profiled, "| 2 | 1 |")[2] == "unreadable: profile_rank1_rows1.json: a JSON list, not an object"
    assert _row(profiled, "| 1 | 1 |")[2] == "not run"


def _parity(text: str) -> str:
    """What a report says of the parity test."""
    [line] = [line for line in text.splitlines() if line.startswith("fp32 greedy parity")]
    return line.split(": ", 1)[1]


def test_parity_line_is_the_pytest_summary_of_the_log(tmp_path):
    assert _parity(report(tmp_path, "bench", [1], [1], [1])) == "not run"
    log = tmp_path / "tp_parity_bench.log"
    log.write_text("tests/e2e/test_cuda_tp_bench.py::test_tp_serves_like_transformers PASSED\n"
                   "=================== 1 passed, 2 warnings in 187.21s (0:03:07) ===================\n")
    assert _parity(report(tmp_path, "bench", [1], [1], [1])) == "1 passed, 2 warnings in 187.21s (0:03:07)"
    log.write_text("tests/e2e/test_cuda_tp_bench.py::test_tp_serves_like_transformers \n")  # killed by timeout
    assert _parity(report(tmp_path, "bench", [1], [1], [1])) == "no pytest summary in tp_parity_bench.log (cut short?)"


def test_cli_prints_and_writes_the_markdown(tmp_path, capsys):
    _bench_json(tmp_path, "tp_bench_tp1_c64", itl_s=0.01, duration_s=4.0, requests=128)
    out = tmp_path / "tp_speed_bench.md"
    assert main(["--model-name", "bench", "--dir", str(tmp_path), "--tps", "1,2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed == out.read_text()
    served, profiled = _tables(printed)
    assert _row(served, "| 64 | 1 |")[2:5] == ["10.000 ms", "10.000 ms", "160.0"]
    assert _row(served, "| 1 | 2 |")[2] == "not run"
    assert _row(profiled, "| 2 | 64 |")[2] == "not run"
    with pytest.raises(SystemExit) as exc:
        main(["--model-name", "bench", "--dir", str(tmp_path), "--tps", "1,two"])
    assert exc.value.code == 2 and "a list of sizes" in capsys.readouterr().err
