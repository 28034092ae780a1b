"""Mixture-of-experts: routing (softmax, top-k, renormalisation), tokens sorted by expert and the
experts' SwiGLU as two grouped GEMMs over the stacked weights, the shared expert added at the end.

Experts are addressed by their global id everywhere (w13[e], w2[e], the router's column e), so a
later expert-parallel layout can keep a slice of them per rank and remap ids at the edge.
"""
