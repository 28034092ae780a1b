"""Sampler: greedy, seeded randomness independent of batch mix, top-k/top-p, logprobs."""

from __future__ import annotations

import math

import torch

from hkv.engine.sampler import SampleRow, sample
from hkv.ipc.messages import SamplingParams


def row(position=5, **kw):
    return SampleRow(SamplingParams(max_tokens=1, **kw), position)


def test_greedy_takes_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 0.0]])
    outs = sample(logits, [row(), row()])
    assert [o.token_id for o in outs] == [1, 0]
    assert outs[0].logprob is None


def test_seeded_draw_is_independent_of_batch_neighbours():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    alone = sample(logits[1:2], [row(temperature=1.0, seed=11)])[0].token_id
    mixed = sample(logits, [row(), row(temperature=1.0, seed=11), row(temperature=0.7, seed=3)])[1].token_id
    assert alone == mixed


def test_seed_and_position_change_the_draw():
    logits = torch.zeros(1, 1000)
    draws = {sample(logits, [row(temperature=1.0, seed=s, position=p)])[0].token_id for s in range(4) for p in range(4)}
    assert len(draws) > 8


def test_top_k_one_is_greedy_and_top_p_keeps_the_nucleus():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0]])
    for seed in range(20):
        assert sample(logits, [row(temperature=1.0, top_k=1, seed=seed)])[0].token_id == 0
    probs = torch.softmax(logits[0], -1)
    assert probs[0] < 0.6 < probs[0] + probs[1]
    seen = {sample(logits, [row(temperature=1.0, top_p=0.6, seed=s)])[0].token_id for s in range(60)}
    assert seen == {0, 1}


def test_logprobs_and_top_logprobs():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    (out,) = sample(logits, [row(logprobs=2)])
    expected = torch.log_softmax(logits[0], -1)
    assert out.token_id == 2
    assert math.isclose(out.logprob, float(expected[2]), rel_tol=1e-6)
    assert [t.token_id for t in out.top_logprobs] == [2, 1]


def test_extreme_but_valid_parameters_still_give_a_token():
    """Issue 16: top_p=5e-324 rounds to 0 in float32 and a tiny temperature overflows; both failed the step."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0]])
    for params in ({"temperature": 1.0, "top_p": 5e-324}, {"temperature": 5e-324}, {"temperature": 1e-30, "seed": 3}):
        outs = sample(logits, [row(**params), row(**params)])
        assert outs[0].token_id == 0 and 0 <= outs[1].token_id < 4


def test_min_p_drops_the_unlikely_and_keeps_the_most_likely():
    """Issue 37: min_p keeps the tokens at least min_p times as likely as the most likely one."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen = {sample(logits, [row(temperature=1.0, min_p=0.25, seed=s)])[0].token_id for s in range(200)}
    assert seen == {0, 1, 2}  # 0.05 < 0.25 * 0.5
    seen = {sample(logits, [row(temperature=1.0, min_p=1.0, seed=s)])[0].token_id for s in range(20)}
    assert seen == {0}
    many = {sample(logits, [row(temperature=1.0, seed=s)])[0].token_id for s in range(200)}
    assert many == {0, 1, 2, 3}
