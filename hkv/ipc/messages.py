"""Typed messages for every ZeroMQ link, encoded as msgpack by msgspec.

One section per link. Decoding validates the schema (msgspec raises
`msgspec.ValidationError`); no class is ever reconstructed from the wire
beyond these Structs, and nothing here uses pickle.

    api ---Inbound---> router ---StepPlan---> rank 0..N-1
    api <--Outbound--- router <--StepResult-- rank 0
                       router ---TierInbound---> cache worker
                       router <--TierOutbound--- cache worker   (same inbox as the api's messages)
"""

from __future__ import annotations

import msgspec

from hkv.cache.types import CacheOp


class Constraint(msgspec.Struct, frozen=True, array_like=True):
    """Output a sequence must keep to, enforced by token masks (hkv/engine/grammar.py)."""

    kind: str  # CONSTRAINT_KINDS: "json_schema" (spec: a JSON schema as text), "regex", "lark" (llguidance's Lark)
    spec: str  # at most MAX_CONSTRAINT_CHARS characters


CONSTRAINT_KINDS = ("json_schema", "regex", "lark")
MAX_CONSTRAINT_CHARS = 65536
MAX_LOGIT_BIAS = 300  # entries of one request's logit_bias (OpenAI's bound)
MAX_LOGIT_BIAS_VALUE = 100.0  # |bias| of one entry (OpenAI's range)


class SamplingParams(msgspec.Struct, frozen=True):
    """How one sequence picks its tokens; validated by the api before queueing.

    The logits of a row go through, in order: logit_bias, repetition_penalty, frequency_penalty and
    presence_penalty, the constraint's mask (hkv/engine/logits_process.py); then temperature, top_k,
    top_p and min_p (hkv/engine/sampler.py). Logprobs are those of the processed logits, before temperature.
    """

    max_tokens: int  # completion tokens to generate at most (>= 1)
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]
    top_k: int | None = None  # keep the k most likely tokens; None keeps all
    seed: int = 0  # per-request generator seed (the api draws one when the client gives none)
    ignore_eos: bool = False  # keep generating past EOS until max_tokens
    logprobs: int | None = None  # None: no logprobs; n >= 0: chosen token's logprob plus the top n
    min_p: float = 0.0  # [0, 1]: drop tokens less likely than min_p times the most likely one (random rows)
    presence_penalty: float = 0.0  # [-2, 2]: subtracted from the logit of every token the output holds
    frequency_penalty: float = 0.0  # [-2, 2]: subtracted once per time the output holds the token
    repetition_penalty: float = 1.0  # (0, 2]: tokens of the prompt or output: logit / r where > 0, else * r
    logit_bias: dict[int, float] = {}  # token id -> added to its logit, in [-100, 100]; at most MAX_LOGIT_BIAS
    constraint: Constraint | None = None  # structured output: only tokens the grammar allows

    @property
    def processed(self) -> bool:
        """Its logits need more than sampling: penalties, a bias or a grammar (hkv/engine/logits_process.py)."""
        return (self.constraint is not None or bool(self.logit_bias) or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0)


# api -> router


class PeerDevice(msgspec.Struct, frozen=True):
    """Decode mode on a prefill peer's GPU: its held device pages and checkpoint to copy over CUDA IPC."""

    pools: str  # the peer's pools document (hkv/storage/ipc_pools.py)
    hold_id: int  # the peer router's hold on them, released through the transporters once copied
    length: int  # tokens the pages and the checkpoint cover (a multiple of the page size)
    pages: list[int]  # the peer's device pages of [0, length)
    slot: int | None  # the peer's checkpoint slot at `length` (hybrid models)


