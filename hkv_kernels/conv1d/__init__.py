"""Causal depthwise conv1d over a ragged batch, conv state carried in state-pool slots."""
