"""tools/bench/moe_roofline.py: the decode roofline of an MoE checkpoint, and served results against it."""

from __future__ import annotations

import json

import pytest

from tools.bench.make_bench_model import MOE_DEFAULTS, main as make_model, moe_bench_config, tensor_specs
from tools.bench.moe_roofline import main, roofline_bytes, touched_experts, weight_bytes


def test_full_size_model_gives_the_issues_roofline():
    """Issue 36's table: 0.42 / 1.88 / 2.74 ms at concurrency 1 / 32 / 64 (context 576, ~4.25 TB/s)."""
    config = moe_bench_config(**MOE_DEFAULTS, eot=0, im_end=2)
    specs = tensor_specs(config)
    experts = sum(s.numel for s in specs if ".experts." in s.name) * 2
    other = sum(s.numel for s in specs if ".experts." not in s.name) * 2
    ms = [roofline_bytes(config, other, experts, b, 576) / 4.25e12 * 1e3 for b in (1, 32, 64)]
    assert [round(m, 2) for m in ms] == [0.42, 1.89, 2.75]
    assert touched_experts(512, 10, 1) == pytest.approx(10)
    assert touched_experts(512, 10, 64) == pytest.approx(367.1, abs=0.1)


def test_served_results_against_the_roofline(tmp_path, capsys):
    folder = tmp_path / "moe"
    assert make_model([str(folder), "--moe", "--hidden-size", "64", "--vocab-size", "2048", "--experts", "8",
                       "--experts-per-token", "2", "--moe-intermediate-size", "32",
                       "--shared-expert-intermediate-size", "48", "--no-progress"]) == 0
    other, experts = weight_bytes(folder)
    assert experts == 4 * 8 * 3 * 32 * 64 * 2  # 4 sparse layers of 8 experts, bf16
    report = tmp_path / "c32.json"
    report.write_text(json.dumps({"latency": {"tpot_ms": {"mean": 2.0}, "itl_ms": {"median": 1.0}},
                                  "throughput": {"output_tokens_per_s": 900.0},
                                  "baseline": {"hkv_over_hf": 25.0}}))
    out = tmp_path / "roof.json"
    assert main(["--model", str(folder), "--bandwidth-gbs", "1", "--batches", "1",
                 "--results", f"c32={report}", "--json", str(out)]) == 0
    rows = {r["batch"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {1, 32}
    config = json.loads((folder / "config.json").read_text())
    roof = roofline_bytes(config, other, experts, 32, 576) / 1e9 * 1e3
    assert rows[32]["roofline_ms"] == pytest.approx(roof)
    assert rows[32]["of_roofline_tpot"] == pytest.approx(roof / 2.0)
    assert rows[32]["of_roofline_itl"] == pytest.approx(roof / 1.0)
    assert "25.0x HF" in capsys.readouterr().out


def test_a_dense_checkpoint_counts_every_weight(tmp_path, capsys):
    """A dense model's roofline (issue 38's large layers): all weights, K/V and states, no expert term."""
    folder = tmp_path / "dense"
    assert make_model([str(folder), "--layers", "4", "--hidden-size", "8", "--intermediate-size", "8",
                       "--vocab-size", "1536", "--no-progress"]) == 0
    other, experts = weight_bytes(folder)
    assert experts == 0 and other > 0
    config = json.loads((folder / "config.json").read_text())
    one, two = (roofline_bytes(config, other, 0, b, 576) for b in (1, 2))
    kv = 576 * 1 * 2 * 2 * 256 * 2  # one full-attention layer, 2 KV heads of 256, bf16
    state = 3 * (32 * 128 * 128 + (2 * 16 * 128 + 32 * 128) * 3) * 4  # three GDN layers' fp32 states
    assert one == other + kv + 2 * state and two - one == kv + 2 * state
    assert main(["--model", str(folder), "--bandwidth-gbs", "1"]) == 0
    assert "B64" in capsys.readouterr().out
