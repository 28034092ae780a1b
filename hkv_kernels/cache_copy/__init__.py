"""Cache copies: pages between pools by index lists, state-slot checkpoints, draft-window ring writes."""
