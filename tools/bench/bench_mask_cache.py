"""Can a mask cache for states inside bounded JSON strings be exact? A study, not a serving feature (issue 37).

    python -m tools.bench.bench_mask_cache --tokenizer TOKENIZER.json [--vocab V] [--eos ID] [--walks 32]
                                           [--steps 80] [--seeds 0,1,2] [--schemas bounded,nested,...]
                                           [--horizon H] [--json out.json]

llguidance walks its whole token trie for a state inside a string with `maxLength` (1.0-1.8 ms a mask on a
151k vocabulary, against 10-60 us for most states). Within one string lexeme its parser state stays put and
only the lexer moves, so such a mask should be a function of where the string sits in the schema and how far
into it the matcher is. This tool tests that claim against llguidance itself: random walks (tokens drawn
uniformly from each mask, as bench_mask_threads.record_walks draws them) over schemas of a restricted family,
every mask computed by llguidance AND looked up in a dict keyed by a schema-aware tracker of the bytes the
matcher consumed (filled on a miss). A hit whose cached mask differs bit for bit from llguidance's is a
MISMATCH: the key missed part of the state.

The key is hkv/engine/mask_cache.py's Tracker (where HKV_GRAMMAR_MASK_CACHE's serving cache took it from; its
docstring says what a key holds and why): each enclosing container's state, the string's node, its characters
still allowed and required (capped at what a token can reach), and a pending partial character or escape. The
"naive" key (the string's node and position alone, no container state) is checked beside it: its
mismatches show what the container state is for.

The family: objects with fixed `properties` (`additionalProperties: false`; required and optional),
arrays with `items` (+ minItems / maxItems), strings with maxLength / minLength and nothing else, integers,
numbers, booleans, enums of scalars but floats. JSON is compact (grammar.JSON_OPTIONS). Per schema it reports fills,
keyed fills, would-be hits, the fill time hits would save, fills over 0.5 ms (keyed and all), mismatches
of both keys, the tracker's own cost a token and llguidance's consume (which a hit would still pay).
`--horizon` below the longest token is an ablation: the caps then merge states a token can tell apart, and
the study should catch it (docs/benchmarks.md has the figures).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from hkv.engine.grammar import Grammars
from hkv.engine.mask_cache import Tracker, compile_schema
from hkv.ipc.messages import Constraint
from tools.bench.bench_grammar import allowed_ids
from tools.bench.bench_structured import schema_of

COSTLY_S = 5e-4  # a fill over this is one of llguidance's trie walks

SCHEMAS = {
    "bounded": schema_of("bounded"),
    # a bounded string two objects deep, beside an enum, then an optional bounded string and a number
    "nested": {"type": "object", "additionalProperties": False, "required": ["user", "score"], "properties": {
        "user": {"type": "object", "additionalProperties": False, "required": ["name", "role"], "properties": {
            "name": {"type": "string", "maxLength": 12},
            "role": {"enum": ["admin", "guest", "owner"]},
            "team": {"type": "object", "additionalProperties": False, "required": ["title"], "properties": {
                "title": {"type": "string", "minLength": 2, "maxLength": 8}}}}},
        "note": {"type": "string", "maxLength": 20},
        "score": {"type": "number"}}},
    # optional properties around bounded strings: what follows a string depends on the keys written
    "optional": {"type": "object", "additionalProperties": False, "required": ["b"], "properties": {
        "a": {"type": "string", "maxLength": 10},
        "b": {"type": "string", "maxLength": 10},
        "c": {"type": "string", "maxLength": 10},
        "d": {"type": "boolean"}}},
    # short arrays: whether `]` or `, ` may follow a string depends on the item's index
    "arrays": {"type": "object", "additionalProperties": False, "required": ["tags", "rows"], "properties": {
        "tags": {"type": "array", "minItems": 2, "maxItems": 4, "items": {"type": "string", "maxLength": 6}},
        "rows": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "array", "maxItems": 2, "items": {"type": "string", "minLength": 1, "maxLength": 5}}}}},
    # several bounded strings of different lengths (one past any token's reach) beside an enum and an integer
    "strings": {"type": "array", "minItems": 3, "items": {
        "type": "object", "additionalProperties": False, "required": ["code", "text", "level", "body"],
        "properties": {"code": {"type": "string", "minLength": 3, "maxLength": 3},
                       "text": {"type": "string", "maxLength": 40},
                       "level": {"enum": ["low", "high", 3, True]},
                       "body": {"type": "string", "maxLength": 300},
                       "n": {"type": "integer"}}}},
    # many short items: the items still required and allowed are capped at R (the early items share keys)
    "long": {"type": "array", "minItems": 60, "maxItems": 70, "items": {"type": "string", "maxLength": 3}},
}


@dataclass
class Tally:
    """One schema's study: fills (llguidance's masks), those with a key, and what a cache would have done."""

    schema: str
    fills: int = 0
    fill_s: float = 0.0
    costly: int = 0  # fills over COSTLY_S
    keyed: int = 0
    keyed_s: float = 0.0
    costly_keyed: int = 0
    keys: int = 0  # distinct keys
    hits: int = 0
    saved_s: float = 0.0  # the fill time of the hits
    costly_hits: int = 0
    capped_hits: int = 0  # hits at a key with a count capped at a token's reach
    mismatches: int = 0
    naive_hits: int = 0
    naive_mismatches: int = 0
    keyed_consume_s: float = 0.0  # llguidance's consume of the tokens drawn at keyed states (a hit still pays it)
    tracked_tokens: int = 0
    tracker_s: float = 0.0  # feeding the tracker and building both keys
    examples: list[dict] = field(default_factory=list)  # the first mismatches, either key

    def row(self) -> dict:
        return asdict(self)


def _difference(cached: bytes, bits: bytes, tokens: list[bytes]) -> dict:
    """Tokens one mask allows and the other does not, a few of each spelled out."""
    import numpy as np

    old, new = (np.unpackbits(np.frombuffer(m, np.uint8), bitorder="little")[:len(tokens)] for m in (cached, bits))
    only_cached, only_now = np.flatnonzero(old & ~new), np.flatnonzero(new & ~old)
    return {"only_cached": len(only_cached), "only_now": len(only_now),
            "cached_examples": [tokens[t].decode("utf-8", "replace") for t in only_cached[:4]],
            "now_examples": [tokens[t].decode("utf-8", "replace") for t in only_now[:4]]}


class _Cache:
    """A dict of masks under one kind of key, filled on a miss; it counts hits and mismatches."""

    def __init__(self):
        self.masks: dict[tuple, tuple[bytes, bytes]] = {}  # key -> (mask, the text that filled it)
        self.hits = 0
        self.mismatches = 0

    def look(self, key: tuple, bits: bytes, text: bytes) -> tuple[bytes, bytes] | None:
        """Count a lookup; the cached (mask, text) of a mismatch, else None."""
        cached = self.masks.get(key)
        if cached is None:
            self.masks[key] = bits, text
            return None
        self.hits += 1
        if cached[0] == bits:
            return None
        self.mismatches += 1
        return cached


def _walk(grammars: Grammars, constraint: Constraint, tracker: Tracker, steps: int, rng: random.Random,
          tokens: list[bytes], caches: tuple[_Cache, _Cache], tally: Tally) -> None:
    """One walk of at most `steps` tokens drawn uniformly from llguidance's masks (EOS only when alone),
    each mask checked against both caches."""
    eos = grammars.eos_ids[0]
    matcher, text = grammars.matcher(constraint), b""
    mask = torch.empty(1, grammars.words, dtype=torch.int32)
    for _ in range(steps):
        if matcher.done:
            return
        started = time.perf_counter()
        matcher.fill(mask[0])
        spent = time.perf_counter() - started
        bits = mask[0].numpy().tobytes()
        tally.fills, tally.fill_s, tally.costly = tally.fills + 1, tally.fill_s + spent, tally.costly + (spent > COSTLY_S)
        started = time.perf_counter()
        keys = tracker.key(), tracker.naive_key()
        tally.tracker_s += time.perf_counter() - started
        if keys[0] is not None:
            tally.keyed, tally.keyed_s, tally.costly_keyed = (tally.keyed + 1, tally.keyed_s + spent,
                                                              tally.costly_keyed + (spent > COSTLY_S))
            hits = caches[0].hits
            _check(caches[0], "key", keys[0], bits, text, tokens, tally)
            if caches[0].hits > hits:
                tally.saved_s, tally.costly_hits = tally.saved_s + spent, tally.costly_hits + (spent > COSTLY_S)
                tally.capped_hits += tracker.capped
        if keys[1] is not None:
            _check(caches[1], "naive", keys[1], bits, text, tokens, tally)
        allowed = allowed_ids(mask[0], grammars.vocab_size)
        allowed = allowed[allowed != eos] if (allowed != eos).any() else allowed
        token = int(allowed[rng.randrange(len(allowed))])
        started = time.perf_counter()
        matcher.consume(token)
        tally.keyed_consume_s += (time.perf_counter() - started) * (keys[0] is not None)
        text += tokens[token]
        started = time.perf_counter()
        tracker.feed(tokens[token])
        tally.tracker_s += time.perf_counter() - started
        tally.tracked_tokens += 1


def _check(cache: _Cache, which: str, key: tuple, bits: bytes, text: bytes, tokens: list[bytes], tally: Tally) -> None:
    cached = cache.look(key, bits, text)
    if cached is not None and len(tally.examples) < 8:
        tally.examples.append({"key": which, "state": repr(key), "text": text[-80:].decode("utf-8", "replace"),
                               "cached_text": cached[1][-80:].decode("utf-8", "replace"),
                               **_difference(cached[0], bits, tokens)})


def study(grammars: Grammars, name: str, schema: dict, walks: int, steps: int, seeds: list[int],
          horizon: int = 0) -> Tally:
    """`walks` walks per seed over `schema`, every mask looked up under both keys (one cache per key and
    schema, shared by all its walks, as a server's would be by its requests). horizon: the token bytes the
    key's caps assume (0: the longest token's, which makes them exact; less is an ablation)."""
    tokens = [grammars.tokenizer.decode_bytes([t]) for t in range(grammars.vocab_size)]
    horizon = horizon or max(map(len, tokens))
    root = compile_schema(schema)
    constraint = Constraint("json_schema", json.dumps(schema))
    caches, tally = (_Cache(), _Cache()), Tally(name)
    for seed in seeds:
        rng = random.Random(seed)
        for _ in range(walks):
            _walk(grammars, constraint, Tracker(root, horizon), steps, rng, tokens, caches, tally)
    tally.keys, tally.hits, tally.mismatches = len(caches[0].masks), caches[0].hits, caches[0].mismatches
    tally.naive_hits, tally.naive_mismatches = caches[1].hits, caches[1].mismatches
    return tally


def report(tallies: list[Tally]) -> str:
    lines = ["| schema | fills | keyed | keys | hits | fill ms | saved ms | fills > 0.5 ms: all, keyed, hits | "
             "capped hits | mismatches | naive key: hits, mismatches | tracker us/token | consume us (keyed) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for t in tallies:
        share = 100 * t.saved_s / t.fill_s if t.fill_s else 0.0
        lines.append(f"| {t.schema} | {t.fills} | {t.keyed} | {t.keys} | {t.hits} | {1e3 * t.fill_s:.1f} | "
                     f"{1e3 * t.saved_s:.1f} ({share:.0f}%) | {t.costly}, {t.costly_keyed}, {t.costly_hits} | {t.capped_hits} | "
                     f"**{t.mismatches}** | {t.naive_hits}, {t.naive_mismatches} | "
                     f"{1e6 * t.tracker_s / max(t.tracked_tokens, 1):.1f} | "
                     f"{1e6 * t.keyed_consume_s / max(t.keyed, 1):.1f} |")
    for t in tallies:
        for example in t.examples:
            lines.append(f"{t.schema}: {example['key']} mismatch at {example['state']}: now {example['text']!r} "
                         f"(+{example['only_now']} tokens, e.g. {example['now_examples']}), cached at "
                         f"{example['cached_text']!r} (+{example['only_cached']}, e.g. {example['cached_examples']})")
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"want comma-separated integers, not {text!r}") from None


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", required=True, help="a tokenizer.json (bench_grammar's 151k, or Qwen's)")
    parser.add_argument("--vocab", type=int, default=0, help="the model's logit rows (default: the tokenizer's)")
    parser.add_argument("--eos", type=int, default=-1, help="the EOS id (default: the last id)")
    parser.add_argument("--walks", type=int, default=32, help="walks per seed and schema (default: 32)")
    parser.add_argument("--steps", type=int, default=80, help="tokens a walk takes at most (default: 80)")
    parser.add_argument("--seeds", type=_ints, default=[0, 1, 2], help="walk seeds (default: 0,1,2)")
    parser.add_argument("--schemas", default=",".join(SCHEMAS), help=f"of {', '.join(SCHEMAS)} (default: all)")
    parser.add_argument("--horizon", type=int, default=0, help="token bytes the keys' caps assume (default: the "
                        "longest token's; less is an ablation whose capped keys should mismatch)")
    parser.add_argument("--json", help="write the tallies here")
    args = parser.parse_args(argv)
    names = [n for n in args.schemas.split(",") if n]
    if args.walks < 1 or args.steps < 1 or args.horizon < 0 or not args.seeds or not names or set(names) - set(SCHEMAS):
        parser.error(f"--walks and --steps must be at least 1, --horizon not negative, --seeds not empty, --schemas of {list(SCHEMAS)}")
    from tokenizers import Tokenizer

    size = Tokenizer.from_file(args.tokenizer).get_vocab_size()
    grammars = Grammars(args.tokenizer, args.vocab or size, [args.eos if args.eos >= 0 else size - 1], 1)
    tallies = []
    for name in names:
        tallies.append(study(grammars, name, SCHEMAS[name], args.walks, args.steps, args.seeds, args.horizon))
        print(f"{name}: {tallies[-1].fills} fills, {tallies[-1].hits} hits, {tallies[-1].mismatches} mismatches",
              flush=True)
    print(report(tallies))
    out = {"vocab": grammars.vocab_size, "horizon": args.horizon or None, "walks": args.walks, "steps": args.steps, "seeds": args.seeds,
           "tallies": [t.row() for t in tallies]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
