"""A sequence as the scheduler tracks it, and the scheduler's limits (hkv/engine/scheduler.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hkv.engine.tier_client import TierHit
from hkv.ipc.messages import NewSequence, PeerDevice, SamplingParams
from hkv_kernels.gdn import GDN_CHUNK


@dataclass(frozen=True)
class SchedulerLimits:
    page_size: int
    max_running: int  # sequences holding a slot at once (<= request-table slots)
    token_budget: int  # tokens per step, decode and prefill together
    max_context: int  # the model's context length
    eos_ids: frozenset[int]
    hybrid: bool = False  # the model has linear-attention state (one live slot per sequence)
    checkpoint_interval: int | None = None  # hybrid: the state is kept at multiples of this (a multiple of chunk_align)
    chunk_align: int = GDN_CHUNK  # hybrid: in-chunk checkpoints fall on multiples of this from the chunk's start
    tier_checkpoint_interval: int | None = None  # hybrid with tiers: interior prefixes copied out on multiples of this
    spec_tokens: int = 0  # speculative decoding: drafts verified per decode step at most (0 = off)
    # a waiting prompt waits for a prefix another is prefilling when that adds at least this many cached tokens
    # (a shorter share, a chat template's first page say, is not worth a step of its time to first token); 0 = never
    prefix_wait_min: int = 256


@dataclass
class Sequence:
    req_id: int
    prompt_ids: list[int]
    sampling: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    slot: int | None = None  # request-table row while admitted
    state_slot: int | None = None  # live linear-state slot while admitted (hybrid)
    pages: list[int] = field(default_factory=list)  # page ids, in order (shared prefix pages first)
    kv_len: int = 0  # tokens of all_ids whose K/V are computed, or being computed by sent plans
    pending_samples: int = 0  # tokens sampled by sent plans whose results are not in yet (0 to 2)
    done_len: int = 0  # tokens whose K/V steps with results in have computed
    admit_order: int = 0  # larger = admitted later = preempted first
    cached_tokens: int | None = None  # prompt tokens its first admission took from the cache
    cache_tiers: dict[str, int] | None = None  # those tokens per tier: {"gpu", "cpu", "disk", "peer"}
    table_pages: int = 0  # pages already written to its request-table row
    keys: list[bytes] = field(default_factory=list)  # chained page keys, computed as tiers need them
    lookup_pending: bool = False  # a tier lookup is out: it waits (others may pass it)
    tier: TierHit | None = None  # the tier run its first admission may load, pinned by the worker
    proposals: list[int] = field(default_factory=list)  # the drafter's guesses after its last token (spec)
    peer_pages: frozenset[int] = frozenset()  # decode mode: prompt pages pulled from the prefill peer
    peer: str | None = None  # decode mode: the prefill peer's transporter
    peer_device: PeerDevice | None = None  # decode mode on its GPU: its held device pages, until admitted
    peer_copy_by: float = 0.0  # ... copied only before this (monotonic): well inside the peer's hold timeout
    peer_pair: bool = False  # ... over a pair group, not CUDA IPC (hkv/engine/pd_pairing.py)
    arriving: int | None = None  # admitted, its pages still arriving under this transfer id: no chunk planned
    arrive_by: float = 0.0  # ... the client gets an error past this (monotonic; --pd-timeout)
    announced: bool = True  # the ranks know it (NewSequence sent); an arriving one is announced with its chunk
    doomed: bool = False  # answered (aborted, timed out) while arriving: it leaves once the transfer ended
    shared_with: dict[int, int] = field(default_factory=dict)  # prefilling req_id -> common prompt prefix (waiting)
    prefix_waited: bool = False  # it has waited for another's prefix (counted once in prefix_waits)

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def announcement(self) -> NewSequence:
        """How the ranks meet it (again, after a preemption): with processed logits, the history those start
        from (hkv/engine/logits_process.py)."""
        sampling = self.sampling
        if not sampling.processed:
            return NewSequence(self.slot, self.req_id, sampling, self.state_slot)
        prompt = self.prompt_ids if sampling.repetition_penalty != 1.0 else []
        return NewSequence(self.slot, self.req_id, sampling, self.state_slot, prompt, list(self.output_ids))

    def token_slice(self, start: int, stop: int) -> list[int]:
        prompt_len = len(self.prompt_ids)
        if stop <= prompt_len:
            return self.prompt_ids[start:stop]
        if start >= prompt_len:
            return self.output_ids[start - prompt_len : stop - prompt_len]
        return self.prompt_ids[start:] + self.output_ids[: stop - prompt_len]