class GenerateRequest(msgspec.Struct, frozen=True, tag="generate"):
    """One sequence to generate (the api fans `n > 1` out into n of these)."""

    req_id: int  # unique per api process, never reused
    prompt_ids: list[int]  # validated: every id inside the vocabulary, length >= 1
    sampling: SamplingParams
    peer: str | None = None  # decode mode: the prefill transporter to pull the prompt's pages from (a checked ticket)
    for_peer: bool = False  # prefill mode: answer only once the prompt's pages are in the CPU tier (docs/pd.md)
    peer_device: PeerDevice | None = None  # decode mode: the peer's device pages, when both share a GPU
    device_hold: bool = False  # prefill mode on CUDA: hold the prompt's device prefix for the peer (one-prompt
    # requests only: the answer names one hold, and a hold nobody names would sit until it expires)
    received_at: float = 0.0  # time.monotonic() when the api took the HTTP request (0: unknown); only timed


class AbortRequest(msgspec.Struct, frozen=True, tag="abort"):
    """Stop a sequence (client gone, stop string matched); resources return within one step."""

    req_id: int


class FlushCache(msgspec.Struct, frozen=True, tag="flush"):
    """Drop every unreferenced cache entry (POST /cache/flush); answered by CacheFlushed."""

    flush_id: int  # echoed in the answer


Inbound = GenerateRequest | AbortRequest | FlushCache


# router -> api


class TopLogprob(msgspec.Struct, frozen=True, array_like=True):
    token_id: int
    logprob: float


class PeerHold(msgspec.Struct, frozen=True, array_like=True):
    """Prefill mode: a for_peer request's prefix held on the device for a decode instance to copy."""

    hold_id: int
    length: int
    pages: list[int]
    slot: int | None


CACHE_TIERS = ("gpu", "cpu", "disk", "peer")  # where a prompt's cached tokens came from (TokenDelta.cache_tiers)


class TokenDelta(msgspec.Struct, frozen=True, array_like=True):
    """New tokens of one sequence in one step, and its end when it ends."""

    req_id: int
    token_ids: list[int]
    logprobs: list[float] | None  # one per token when requested
    top_logprobs: list[list[TopLogprob]] | None  # one list per token when requested
    finish_reason: str | None  # "stop" (EOS), "length", "abort" or "error"; None while running
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from the cache, all tiers
    cache_tiers: dict[str, int] | None = None  # {tier: n} for every tier of CACHE_TIERS, on finish
    error: str | None = None  # human-readable reason when finish_reason == "error"
    peer_hold: PeerHold | None = None  # prefill mode, on a for_peer finish: the prefix held for the peer


class TokenBatch(msgspec.Struct, frozen=True, tag="tokens"):
    """Everything one router step produced for the api: one message per step, not per token."""

    deltas: list[TokenDelta]


ENGINE_HEARTBEAT_S = 1.0  # the router sends EngineState when it changes and at least this often


class EngineState(msgspec.Struct, frozen=True, tag="state"):
    """Router health for /ready and /health, and the engine gauges of /metrics."""

    ready: bool  # can admit new work
    alive: bool  # False once the engine has failed for good (every step failing)
    waiting: int  # requests queued at the router
    running: int  # requests holding KV pages
    kv_tokens: int | None = None  # the device KV capacity in tokens (the ranks size it on CUDA)
    steps: int = 0  # steps finished since start: the api sees progress as this moving
    failed_steps: int = 0  # steps that failed in a row (alive turns False past a bound)
    # seconds since `steps` last moved, as of this report: the api dates the move by it, not by the report,
    # which comes up to ENGINE_HEARTBEAT_S later (steps alone are no change worth a report)
    since_step_s: float = 0.0
    # while the router probes idle ranks (hkv/engine/rank_probe.py): seconds since they last answered, as of
    # this report; the api adds the time since it came. None while no probe is out (steps judge a busy engine)
    ranks_silent_s: float | None = None


class CacheFlushed(msgspec.Struct, frozen=True, tag="flushed"):
    """The answer to FlushCache: what the flush freed."""

    flush_id: int
    pages: int  # device KV pages freed
    checkpoints: int  # state checkpoints freed
    cpu_pages: int = 0  # CPU-tier page entries freed
    disk_files: int = 0  # disk-tier files deleted


