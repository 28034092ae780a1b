"""Speculative verify: greedy equals plain greedy, random keeps the target's distribution, logprobs, lengths."""

from __future__ import annotations

import math

import pytest
import torch

from hkv.engine.sampler import SampleRow, sample
from hkv.engine.spec_verify import _final_draw, verify
from hkv.ipc.messages import SamplingParams

# Upper 0.001 critical values of the chi-square distribution by degrees of freedom, from the
# NIST/SEMATECH e-Handbook of Statistical Methods, table 1.3.6.7.4 ("Critical Values of the
# Chi-Square Distribution"). scipy is not in the venv.
CHI2_CRIT_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}


def row(position=5, **kw):
    return SampleRow(SamplingParams(max_tokens=1, **kw), position)


def tokens(verified):
    return [o.token_id for o in verified.outputs]


def test_greedy_keeps_the_argmax_prefix_and_emits_the_next_argmax():
    torch.manual_seed(0)
    k, vocab = 4, 50
    logits = torch.randn(k + 1, vocab)
    chain = logits.argmax(dim=-1).tolist()  # what plain greedy emits given the drafts so far
    for j in range(k + 1):
        drafts = chain[:j] + [(t + 1) % vocab for t in chain[j:k]]
        out = verify(logits, drafts, row())
        assert out.accepted == j
        assert tokens(out) == chain[: j + 1]
        assert tokens(out) == [sample(logits[i : i + 1], [row(position=5 + i)])[0].token_id for i in range(j + 1)]
    assert len(verify(logits, chain[:k], row()).outputs) == k + 1


@pytest.mark.parametrize(
    "params",
    [
        {},
        {"logprobs": 3},
        {"temperature": 1.0},
        {"temperature": 0.7, "top_k": 5},
        {"temperature": 1.3, "top_p": 0.9},
        {"temperature": 0.8, "top_k": 20, "top_p": 0.5, "logprobs": 0},
        {"temperature": 1.0, "top_k": 1},
        {"temperature": 1.2, "min_p": 0.1},
        {"temperature": 0.9, "top_k": 30, "top_p": 0.8, "min_p": 0.3},
    ],
)
def test_no_drafts_equals_sample(params):
    torch.manual_seed(1)
    logits = torch.randn(1, 100) * 2
    for seed in range(12):
        r = row(position=3 + seed, seed=seed, **params)
        out = verify(logits, [], r)
        assert out.accepted == 0
        assert out.outputs == sample(logits, [r])


def _reference_probs(logits: torch.Tensor, temperature: float, top_k=None, top_p=1.0) -> list[float]:
    """The filtered target distribution, computed independently in plain Python."""
    scaled = [x / temperature for x in logits.tolist()]
    order = sorted(range(len(scaled)), key=lambda t: -scaled[t])
    keep = order if top_k is None else order[:top_k]
    z = sum(math.exp(scaled[t]) for t in keep)
    probs = {t: math.exp(scaled[t]) / z for t in keep}
    nucleus, mass = [], 0.0
    for t in keep:
        if mass >= top_p and nucleus:
            break
        nucleus.append(t)
        mass += probs[t]
    z = sum(probs[t] for t in nucleus)
    return [probs[t] / z if t in nucleus else 0.0 for t in range(len(scaled))]


def _chi2_fits(counts: list[int], probs: list[float]) -> None:
    """Pearson goodness of fit at p = 0.001; bins expecting fewer than 5 are pooled."""
    n = sum(counts)
    assert all(c == 0 for c, p in zip(counts, probs) if p == 0.0), "drew a token the filter removes"
    bins = sorted(((n * p, c) for c, p in zip(counts, probs) if p > 0.0), reverse=True)
    while len(bins) > 1 and bins[-1][0] < 5:  # pool the smallest bin into the next smallest
        e, c = bins.pop()
        bins[-1] = (bins[-1][0] + e, bins[-1][1] + c)
    if len(bins) < 2:
        return  # too few samples to say anything
    stat = sum((c - e) ** 2 / e for e, c in bins)
    assert stat < CHI2_CRIT_001[len(bins) - 1], (stat, counts, [round(n * p, 1) for p in probs])


def _chi2_same(a: list[int], b: list[int]) -> None:
    """Two-sample chi-square for equal sample sizes (Numerical Recipes' chstwo) at p = 0.001."""
    assert sum(a) == sum(b)
    bins = [(x, y) for x, y in zip(a, b) if x + y > 0]
    stat = sum((x - y) ** 2 / (x + y) for x, y in bins)
    assert stat < CHI2_CRIT_001[len(bins) - 1], (stat, a, b)


LOGITS = torch.tensor(
    [
        [1.5, 0.8, 0.3, 0.0, -0.3, -0.6, -1.0, 0.2],  # p at T=0.8: token 0 ~0.45, token 6 ~0.02
        [-0.5, 1.2, 0.1, 0.9, -1.0, 0.4, 0.0, -0.2],
        [0.3, -0.4, 1.0, 0.2, 0.6, -0.8, 0.0, 0.5],
    ]
)


