"""Attention input prep: per-head q/k RMSNorm, (partial) rope and the K/V cache write, in one pass."""
