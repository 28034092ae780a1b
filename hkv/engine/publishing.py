"""What a step computed goes into the prefix cache: the publish half of the Scheduler.

`Publishing` is part of `Scheduler` (hkv/engine/scheduler.py), split out to keep that
file readable. A sent plan publishes once: when the next plan is planned (the router
plans one step ahead, so that is usually before the plan's result) or at its result,
whichever comes first. Either way its checkpoint saves ride the next plan, ahead of
any forward that moves the live states on; a plan that then fails takes the device
cache with it (Scheduler._fail).
"""

from __future__ import annotations

from hkv.engine.sequence import Sequence
from hkv.ipc.messages import Chunk, StepPlan


class Publishing:
    """Scheduler provides coord, limits, tiers, running, _ops and _unpublished/_sent."""

    def _publish_sent(self) -> None:
        """Publish what the sent plans compute, before planning the next: its checkpoint saves must
        run ahead of the next forward. (A plan that fails takes the cache with it: `_fail`.)"""
        for step, plan in list(self._unpublished.items()):
            self._publish_plan(plan, self._sent.get(step, {}))
            del self._unpublished[step]

    def _publish_plan(self, plan: StepPlan, sent: dict[int, Sequence]) -> None:
        for chunk in plan.chunks:
            seq = sent.get(chunk.slot)
            if seq is None or seq.req_id not in self.running or seq.slot != chunk.slot:
                continue
            if chunk.drafts:  # what it computes is known at its result (Scheduler._apply_verified)
                continue
            self._publish_in_chunk(seq, chunk)
            self._publish(seq, len(chunk.token_ids) > 1, chunk.start_pos + len(chunk.token_ids))

    def _publish_in_chunk(self, seq: Sequence, chunk: Chunk) -> None:
        """Publish the checkpoints the forward kept inside the chunk (interval boundaries). With
        tiers each one at a multiple of --tier-checkpoint-interval publishes on its own and is
        copied out; a publish attaches every pending checkpoint up to its depth, so one publish
        at the deepest takes the rest."""
        if not chunk.checkpoints:
            return
        all_ids = seq.all_ids()
        depths = [chunk.start_pos + tokens for tokens, _ in chunk.checkpoints]
        tier_interval = self.limits.tier_checkpoint_interval
        offloaded = [d for d in depths if self.tiers is not None and tier_interval and d % tier_interval == 0]
        for depth in offloaded:
            self.coord.publish(seq.req_id, all_ids, depth, checkpoint=True)
            self._offload(seq)
        if not offloaded or offloaded[-1] != depths[-1]:
            self.coord.publish(seq.req_id, all_ids, depths[-1], checkpoint=True)

    def _publish(self, seq: Sequence, prefill: bool, end: int) -> None:
        """Cache the prefix a chunk ending at `end` computes; on a hybrid model save the state at each page boundary.

        Dense: after a prefill chunk and when decoding fills a page (publishing a
        prefix that did not grow by a page would change nothing). Hybrid: a
        checkpoint boundary (an interval multiple, the prompt's last page
        boundary) keeps its checkpoint and is offloaded; any other page boundary
        moves the sequence's rolling checkpoint there (see the module docstring).
        """
        if not self.coord.spec.prefix_cache:
            return
        ps = self.limits.page_size
        at_page = end % ps == 0
        if not self.limits.hybrid:
            if at_page or prefill:
                self.coord.publish(seq.req_id, seq.all_ids(), end)
                if prefill:
                    self._offload(seq)
                if end >= len(seq.prompt_ids):
                    self._hold_for_peer_device(seq)
            return
        if at_page:
            interval = self.limits.checkpoint_interval
            kept = end == len(seq.prompt_ids) // ps * ps or bool(interval and end % interval == 0)
            published = self.coord.publish(seq.req_id, seq.all_ids(), end, checkpoint=True, rolling=not kept)
            # ahead of this plan's admissions: a RestoreCheckpoint from a moved checkpoint reads the new state
            self._ops.extend(published.ops)
            tier_interval = self.limits.tier_checkpoint_interval  # the tiers keep fewer interior checkpoints
            if end == len(seq.prompt_ids) // ps * ps or (tier_interval and end % tier_interval == 0):
                self._offload(seq)
            if end == len(seq.prompt_ids) // ps * ps:
                self._hold_for_peer_device(seq)  # prefill mode on CUDA (hkv/engine/pd_fetching.py)

    def _offload(self, seq: Sequence) -> None:
        """Copy the published prefix out to the CPU tier: prompt checkpoints and prefill
        chunks as they publish, the rest on finish (not every decode page)."""
        if self.tiers is not None:
            self.tiers.offload(seq.req_id, seq.keys, seq.all_ids())

