"""IncrementalDetokenizer and StopMatcher: no broken characters, no leaked stop text."""

from __future__ import annotations

import random

import pytest

from hkv.ipc.messages import TokenDelta
from hkv.openai.detok import REPLACEMENT, IncrementalDetokenizer, StopMatcher
from hkv.openai.generation import ChoiceState
from tests.openai.tokenizer_fixture import tiny_tokenizer

TEXTS = [
    "Hello 😀 world",
    "a😀b🦀c",
    "你好世界, the end.",
    "mixed: 🇫🇷 flag, é accents, 日本語 and 👩‍👩‍👧 family",
    "plain ascii STOP here",
]


SPLIT_EMOJI = "a😀b"  # tiny-dense has " 😀" as one token, but "a😀" splits the emoji's bytes


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _stream(tok, ids, chunks, prompt=()):
    detok = IncrementalDetokenizer(tok, prompt)
    deltas, pos = [], 0
    for size in chunks:
        deltas.append(detok.feed(ids[pos : pos + size]))
        pos += size
    deltas.append(detok.flush())
    return deltas


def _random_chunks(total, rng):
    chunks = []
    while total > 0:
        size = rng.randint(1, 3)
        chunks.append(min(size, total))
        total -= size
    return chunks


def test_emoji_split_across_tokens_is_held_back(tok):
    ids = tok.encode(SPLIT_EMOJI)
    assert REPLACEMENT in tok.decode(ids[:2]), "the test needs an emoji spanning several tokens"
    deltas = _stream(tok, ids, [1] * len(ids))
    assert all(REPLACEMENT not in d for d in deltas)
    assert "😀" in deltas  # emitted whole, in one delta
    assert "".join(deltas) == SPLIT_EMOJI


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_equals_full_decode(tok, text):
    ids = tok.encode(text)
    deltas = _stream(tok, ids, [1] * len(ids))
    assert all(REPLACEMENT not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == text


@pytest.mark.parametrize("text", TEXTS)
def test_any_chunking_gives_the_same_text(tok, text):
    ids = tok.encode(text)
    rng = random.Random(text)
    for _ in range(20):
        assert "".join(_stream(tok, ids, _random_chunks(len(ids), rng))) == text


def test_cjk_characters_come_out_whole(tok):
    ids = tok.encode("你好")
    deltas = [d for d in _stream(tok, ids, [1] * len(ids)) if d]
    assert deltas == ["你", "好"]


def test_truncated_character_is_flushed_as_replacement(tok):
    ids = tok.encode(SPLIT_EMOJI)
    detok = IncrementalDetokenizer(tok)
    assert detok.feed(ids[:1]) == "a"
    assert detok.feed(ids[1:2]) == ""  # the emoji's first bytes are held back
    assert detok.flush() == REPLACEMENT


def test_special_tokens_are_skipped(tok):
    end = tok.encode("<|im_end|>", add_special_tokens=False)
    assert len(end) == 1
    detok = IncrementalDetokenizer(tok)
    assert detok.feed(tok.encode("hi")) == "hi"
    assert detok.feed(end) == ""
    assert detok.feed(tok.encode(" there")) == " there"
    assert detok.flush() == ""


def test_prompt_context_does_not_leak_into_output(tok):
    prompt = tok.encode("The quick brown")
    out = tok.encode(" fox 😀")
    assert "".join(_stream(tok, out, [1] * len(out), prompt)) == " fox 😀"


def test_prompt_ending_mid_character_is_ignored_as_context(tok):
    prompt = tok.encode(SPLIT_EMOJI)[:2]
    out = tok.encode(" ok")
    assert "".join(_stream(tok, out, [len(out)], prompt)) == " ok"


def test_long_output_compacts_without_changing_text(tok):
    text = "Hello world! " * 200
    ids = tok.encode(text)
    assert "".join(_stream(tok, ids, [1] * len(ids))) == text


def test_stop_string_spanning_deltas():
    m = StopMatcher(["STOP"])
    assert m.feed("abc ST") == "abc "
    assert m.feed("O") == ""
    assert m.feed("P and more") == ""
    assert m.matched == "STOP"
    assert m.feed("later") == ""


def test_hold_back_released_when_prefix_breaks():
    m = StopMatcher(["STOP"])
    assert m.feed("xS") == "x"
    assert m.feed("T") == ""
    assert m.feed("ART") == "START"
    assert m.matched is None


def test_flush_releases_held_tail():
    m = StopMatcher(["END"])
    assert m.feed("the EN") == "the "
    assert m.flush() == "EN"


def test_earliest_stop_wins():
    m = StopMatcher(["world", "lo w"])
    assert m.feed("hello world") == "hel"
    assert m.matched == "lo w"


def test_match_inside_one_delta_cuts_before_it():
    m = StopMatcher(["\n\n"])
    assert m.feed("line one\n\nline two") == "line one"


def test_overlapping_prefixes_hold_the_longest():
    m = StopMatcher(["aab", "ab"])
    assert m.feed("xaa") == "x"
    assert m.feed("c") == "aac"


def test_stop_matcher_refuses_empty_stops():
    with pytest.raises(ValueError):
        StopMatcher([""])


@pytest.mark.parametrize("seed", range(30))
def test_streamed_text_equals_whole_text_with_stops(seed):
    rng = random.Random(seed)
    alphabet = "abST OP\n"
    text = "".join(rng.choice(alphabet) for _ in range(60))
    stops = ["STOP", "b\n", "aa"]
    whole = StopMatcher(stops)
    expected = whole.feed(text) + (whole.flush() if whole.matched is None else "")
    streamed, pos, m = [], 0, StopMatcher(stops)
    while pos < len(text) and m.matched is None:
        size = rng.randint(1, 5)
        streamed.append(m.feed(text[pos : pos + size]))
        pos += size
    if m.matched is None:
        streamed.append(m.flush())
    out = "".join(streamed)
    assert out == expected
    assert not any(s in out for s in stops)


def _delta(req_id, ids, finish=None):
    return TokenDelta(req_id, list(ids), None, None, finish, 3, 0)


def _run_choice(tok, ids, chunks, stops):
    choice = ChoiceState(0, 0, IncrementalDetokenizer(tok), StopMatcher(stops) if stops else None, False)
    pos, texts = 0, []
    for i, size in enumerate(chunks):
        last = i == len(chunks) - 1
        update = choice.apply(_delta(1, ids[pos : pos + size], "length" if last else None), 0.0)
        pos += size
        if update is None:
            break
        texts.append(update.text)
    return choice, "".join(texts)


@pytest.mark.parametrize("seed", range(10))
def test_choice_text_is_chunking_independent_with_stop_strings(tok, seed):
    text = "Hello a😀b world! 你好 STOP after the stop"
    ids = tok.encode(text)
    rng = random.Random(seed)
    one, one_text = _run_choice(tok, ids, [1] * len(ids), ["STOP"])
    many, many_text = _run_choice(tok, ids, _random_chunks(len(ids), rng), ["STOP"])
    assert one_text == many_text == one.output_text == "Hello a😀b world! 你好 "
    assert one.finish_reason == many.finish_reason == "stop"
    assert one.token_ids == many.token_ids  # cut at the token completing the stop string
    assert tok.decode(one.token_ids).endswith("STOP")


def test_choice_without_stops_flushes_on_finish(tok):
    ids = tok.encode(SPLIT_EMOJI)
    choice, text = _run_choice(tok, ids[:2], [2], [])
    assert choice.finish_reason == "length"
    assert text == "a" + REPLACEMENT  # the sequence really ended mid-character
