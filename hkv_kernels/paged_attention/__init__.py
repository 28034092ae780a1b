"""Paged attention over a ragged batch (decode and prefill-with-prefix in one kernel)."""
