"""Waiting for a prefix another sequence is prefilling: the admission half of the Scheduler that holds.

`PrefixWaiting` is part of `Scheduler` (hkv/engine/scheduler.py), split out to keep that
file readable. Requests that reach the router in the same step share nothing yet: a
prefix is published only once its chunk is planned. So a waiting sequence whose prompt
shares a cacheable prefix with a prompt a running sequence is still prefilling waits
for that prefix, when it would gain at least `SchedulerLimits.prefix_wait_min`
(`--prefix-wait-tokens`) cached tokens, rather than compute it again beside it
(docs/cache.md, section 4).
"""

from __future__ import annotations

from hkv.engine.sequence import Sequence

PREFIX_WAIT_SCAN = 256  # waiting sequences held for a prefix in one step, past which the step admits no more


class PrefixWaiting:
    """Scheduler provides coord, limits, running and prefix_waits."""

    def _prefix_feeders(self) -> list[tuple[Sequence, int]] | None:
        """Running sequences still prefilling their prompt, each with what it has published
        (its kv_len: `_publish_sent` has just published every sent chunk); None with the
        prefix cache off (nothing to wait for) or the wait turned off (--prefix-wait-tokens 0)."""
        if not self.coord.spec.prefix_cache or self.limits.prefix_wait_min <= 0:
            return None
        return [(seq, seq.kv_len) for seq in self.running.values()
                if seq.arriving is None and seq.kv_len < len(seq.prompt_ids)]

    def _waits_for_prefix(self, seq: Sequence, feeders: list[tuple[Sequence, int]]) -> bool:
        """Whether `seq` should stay waiting: a feeder is prefilling a prompt that shares a prefix
        with it, up to a boundary the cache will serve (a page; on a hybrid model a checkpoint
        interval or that prompt's last page) that the feeder has not published yet and that is
        at least limits.prefix_wait_min tokens longer than what the cache serves `seq` now.
        Counted once per sequence in prefix_waits.

        Not held: a sequence with a tier run or a prefill peer (its prefix comes from there) and
        a preempted one (its own prefix is published). The hold ends when the feeder publishes
        past the boundary, leaves (finished, aborted) or is preempted, whatever the hit is then."""
        if seq.tier is not None or seq.peer is not None or seq.peer_device is not None or seq.output_ids:
            return False
        if len(seq.shared_with) > 2 * len(feeders):  # forget feeders that have left
            seq.shared_with = {r: n for r, n in seq.shared_with.items() if r in self.running}
        best = 0
        for feeder, published in feeders:
            if feeder is seq or feeder.req_id not in self.running:  # (preempted earlier in this step)
                continue
            shared = seq.shared_with.get(feeder.req_id)
            if shared is None:
                shared = seq.shared_with[feeder.req_id] = _common_prefix(
                    seq.prompt_ids, feeder.prompt_ids, min(len(seq.prompt_ids) - 1, len(feeder.prompt_ids)))
            boundary = self._served_boundary(shared, len(feeder.prompt_ids))
            if boundary > published:
                best = max(best, boundary)
        if best < self.limits.prefix_wait_min or best - self.coord.peek(seq.prompt_ids) < self.limits.prefix_wait_min:
            return False
        if not seq.prefix_waited:
            seq.prefix_waited = True
            self.prefix_waits += 1
        return True

    def _served_boundary(self, shared: int, feeder_prompt: int) -> int:
        """The longest hit a prompt sharing `shared` tokens with a feeder's prompt of `feeder_prompt`
        tokens gets once the feeder published them: a page boundary (dense); an interval multiple,
        or the feeder prompt's last page boundary where the shared part reaches it (hybrid)."""
        ps = self.limits.page_size
        if not self.limits.hybrid:
            return shared // ps * ps
        interval = self.limits.checkpoint_interval
        boundary = shared // interval * interval if interval else 0
        last_page = feeder_prompt // ps * ps
        return max(boundary, last_page) if last_page <= shared else boundary


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """Length of the common prefix of a and b, at most `limit`: slices compared in doubling
    strides (C-speed compares, O(shared) in all), the last one element by element."""
    i, stride = 0, 64
    while i < limit:
        j = min(limit, i + stride)
        if a[i:j] != b[i:j]:
            while a[i] == b[i]:
                i += 1
            return i
        i, stride = j, min(stride * 2, 8192)
    return max(limit, 0)
