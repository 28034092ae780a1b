"""Structured output's library, measured: llguidance against xgrammar on one tokenizer and one set of grammars.

    python -m tools.bench.bench_grammar [--tokenizer PATH|builtin] [--train-vocab 151000] [--walks 64]
                                  [--batch 32] [--steps 256] [--threads N] [--only flat,regex] [--json out.json]

(as a module: tools/inspect.py would shadow the standard library run as a script).

Per grammar (JSON schemas of the kinds OpenAI-style clients send, a regex, a small Lark grammar that
both libraries read, and four schemas using a keyword one of them leaves out), on the CPU:

  compiles     whether each library compiles it (its error's first line if not)
  compile      ms from the spec to a matcher ready for its first mask, the first time the grammar is
               seen and again (xgrammar answers a repeat from its compiler cache; llguidance keeps no
               cache: every request's matcher is built from the grammar text, as the engine does)
  first mask   us for a fresh matcher's first mask (llguidance builds its lexer lazily, from here on)
  mask         us to fill one matcher's mask, alone (consume is timed apart), median and p99 over every
               token of the walks both libraries accept, replayed on fresh matchers: the same tokens;
               and their sum over a walk (what one answer's masks cost)
  batch        ms per step to fill --batch matchers' masks at once on --threads threads (llguidance's
               LLExecutor, as the engine does; xgrammar's BatchGrammarMatcher), mean and worst of 64
               steps; each matcher follows a walk and starts it again on a fresh matcher when it ends
  agreement    each walk runs both matchers in lockstep (even seeds sample llguidance's mask, odd ones
               xgrammar's) and compares the two masks at every step: steps whose masks differ, tokens
               only one allows, walks the other library rejects (a sampled token it does not allow),
               steps where a special token other than EOS is allowed
  answers      per library, the finished walks it sampled that parse as JSON and pass the grammar's
               check (the schema's enum, const, bounds, uniqueness ... where one is given)

A walk fills the mask and picks an allowed token: EOS with probability 1/2 once allowed; else, one
time in four, a token holding a closing byte (`"}])`: strings, arrays and nesting end), one time in
four a token holding ASCII punctuation (`@`, `+`, `.`: formats and patterns move on); else any
allowed token. At most --steps tokens.

Tokenizer: --tokenizer PATH (a HF tokenizer.json, byte-level BPE; `builtin` is the 4,096-token one of
hkv/models/builtin/tiny-hybrid) or, by default, a byte-level BPE of --train-vocab tokens trained on
this interpreter's standard library .py files (sorted; deterministic given the files; they hold
about 123k tokens' worth of merges, so larger requests stop there), cached in --cache-dir. Neither
library gets a transformers tokenizer: llguidance reads tokenizer.json, xgrammar gets the raw
byte-level vocabulary (importing xgrammar imports transformers all the same). Times are wall clock
(the batch fills run on several threads).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import math
import os
import random
import statistics
import string
import sys
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from hkv.engine.grammar import JSON_OPTIONS, byte_alphabet

BUILTIN = Path(__file__).resolve().parents[2] / "hkv/models/builtin/tiny-hybrid/tokenizer.json"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]
EOS_NAMES = ("<|im_end|>", "<|endoftext|>")  # Qwen's generation_config ends on either
LLG_JSON = JSON_OPTIONS  # the engine's JSON: compact, ", " and ": " between items
XGR_JSON = {"any_whitespace": False, "separators": (", ", ": ")}
CLOSING = b'"}])'
PUNCTUATION = string.punctuation.encode()
BATCH_STEPS = 64


class Grammar(NamedTuple):
    name: str
    kind: str  # "json_schema", "regex" or "lark"
    spec: object  # the schema (a dict), or the regex / Lark text: both libraries read the same text
    check: Callable[[object], bool] | None = None  # what a parsed answer must satisfy, beyond parsing


def _obj(properties: dict, required: list[str] | None = None) -> dict:
    """A closed object schema (additionalProperties false); all properties required unless named."""
    required = list(properties) if required is None else required
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


_NAME = {"type": "string", "maxLength": 20}
_ADDRESS = _obj({"street": {"type": "string", "maxLength": 40}, "city": _NAME,
                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, ["street", "city"])
_NODE = _obj({"value": {"type": "integer"},
              "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}})
_SHAPES = [_obj({"kind": {"const": "circle"}, "radius": {"type": "number"}}),
           _obj({"kind": {"const": "rect"}, "w": {"type": "number"}, "h": {"type": "number"}})]
ARITHMETIC = """start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]+/
"""

GRAMMARS = [
    Grammar("flat", "json_schema", _obj({
        "status": {"enum": ["active", "inactive", "banned"]}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "admin": {"type": "boolean"}, "name": _NAME}),
        lambda a: list(a) == ["status", "age", "admin", "name"] and a["status"] in ("active", "inactive", "banned")
        and 0 <= a["age"] <= 150 and len(a["name"]) <= 20),
    Grammar("nested", "json_schema", _obj({
        "user": _obj({"name": _NAME, "address": _ADDRESS}), "score": {"type": "number"}})),
    Grammar("arrays", "json_schema", _obj({
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 5},
        "matrix": {"type": "array", "maxItems": 3,
                   "items": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}}})),
    Grammar("anyof_oneof", "json_schema", _obj({
        "id": {"anyOf": [{"type": "string", "maxLength": 10}, {"type": "integer"}, {"type": "null"}]},
        "shape": {"oneOf": _SHAPES}})),
    Grammar("ref_recursive", "json_schema", {"$defs": {"node": _NODE}, "$ref": "#/$defs/node"}),
    Grammar("pattern", "json_schema", _obj({
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "phone": {"type": "string", "pattern": "^\\+?[0-9]{7,12}$"}})),
    Grammar("formats", "json_schema", _obj({
        "when": {"type": "string", "format": "date-time"}, "day": {"type": "string", "format": "date"},
        "email": {"type": "string", "format": "email"}, "id": {"type": "string", "format": "uuid"}})),
    Grammar("const_optional", "json_schema", _obj({
        "version": {"const": 2}, "kind": {"const": "event"}, "note": {"type": "string", "maxLength": 30},
        "count": {"type": "integer", "minimum": 1}, "flag": {"type": "boolean"}}, ["version", "kind"]),
        lambda a: (a["version"], a["kind"]) == (2, "event") and len(a.get("note", "")) <= 30
        and set(a) <= {"version", "kind", "note", "count", "flag"}),
    # an OpenAI strict-mode function's parameters: nullable via a type list
    Grammar("tool_args", "json_schema", _obj({
        "location": {"type": "string", "description": "City and country"},
        "unit": {"type": ["string", "null"], "enum": ["celsius", "fahrenheit", None]}})),
    # response_format {"type": "json_object"}: any object
    Grammar("json_object", "json_schema", {"type": "object"}),
    Grammar("regex", "regex", r"(0|[1-9][0-9]{0,5})\.[0-9]{2} (USD|EUR|GBP)"),
    Grammar("lark", "lark", ARITHMETIC),
    # keywords one library or the other leaves out: does it refuse the schema, or ignore the keyword?
    Grammar("unique_items", "json_schema", {
        "type": "array", "items": {"enum": [1, 2, 3, 4]}, "minItems": 3, "maxItems": 4, "uniqueItems": True},
        lambda a: len(set(a)) == len(a)),
    Grammar("not", "json_schema", _obj({"v": {"not": {"type": "string"}}}), lambda a: not isinstance(a["v"], str)),
    Grammar("min_properties", "json_schema", {"type": "object", "minProperties": 2}, lambda a: len(a) >= 2),
    Grammar("lookahead", "json_schema", {"type": "string", "pattern": "^(?=.*[0-9])[a-z0-9]{4,8}$"},
            lambda a: any(c.isdigit() for c in a)),
]


@dataclass(frozen=True)
class Vocab:
    """A byte-level BPE tokenizer.json as both libraries need it."""

    path: str
    encoded: list[str]  # id -> the token as tokenizer.json spells it (byte-level alphabet; special tokens as text)
    tokens: list[bytes]  # id -> the bytes it stands for (special tokens: their text)
    special: tuple[int, ...]  # added tokens marked special, EOS aside: never text a JSON answer may hold
    eos: tuple[int, ...]
    is_eos: np.ndarray = field(repr=False)  # [size] bool
    closing: np.ndarray = field(repr=False)  # [size] bool: the token holds a byte of CLOSING
    punctuation: np.ndarray = field(repr=False)  # [size] bool: the token holds a byte of PUNCTUATION

    @property
    def size(self) -> int:
        return len(self.tokens)

    @property
    def words(self) -> int:
        """int32 words of one mask."""
        return (self.size + 31) // 32


def load_vocab(path: str | Path) -> Vocab:
    """Read a byte-level BPE tokenizer.json; EOS = <|im_end|> and <|endoftext|> where present."""
    spec = json.loads(Path(path).read_text(encoding="utf-8"))
    if "ByteLevel" not in json.dumps(spec.get("decoder")):
        raise SystemExit(f"{path}: not a byte-level BPE tokenizer (its decoder is {spec.get('decoder')})")
    ids = dict(spec["model"]["vocab"])
    added = {a["content"]: a for a in spec.get("added_tokens", [])}
    ids.update({text: a["id"] for text, a in added.items()})
    encoded = [""] * (max(ids.values()) + 1)
    for text, i in ids.items():
        encoded[i] = text
    byte_of = byte_alphabet()
    tokens = [t.encode() if t in added else bytes(byte_of[c] for c in t) for t in encoded]
    eos = tuple(ids[name] for name in EOS_NAMES if name in added)
    if not eos:
        raise SystemExit(f"{path}: none of {EOS_NAMES} among its added tokens, so no EOS")
    is_eos = np.zeros(len(tokens), dtype=bool)
    is_eos[list(eos)] = True
    closing = np.array([any(b in CLOSING for b in t) for t in tokens], dtype=bool)
    punctuation = np.array([any(b in PUNCTUATION for b in t) for t in tokens], dtype=bool)
    special = tuple(a["id"] for a in added.values() if a.get("special") and a["id"] not in eos)
    return Vocab(str(path), encoded, tokens, special, eos, is_eos, closing, punctuation)


def stdlib_files() -> list[Path]:
    """The running interpreter's standard library .py files (site-packages excluded), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if not {"site-packages", "dist-packages"} & set(p.parts))


