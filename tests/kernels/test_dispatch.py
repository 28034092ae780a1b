"""The dispatch ops keep the CPU path on the references: the tiny hybrid with the recommended
call-site edits applied still matches transformers (fp32, CPU)."""

import transformers as tf

from hkv.models.loader import load_model
from tests.kernels.test_model_cuda import kernels_on  # noqa: F401  (fixture)
from tests.models.test_qwen3_5 import TEXT_CONFIG, TOL, build_hf, ragged_parity


def test_cpu_dispatch_matches_transformers(tmp_path, kernels_on):  # noqa: F811
    ref = build_hf(tf.Qwen3_5ForCausalLM, tf.Qwen3_5TextConfig(**TEXT_CONFIG), tmp_path, seed=1)
    ours = load_model(tmp_path, "float32", "cpu").model
    assert ragged_parity(ours, ref, TEXT_CONFIG["vocab_size"]) < TOL
