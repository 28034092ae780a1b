"""The router's stats block in shared memory.

Writer: the router (after every step). Readers: the api (`/metrics`),
`hkv-inspect` and benchmarks. Every field is a float64 counter or gauge at a
fixed index, so a reader never needs a lock: a torn read can only mix two
consecutive steps' values.
"""

from __future__ import annotations

import numpy as np

from hkv.engine.validate import MAX_SPEC_TOKENS

REGION = "router_stats"
GRAPH_KINDS = ("decode", "short_prefill", "verify", "mixed")  # StepResult.graph 1 to 4 (hkv.ipc.messages.STEP_*)
VERSION = 11  # 5: cached_tokens_peer; 6: graph_steps_*; 7: pd_pair_*; 8: graph_steps_mixed; 9: prefix_waits;
#              10: grammar_*; 11: grammar_cache_*

FIELDS = (
    "steps",  # steps run
    "step_wall_s",  # seconds from scheduling a step to publishing its tokens, summed
    "forward_s",  # seconds ranks spent in the model forward, summed
    "prefill_tokens",  # prompt (and recomputed) tokens run
    "decode_tokens",  # tokens generated
    "preemptions",  # sequences preempted for pages
    "waiting",  # gauge: sequences waiting for admission
    "running",  # gauge: sequences holding a slot
    "pages_total",  # gauge: device KV pages
    "pages_free",  # gauge: free device KV pages
    "pages_cached",  # gauge: pages held by the radix tree
    "state_slots_total",  # gauge: linear-state slots (live + checkpoints); 0 for dense models
    "state_slots_free",  # gauge
    "state_slots_cached",  # gauge: slots holding checkpoints
    "window_slots_total",  # gauge: MTP draft windows
    "window_slots_free",  # gauge
    "window_slots_cached",  # gauge
    "radix_nodes",  # gauge
    "radix_checkpoints",  # gauge: nodes carrying a checkpoint
    "radix_evictable_pages",  # gauge: cached pages no request locks
    "requests_cached_tokens",  # counter: prompt tokens served from the cache, all tiers
    "cached_tokens_gpu",  # counter: ... of them from device pages
    "cached_tokens_cpu",  # counter: ... loaded from the CPU tier
    "cached_tokens_disk",  # counter: ... read from the disk tier
    "cached_tokens_peer",  # counter: ... moved from a prefill instance (decode mode)
    "tier_offloads_skipped",  # counter: published prefixes not copied out (too many in flight)
    "flushes",  # counter: /cache/flush calls
    "page_size",  # constant: tokens per KV page
    "radix_reachable_pages",  # gauge: cached pages a hit could reach (hybrid: up to a checkpoint), every <= 0.5 s
    "malformed_router_in",  # counter: router_in messages dropped (undecodable, or invalid fields)
    "malformed_router_results",  # counter: rank results dropped (undecodable, or not answering the plan)
    "malformed_rank_in",  # counter: plans rank 0 dropped (undecodable), as its results report
    "failed_steps",  # counter: steps whose result carried an error
    # counters: steps replayed from CUDA graphs, by kind: a decode graph, the parts' graphs of one short
    # prefill chunk, verify graphs (every row of a speculative step), a decode graph and one short chunk's parts
    *(f"graph_steps_{kind}" for kind in GRAPH_KINDS),
    "pd_pair_ok",  # counter: prefill/decode transfers over a pair group that ended well (hkv/engine/pd_pairing.py)
    "pd_pair_failed",  # counter: ... that failed (both ends rolled back)
    "pd_pair_pages",  # counter: KV pages they moved (received on a decode instance, sent on a prefill one)
    "spec_tokens",  # constant: --spec-tokens (0: not speculating; /metrics then has no hkv_spec_*)
    "spec_verified",  # counter: draft tokens the target verified (speculative decoding)
    "spec_accepted",  # counter: ... of them accepted
    # counters: verify steps of one sequence that accepted i drafts, i = 0..MAX_SPEC_TOKENS
    *(f"spec_accepted_{i}" for i in range(MAX_SPEC_TOKENS + 1)),
    "prefix_waits",  # counter: requests that waited for a prefix another request was prefilling (once each)
    "grammar_steps",  # counter: steps with live grammar rows (structured output), as their results report
    "grammar_mask_s",  # counter: seconds those steps' ranks spent filling masks (llguidance), summed
    "grammar_rows",  # counter: live matchers those fills computed, summed
    "grammar_wait_s",  # counter: seconds late-sampled steps waited, forward queued to masks started, summed
    "grammar_cache_hits",  # counter: grammar masks taken from the mask cache (HKV_GRAMMAR_MASK_CACHE)
    "grammar_cache_misses",  # counter: keyed masks llguidance computed and the cache kept
)
NBYTES = len(FIELDS) * 8

# The router's listing of checkpoint-carrying radix nodes, a json_block (hkv/ipc/json_block.py).
RADIX_REGION = "radix"
RADIX_NBYTES = 256 * 1024


class RouterStats:
    """Named float64 fields over the region's payload."""

    def __init__(self, payload: memoryview):
        self._values = np.frombuffer(payload, dtype="<f8", count=len(FIELDS))
        self._index = {name: i for i, name in enumerate(FIELDS)}

    def add(self, name: str, amount: float) -> None:
        self._values[self._index[name]] += amount

    def set(self, name: str, value: float) -> None:
        self._values[self._index[name]] = value

    def add_many(self, amounts: dict[str, float]) -> None:
        """Add to several counters in one numpy operation."""
        self._values[[self._index[name] for name in amounts]] += list(amounts.values())

    def set_many(self, values: dict[str, float]) -> None:
        """Set several fields in one numpy operation (the router does this every step)."""
        self._values[[self._index[name] for name in values]] = list(values.values())

    def read(self) -> dict[str, float]:
        values = self._values.copy()
        return {name: float(values[i]) for name, i in self._index.items()}

    def release_views(self) -> None:
        self._values = None
