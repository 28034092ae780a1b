"""Block-scaled FP8 weights (float8_e4m3fn with one fp32 multiplier per 128 x 128 block, the layout of
Qwen's and DeepSeek's published FP8 checkpoints): quantize, dequantize, and the weight-only GEMM that
dequantizes the weights in registers for the dense projections."""
