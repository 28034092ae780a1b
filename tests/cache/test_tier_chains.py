"""Issue 13, acceptance 2: random publish, offload, lookup, disk and eviction sequences through the tiers.

After every step, at rest (entries no lookup, offload or disk write holds):
no page lies beyond the deepest checkpoint of its chain, no checkpoint lacks
its pages (every page from the prompt's first one is held, or the chain came
without its prefix from a disk read past the device's hit), every hit is
exactly the pages and checkpoint asked for, and pinned entries neither move
nor go. A hybrid tier (a checkpoint is two units, so compaction runs) and a
dense one (pages only, never a checkpoint).
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hkv.cache.cpu_tier import CpuTier
from hkv.cache.keys import page_keys
from hkv.cache.tier_policy import TierPolicy

ROOT = b"\x5a" * 16
PROMPTS = (  # page size 1: each token is a page; shared prefixes make branching chains
    (1, 2, 3, 4, 5, 6),
    (1, 2, 3, 7, 8, 9, 10),
    (1, 2, 11, 12),
    (20, 21, 22, 23, 24),
    (20, 21, 25),
)
KEYS = [page_keys(ROOT, list(p), 1) for p in PROMPTS]


class FakeDisk:
    """The disk index: key -> whether its file has a checkpoint; lookups tell it parents."""

    def __init__(self):
        self.files: dict[bytes, bool] = {}

    def contains(self, key: bytes) -> bool:
        return key in self.files

    def has_state(self, key: bytes) -> bool:
        return self.files.get(key, False)

    def link(self, key: bytes, parent: bytes) -> None:
        assert key in self.files


class TierChainMachine(RuleBasedStateMachine):
    hybrid = True

    def __init__(self):
        super().__init__()
        self.disk = FakeDisk()
        units, per = (12, 2) if self.hybrid else (8, 0)
        self.policy = TierPolicy(CpuTier(units, per, ROOT, self._moved), self.disk)
        self.ids = iter(range(1, 10**6))
        self.offloads: list[int] = []  # reserved, not committed
        self.writes: list = []  # entries pinned for a disk write
        self.hits: dict[int, tuple[list[bytes], list[int]]] = {}  # lookup id -> (keys, entries), pinned

    def _moved(self, src: int, dst: int) -> None:
        held = {u for _, pages in self.hits.values() for u in pages}
        held |= {e.page for e in self.writes} | {e.page for o in self.offloads for e in self.policy.offloads[o].new}
        assert src not in held, f"compaction moved unit {src}, which a load, a store or a disk write uses"

    @rule(prompt=st.integers(0, len(PROMPTS) - 1), data=st.data())
    def offload(self, prompt, data):
        n = data.draw(st.integers(1, len(PROMPTS[prompt])))
        offload_id = next(self.ids)
        self.policy.reserve(offload_id, KEYS[prompt][:n], self.hybrid)
        if offload_id in self.policy.offloads:
            self.offloads.append(offload_id)

    @precondition(lambda self: self.offloads)
    @rule(data=st.data(), ok=st.booleans(), room=st.integers(0, 3))
    def commit(self, data, ok, room):
        offload_id = self.offloads.pop(data.draw(st.integers(0, len(self.offloads) - 1)))
        self.writes += self.policy.commit(offload_id, ok, room).to_write

    @precondition(lambda self: self.writes)
    @rule(data=st.data(), ok=st.booleans())
    def write_done(self, data, ok):
        entry = self.writes.pop(data.draw(st.integers(0, len(self.writes) - 1)))
        if ok:
            self.disk.files[entry.key] = self.disk.files.get(entry.key, False) or entry.checkpoint is not None
        self.policy.write_done(entry)

    @rule(prompt=st.integers(0, len(PROMPTS) - 1), data=st.data())
    def lookup(self, prompt, data):
        keys = KEYS[prompt]
        first = data.draw(st.integers(0, len(keys) - 1))  # pages before it are on the device
        lookup_id = next(self.ids)
        plan = self.policy.begin_lookup(lookup_id, keys[first:], self.hybrid, keys[first - 1] if first else None)
        reads = plan.disk_reads
        failed_at = data.draw(st.sampled_from([None] + [i for i, _ in reads]))
        if failed_at is not None:
            del self.disk.files[plan.entries[failed_at].key]  # a corrupt file is deleted
        hit = self.policy.finish_lookup(plan, failed_at)
        if hit is None:
            return
        asked = keys[first : first + len(hit.pages)]
        entries = [self.policy.cpu.entries[k] for k in asked]
        assert hit.pages == [e.page for e in entries], "a hit's entries are not the pages asked for"
        assert hit.state_entry == (entries[-1].checkpoint if self.hybrid else None)
        assert not self.hybrid or hit.state_entry is not None, "a hybrid hit must end at a checkpoint"
        self.hits[lookup_id] = (asked, list(hit.pages))

    @precondition(lambda self: self.hits)
    @rule(data=st.data())
    def release(self, data):
        lookup_id = data.draw(st.sampled_from(sorted(self.hits)))
        keys, pages = self.hits.pop(lookup_id)
        assert [self.policy.cpu.entries[k].page for k in keys] == pages, "a pinned hit moved or went"
        self.policy.release(lookup_id)

    @rule()
    def flush(self):
        self.policy.cpu.flush()

    @precondition(lambda self: self.disk.files)
    @rule(data=st.data())
    def disk_evicts(self, data):
        del self.disk.files[data.draw(st.sampled_from(sorted(self.disk.files)))]

    @invariant()
    def books_balance(self):
        self.policy.cpu.check()
        usage = self.policy.cpu.usage()
        for pool in usage.values():
            assert pool["total"] == pool["free"] + pool["cached"] + pool["in_use"], usage
        if not self.hybrid:
            assert usage["states"]["total"] == 0 and all(e.state is None for e in self.policy.cpu.entries.values())

    @invariant()
    def no_page_beyond_the_deepest_checkpoint_at_rest(self):
        if not self.hybrid:
            return
        cpu = self.policy.cpu
        for key, entry in cpu.entries.items():
            if entry.pins:
                continue
            below, stack = [], [key]
            while stack:
                k = stack.pop()
                below.append(cpu.entries[k])
                stack += cpu.chains.links[k].children
            assert any(e.checkpoint is not None or e.pins for e in below), (
                f"page {key.hex()} is at rest beyond the deepest checkpoint of its chain")

    @invariant()
    def no_checkpoint_lacks_its_pages(self):
        cpu = self.policy.cpu
        for entry in cpu.entries.values():
            if entry.checkpoint is None or entry.pins:
                continue
            walk = entry
            while walk is not None and not walk.pins and walk.parent != ROOT and walk.anchored:
                walk = cpu.entries.get(walk.parent)
                # (a chain through a page in flight is not at rest: when a failed copy drops that
                # page, the pages below it go too; a lookup stops at a page not yet valid)
                assert walk is not None, f"the checkpoint after {entry.key.hex()} lacks a page of its chain"

    def teardown(self):
        for lookup_id in list(self.hits):
            self.policy.release(lookup_id)
        for offload_id in self.offloads:
            self.policy.commit(offload_id, False, 0)
        for entry in self.writes:
            self.policy.write_done(entry)
        self.policy.cpu.flush()
        self.policy.cpu.check()
        assert self.policy.cpu.entries == {} and self.policy.cpu.free_pages == self.policy.cpu.num_pages


class DenseTierChainMachine(TierChainMachine):
    hybrid = False


SETTINGS = settings(max_examples=150, stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
TestHybridTierChains = TierChainMachine.TestCase
TestHybridTierChains.settings = SETTINGS
TestDenseTierChains = DenseTierChainMachine.TestCase
TestDenseTierChains.settings = SETTINGS