@pytest.mark.parametrize("first_draft", [0, 6], ids=["likely", "unlikely"])
@pytest.mark.parametrize("filters", [{}, {"top_k": 6, "top_p": 0.9}], ids=["plain", "topk-topp"])
def test_random_rows_keep_the_target_distribution(first_draft, filters):
    n, vocab, temperature = 4000, LOGITS.shape[1], 0.8
    drafts = [first_draft, 3]
    if filters and first_draft == 6:
        drafts = [7, 3]  # token 6 is filtered out; 7 is the least likely survivor
    first, second, bonus, plain = ([0] * vocab for _ in range(4))
    for seed in range(n):
        out = verify(LOGITS, drafts, row(temperature=temperature, seed=seed, **filters))
        assert len(out.outputs) == out.accepted + 1
        first[out.outputs[0].token_id] += 1
        if out.accepted >= 1:
            second[out.outputs[1].token_id] += 1
        if out.accepted == 2:
            bonus[out.outputs[2].token_id] += 1
        plain[sample(LOGITS[:1], [row(temperature=temperature, seed=n + seed, **filters)])[0].token_id] += 1
    ref = [_reference_probs(LOGITS[i], temperature, **filters) for i in range(3)]
    _chi2_fits(first, ref[0])  # (a) the first token is a draw from the target
    _chi2_same(first, plain)  # (b) and looks like plain sampling
    _chi2_fits(second, ref[1])  # given the first draft kept, the second token is a draw from row 1
    _chi2_fits(bonus, ref[2])  # given both kept, the bonus is a draw from row 2
    assert 0 < first[drafts[0]] < n  # both branches ran


@pytest.mark.parametrize("params", [{"logprobs": 4}, {"logprobs": 4, "temperature": 1.0, "seed": 9}])
def test_logprobs_come_from_the_scoring_row(params):
    torch.manual_seed(2)
    k, vocab = 3, 30
    logits = torch.randn(k + 1, vocab)
    chain = logits.argmax(dim=-1).tolist()
    for drafts in (chain[:k], [chain[0], (chain[1] + 1) % vocab, chain[2]], [(chain[0] + 1) % vocab] * k):
        out = verify(logits, drafts, row(**params))
        for i, o in enumerate(out.outputs):
            expected = torch.log_softmax(logits[i], dim=-1)
            assert math.isclose(o.logprob, float(expected[o.token_id]), rel_tol=1e-6, abs_tol=1e-6)
            values, ids = torch.topk(expected, 4)
            assert [t.token_id for t in o.top_logprobs] == ids.tolist()
            assert all(math.isclose(t.logprob, v, rel_tol=1e-6) for t, v in zip(o.top_logprobs, values.tolist()))
    assert all(o.logprob is None and o.top_logprobs is None for o in verify(logits, chain[:k], row()).outputs)


def test_output_lengths_and_determinism():
    torch.manual_seed(3)
    k, vocab = 4, 20
    logits = torch.randn(k + 1, vocab)
    chain = logits.argmax(dim=-1).tolist()
    # accept all: greedy with the argmax chain, and a random row with top_k=1 (p(draft) == 1)
    for r in (row(), row(temperature=1.0, top_k=1, seed=4)):
        out = verify(logits, chain[:k], r)
        assert out.accepted == k and tokens(out) == chain
    # reject at the first draft: greedy with a wrong draft, and a random row whose draft top_k removed (p == 0)
    wrong = [(chain[0] + 1) % vocab] + chain[1:k]
    for r in (row(), row(temperature=1.0, top_k=1, seed=4)):
        out = verify(logits, wrong, r)
        assert out.accepted == 0 and tokens(out) == chain[:1]
    # any drafts: kept drafts come out unchanged, a rejected draft is never the replacement
    gen = torch.Generator().manual_seed(5)
    for seed in range(200):
        n_drafts = seed % (k + 1)
        drafts = torch.randint(0, 4, (n_drafts,), generator=gen).tolist()  # small ids: often accepted
        scores = logits[: n_drafts + 1].clone()
        scores[:, :4] += 2.0
        r = row(temperature=1.0, top_p=0.95, seed=seed, position=seed)
        out = verify(scores, drafts, r)
        assert len(out.outputs) == out.accepted + 1 <= n_drafts + 1
        assert tokens(out)[: out.accepted] == drafts[: out.accepted]
        if out.accepted < n_drafts:
            assert tokens(out)[out.accepted] != drafts[out.accepted]
        assert verify(scores, drafts, r) == out
    with pytest.raises(ValueError):
        verify(logits, chain[: k - 1], row())


def test_empty_residual_falls_back_to_the_target():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0])
    params = SamplingParams(max_tokens=1, temperature=1.0, top_k=1)
    assert _final_draw(logits, 1, params, 0) == 1
