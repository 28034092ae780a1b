"""The router's inbox checks (issue 16, item 7): every field checked before it is an index or a size."""

from __future__ import annotations

import math

import pytest

from hkv.engine.validate import MAX_CACHE_FILLS, InboxCheck, RouterLimits
from hkv.ipc.messages import (
    MAX_CONSTRAINT_CHARS, Chunk, Constraint, GenerateRequest, Sampled, SamplingParams, StepPlan, StepResult, TopLogprob,
)  # fmt: skip

LIMITS = RouterLimits(vocab_size=100, max_context=64, row_tokens=80, kv_tokens=48, max_live=3)


def _req(req_id: int = 1, prompt=(1, 2, 3), **sampling) -> GenerateRequest:
    return GenerateRequest(req_id, list(prompt), SamplingParams(**{"max_tokens": 4, **sampling}))


def test_a_valid_request_becomes_live_until_it_finishes():
    check = InboxCheck(LIMITS)
    assert check.generate(_req(7)) is None and check.live == {7}
    assert check.generate(_req(7)) == "reused or out-of-range req_id" and not check.usable_id(_req(7))
    check.finished(7)
    assert check.generate(_req(7)) is None
    assert check.dropped_router_in == 1


@pytest.mark.parametrize("req, fragment", [
    (_req(0), "req_id"),
    (_req(2**63), "req_id"),
    (_req(prompt=()), "prompt of 0 tokens"),
    (_req(prompt=[1] * 48), "prompt of 48 tokens, want 1..47"),  # min(context, row, kv) - 1
    (_req(prompt=[1, 10**6]), "token id 1000000 outside the vocabulary"),
    (_req(prompt=[-1, 2]), "token id -1"),
    (_req(max_tokens=0), "max_tokens"),
    (_req(temperature=math.nan), "temperature"),
    (_req(temperature=-1.0), "temperature"),
    (_req(top_p=0.0), "top_p"),
    (_req(top_k=0), "top_k"),
    (_req(logprobs=21), "logprobs"),
    (_req(min_p=1.5), "min_p"),
    (_req(presence_penalty=-2.5), "presence_penalty"),
    (_req(frequency_penalty=math.inf), "frequency_penalty"),
    (_req(repetition_penalty=0.0), "repetition_penalty"),
    (_req(logit_bias={100: 1.0}), "logit_bias 100"),
    (_req(logit_bias={3: 101.0}), "logit_bias 3"),
    (_req(logit_bias={t: 0.5 for t in range(301)}), "a logit_bias of 301 tokens"),
    (_req(constraint=Constraint("ebnf", "x")), "'ebnf' constraint"),
    (_req(constraint=Constraint("regex", "a" * (MAX_CONSTRAINT_CHARS + 1))), "'regex' constraint"),
])
def test_bad_fields_are_refused_and_counted(req, fragment):
    check = InboxCheck(LIMITS)
    reason = check.generate(req)
    assert reason is not None and fragment in reason
    assert check.dropped_router_in == 1 and check.live == set()
    assert check.usable_id(req) == (fragment != "req_id")


def test_no_more_live_sequences_than_the_api_could_have_in_flight():
    check = InboxCheck(LIMITS)
    assert [check.generate(_req(i)) for i in (1, 2, 3)] == [None, None, None]
    assert "3 sequences are queued or running" in check.generate(_req(4)) and check.usable_id(_req(4))
    check.finished(2)
    assert check.generate(_req(4)) is None


def _plan() -> StepPlan:
    chunks = [Chunk(0, [1, 2], 0, True), Chunk(1, [3], 5, False), Chunk(2, [4], 7, True)]
    return StepPlan(step=3, new=[], chunks=chunks, freed=[])


@pytest.mark.parametrize("sampled, fragment", [
    ([Sampled(0, 5, None, None), Sampled(2, 6, None, None)], None),
    ([Sampled(0, 5, None, None)], "sampled slots"),
    ([Sampled(2, 5, None, None), Sampled(0, 6, None, None)], "sampled slots"),
    ([Sampled(0, 100, None, None), Sampled(2, 6, None, None)], "token id 100"),
    ([Sampled(0, 5, math.nan, None), Sampled(2, 6, None, None)], "NaN"),
    ([Sampled(0, 5, -1.0, [TopLogprob(10**6, -2.0)]), Sampled(2, 6, None, None)], "top-logprob"),
])
def test_results_must_answer_the_plan(sampled, fragment):
    check = InboxCheck(LIMITS)
    reason = check.result(StepResult(3, sampled, 0.01), _plan())
    assert (reason is None) == (fragment is None) and (fragment is None or fragment in reason)
    assert check.dropped_results == (fragment is not None)


def test_a_failed_step_is_a_valid_answer():
    assert InboxCheck(LIMITS).result(StepResult(3, [], 0.0, "boom"), _plan()) is None


@pytest.mark.parametrize("figures, ok", [
    (dict(grammar_rows=2, grammar_mask_s=0.004, grammar_wait_s=0.001), True),
    (dict(grammar_rows=3), False),  # more live rows than sampled ones
    (dict(grammar_rows=-1), False),
    (dict(grammar_rows=1, grammar_mask_s=math.nan), False),
    (dict(grammar_rows=1, grammar_wait_s=-0.5), False),
    (dict(grammar_rows=1, grammar_mask_s=math.inf), False),
    (dict(grammar_rows=2, grammar_cache_hits=7, grammar_cache_misses=3), True),
    (dict(grammar_cache_hits=5), True),  # fills a background fill made after its own step's result
    (dict(grammar_cache_hits=-1), False),
    (dict(grammar_cache_misses=MAX_CACHE_FILLS + 1), False),
])
def test_a_results_grammar_figures_are_checked(figures, ok):
    """grammar_rows against the sampled rows, the seconds finite and >= 0, the cache's fills in 0..MAX_CACHE_FILLS."""
    sampled = [Sampled(0, 5, None, None), Sampled(2, 6, None, None)]
    reason = InboxCheck(LIMITS).result(StepResult(3, sampled, 0.01, **figures), _plan())
    assert (reason is None) == ok and (ok or "grammar" in reason and "figures out of range" in reason)