def train_tokenizer(vocab_size: int, cache_dir: Path) -> Path:
    """A byte-level BPE of `vocab_size` tokens (fewer if the corpus runs out of merges) over stdlib_files(),
    trained once per interpreter version into cache_dir."""
    path = cache_dir / f"stdlib-bpe-{vocab_size}-py{sys.version_info[0]}{sys.version_info[1]}.json"
    if path.exists():
        return path
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = []
    for file in stdlib_files():
        try:
            texts.append(file.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue  # a test fixture in another encoding
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=1,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    print(f"training a {vocab_size}-token byte-level BPE on {len(texts)} stdlib files -> {path}", flush=True)
    tokenizer.train_from_iterator(texts, trainer)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return path


class Llguidance:
    """llguidance, as hkv/engine/grammar.py drives it."""

    name = "llguidance"

    def __init__(self, vocab: Vocab, threads: int):
        self._llg = importlib.import_module("llguidance")
        self._tokenizer = self._llg.LLTokenizer(vocab.path, n_vocab=vocab.size, eos_token=list(vocab.eos))
        self._executor = self._llg.LLExecutor(threads)
        self._words = vocab.words

    def decoded(self, ids: range) -> list[bytes]:
        return [self._tokenizer.decode_bytes([i]) for i in ids]

    def compile(self, grammar: Grammar) -> str:
        """The grammar's text (JSON schemas with the engine's compact options)."""
        matcher = self._llg.LLMatcher
        if grammar.kind == "json_schema":
            return matcher.grammar_from_json_schema(grammar.spec, overrides=LLG_JSON)
        if grammar.kind == "regex":
            return matcher.grammar_from_regex(grammar.spec)
        return matcher.grammar_from_lark(grammar.spec)

    def matcher(self, compiled: str):
        """A fresh matcher; llguidance compiles the grammar here, and reports errors by state."""
        matcher = self._llg.LLMatcher(self._tokenizer, compiled, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def fill(self, matcher, masks: torch.Tensor, row: int) -> None:
        matcher.unsafe_compute_mask_ptr(masks[row].data_ptr(), self._words * 4)

    def consume(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def fill_batch(self, matchers: list, masks: torch.Tensor) -> None:
        rows = [(m, i) for i, m in enumerate(matchers)]
        self._executor.unsafe_compute_mask_ptr(rows, masks.data_ptr(), self._words * 4, masks.shape[0])


class Xgrammar:
    """xgrammar, from the raw byte-level vocabulary (no transformers tokenizer)."""

    name = "xgrammar"

    def __init__(self, vocab: Vocab, threads: int):
        self._xgr = importlib.import_module("xgrammar")
        self._info = self._xgr.TokenizerInfo(vocab.encoded, self._xgr.VocabType.BYTE_LEVEL, vocab_size=vocab.size,
                                             stop_token_ids=list(vocab.eos))
        self._compiler = self._xgr.GrammarCompiler(self._info, max_threads=threads)
        self._batch = self._xgr.BatchGrammarMatcher(threads)

    def decoded(self, ids: range) -> list[bytes]:
        vocab = self._info.decoded_vocab
        return [vocab[i] for i in ids]

    def compile(self, grammar: Grammar):
        """A CompiledGrammar (its compiler caches it: the same spec again is a cache hit)."""
        if grammar.kind == "json_schema":
            return self._compiler.compile_json_schema(json.dumps(grammar.spec), **XGR_JSON)
        if grammar.kind == "regex":
            return self._compiler.compile_regex(grammar.spec)
        return self._compiler.compile_lark(grammar.spec)

    def matcher(self, compiled):
        return self._xgr.GrammarMatcher(compiled)

    def fill(self, matcher, masks: torch.Tensor, row: int) -> None:
        matcher.fill_next_token_bitmask(masks, row)

    def consume(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def fill_batch(self, matchers: list, masks: torch.Tensor) -> None:
        self._batch.batch_fill_next_token_bitmask(matchers, masks)


LIBRARIES = {"llguidance": Llguidance, "xgrammar": Xgrammar}


def start_libraries(vocab: Vocab, threads: int, names: list[str]) -> tuple[list, dict[str, float]]:
    """The libraries that import, and each one's seconds to import and read the tokenizer."""
    libraries, setup_s = [], {}
    for name in names:
        start = time.perf_counter()
        try:
            libraries.append(LIBRARIES[name](vocab, threads))
        except ImportError as exc:
            print(f"{name}: not importable ({exc}); left out", flush=True)
            continue
        setup_s[name] = time.perf_counter() - start
    return libraries, setup_s


def check_vocab(vocab: Vocab, library) -> dict:
    """Where the library's bytes for each token differ from tokenizer.json's."""
    ids = range(vocab.size)
    wrong = [(i, vocab.tokens[i], got) for i, got in zip(ids, library.decoded(ids)) if got != vocab.tokens[i]]
    return {"differ": len(wrong), "examples": [f"{i}: {want!r} vs {got!r}" for i, want, got in wrong[:3]]}


def allowed_ids(mask: torch.Tensor, size: int) -> np.ndarray:
    """Token ids whose bit is set in one [words] int32 mask."""
    return np.flatnonzero(np.unpackbits(mask.numpy().view(np.uint8), bitorder="little")[:size])


def allows(mask: torch.Tensor, token: int) -> bool:
    return bool((int(mask[token // 32]) >> (token % 32)) & 1)


def pick(rng: random.Random, allowed: np.ndarray, vocab: Vocab) -> int:
    """The walk's next token (module docstring: EOS half the time once allowed, then the biases)."""
    eos = allowed[vocab.is_eos[allowed]]
    rest = allowed[~vocab.is_eos[allowed]]
    if eos.size and (not rest.size or rng.random() < 0.5):
        return int(eos[rng.randrange(eos.size)])
    draw = rng.random()
    if draw < 0.5:
        biased = rest[(vocab.closing if draw < 0.25 else vocab.punctuation)[rest]]
        rest = biased if biased.size else rest
    return int(rest[rng.randrange(rest.size)])


class Side(NamedTuple):
    """One library and the grammar compiled by it."""

    library: object
    compiled: object


@dataclass
class Walk:
    driver: str  # the library whose masks the tokens were sampled from
    tokens: list[int]  # the sampled tokens, the final EOS included when the walk ended
    complete: bool  # ended on EOS within the step bound
    compared: int = 0  # steps where two libraries' masks were compared
    differ: int = 0  # ... and differed
    rejected_by: str | None = None  # the library that does not allow a token the driver sampled
    rejected: str | None = None  # ... that token and the text before it
    only: dict[str, str] = field(default_factory=dict)  # library -> first step it allows tokens the other does not
    special: dict[str, int] = field(default_factory=dict)  # library -> steps its mask allowed a special token


def _tail(tokens: list[int], vocab: Vocab) -> bytes:
    """The walk's last 40 bytes."""
    return b"".join(vocab.tokens[t] for t in tokens)[-40:]


def walk(sides: list[Side], driver: int, vocab: Vocab, seed: int, steps: int) -> Walk:
    """A seeded random walk sampled from sides[driver]'s masks; with two sides, the other runs in
    lockstep and both masks are compared at every step (the other is dropped if it rejects a token)."""
    rng = random.Random(seed)
    masks = torch.zeros(len(sides), vocab.words, dtype=torch.int32)
    matchers = [s.library.matcher(s.compiled) for s in sides]
    result = Walk(sides[driver].library.name, [], False)
    for _ in range(steps):
        for i, side in enumerate(sides):
            if matchers[i] is not None:
                side.library.fill(matchers[i], masks, i)
                if any(allows(masks[i], t) for t in vocab.special):
                    result.special[side.library.name] = result.special.get(side.library.name, 0) + 1
        allowed = allowed_ids(masks[driver], vocab.size)
        if not allowed.size:
            raise AssertionError(f"{sides[driver].library.name}: an empty mask after {_tail(result.tokens, vocab)!r}")
        token = pick(rng, allowed, vocab)
        if len(sides) == 2 and matchers[1 - driver] is not None:
            _compare(result, masks, sides, vocab, driver, token)
            if result.rejected:
                matchers[1 - driver] = None
        for i, side in enumerate(sides):
            if matchers[i] is not None and not side.library.consume(matchers[i], token):
                raise AssertionError(f"{side.library.name} refused token {token}, which its mask allowed")
        result.tokens.append(token)
        if vocab.is_eos[token]:
            result.complete = True
            break
    return result


def _compare(result: Walk, masks: torch.Tensor, sides: list[Side], vocab: Vocab, driver: int, token: int) -> None:
    """Count a step whose two masks differ; note a sampled token the other side does not allow."""
    result.compared += 1
    if not torch.equal(masks[0], masks[1]):
        result.differ += 1
        for i, side in enumerate(sides):
            only = allowed_ids(masks[i] & ~masks[1 - i], vocab.size)
            if only.size and side.library.name not in result.only:
                result.only[side.library.name] = (f"{len(only)} tokens after {_tail(result.tokens, vocab)!r}, "
                                                  f"e.g. {[vocab.tokens[t] for t in only[:3]]}")
    if not allows(masks[1 - driver], token):
        result.rejected_by = sides[1 - driver].library.name
        result.rejected = f"{vocab.tokens[token]!r} (id {token}) after {_tail(result.tokens, vocab)!r}"


def replay(side: Side, tokens: list[int], vocab: Vocab) -> tuple[list[int], list[int]]:
    """ns to fill each mask and to consume each token, on a fresh matcher (each token checked allowed)."""
    masks = torch.zeros(1, vocab.words, dtype=torch.int32)
    library, matcher = side.library, side.library.matcher(side.compiled)
    fill_ns, consume_ns = [], []
    for token in tokens:
        start = time.perf_counter_ns()
        library.fill(matcher, masks, 0)
        filled = time.perf_counter_ns()
        assert allows(masks[0], token), f"{library.name}: replayed token {token} not allowed"
        start_consume = time.perf_counter_ns()
        assert library.consume(matcher, token)
        consume_ns.append(time.perf_counter_ns() - start_consume)
        fill_ns.append(filled - start)
    return fill_ns, consume_ns


def batch_fill_s(side: Side, walks: list[list[int]], vocab: Vocab, steps: int = BATCH_STEPS) -> list[float]:
    """Seconds per step to fill all len(walks) masks at once, each matcher following its walk (a
    finished one starts its walk again on a fresh matcher)."""
    library = side.library
    masks = torch.zeros(len(walks), vocab.words, dtype=torch.int32)
    matchers = [library.matcher(side.compiled) for _ in walks]
    at, times = [0] * len(walks), []
    for _ in range(steps):
        start = time.perf_counter()
        library.fill_batch(matchers, masks)
        times.append(time.perf_counter() - start)
        for i, tokens in enumerate(walks):
            library.consume(matchers[i], tokens[at[i]])
            at[i] += 1
            if at[i] == len(tokens):
                matchers[i], at[i] = library.matcher(side.compiled), 0
    return times


def compile_ms(library, grammar: Grammar) -> tuple[object, float, float]:
    """(compiled, ms to a ready matcher the first time, ms the second time); raises what the library raises."""
    times, compiled = [], None
    for _ in range(2):
        start = time.perf_counter()
        compiled = library.compile(grammar)
        library.matcher(compiled)
        times.append((time.perf_counter() - start) * 1e3)
    return compiled, times[0], times[1]


def _brief(exc: Exception) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
    return lines[0][:160]


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(grammar: Grammar, libraries: list, vocab: Vocab, walks: int, steps: int, batch: int) -> dict:
    """Coverage, compile and mask times for one grammar on each library, and where they disagree."""
    result: dict = {"name": grammar.name, "kind": grammar.kind, "libraries": {}}
    sides = []
    for library in libraries:
        try:
            compiled, first, again = compile_ms(library, grammar)
        except Exception as exc:  # noqa: BLE001 - any failure to compile is a coverage fact to report
            result["libraries"][library.name] = {"compiles": False, "error": _brief(exc)}
            continue
        result["libraries"][library.name] = {"compiles": True, "compile_ms": first, "again_ms": again}
        sides.append(Side(library, compiled))
    if not sides:
        return result
    runs = [walk(sides, seed % len(sides), vocab, seed, steps) for seed in range(walks)]
    result.update(_agreement(runs, [s.library.name for s in sides], vocab))
    if grammar.kind == "json_schema":
        result["answers_valid"] = {s.library.name: _answers_valid(grammar, runs, s.library.name, vocab) for s in sides}
    shared = [w.tokens for w in runs if w.rejected is None]
    result["timed_walks"], result["timed_tokens"] = len(shared), sum(map(len, shared))
    for side in sides if shared else ():
        result["libraries"][side.library.name].update(_timings(side, shared, vocab, batch))
    return result


def _agreement(runs: list[Walk], names: list[str], vocab: Vocab) -> dict:
    """What the walks say about the two libraries' masks (module docstring: agreement)."""
    return {"walks": len(runs), "complete": sum(w.complete for w in runs), "tokens": sum(len(w.tokens) for w in runs),
            "samples": [b"".join(vocab.tokens[t] for t in w.tokens if not vocab.is_eos[t]).decode(errors="replace")
                        for w in runs[:3]],
            "compared_steps": sum(w.compared for w in runs), "differing_steps": sum(w.differ for w in runs),
            "rejected_by": {name: sum(w.rejected_by == name for w in runs) for name in names},
            "rejections": {name: [w.rejected for w in runs if w.rejected_by == name][:2] for name in names},
            "special_allowed_steps": {name: sum(w.special.get(name, 0) for w in runs) for name in names},
            "only_allowed_by": {name: [w.only[name] for w in runs if name in w.only][:2] for name in names}}


def _answers_valid(grammar: Grammar, runs: list[Walk], driver: str, vocab: Vocab) -> tuple[int, int]:
    """(answers that parse and pass the grammar's check, complete walks) among the walks `driver` sampled."""
    valid = total = 0
    for run in runs:
        if run.driver != driver or not run.complete:
            continue
        total += 1
        try:
            answer = json.loads(b"".join(vocab.tokens[t] for t in run.tokens[:-1]))
        except ValueError:
            continue
        valid += grammar.check is None or bool(grammar.check(answer))
    return valid, total


def _timings(side: Side, shared: list[list[int]], vocab: Vocab, batch: int) -> dict:
    """Mask and consume times over the shared walks, replayed; the batch's time per step."""
    gc.disable()  # a collection inside a timed fill is the benchmark's noise, not the library's cost
    try:
        fills, consumes, firsts, totals = [], [], [], []
        for tokens in shared:
            fill_ns, consume_ns = replay(side, tokens, vocab)
            fills += fill_ns
            consumes += consume_ns
            firsts.append(fill_ns[0])
            totals.append(sum(fill_ns))
        cycle = [shared[i % len(shared)] for i in range(batch)]
        per_step = batch_fill_s(side, cycle, vocab)
    finally:
        gc.enable()
    return {"first_mask_us": statistics.median(firsts) / 1e3, "mask_us_median": statistics.median(fills) / 1e3,
            "mask_us_p99": _quantile(fills, 0.99) / 1e3, "walk_mask_ms": statistics.fmean(totals) / 1e6,
            "consume_us_median": statistics.median(consumes) / 1e3,
            "batch_ms_per_step": statistics.fmean(per_step) * 1e3, "batch_ms_max": max(per_step) * 1e3}


RATIO_KEYS = ("compile_ms", "again_ms", "first_mask_us", "mask_us_median", "mask_us_p99", "walk_mask_ms",
              "batch_ms_per_step", "batch_ms_max")


def ratios(results: list[dict], top: str = "xgrammar", bottom: str = "llguidance") -> dict:
    """Geometric mean over grammars both compile of top / bottom, per measure."""
    both = [r["libraries"] for r in results if all(r["libraries"].get(n, {}).get("compiles") for n in (top, bottom))]
    out = {"grammars": len(both)}
    for key in RATIO_KEYS if both else ():
        logs = [math.log(lib[top][key] / lib[bottom][key]) for lib in both if lib[bottom][key] > 0]
        out[key] = math.exp(sum(logs) / len(logs))
    return out


def _pair(result: dict, names: list[str], key: str, fmt: str) -> str:
    cells = []
    for name in names:
        lib = result["libraries"].get(name, {})
        cells.append(fmt.format(lib[key]) if key in lib else "-")
    return " / ".join(cells)


def table(results: list[dict], names: list[str], batch: int) -> list[str]:
    """The results as two markdown tables (values `a / b` in the order of `names`)."""
    lines = ["| grammar | compiles | compile ms | again ms | first mask us | walks complete | rejected | "
             "timed walks (tokens) |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        ok = " / ".join("yes" if r["libraries"].get(n, {}).get("compiles") else "NO" for n in names)
        done = f"{r['complete']}/{r['walks']}" if "walks" in r else "-"
        rejected = " / ".join(str(r["rejected_by"].get(n, "-")) for n in names) if "rejected_by" in r else "-"
        timed = f"{r['timed_walks']} ({r['timed_tokens']})" if "timed_walks" in r else "-"
        lines.append(f"| {r['name']} | {ok} | {_pair(r, names, 'compile_ms', '{:.2f}')} | "
                     f"{_pair(r, names, 'again_ms', '{:.2f}')} | {_pair(r, names, 'first_mask_us', '{:.0f}')} | "
                     f"{done} | {rejected} | {timed} |")
    lines += ["", f"| grammar | mask us median | p99 | masks ms per walk | consume us median | "
                  f"batch-{batch} ms/step mean | max | masks differ (steps) |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        differ = f"{r['differing_steps']}/{r['compared_steps']}" if r.get("compared_steps") else "-"
        lines.append(f"| {r['name']} | {_pair(r, names, 'mask_us_median', '{:.1f}')} | "
                     f"{_pair(r, names, 'mask_us_p99', '{:.0f}')} | {_pair(r, names, 'walk_mask_ms', '{:.2f}')} | "
                     f"{_pair(r, names, 'consume_us_median', '{:.1f}')} | "
                     f"{_pair(r, names, 'batch_ms_per_step', '{:.2f}')} | "
                     f"{_pair(r, names, 'batch_ms_max', '{:.1f}')} | {differ} |")
    return lines


def notes(results: list[dict]) -> list[str]:
    """Per grammar and library: a compile error, or the first token it rejected and the first tokens
    only it allowed (one line each)."""
    lines = []
    for r in results:
        for name, lib in r["libraries"].items():
            if not lib["compiles"]:
                lines.append(f"- {r['name']}: {name} does not compile it: {lib['error']}")
                continue
            for text in r["rejections"][name][:1]:
                lines.append(f"- {r['name']}: {name} rejects, in {r['rejected_by'][name]} walks, e.g. {text}")
            for text in r["only_allowed_by"][name][:1]:
                lines.append(f"- {r['name']}: only {name} allows {text}")
            valid, total = r.get("answers_valid", {}).get(name, (0, 0))
            if valid < total:
                lines.append(f"- {r['name']}: only {valid} of the {total} answers {name} led to are valid")
            if r["special_allowed_steps"][name]:
                lines.append(f"- {r['name']}: {name} allows a special token (not EOS) at "
                             f"{r['special_allowed_steps'][name]} steps")
    return lines


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", help="a byte-level BPE tokenizer.json, or `builtin` (default: train one)")
    parser.add_argument("--train-vocab", type=int, default=151_000, help="tokens of the trained one (Qwen's ~151k)")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache/hkv/bench_grammar")
    parser.add_argument("--walks", type=int, default=64, help="random walks per grammar")
    parser.add_argument("--batch", type=int, default=32, help="matchers filled at once in the batched measure")
    parser.add_argument("--steps", type=int, default=256, help="at most this many tokens per walk")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="threads of the batched fills")
    parser.add_argument("--libraries", default="llguidance,xgrammar")
    parser.add_argument("--only", help="comma-separated grammar names")
    parser.add_argument("--json", type=Path, help="also write the results here")
    return parser


def _warm_up(libraries: list, vocab: Vocab) -> None:
    """One throwaway grammar per library, so one-off start-up work is nobody's first compile."""
    warm = Grammar("warm-up", "json_schema", {"type": "object", "properties": {"a": {"type": "string"}}})
    for library in libraries:
        side = Side(library, library.compile(warm))
        replay(side, walk([side], 0, vocab, 0, 16).tokens, vocab)


def _summary_lines(summary: dict) -> list[str]:
    if not summary.get("grammars"):
        return []
    parts = [f"{key} {summary[key]:.2f}x" for key in RATIO_KEYS]
    return [f"xgrammar / llguidance, geometric mean over the {summary['grammars']} grammars both compile: "
            + ", ".join(parts), ""]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.tokenizer is None:
        path = train_tokenizer(args.train_vocab, args.cache_dir)
    else:
        path = BUILTIN if args.tokenizer == "builtin" else Path(args.tokenizer)
    vocab = load_vocab(path)
    libraries, setup_s = start_libraries(vocab, args.threads, args.libraries.split(","))
    names = [lib.name for lib in libraries]
    print(f"tokenizer {path}: {vocab.size} tokens, EOS {list(vocab.eos)}; {args.threads} threads; "
          f"{args.walks} walks of at most {args.steps} tokens; batches of {args.batch}", flush=True)
    checks = {lib.name: check_vocab(vocab, lib) for lib in libraries}
    for name in names:
        print(f"{name}: import + tokenizer {setup_s[name]:.2f} s; token bytes unlike tokenizer.json's: "
              f"{checks[name]['differ']} {checks[name]['examples']}", flush=True)
    _warm_up(libraries, vocab)
    results = []
    for grammar in [g for g in GRAMMARS if not args.only or g.name in args.only.split(",")]:
        results.append(measure(grammar, libraries, vocab, args.walks, args.steps, args.batch))
        print(f"  {grammar.name} done", file=sys.stderr, flush=True)
    summary = ratios(results) if len(names) == 2 else {}
    print("\n".join(["", *table(results, names, args.batch), "", *_summary_lines(summary), *notes(results)]))
    if args.json:
        args.json.write_text(json.dumps({
            "tokenizer": str(path), "vocab_size": vocab.size, "eos": list(vocab.eos), "threads": args.threads,
            "walks": args.walks, "steps": args.steps, "batch": args.batch, "setup_s": setup_s,
            "vocab_check": checks, "grammars": results, "ratios_xgrammar_over_llguidance": summary}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
