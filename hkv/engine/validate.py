"""Checks on what reaches the router, before any field is used as an index or a size.

The api validates requests already, but anything that can write to the
router's sockets (a bug, another process of this user) must neither crash
the router nor fail the requests batched with a bad one. The router asks
`InboxCheck` about each message at its inbox and each step result before
applying it; what fails is dropped and counted per link. A GenerateRequest
that fails on a field other than its id is answered with an error delta, so
its client is not left waiting; one reusing a live id is only dropped.
Tier answers are checked where their ids are known (TierClient).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hkv.ipc.messages import (
    CONSTRAINT_KINDS, MAX_CONSTRAINT_CHARS, MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_VALUE, GenerateRequest, SamplingParams, StepPlan, StepResult,
)  # fmt: skip

INT64_MAX = 2**63 - 1  # request-table req_id is int64
MAX_LOGPROBS = 20  # alternatives per token a sequence may ask for
MAX_SPEC_TOKENS = 8  # --spec-tokens at most (hkv.config checks the flag against it)
MAX_CACHE_FILLS = 1 << 24  # grammar mask cache fills a step result may report (a rank's since its last result)


@dataclass(frozen=True)
class RouterLimits:
    """What one sequence may hold, from the config."""

    vocab_size: int
    max_context: int  # prompt + output tokens of one sequence (the model's context)
    row_tokens: int  # tokens one request-table row can hold pages for
    kv_tokens: int  # device KV capacity in tokens
    max_live: int  # sequences queued or running at once (the api's own bound on what it has in flight)

    @property
    def max_prompt(self) -> int:
        """A prompt must leave room for one generated token in every bound."""
        return min(self.max_context, self.row_tokens, self.kv_tokens) - 1


class InboxCheck:
    """Validates messages for the router; counts drops per link."""

    def __init__(self, limits: RouterLimits):
        self.limits = limits
        self.live: set[int] = set()  # req ids admitted and not yet finished (a reused one is dropped)
        self.dropped_router_in = 0
        self.dropped_results = 0

    def generate(self, msg: GenerateRequest) -> str | None:
        """None if `msg` may be scheduled (its id is then live), else why not."""
        if not 0 < msg.req_id <= INT64_MAX or msg.req_id in self.live:
            self.dropped_router_in += 1
            return "reused or out-of-range req_id"
        reason = self._prompt(msg.prompt_ids) or _sampling(msg.sampling, self.limits.vocab_size)
        if reason is None and len(self.live) >= self.limits.max_live:
            reason = f"{len(self.live)} sequences are queued or running already"
        if reason is not None:
            self.dropped_router_in += 1
            return reason
        self.live.add(msg.req_id)
        return None

    def usable_id(self, msg: GenerateRequest) -> bool:
        """Whether a refused request may be answered under its id (it clashes with nothing)."""
        return 0 < msg.req_id <= INT64_MAX and msg.req_id not in self.live

    def finished(self, req_id: int) -> None:
        self.live.discard(req_id)

    def _prompt(self, ids: list[int]) -> str | None:
        limit = self.limits.max_prompt
        if not 0 < len(ids) <= limit:
            return f"prompt of {len(ids)} tokens, want 1..{limit}"
        low, high = min(ids), max(ids)
        if low < 0 or high >= self.limits.vocab_size:
            return f"token id {low if low < 0 else high} outside the vocabulary [0, {self.limits.vocab_size})"
        return None

    def result(self, result: StepResult, plan: StepPlan) -> str | None:
        """None if `result` answers `plan` with usable tokens, else why not (the step then counts as failed)."""
        reason = _result(result, plan, self.limits.vocab_size)
        if reason is not None:
            self.dropped_results += 1
        return reason


def _sampling(s: SamplingParams, vocab_size: int) -> str | None:
    if s.max_tokens < 1:
        return f"max_tokens {s.max_tokens} < 1"
    if not (math.isfinite(s.temperature) and s.temperature >= 0):
        return f"temperature {s.temperature}"
    if not (math.isfinite(s.top_p) and 0 < s.top_p <= 1):
        return f"top_p {s.top_p}"
    if s.top_k is not None and s.top_k < 1:
        return f"top_k {s.top_k}"
    if s.logprobs is not None and not 0 <= s.logprobs <= min(MAX_LOGPROBS, vocab_size):
        return f"logprobs {s.logprobs}"
    return _processing(s, vocab_size)


def _within(value: float, low: float, high: float) -> bool:
    return math.isfinite(value) and low <= value <= high


def _processing(s: SamplingParams, vocab_size: int) -> str | None:
    """The fields hkv/engine/logits_process.py uses (token ids as indexes, sizes of masks)."""
    if not _within(s.min_p, 0.0, 1.0):
        return f"min_p {s.min_p}"
    for name in ("presence_penalty", "frequency_penalty"):
        if not _within(getattr(s, name), -2.0, 2.0):
            return f"{name} {getattr(s, name)}"
    if not (_within(s.repetition_penalty, 0.0, 2.0) and s.repetition_penalty > 0):
        return f"repetition_penalty {s.repetition_penalty}"
    if len(s.logit_bias) > MAX_LOGIT_BIAS:
        return f"a logit_bias of {len(s.logit_bias)} tokens (at most {MAX_LOGIT_BIAS})"
    for token, bias in s.logit_bias.items():
        if not 0 <= token < vocab_size or not _within(bias, -MAX_LOGIT_BIAS_VALUE, MAX_LOGIT_BIAS_VALUE):
            return f"logit_bias {token}: {bias}"
    c = s.constraint
    if c is not None and (c.kind not in CONSTRAINT_KINDS or len(c.spec) > MAX_CONSTRAINT_CHARS):
        return f"a {c.kind!r} constraint of {len(c.spec)} characters"
    return None


def _result(result: StepResult, plan: StepPlan, vocab_size: int) -> str | None:
    if result.error is not None:
        return None  # a failed step is a valid answer: it carries no tokens to use
    sampling_slots = [c.slot for c in plan.chunks if c.sample]
    if [s.slot for s in result.sampled] != sampling_slots:
        return f"sampled slots {[s.slot for s in result.sampled][:8]} do not match the plan's {sampling_slots[:8]}"
    if not all(0 <= n <= MAX_CACHE_FILLS for n in (result.grammar_cache_hits, result.grammar_cache_misses)):
        return f"grammar cache figures out of range ({result.grammar_cache_hits}, {result.grammar_cache_misses})"
    if not 0 <= result.grammar_rows <= len(result.sampled) or not all(
            _within(v, 0.0, 3600.0) for v in (result.grammar_mask_s, result.grammar_wait_s)):
        return f"grammar figures out of range ({result.grammar_rows} rows, {result.grammar_mask_s} s, " \
               f"{result.grammar_wait_s} s)"
    drafts = {c.slot: c.drafts for c in plan.chunks if c.sample}
    for s in result.sampled:
        if len(s.extra) > drafts[s.slot]:
            return f"{1 + len(s.extra)} tokens emitted for a chunk verifying {drafts[s.slot]} drafts"
        if len(s.proposals) > MAX_SPEC_TOKENS:
            return f"{len(s.proposals)} draft proposals (at most {MAX_SPEC_TOKENS})"
        if any(not 0 <= t < vocab_size for t in s.proposals):
            return "a draft proposal outside the vocabulary"
        for tok in (s, *s.extra):
            if not 0 <= tok.token_id < vocab_size:
                return f"sampled token id {tok.token_id} outside the vocabulary"
            if tok.logprob is not None and math.isnan(tok.logprob):
                return "a NaN logprob"
            if tok.top_logprobs is not None and any(not 0 <= t.token_id < vocab_size for t in tok.top_logprobs):
                return "a top-logprob token id outside the vocabulary"
    return None
