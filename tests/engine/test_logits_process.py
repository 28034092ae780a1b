"""The rank's logits processing: bias and penalties against a per-token reference, the count pools
through admission, sampling, preemption and reuse, and the grammar mask's bookkeeping."""

from __future__ import annotations

import json

import pytest
import torch

from hkv.engine.logits_process import GrammarLoader, LogitsProcessor
from hkv.ipc.messages import Constraint, NewSequence, SamplingParams
from hkv.models.tiny import SHIPPED_DIR

V = 4096
EOS = 0


def seq(slot: int, req_id: int, prompt=(), output=(), **params) -> NewSequence:
    return NewSequence(slot, req_id, SamplingParams(max_tokens=8, **params), None, list(prompt), list(output))


def reference(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """The documented order, one token at a time: bias, repetition (prompt and output), frequency, presence."""
    out = logits.clone()
    for t, b in params.logit_bias.items():
        out[t] += b
    for t in set(prompt) | set(output):
        r = params.repetition_penalty
        out[t] = out[t] / r if out[t] > 0 else out[t] * r
    for t in set(output):
        out[t] -= params.frequency_penalty * output.count(t) + params.presence_penalty
    return out


def test_bias_and_penalties_equal_the_reference_and_plain_rows_are_untouched():
    proc = LogitsProcessor(V, torch.device("cpu"), None)
    plans = {
        3: (dict(logit_bias={5: 2.5, 7: -100.0}), [], []),
        1: (dict(repetition_penalty=1.3), [5, 9, 9, 11], [12, 5]),
        4: (dict(frequency_penalty=0.7, presence_penalty=-0.4, repetition_penalty=0.8, logit_bias={12: 1.0}),
            [1, 2], [12, 12, 40, 3, 12]),
    }
    for slot, (params, prompt, output) in plans.items():
        proc.admit(seq(slot, 100 + slot, prompt, output, **params))
    slots = [0, 3, 1, 2, 4]  # 0 and 2 are plain
    torch.manual_seed(0)
    logits = torch.randn(len(slots), V) * 3
    before = logits.clone()
    rows = proc.rows(slots)
    assert rows == [1, 2, 4]
    proc.apply(logits, slots, rows)
    for i, slot in enumerate(slots):
        if slot in plans:
            params, prompt, output = plans[slot]
            want = reference(before[i], SamplingParams(max_tokens=8, **params), prompt, output)
            torch.testing.assert_close(logits[i], want, rtol=0, atol=1e-5)
        else:
            assert torch.equal(logits[i], before[i])


def test_sampled_tokens_count_from_then_on_and_a_readmission_starts_over():
    proc = LogitsProcessor(V, torch.device("cpu"), None)
    proc.admit(seq(2, 7, output=[4], frequency_penalty=1.0))
    slots = [2]
    for token in (4, 9):
        proc.sampled(slots, [0], torch.tensor([token]))
    logits = torch.zeros(1, V)
    proc.apply(logits, slots, [0])
    assert logits[0, 4] == -2.0 and logits[0, 9] == -1.0 and logits[0].sum() == -3.0
    # preempted and admitted again: the router's output so far is the history, the rank's counts go
    proc.drop(2)
    proc.admit(seq(2, 7, output=[4, 9], frequency_penalty=1.0))
    logits = torch.zeros(1, V)
    proc.apply(logits, slots, [0])
    assert logits[0, 4] == -1.0 and logits[0, 9] == -1.0


def test_the_count_pools_grow_and_a_freed_row_comes_back_clean():
    proc = LogitsProcessor(V, torch.device("cpu"), None)
    for slot in range(20):
        proc.admit(seq(slot, slot + 1, prompt=[slot], output=[slot], repetition_penalty=2.0))
    assert proc.counts.shape[0] == 32  # 8, 16, 32 rows
    assert sorted(s.row for s in proc.slots.values()) == list(range(20))
    proc.drop(5)
    proc.admit(seq(30, 99, repetition_penalty=2.0))  # takes the freed row: nothing of slot 5's is left in it
    row = proc.slots[30].row
    assert proc.counts[row].sum() == 0 and not proc.prompt[row].any()
    proc.admit(seq(31, 98))  # a plain sequence takes nothing
    assert 31 not in proc.slots and proc.rows([31, 30]) == [1]


def test_plain_steps_find_nothing_to_do():
    proc = LogitsProcessor(V, torch.device("cpu"), None)
    proc.admit(seq(0, 1, temperature=0.5, min_p=0.2))  # sampling knobs alone are the sampler's
    assert proc.slots == {} and proc.rows([0, 1]) == [] and proc.matched([0]) is None


@pytest.fixture(scope="module")
def loader() -> GrammarLoader:
    return GrammarLoader(str(SHIPPED_DIR / "tokenizer.json"), V, [EOS])


def test_a_grammar_row_is_masked_and_waits_for_its_tokens(loader):
    proc = LogitsProcessor(V, torch.device("cpu"), loader)
    proc.admit(seq(1, 5, constraint=Constraint("regex", "[0-9]{3}")))
    proc.admit(seq(2, 6))
    slots = [2, 1]
    assert proc.matched(slots) == {1: 5} and not proc.behind(slots)
    logits = torch.zeros(2, V)
    proc.apply(logits, slots, proc.rows(slots))
    allowed = (logits[1] == 0).nonzero().flatten().tolist()
    digits = set(loader.get().tokenizer.tokenize_str("0123456789"))
    assert allowed and set(allowed) <= set(range(V)) and len(allowed) < 40
    assert digits & set(allowed) and torch.equal(logits[0], torch.zeros(V))
    token = allowed[0]
    proc.sampled(slots, [1], torch.tensor([0, token]))
    assert proc.behind(slots)
    proc.consume(1, 4, [token])  # another request's answer for this slot: ignored
    assert proc.behind(slots)
    proc.consume(1, 5, [token])
    assert not proc.behind(slots)


def test_the_mask_fill_is_timed_and_its_live_rows_counted(loader, monkeypatch):
    """StepResult.grammar_mask_s / grammar_rows: a fill that takes 50 ms more shows as >= 50 ms; a finished
    matcher (EOS only) is no live row, a plain row none at all."""
    import time

    from hkv.engine import logits_process

    real = logits_process.fill_masks

    def slow_fill(matchers, masks, executor=None):
        time.sleep(0.05)
        real(matchers, masks, executor)

    monkeypatch.setattr(logits_process, "fill_masks", slow_fill)
    proc = LogitsProcessor(V, torch.device("cpu"), loader)
    proc.admit(seq(1, 5, constraint=Constraint("regex", "[0-9]{3}")))
    proc.admit(seq(2, 6, constraint=Constraint("regex", "[0-9]{3}")))
    proc.admit(seq(3, 7, logit_bias={5: 1.0}))
    proc.slots[2].matcher.failed = True  # only EOS from now on: filled here, not by llguidance
    slots = [3, 1, 2, 0]
    mask_s, live = proc.apply(torch.zeros(4, V), slots, proc.rows(slots))
    assert live == 1 and 0.05 <= mask_s < 5.0
    assert proc.apply(torch.zeros(1, V), [3], [0]) == (0.0, 0)  # no grammar row: nothing filled, nothing timed


def test_grammars_take_the_thread_count(loader):
    threaded = GrammarLoader(str(SHIPPED_DIR / "tokenizer.json"), V, [EOS], threads=2)
    proc = LogitsProcessor(V, torch.device("cpu"), threaded)
    proc.admit(seq(1, 5, constraint=Constraint("regex", "[0-9]{3}")))
    logits = torch.zeros(1, V)
    _, live = proc.apply(logits, [1], [0])
    assert live == 1 and threaded._threads == 2
    reference = torch.zeros(1, V)
    other = LogitsProcessor(V, torch.device("cpu"), loader)
    other.admit(seq(1, 5, constraint=Constraint("regex", "[0-9]{3}")))
    other.apply(reference, [1], [0])
    assert torch.equal(logits, reference)  # two threads mask as the default count does


def test_a_grammar_that_fails_on_the_rank_ends_its_sequence(loader, caplog):
    proc = LogitsProcessor(V, torch.device("cpu"), loader)
    proc.admit(seq(0, 9, constraint=Constraint("lark", "start: nothing_defined")))
    assert "its grammar failed on the rank" in caplog.text
    logits = torch.zeros(1, V)
    proc.apply(logits, [0], [0])
    assert (logits[0] == 0).nonzero().flatten().tolist() == [EOS]


def test_a_resumed_grammar_row_continues_after_its_output(loader):
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                         "additionalProperties": False})
    ids = loader.get().tokenizer.tokenize_str('{"a": 12')
    proc = LogitsProcessor(V, torch.device("cpu"), loader)
    proc.admit(seq(0, 9, output=ids, constraint=Constraint("json_schema", schema)))
    logits = torch.zeros(1, V)
    proc.apply(logits, [0], [0])
    texts = {loader.get().tokenizer.decode_str([t]) for t in (logits[0] == 0).nonzero().flatten().tolist()}
    assert "}" in texts and all(t[0] in "0123456789}" for t in texts)


def test_a_tiny_repetition_penalty_keeps_the_logits_finite():
    """repetition_penalty 5e-324 (inside (0, 2]) divides a positive logit by what float32 rounds to 0."""
    proc = LogitsProcessor(V, torch.device("cpu"), None)
    proc.admit(seq(0, 1, prompt=[3, 4], repetition_penalty=5e-324))
    logits = torch.ones(1, V)
    logits[0, 4] = -1.0
    proc.apply(logits, [0], [0])
    assert torch.isfinite(logits).all() and logits[0, 3] == 1e30 and logits[0, 4] == 0.0
