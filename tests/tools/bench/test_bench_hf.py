"""`hkv-bench --baseline hf` (tools/bench/bench_hf.py) on a tiny transformers-built Qwen3."""

from __future__ import annotations

import argparse

import pytest
import torch
import transformers as tf

from tools import hkv_bench
from tools.bench.bench_client import RequestResult
from tools.bench.bench_hf import run_hf_baseline

PROMPTS = [[5, 9, 33, 70, 2, 14, 8], [40, 41, 42], [7, 7, 7, 7, 7]]


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf_baseline")
    config = tf.Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, initializer_range=0.2,
                            max_position_embeddings=256, eos_token_id=3, pad_token_id=0)
    torch.manual_seed(0)
    tf.Qwen3ForCausalLM(config).save_pretrained(folder)
    return folder


def test_left_padded_batches_decode_like_single_prompts(tiny_qwen3):
    batched = run_hf_baseline(tiny_qwen3, PROMPTS, batch_size=2, output_len=6, progress=False)
    assert batched["output_tokens"] == 18 and batched["seconds"] > 0 and batched["output_tokens_per_s"] > 0
    assert (batched["device"], batched["dtype"], batched["batch_size"]) == ("cpu", "float32", 2)
    # min_new_tokens: every prompt gets all 6 tokens even past the EOS id
    assert [len(o) for o in batched["outputs"]] == [6, 6, 6]
    single = run_hf_baseline(tiny_qwen3, PROMPTS, batch_size=1, output_len=6, progress=False)
    assert single["outputs"] == batched["outputs"]


def test_add_baseline_reports_the_ratio(tiny_qwen3):
    outputs = run_hf_baseline(tiny_qwen3, PROMPTS[:2], batch_size=2, output_len=4, progress=False)["outputs"]
    done = [RequestResult(tuple(p), 0.0, output=o if i == 0 else [1, 2, 3, 4], finished_at=1.0)
            for i, (p, o) in enumerate(zip(PROMPTS[:2], outputs))]
    run = hkv_bench.Run({"id": "m"}, {"name": "random"}, done, 0.0, 1.0, None, None)
    args = argparse.Namespace(baseline_num_prompts=None, model_path=tiny_qwen3, concurrency=2, output_len=4,
                              no_progress=True)
    report = {"throughput": {"output_tokens_per_s": 8.0}}
    hkv_bench.add_baseline(args, report, run)
    baseline = report["baseline"]
    assert baseline["prompts"] == 2 and baseline["same_tokens_fraction"] == 0.5 and "outputs" not in baseline
    assert baseline["hkv_over_hf"] == pytest.approx(8.0 / baseline["output_tokens_per_s"])
