"""tools/bench/bench_grammar.py on the built-in 4,096-token tokenizer: the vocabulary as both libraries see it,
llguidance's walks (every token allowed, every finished walk an answer of its schema), and the measure's
report; xgrammar only where it is installed (it is not an hkv dependency)."""

from __future__ import annotations

import json

import pytest

from tools.bench.bench_grammar import (
    BUILTIN, GRAMMARS, Grammar, Llguidance, Side, check_vocab, load_vocab, measure, replay, walk,
)

GRAMMAR = {g.name: g for g in GRAMMARS}


@pytest.fixture(scope="module")
def vocab():
    return load_vocab(BUILTIN)


@pytest.fixture(scope="module")
def llg(vocab):
    return Llguidance(vocab, threads=2)


def _answer(tokens: list[int], vocab) -> object:
    assert vocab.is_eos[tokens[-1]] and not vocab.is_eos[tokens[:-1]].any()
    return json.loads(b"".join(vocab.tokens[t] for t in tokens[:-1]))


def test_the_vocabulary_as_tokenizer_json_spells_it(vocab, llg):
    assert vocab.size == 4096 and vocab.words == 128
    assert vocab.eos == (2, 0) and vocab.special == (1,)  # <|im_end|>, <|endoftext|>; <|im_start|>
    assert vocab.tokens[:3] == [b"<|endoftext|>", b"<|im_start|>", b"<|im_end|>"]
    assert vocab.encoded[223] == "Ġ" and vocab.tokens[223] == b" "  # byte-level: U+0120 stands for a space
    # llguidance reads every token's bytes alike, but the lone 0xFF byte (its special-token marker) as empty
    assert check_vocab(vocab, llg) == {"differ": 1, "examples": ["190: b'\\xff' vs b''"]}


def test_walks_of_the_flat_schema_are_its_answers(vocab, llg):
    side = Side(llg, llg.compile(GRAMMAR["flat"]))
    statuses = set()
    for seed in range(6):
        run = walk([side], 0, vocab, seed, steps=256)
        assert run.complete and run.driver == "llguidance" and run.special == {}
        answer = _answer(run.tokens, vocab)
        assert list(answer) == ["status", "age", "admin", "name"]  # all required, in order, nothing else
        assert 0 <= answer["age"] <= 150 and isinstance(answer["admin"], bool) and len(answer["name"]) <= 20
        statuses.add(answer["status"])
        fill_ns, consume_ns = replay(side, run.tokens, vocab)  # asserts each token allowed on a fresh matcher
        assert len(fill_ns) == len(consume_ns) == len(run.tokens)
    assert statuses <= {"active", "inactive", "banned"} and len(statuses) > 1


def test_optional_fields_come_and_go_but_consts_stay(vocab, llg):
    side = Side(llg, llg.compile(GRAMMAR["const_optional"]))
    answers = [_answer(walk([side], 0, vocab, seed, steps=256).tokens, vocab) for seed in range(8)]
    assert all((a["version"], a["kind"]) == (2, "event") for a in answers)
    assert all(set(a) <= {"version", "kind", "note", "count", "flag"} for a in answers)
    assert {len(a) for a in answers} != {2} and any(len(a) == 2 for a in answers)


def test_measure_with_llguidance_alone(vocab, llg):
    result = measure(GRAMMAR["flat"], [llg], vocab, walks=4, steps=256, batch=4)
    lib = result["libraries"]["llguidance"]
    assert lib["compiles"] and lib["compile_ms"] > 0 and lib["again_ms"] > 0
    assert result["complete"] == result["timed_walks"] == 4 and result["answers_valid"] == {"llguidance": (4, 4)}
    assert result["rejected_by"] == {"llguidance": 0} and result["compared_steps"] == 0
    assert 0 < lib["mask_us_median"] <= lib["mask_us_p99"] and 0 < lib["batch_ms_per_step"] <= lib["batch_ms_max"]


def test_a_schema_it_cannot_compile_is_reported(vocab, llg):
    result = measure(GRAMMAR["unique_items"], [llg], vocab, walks=2, steps=16, batch=2)
    assert result["libraries"] == {"llguidance": {"compiles": False, "error": 'Unimplemented keys: ["uniqueItems"]'}}
    bad_ref = Grammar("bad", "json_schema", {"$ref": "#/$defs/missing"})
    assert not measure(bad_ref, [llg], vocab, walks=2, steps=16, batch=2)["libraries"]["llguidance"]["compiles"]


def test_xgrammar_in_lockstep_on_the_lark_grammar(vocab, llg):
    pytest.importorskip("xgrammar", reason="xgrammar is the benchmark's comparison, not an hkv dependency")
    from tools.bench.bench_grammar import Xgrammar

    xgr = Xgrammar(vocab, threads=2)
    assert check_vocab(vocab, xgr) == {"differ": 0, "examples": []}
    result = measure(GRAMMAR["lark"], [llg, xgr], vocab, walks=4, steps=64, batch=4)
    # no forced text to tokenize and no strings: the two masks agree at every step
    assert result["compared_steps"] > 0 and result["differing_steps"] == 0
    assert result["rejected_by"] == {"llguidance": 0, "xgrammar": 0} and result["timed_walks"] == 4
