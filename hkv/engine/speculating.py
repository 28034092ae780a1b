"""Speculative decoding in the scheduler: how many drafts a verify chunk carries, and its result.

`Speculating` is part of `Scheduler` (hkv/engine/scheduler.py), split out like
`Publishing`. A decoding sequence with proposals (Sampled.proposals of its last
result) runs [its last token, the drafts] as one verify chunk; the step's
transaction reserves pages for all of them, and the result says how many held:
the cursor moves back there (CacheCoordinator.rewind frees the look-ahead pages),
that length publishes, and the emitted tokens are appended (docs/spec.md).
"""

from __future__ import annotations

import logging

from hkv.engine.sequence import Sequence
from hkv.ipc.messages import Chunk, TokenDelta

log = logging.getLogger("hkv.router")


class Speculating:
    """Scheduler provides limits, coord, the spec counters, _append, _token_delta and _publish."""

    def _note_no_drafts(self, seq: Sequence) -> None:
        """A sequence whose logits are processed verifies no drafts (see `_drafts`): said once, when it arrives."""
        if self.limits.spec_tokens and seq.sampling.processed:
            log.info("request %d decodes without drafts: its logits are processed (a grammar, penalties or a "
                     "logit bias), which the verify step does not apply", seq.req_id)

    def _drafts(self, seq: Sequence, budget: int) -> int:
        """How many of its proposals a decoding sequence verifies this step.

        At most --spec-tokens, what the budget, max_tokens and the context leave room for, and, on a
        hybrid model with the prefix cache, no further than the next page boundary: every boundary is
        then a length the sequence stops at, where its rolling checkpoint saves (a verify chunk that
        reaches the boundary, or a plain decode of its last token):

            kv_len n   [x_n d_1 .. d_k]   n + k + 1 <= the next multiple of the page size
        """
        if seq.sampling.processed:  # the verify step samples raw logits: such a sequence decodes one token a step
            return 0
        room = min(len(seq.proposals), self.limits.spec_tokens, budget - 1,
                   seq.sampling.max_tokens - len(seq.output_ids) - 1, self.limits.max_context - seq.total_len - 1)
        if self.limits.hybrid and self.coord.spec.prefix_cache:
            ps = self.limits.page_size
            room = min(room, (seq.kv_len // ps + 1) * ps - seq.kv_len - 1)
        return max(0, room)

    def _apply_verified(self, seq: Sequence, chunk: Chunk, sampled) -> TokenDelta:
        """A verify chunk's answer: `accepted` drafts held, so the K/V of positions up to
        start + accepted are computed; the cursor moves back there (freeing the look-ahead pages),
        that length publishes, and the emitted tokens (up to a finish) are appended."""
        accepted = len(sampled.extra)
        end = chunk.start_pos + 1 + accepted
        seq.kv_len = seq.done_len = end
        self.coord.rewind(seq.req_id, end)
        self.spec_verified += chunk.drafts
        self.spec_accepted += accepted
        self.spec_histogram[accepted] += 1
        seq.pending_samples -= 1
        seq.proposals = list(sampled.proposals)
        tokens, reason = self._append(seq, [sampled, *sampled.extra])
        if end <= seq.total_len:  # what a finish mid-way leaves computed past its end is not a prefix of it
            self._publish(seq, False, end)
        return self._token_delta(seq, tokens, reason)
