"""HKV_GRAMMAR_MASK_CACHE (hkv/engine/mask_cache.py through grammar.Grammars) on the built-in 4,096-token
tokenizer: cached masks equal llguidance's bit for bit along random walks of the study's schemas, `verify`
finds no mismatch there and catches a planted one, the byte budget evicts the least recently used mask, two
mask threads fill what one does, and a resumed matcher keys as one fed token by token."""

from __future__ import annotations

import json
import random

import pytest
import torch

from hkv.engine.grammar import Grammars, MaskWorkers, fill_masks, grammar_of
from hkv.engine.mask_cache import MaskCaches, compile_schema
from hkv.ipc.messages import Constraint
from hkv.models.tiny import SHIPPED_DIR
from tools.bench.bench_grammar import allowed_ids
from tools.bench.bench_mask_cache import SCHEMAS

TOKENIZER = str(SHIPPED_DIR / "tokenizer.json")
VOCAB = 4096
EOS = 0
STUDIED = ("arrays", "strings", "optional", "nested")  # "long" and "bounded" add steps, not kinds of state


@pytest.fixture(scope="module")
def plain() -> Grammars:
    return Grammars(TOKENIZER, VOCAB, [EOS], 1)


def _constraint(name: str) -> Constraint:
    return Constraint("json_schema", json.dumps(SCHEMAS[name]))


def _walks(grammars: Grammars, constraint: Constraint, walks: int, steps: int, seed: int) -> list[list[int]]:
    """Token walks drawn uniformly from each mask (EOS only when it is all that is allowed)."""
    rng, out = random.Random(seed), []
    mask = torch.empty(1, grammars.words, dtype=torch.int32)
    for _ in range(walks):
        matcher, tokens = grammars.matcher(constraint), []
        for _ in range(steps):
            if matcher.done:
                break
            matcher.fill(mask[0])
            allowed = [int(t) for t in allowed_ids(mask[0], VOCAB) if t != EOS] or [EOS]
            tokens.append(rng.choice(allowed))
            matcher.consume(tokens[-1])
        out.append(tokens)
    return out


def _replay_masks(grammars: Grammars, constraint: Constraint, walk: list[int]) -> list[bytes]:
    """Each step's mask along `walk` (one matcher, Matcher.fill)."""
    matcher, masks = grammars.matcher(constraint), []
    row = torch.empty(grammars.words, dtype=torch.int32)
    for token in walk:
        matcher.fill(row)
        masks.append(row.numpy().tobytes())
        matcher.consume(token)
    return masks


@pytest.mark.parametrize("mode", ["on", "verify"])
def test_cached_masks_are_llguidances_bit_for_bit_along_the_studys_walks(plain, mode):
    cached = Grammars(TOKENIZER, VOCAB, [EOS], 1, mask_cache=mode)
    for name in STUDIED:
        constraint = _constraint(name)
        for walk in _walks(plain, constraint, 6, 60, seed=len(name)):
            assert _replay_masks(cached, constraint, walk) == _replay_masks(plain, constraint, walk), name
    counts = cached.mask_cache
    assert counts.hits > 100 and counts.misses > 0 and counts.mismatches == 0
    assert plain.mask_cache is None


def test_verify_catches_a_wrong_cached_mask_and_turns_that_grammars_cache_off(plain, caplog):
    cached = Grammars(TOKENIZER, VOCAB, [EOS], 1, mask_cache="verify")
    constraint = _constraint("arrays")
    walk = _walks(plain, constraint, 1, 40, seed=3)[0]
    want = _replay_masks(plain, constraint, walk)
    _replay_masks(cached, constraint, walk)  # warms the cache
    cache = cached.mask_cache.for_grammar(grammar_of(constraint), constraint.spec)
    assert cache.masks
    for key in cache.masks:
        cache.masks[key] = bytes(len(cache.masks[key]))  # every cached mask now allows nothing
    assert _replay_masks(cached, constraint, walk) == want  # llguidance's masks were the ones used
    assert cached.mask_cache.mismatches == 1 and not cache.enabled and not cache.masks
    assert sum("disagrees" in r.message for r in caplog.records) == 1
    hits = cached.mask_cache.hits
    assert _replay_masks(cached, constraint, walk) == want and cached.mask_cache.hits == hits


def test_a_schema_outside_the_trackers_family_gets_no_cache_and_still_works(plain):
    cached = Grammars(TOKENIZER, VOCAB, [EOS], 1, mask_cache="on")
    constraint = Constraint("json_schema", json.dumps({"type": "object", "properties": {
        "id": {"type": "string", "pattern": "^[a-z]{1,6}$"}, "n": {"type": "string", "maxLength": 4}}}))
    for walk in _walks(plain, constraint, 3, 40, seed=1):
        assert _replay_masks(cached, constraint, walk) == _replay_masks(plain, constraint, walk)
    assert cached.matcher(constraint).cache_key() is None
    assert cached.mask_cache.hits == cached.mask_cache.misses == 0


