"""Constraints as grammars (llguidance): what compiles, what a bad spec says, and that a random walk
over the allowed tokens produces text the constraint describes, on the built-in tokenizer."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch
from tokenizers import Tokenizer

from hkv.engine.grammar import GrammarError, Grammars, Matcher, check_constraint, fill_masks, mask_words
from hkv.ipc.messages import MAX_CONSTRAINT_CHARS, Constraint
from hkv.models.tiny import SHIPPED_DIR

TOKENIZER = str(SHIPPED_DIR / "tokenizer.json")
VOCAB = 4096 + 64  # the model's rows may pass the tokenizer's: those ids are never allowed
EOS = 0


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    return Grammars(TOKENIZER, VOCAB, [EOS])


def allowed(mask: torch.Tensor) -> list[int]:
    """Token ids whose bit is set in one [words] int32 mask."""
    bits = (mask.to(torch.int64).unsqueeze(-1) >> torch.arange(32)) & 1
    return bits.flatten().nonzero().flatten().tolist()


def walk(grammars: Grammars, constraint: Constraint, seed: int, steps: int = 200) -> tuple[list[int], bool]:
    """A random walk through the grammar: (tokens before EOS, whether it ended with EOS)."""
    rng = random.Random(seed)
    matcher = grammars.matcher(constraint)
    masks = torch.empty(1, grammars.words, dtype=torch.int32)
    out = []
    for _ in range(steps):
        grammars.fill([matcher], masks)
        choices = allowed(masks[0])
        assert choices, "a live grammar allowed nothing"
        assert all(t < 4096 for t in choices), "a padding id past the tokenizer was allowed"
        plain = [t for t in choices if t != EOS]
        token = rng.choice(plain) if plain and rng.random() < 0.9 else rng.choice(choices)
        if token == EOS:
            return out, True
        out.append(token)
        matcher.consume(token)
        assert not matcher.failed
    return out, False


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "size": {"enum": ["small", "large"]},
    "tags": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
    "inner": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}},
    "required": ["name", "size", "tags", "inner"], "additionalProperties": False}


@pytest.mark.parametrize("seed", range(6))
def test_a_random_walk_through_a_schema_writes_json_that_fits_it(grammars, seed):
    tokens, ended = walk(grammars, Constraint("json_schema", json.dumps(SCHEMA)), seed)
    text = Tokenizer.from_file(TOKENIZER).decode(tokens)
    assert ended, text
    value = json.loads(text)
    assert set(value) == {"name", "size", "tags", "inner"}
    assert value["size"] in ("small", "large") and len(value["name"]) <= 6
    assert all(isinstance(t, int) and 0 <= t <= 9 for t in value["tags"]) and len(value["tags"]) <= 3
    assert value["inner"] in ({"ok": True}, {"ok": False})
    assert ", " in text and "\n" not in text  # compact JSON: items and keys separated as documented


@pytest.mark.parametrize("seed", range(3))
def test_a_random_walk_through_a_regex_matches_it(grammars, seed):
    pattern = r"(yes|no), [a-c]{2,4}!"
    tokens, ended = walk(grammars, Constraint("regex", pattern), seed)
    assert ended and re.fullmatch(pattern, Tokenizer.from_file(TOKENIZER).decode(tokens))


def test_a_finished_grammar_allows_only_eos(grammars):
    matcher = grammars.matcher(Constraint("regex", "ab"))
    for token in Tokenizer.from_file(TOKENIZER).encode("ab", add_special_tokens=False).ids:
        matcher.consume(token)
    masks = torch.empty(1, grammars.words, dtype=torch.int32)
    grammars.fill([matcher], masks)
    assert allowed(masks[0]) == [EOS]
    matcher.consume(EOS)
    assert matcher.done
    grammars.fill([matcher], masks)
    assert allowed(masks[0]) == [EOS]


def test_a_forced_token_leaves_only_eos(grammars):
    matcher = grammars.matcher(Constraint("regex", "[0-9]+"))
    matcher.consume(Tokenizer.from_file(TOKENIZER).encode("x", add_special_tokens=False).ids[0])
    assert matcher.failed and matcher.done


def test_resuming_past_the_output_so_far_continues_the_grammar(grammars):
    ids = Tokenizer.from_file(TOKENIZER).encode('{"size": "sm', add_special_tokens=False).ids
    schema = {"type": "object", "properties": {"size": {"enum": ["small", "large"]}}, "required": ["size"]}
    matcher = grammars.matcher(Constraint("json_schema", json.dumps(schema)), ids)
    masks = torch.empty(1, grammars.words, dtype=torch.int32)
    grammars.fill([matcher], masks)
    decode = Tokenizer.from_file(TOKENIZER).decode
    assert all("small"[len("sm"):].startswith(decode([t])) or decode([t]).startswith("all")
               for t in allowed(masks[0]))


@pytest.mark.parametrize("eos_ids", [[0], [31], [31, 32, 63], [4095]])
def test_an_ended_matcher_allows_exactly_its_eos_ids(eos_ids):
    masks = torch.full((2, mask_words(VOCAB)), 7, dtype=torch.int32)
    fill_masks([Matcher.ended(eos_ids), Matcher.ended(eos_ids)], masks)  # no executor needed: none is live
    assert allowed(masks[0]) == eos_ids and allowed(masks[1]) == eos_ids


@pytest.mark.parametrize("constraint, says", [
    (Constraint("regex", "(a"), "unclosed group"),
    (Constraint("json_schema", '{"type": "foo"}'), "foo"),
    (Constraint("json_schema", "{not json"), "not JSON"),
    (Constraint("json_schema", "[1, 2]"), "must be an object"),
    (Constraint("lark", "start: missing_rule"), "missing_rule"),
    (Constraint("ebnf", "x"), "unknown constraint kind"),
    (Constraint("regex", "a" * (MAX_CONSTRAINT_CHARS + 1)), "at most"),
])
def test_a_constraint_that_does_not_compile_says_why(constraint, says):
    with pytest.raises(GrammarError, match=re.escape(says)):
        check_constraint(constraint)


def test_the_kinds_that_compile():
    for constraint in (Constraint("json_schema", '{"type": "object"}'), Constraint("regex", "[a-z]+"),
                       Constraint("lark", 'start: "a" b\nb: /[0-9]+/'), Constraint("json_schema", "true")):
        check_constraint(constraint)


def test_a_panic_inside_llguidance_is_a_grammar_error():
    """llguidance panics (pyo3's PanicException, a BaseException) on some malformed schemas; that must reach
    the api as a 400 and never end a rank."""
    bad = Constraint("json_schema", json.dumps({"required": "é" * 100}))
    with pytest.raises(GrammarError, match="failed in llguidance"):
        check_constraint(bad)
    with pytest.raises(GrammarError):
        Grammars(TOKENIZER, VOCAB, [EOS]).matcher(bad)


def test_added_tokens_that_are_not_special_are_the_text_they_spell(tmp_path):
    """Qwen's tokenizers carry <tool_call>, </tool_call>, <think> and </think> as added tokens not marked
    special: a grammar that forces a tag takes the tag's own token, and free text may close with </think>.
    Special ones (<|im_end|>) stay out of text."""
    spec = json.loads(open(TOKENIZER, encoding="utf-8").read())
    tags = ["<tool_call>", "</tool_call>", "<think>", "</think>"]
    spec["added_tokens"] += [{"id": 4096 + i, "content": t, "special": False, "normalized": False, "lstrip": False,
                              "rstrip": False, "single_word": False} for i, t in enumerate(tags)]
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec), encoding="utf-8")
    grammars = Grammars(str(path), VOCAB, [EOS])
    tool_call, close_call, _, close_think = range(4096, 4100)
    forced = grammars.matcher(Constraint("lark", 'start: "<tool_call>\\n{}\\n</tool_call>"\n'))
    masks = torch.empty(1, grammars.words, dtype=torch.int32)
    grammars.fill([forced], masks)
    assert allowed(masks[0]) == [tool_call]
    newline_brace = Tokenizer.from_str(json.dumps(spec)).encode("\n{}\n", add_special_tokens=False).ids
    for token in [tool_call, *newline_brace]:
        forced.consume(token)
    grammars.fill([forced], masks)
    assert allowed(masks[0]) == [close_call] and not forced.failed
    reasoning = grammars.matcher(Constraint("lark", 'start: r "ok"\nr[lazy]: /(.|\\n)*<\\/think>/\n'))
    grammars.fill([reasoning], masks)
    choices = allowed(masks[0])
    assert close_think in choices and EOS not in choices


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_mask_workers_fill_each_row_as_one_matcher_alone_does(grammars, threads):
    """Rows taken from a shared queue by several threads (llguidance without the GIL) land in their own rows:
    40 matchers at different places of SCHEMA, in a buffer with spare rows, equal each matcher's mask alone."""
    from hkv.engine.grammar import MaskWorkers

    constraint = Constraint("json_schema", json.dumps(SCHEMA))
    matchers = []
    for seed in range(40):
        tokens, _ = walk(grammars, constraint, seed, steps=seed % 13)
        matchers.append(grammars.matcher(constraint, tokens))
    matchers[3].failed = True  # a finished row among them: EOS only, filled outside the workers
    alone = torch.empty(len(matchers), grammars.words, dtype=torch.int32)
    for i, m in enumerate(matchers):
        m.fill(alone[i])
    workers = MaskWorkers(threads)
    try:
        masks = torch.full((len(matchers) + 3, grammars.words), -1, dtype=torch.int32)
        fill_masks(matchers, masks, workers)
    finally:
        workers.close()
    assert torch.equal(masks[: len(matchers)], alone)
    assert (masks[len(matchers):] == -1).all()  # rows past the matchers' untouched
    assert allowed(masks[3]) == [EOS]


def test_a_row_whose_mask_fails_ends_only_its_sequence(grammars, caplog):
    from hkv.engine.grammar import MaskWorkers

    class Broken:  # an llguidance matcher whose mask call panics (pyo3 raises a BaseException)
        def is_stopped(self):
            return False

        def is_error(self):
            return False

        def unsafe_compute_mask_ptr(self, ptr, size):
            raise BaseException("panicked at the lexer")

    constraint = Constraint("regex", "[0-9]{3}")
    good, bad = grammars.matcher(constraint), Matcher(Broken(), [EOS])
    masks = torch.empty(2, grammars.words, dtype=torch.int32)
    workers = MaskWorkers(2)
    try:
        fill_masks([bad, good], masks, workers)
    finally:
        workers.close()
    assert bad.failed and allowed(masks[0]) == [EOS]
    assert not good.failed and set(allowed(masks[1])) and EOS not in allowed(masks[1])
    assert "panicked at the lexer" in caplog.text


def test_mask_workers_refuse_no_threads():
    from hkv.engine.grammar import MaskWorkers, default_mask_threads

    with pytest.raises(ValueError, match=">= 1"):
        MaskWorkers(0)
    assert 1 <= default_mask_threads() <= 32
