"""RMSNorm with a fused residual add (both Qwen weight conventions) and the gated RMSNorm of GDN outputs."""
