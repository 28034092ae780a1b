"""Cache sizing for Qwen3.5-9B: the layouts the server allocates agree with the formulas in docs/sizing.md."""

from tools.bench.cache_sizing import QWEN3_5_9B, sizing


def test_qwen3_5_9b_bytes_per_token_and_per_checkpoint():
    s = sizing(QWEN3_5_9B)
    full, linear = 8, 24
    assert (s["full_attention_layers"], s["linear_attention_layers"]) == (full, linear)
    # K and V, 4 KV heads x 256 dims, bf16, 8 full-attention layers
    assert s["kv_bytes_per_token"] == full * 2 * 4 * 256 * 2 == 32768
    recurrent = linear * 32 * 128 * 128 * 4  # v_heads x k_dim x v_dim, fp32
    conv = linear * (2 * 16 * 128 + 32 * 128) * 3 * 4  # conv_dim x (kernel - 1), fp32
    assert s["checkpoint_conv_bytes"] == conv
    assert s["checkpoint_bytes"] == recurrent + conv == 52_690_944
    assert s["checkpoints_in_budget"] == 8 * 2**30 // (recurrent + conv) == 163


def test_bf16_state_halves_a_checkpoint():
    assert sizing(QWEN3_5_9B, state_dtype="bfloat16")["checkpoint_bytes"] == 52_690_944 // 2
