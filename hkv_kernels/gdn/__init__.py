"""Gated DeltaNet over a ragged batch with recurrent states in state-pool slots."""
