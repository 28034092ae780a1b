"""Issue 13, acceptance 3: a shared-prefix workload through a CPU tier sized for N tokens, against the ideal.

The router's side is played here as the scheduler runs it (no device cache,
so every hit comes from the tier): a lookup of the prompt's pages before
prefill, then copies out at each tier-checkpoint multiple inside the prompt,
at the prompt's last page boundary and at the finish (hybrid), or after the
prompt and at the finish (dense).

Workload: 8 groups of a 512-token shared prefix, each request one group's
prefix and a unique question of 32-199 tokens, 32 output tokens, groups drawn
at random (seeded). A checkpoint weighs the KV of 128 tokens (8 units), so the
tier keeps interior checkpoints every 128 tokens, and a prefix costs 32 pages
+ 4 checkpoints. The tier is sized for N = 1.1 x the 8 prefixes with their
checkpoints: they fit, the unique tails (questions, outputs and their
checkpoints, ~40 units per request) overflow it every few requests. The ideal
cache of that size keeps the prefixes and drops the tails: every request
after its group's first hits the 512 tokens. The tier must reach 95% of that.
"""

from __future__ import annotations

import random

from hkv.cache.cpu_tier import CpuTier
from hkv.cache.keys import page_keys
from hkv.cache.tier_policy import TierPolicy

ROOT = b"\x33" * 16
P, INTERVAL, STATE_UNITS = 16, 128, 8
GROUPS, PREFIX, REQUESTS, OUTPUT = 8, 512, 300, 32


class Workload:
    """Requests through one TierPolicy; counts the prompt tokens, the hits, and the ideal hits."""

    def __init__(self, hybrid: bool, units: int):
        self.hybrid = hybrid
        self.policy = TierPolicy(CpuTier(units, STATE_UNITS if hybrid else 0, ROOT, lambda src, dst: None), None)
        self.ids = iter(range(1, 10**9))
        self.prompt_tokens = self.hit_tokens = self.ideal_tokens = 0

    def request(self, prompt: list[int], output: list[int], shared: int) -> None:
        keys = page_keys(ROOT, prompt + output, P)
        L = len(prompt)
        lookup_id = next(self.ids)
        hit = self.policy.finish_lookup(self.policy.begin_lookup(lookup_id, keys[: (L - 1) // P], self.hybrid), None)
        got = len(hit.pages) * P if hit is not None else 0
        if hit is not None:
            assert not self.hybrid or hit.state_entry is not None
            self.policy.release(lookup_id)
        self.prompt_tokens += L
        self.hit_tokens += got
        self.ideal_tokens += shared
        for end in self._copy_points(L, got):
            offload_id = next(self.ids)
            self.policy.reserve(offload_id, keys[: end // P], self.hybrid)
            if offload_id in self.policy.offloads:
                self.policy.commit(offload_id, True, 0)

    def _copy_points(self, L: int, hit: int) -> list[int]:
        """Published lengths the scheduler copies out (hybrid: each with its checkpoint)."""
        prompt_end, finish = L // P * P, (L + OUTPUT - 1) // P * P
        points = {prompt_end, finish}
        if self.hybrid:
            points |= set(range(INTERVAL, prompt_end + 1, INTERVAL))
        return sorted(p for p in points if p > hit)


def run(hybrid: bool, seed: int = 0) -> tuple[Workload, int]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 32000) for _ in range(PREFIX)] for _ in range(GROUPS)]
    per_prefix = PREFIX // P + (PREFIX // INTERVAL * STATE_UNITS if hybrid else 0)
    units = int(1.1 * GROUPS * per_prefix) // STATE_UNITS * STATE_UNITS
    work, seen = Workload(hybrid, units), set()
    for _ in range(REQUESTS):
        group = rng.randrange(GROUPS)
        question = [rng.randrange(3, 32000) for _ in range(rng.randrange(32, 200))]
        output = [rng.randrange(3, 32000) for _ in range(OUTPUT)]
        work.request(prefixes[group] + question, output, PREFIX if group in seen else 0)
        seen.add(group)
        work.policy.cpu.check()
    return work, units


def test_a_hybrid_tier_reaches_the_ideal_hit_rate_of_its_size():
    work, units = run(hybrid=True)
    assert units == 560  # 8,960 tokens of KV: 8 prefixes of 512 tokens and their 32 checkpoints, + 10%
    ideal = work.ideal_tokens / work.prompt_tokens
    rate = work.hit_tokens / work.prompt_tokens
    assert ideal > 0.7 and rate >= 0.95 * ideal, (rate, ideal)
    held, reachable = work.policy.cpu.coverage()
    assert reachable == held  # at rest every page held lies under a checkpoint of its chain


def test_a_dense_tier_reaches_the_ideal_hit_rate_of_its_size():
    work, units = run(hybrid=False)
    assert units == 280 and work.policy.cpu.num_states == 0
    ideal = work.ideal_tokens / work.prompt_tokens
    rate = work.hit_tokens / work.prompt_tokens
    assert ideal > 0.7 and rate >= 0.95 * ideal, (rate, ideal)
