"""What a random-weight model writes under a constraint's masks: a walk over the built-in tokenizer's
allowed tokens (hkv/engine/grammar.py), and a small JSON-schema check of what it wrote.

The walk picks uniformly among the allowed tokens, except that now and then it writes one of a few
closing strings (a quote, a bracket, `</parameter>`, `</think>`) when the grammar allows its first
token, and it ends at EOS half the times the grammar allows EOS: free text then ends, as it would
within a model's max_tokens, without the grammar having to bound it.
"""

from __future__ import annotations

import random

import numpy as np
import torch
from tokenizers import Tokenizer

from hkv.engine.grammar import Grammars, Matcher
from hkv.ipc.messages import Constraint
from hkv.models.tiny import SHIPPED_DIR

TOKENIZER_JSON = str(SHIPPED_DIR / "tokenizer.json")
CLOSERS = ('"', "}", "]", ",", "\n", "</parameter>", "</think>")
CLOSE_RATE = 0.3  # how often a step tries to write a closer
MAX_STEPS = 4000


class GrammarWalker:
    """Random walks of constraints over the built-in tokenizer, EOS being <|im_end|>."""

    def __init__(self):
        self.tokenizer = Tokenizer.from_file(TOKENIZER_JSON)
        self.vocab = self.tokenizer.get_vocab_size()
        self.eos = self.tokenizer.token_to_id("<|im_end|>")
        self.grammars = Grammars(TOKENIZER_JSON, self.vocab, [self.eos])
        self._closers = [self.tokenizer.encode(c, add_special_tokens=False).ids for c in CLOSERS]

    def allowed(self, matcher: Matcher) -> set[int]:
        masks = torch.zeros(1, self.grammars.words, dtype=torch.int32)
        self.grammars.fill([matcher], masks)
        bits = np.unpackbits(masks.numpy().view(np.uint8), bitorder="little")[: self.vocab]
        return set(bits.nonzero()[0].tolist())

    def walk(self, constraint: Constraint, seed: int) -> str:
        """The text of one walk to EOS; AssertionError if it runs past MAX_STEPS or a token is refused."""
        rng = random.Random(seed)
        matcher = self.grammars.matcher(constraint)
        tokens: list[int] = []
        while len(tokens) < MAX_STEPS:
            allowed = self.allowed(matcher)
            assert allowed, "a live grammar allowed nothing"
            if self.eos in allowed and (allowed == {self.eos} or rng.random() < 0.5):
                return self.tokenizer.decode(tokens, skip_special_tokens=False)
            taken = self._closer(matcher, allowed, rng) if rng.random() < CLOSE_RATE else []
            if not taken:
                taken = [rng.choice(sorted(allowed - {self.eos}))]
                matcher.consume(taken[0])
            assert not matcher.failed
            tokens += taken
        raise AssertionError(f"no EOS in {MAX_STEPS} steps: {self.tokenizer.decode(tokens)[-300:]!r}")

    def _closer(self, matcher: Matcher, allowed: set[int], rng: random.Random) -> list[int]:
        """The tokens of a closing string the grammar takes (as far as it takes it), or []."""
        fits = [ids for ids in self._closers if ids[0] in allowed]
        if not fits:
            return []
        taken = []
        for token in rng.choice(fits):
            if token not in allowed:
                break
            matcher.consume(token)
            taken.append(token)
            allowed = self.allowed(matcher)
        return taken


def conforms(value, schema: dict) -> bool:
    """`value` keeps to `schema`, for the keywords the tests use: type, enum, const, properties, required,
    additionalProperties (false), items, maxItems, maxLength."""
    if "enum" in schema and value not in schema["enum"] or "const" in schema and value != schema["const"]:
        return False
    kinds = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list, "object": dict,
             "null": type(None)}
    kind = schema.get("type")
    if kind is not None and (not isinstance(value, kinds[kind]) or kind in ("integer", "number")
                             and isinstance(value, bool)):
        return False
    if isinstance(value, str):
        return len(value) <= schema.get("maxLength", len(value))
    if isinstance(value, list):
        items = schema.get("items", {})
        return len(value) <= schema.get("maxItems", len(value)) and all(conforms(v, items) for v in value)
    if isinstance(value, dict):
        return _object_conforms(value, schema)
    return True


def _object_conforms(value: dict, schema: dict) -> bool:
    props = schema.get("properties", {})
    if not set(schema.get("required", ())) <= set(value):
        return False
    if schema.get("additionalProperties") is False and not set(value) <= set(props):
        return False
    return all(conforms(v, props[k]) for k, v in value.items() if k in props)