Outbound = TokenBatch | EngineState | CacheFlushed


# router -> cache worker


class TierLookup(msgspec.Struct, frozen=True, tag="tier_lookup"):
    """Find the longest run of a prompt's pages held by the CPU or disk tier.

    keys[i] is the chained key of the prompt's page `first + i` (pages wholly
    inside prompt[:-1]). The worker prefetches disk entries into the CPU tier,
    pins the run's entries and answers TierFound; the router releases the pins
    with TierRelease once the loads ran (or when it does not use them).
    """

    lookup_id: int
    first: int  # page index of keys[0] (pages before it are on the device)
    keys: list[bytes]  # 16-byte page keys, in sequence order
    need_state: bool  # hybrid: the run must end at a page that carries a checkpoint
    parent: bytes | None = None  # the key of page first - 1 (None when first == 0): the run's place in its chain
    to_transporter: bool = False  # answer the transporter (a peer's pull), not the router


class TierRelease(msgspec.Struct, frozen=True, tag="tier_release"):
    """Unpin a lookup's entries (its loads ran, or it was not used)."""

    lookup_id: int


class TierReserve(msgspec.Struct, frozen=True, tag="tier_reserve"):
    """Reserve CPU-tier entries for a published prefix the router is about to copy out.

    keys cover pages [0, len(keys)) of one sequence; the worker skips keys it
    holds already and answers TierReserved. `state`: a checkpoint for the last
    page comes too (hybrid).
    """

    offload_id: int
    keys: list[bytes]
    state: bool
    to_transporter: bool = False  # answer the transporter (a pull from a peer), not the router


class TierCommit(msgspec.Struct, frozen=True, tag="tier_commit"):
    """The copies of an offload ran (ok) or failed: make its entries valid, or free them."""

    offload_id: int
    ok: bool


class TierFlush(msgspec.Struct, frozen=True, tag="tier_flush"):
    """Drop every unpinned CPU-tier entry and every disk-tier file; answered by TierFlushed."""

    flush_id: int


TierInbound = TierLookup | TierRelease | TierReserve | TierCommit | TierFlush


# cache worker -> router


class TierFound(msgspec.Struct, frozen=True, tag="tier_found"):
    """The answer to TierLookup: entries of pages [first, first + len(entries)), pinned.

    Empty when nothing usable was found (nothing is pinned then).
    """

    lookup_id: int
    first: int
    entries: list[int]  # CPU-tier page entries, in sequence order
    from_disk: list[bool]  # per entry: read from the disk tier for this lookup
    state_entry: int | None  # the checkpoint after the run's last page (hybrid), pinned


class TierReserved(msgspec.Struct, frozen=True, tag="tier_reserved"):
    """The answer to TierReserve: where to copy each page (None: held already, or no room)."""

    offload_id: int
    entries: list[int | None]  # one per key
    state_entry: int | None  # where to copy the last page's checkpoint, if asked and granted


class TierFlushed(msgspec.Struct, frozen=True, tag="tier_flushed"):
    flush_id: int
    pages: int  # CPU-tier page entries freed
    states: int  # CPU-tier checkpoints freed
    files: int  # disk-tier files deleted


TierOutbound = TierFound | TierReserved | TierFlushed

# Ids the transporter gives its lookups and reservations start here, so they never meet the router's.
TRANSPORTER_IDS = 1 << 48


# router -> transporter (decode mode)


class PdFetch(msgspec.Struct, frozen=True, tag="pd_fetch"):
    """Pull the pages of keys [0, len(keys)) the CPU tier lacks (and the last one's checkpoint) from `peer`."""

    fetch_id: int
    peer: str  # tcp://ip:port of the prefill instance's transporter, from a checked ticket
    keys: list[bytes]  # chained page keys of the prompt's pages [0, len(keys)), len >= 1
    need_state: bool  # hybrid: the run must end at a checkpoint


