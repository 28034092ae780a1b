"""`bench_step_overhead --free-forward`: a rank whose model forward costs nothing, so a served step is host work only.

On a GPU a decode step's forward is queued, not run, by the host: at concurrency 1 on a small model the step is
bound by the host path around it (scheduling, the plan's trip to the rank, batch building, sampling, the
result's trip back, publishing). On the CPU that path hides behind the forward, which the rank computes
itself. With this folder first on PYTHONPATH, Python imports this module at start-up in every process the
launcher starts; in a rank (`-m hkv.actors.rank`) it replaces the families' forward with one that returns fixed
logits (token FREE_TOKEN wins every row, an ordinary token, so every step streams text). Nothing is written
to the KV pages or state slots. Not for --spec-tokens (no hidden states).
"""

import sys

FREE_TOKEN = 300  # below the built-in models' 1,536-token vocabulary, not a special token

if "hkv.actors.rank" in getattr(sys, "orig_argv", ()):
    import torch

    from hkv.models.qwen3 import Qwen3ForCausalLM
    from hkv.models.qwen3_5 import HybridForCausalLM

    def _free_forward(self, batch, kv, state=None, hidden_out=False):
        if hidden_out:
            raise ValueError("--free-forward has no hidden states (speculative decoding)")
        logits = torch.zeros(len(batch.logits_indices), self.cfg.vocab_size, device=batch.input_ids.device)
        logits[:, FREE_TOKEN] = 1.0  # [S, vocab]
        return logits

    Qwen3ForCausalLM.forward = _free_forward
    HybridForCausalLM.forward = _free_forward