def test_a_tokenizer_that_is_not_byte_level_gets_no_cache(tmp_path):
    spec = json.loads(open(TOKENIZER, encoding="utf-8").read())
    # a token outside the byte alphabet: llguidance's own reader takes the file, the tracker has no id's bytes
    spec["model"]["vocab"]["\u20ac"] = VOCAB
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec), encoding="utf-8")
    grammars = Grammars(str(path), VOCAB + 64, [EOS], 1, mask_cache="on")
    assert grammars.mask_cache is None
    assert grammars.matcher(_constraint("arrays")).cache_key() is None


def _fill(caches: MaskCaches, cache, key: str, computed: list[str]) -> bytes:
    """Fill a 4-byte row at `key`, computing b"<key>..." on a miss; the row's bytes."""
    row = torch.zeros(1, dtype=torch.int32)

    def compute() -> None:
        computed.append(key)
        row.numpy().view("u1")[:] = list(key.encode().ljust(4, b"."))

    cache.fill((key,), row.data_ptr(), 4, compute)
    return row.numpy().tobytes()


def test_the_byte_budget_evicts_the_least_recently_used_mask_across_grammars():
    schema = json.dumps(SCHEMAS["bounded"])
    caches = MaskCaches(horizon=8, budget=12)  # three 4-byte masks
    first, second = caches.for_grammar("g1", schema), caches.for_grammar("g2", schema)
    assert first is not second and caches.for_grammar("g1", schema) is first
    computed: list[str] = []
    for cache, key in ((first, "a"), (second, "b"), (first, "c")):
        assert _fill(caches, cache, key, computed) == key.encode() + b"..."
    assert _fill(caches, first, "a", computed) == b"a..." and computed == ["a", "b", "c"]  # a hit: a is newest
    _fill(caches, second, "d", computed)  # over budget: b, the least recently used, goes
    assert list(first.masks) == [("a",), ("c",)] and list(second.masks) == [("d",)] and caches.bytes == 12
    _fill(caches, second, "b", computed)
    assert computed == ["a", "b", "c", "d", "b"] and list(first.masks) == [("a",)]  # then c went
    assert (caches.hits, caches.misses) == (1, 5)


def test_grammars_past_the_limit_are_forgotten_with_their_masks():
    schema = json.dumps(SCHEMAS["bounded"])
    caches = MaskCaches(horizon=8, grammars=2)
    old = caches.for_grammar("g1", schema)
    _fill(caches, old, "a", [])
    caches.for_grammar("g2", schema), caches.for_grammar("g3", schema)
    assert not old.masks and caches.bytes == 0 and caches.for_grammar("g1", schema) is not old
    assert caches.for_grammar("unsupported", json.dumps({"type": "string", "pattern": "a"})) is None


def test_two_mask_threads_fill_what_one_fills_without_a_cache(plain):
    cached = Grammars(TOKENIZER, VOCAB, [EOS], 2, mask_cache="on")
    constraint = _constraint("strings")
    walks = _walks(plain, constraint, 16, 50, seed=5)
    steps = min(map(len, walks))
    serial = [plain.matcher(constraint) for _ in walks]
    threaded = [cached.matcher(constraint) for _ in walks]
    want = torch.empty(len(walks), plain.words, dtype=torch.int32)
    got = torch.empty_like(want)
    serial_workers = MaskWorkers(1)
    try:
        for step in range(steps):
            fill_masks(serial, want, serial_workers)
            cached.fill(threaded, got)
            assert torch.equal(got, want), step
            for matchers in (serial, threaded):
                for matcher, walk in zip(matchers, walks):
                    matcher.consume(walk[step])
    finally:
        serial_workers.close()
        cached.executor.close()
    assert cached.mask_cache.hits > 50


def test_a_resumed_matcher_keys_as_one_fed_token_by_token(plain):
    cached = Grammars(TOKENIZER, VOCAB, [EOS], 1, mask_cache="on")
    constraint = _constraint("arrays")
    keyed = 0
    for walk in _walks(plain, constraint, 3, 50, seed=7):
        fed = cached.matcher(constraint)
        for n, token in enumerate(walk):
            fed.consume(token)
            resumed = cached.matcher(constraint, consumed=walk[:n + 1])
            assert resumed.cache_key() == fed.cache_key()
            keyed += fed.cache_key() is not None
    assert keyed > 20
    assert compile_schema(SCHEMAS["arrays"]) == cached.matcher(constraint)._cache.root
