"""Gated DeltaNet over a ragged batch with recurrent states in state-pool slots."""

# Tokens per chunk of the chunked rule, the CPU reference's and fla-core's alike. The state after
# every multiple of it, counted from a prefill chunk's start, comes out of that chunk's forward:
# in-chunk checkpoints fall there (docs/cache.md, "In-chunk checkpoints"). Pure Python: the router imports it.
GDN_CHUNK = 64