class PdFetched(msgspec.Struct, frozen=True, tag="pd_fetched"):
    """A fetch ended: its pages are committed in the CPU tier (ok), or nothing changed (ok=False)."""

    fetch_id: int
    ok: bool
    moved: list[int]  # page indices whose bytes came from the peer
    error: str | None = None  # why, when not ok


class PdRelease(msgspec.Struct, frozen=True, tag="pd_release"):
    """The decode router copied a peer's held device pages (or will not): tell the peer to let go."""

    peer: str  # the prefill transporter, from the ticket
    hold_id: int


class PdHoldRelease(msgspec.Struct, frozen=True, tag="pd_hold_release"):
    """Prefill side, transporter -> router: a decode peer is done with a hold."""

    hold_id: int


class PdPairAsk(msgspec.Struct, frozen=True, tag="pd_pair_ask"):
    """Decode side, router -> transporter: ask the prefill peer to send a held prefix over the pair group
    (docs/pd.md): the pages `first` on of its hold `hold_id` into `dst_pages`, its checkpoint into `dst_slot`."""

    peer: str  # the prefill transporter, from the ticket
    hold_id: int
    transfer_id: int  # the decode side's id; the receiving rank checks it in the sender's header
    address: str  # the decode rank's rendezvous host:port
    prefix: str  # the pair group's one-time name
    first: int  # the hold's first page to send (a decode-side hit covers the ones before)
    dst_pages: list[int]
    dst_slot: int | None


class PdPairSend(msgspec.Struct, frozen=True, tag="pd_pair_send"):
    """Prefill side, transporter -> router: a decode peer's PdPairAsk (authenticated, not yet checked)."""

    hold_id: int
    transfer_id: int
    address: str
    prefix: str
    first: int
    dst_pages: list[int]
    dst_slot: int | None


TransporterInbound = PdFetch | PdRelease | PdPairAsk | TierFound | TierReserved

# Everything the router's inbox takes: the api's requests, the cache worker's and the transporter's answers.
RouterInbound = Inbound | TierOutbound | PdFetched | PdHoldRelease | PdPairSend


# router -> rank


class NewSequence(msgspec.Struct, frozen=True, array_like=True):
    """A sequence the rank has not seen: sent once, in full."""

    slot: int  # request-table row; the page ids live there in shared memory
    req_id: int
    sampling: SamplingParams
    state_slot: int | None = None  # live linear-state slot (hybrid models), until the slot is freed
    # with sampling.processed only: the history its logits processing starts from (a sequence resumed
    # after preemption has generated tokens already; a fresh one none)
    prompt_ids: list[int] = []  # its prompt, with a repetition penalty (which counts prompt tokens too)
    output_ids: list[int] = []  # the tokens it generated before this admission


class Chunk(msgspec.Struct, frozen=True, array_like=True):
    """Tokens of one sequence to run this step (a prefill chunk or one decode token)."""

    slot: int  # request-table row holding this sequence's page ids
    token_ids: list[int]  # the new tokens, in order
    start_pos: int  # tokens of this sequence already in the KV pages (position of token_ids[0])
    sample: bool  # sample a token after the last one (the prompt's last chunk, or decode)
    # in-chunk checkpoints, [tokens, state_slot] pairs: write the linear state after the first `tokens`
    # tokens of this chunk (0 < tokens < len(token_ids), a multiple of the GDN chunk, 64) into state_slot
    checkpoints: list[list[int]] = []
    # token_ids is [the token this slot's previous chunk samples]: that plan was sent before its
    # result was in (the router plans one step ahead), so the rank feeds that token in itself
    follows: bool = False
    # speculative decoding (a verify chunk): the last `drafts` tokens of token_ids are draft proposals
    # for the positions after token_ids[0]; the rank keeps only those the target agrees with
    drafts: int = 0


class StepPlan(msgspec.Struct, frozen=True, tag="plan"):
    """The one hand-off from router to ranks per step.

    The router writes each slot's page ids into the shared request table
    before sending the plan; ranks only read them.
    """

    step: int  # monotonically increasing; the result echoes it
    new: list[NewSequence]  # sequences first scheduled in this step
    chunks: list[Chunk]  # work to run, one per scheduled sequence
    freed: list[int]  # slots released since the previous plan (ranks drop per-slot state first)
    ops: list[CacheOp] = []  # cache copies to run in order, after `freed`/`new`, before the forward


class Shutdown(msgspec.Struct, frozen=True, tag="shutdown"):
    """Ask the ranks to exit after the step in flight."""

    reason: str


RankInbound = StepPlan | Shutdown


# rank -> router


class Emitted(msgspec.Struct, frozen=True, array_like=True):
    """A token after the first that one chunk emits (speculative decoding)."""

    token_id: int
    logprob: float | None
    top_logprobs: list[TopLogprob] | None


class Sampled(msgspec.Struct, frozen=True, array_like=True):
    slot: int
    token_id: int  # the first token the chunk emits
    logprob: float | None  # the chosen token's logprob when requested
    top_logprobs: list[TopLogprob] | None
    # speculative decoding: the tokens emitted after token_id (the accepted drafts after the first, then the
    # target's own token), so a verify chunk with `drafts` proposals emits 1 + len(extra) <= drafts + 1 tokens
    extra: list[Emitted] = []
    proposals: list[int] = []  # the drafter's proposals for the positions after the last emitted token


# How a step's forward ran (StepResult.graph): eagerly (every CPU step, and a speculative step only partly
# replayed), or replayed from CUDA graphs (a mixed step: a decode graph and a short chunk's parts);
# hkv.ipc.stats.GRAPH_KINDS[g - 1] names graph kind g
STEP_EAGER, STEP_DECODE_GRAPH, STEP_SHORT_PREFILL_GRAPHS, STEP_VERIFY_GRAPHS, STEP_MIXED_GRAPHS = 0, 1, 2, 3, 4


class TransferDone(msgspec.Struct, frozen=True, array_like=True):
    """A pair-group transfer (PeerSend / PeerRecv) ended, or was refused before it started."""

    transfer_id: int
    ok: bool
    error: str | None = None


class StepResult(msgspec.Struct, frozen=True, tag="result"):
    """What a rank produced for one StepPlan."""

    step: int
    sampled: list[Sampled]  # one per chunk with sample=True, in plan order
    forward_s: float  # seconds inside the model forward alone (overhead = step time minus this)
    error: str | None = None  # set when the step failed; the router fails the step's requests
    malformed: int = 0  # plans this rank dropped since start because they did not decode (link rank_in)
    graph: int = STEP_EAGER  # STEP_*: how the forward ran
    transfers: list[TransferDone] = []  # pair-group transfers that ended since the rank's last result
    # structured output (a step with grammar rows, else all 0): wall seconds filling its masks (llguidance),
    # the live matchers filled, and the seconds a late-sampled step waited between its forward being queued
    # and its masks starting (the previous step's answer); hkv_engine_grammar_* in /metrics
    grammar_mask_s: float = 0.0
    grammar_rows: int = 0
    grammar_wait_s: float = 0.0
    # the grammar mask cache's keyed fills since the rank's last result (HKV_GRAMMAR_MASK_CACHE): hits, misses
    grammar_cache_hits: int = 0
    grammar_cache_misses: int = 0


class RankReady(msgspec.Struct, frozen=True, tag="ready"):
    """Sent once by each rank after the model is loaded and pools are allocated."""

    rank: int
    kv_pages: int  # pages in the device KV pool
    state_slots: int  # slots of the state pool the router may hand out (0: dense model)
    peer_gpu: str = ""  # decode mode on CUDA: the GPU uuid whose prefill peers' pools this rank can map
    pair_address: str = ""  # decode mode with pair transfers: the rendezvous host:port prefill peers join


RankOutbound = StepResult | RankReady
