"""Structured output: a `Constraint` as a grammar, and token masks from it (llguidance).

llguidance (the engine behind vLLM's and SGLang's `guidance` backends) is picked over xgrammar on
what `python -m tools.bench.bench_grammar` measured (docs/benchmarks.md): every answer it led to was valid
JSON that met its schema, where xgrammar let through raw control characters in bounded strings and
special tokens inside strings, and accepted keywords it does not enforce (llguidance refuses those
with an error, a 400); it compiles a schema in about a millisecond (xgrammar 5-50 ms the first
time); and it has no Python dependency (xgrammar needs transformers, pydantic and a TVM runtime at
serving time). xgrammar's masks are faster once compiled (about a third of llguidance's 10-20 us
median a token on a 151k vocabulary); hkv builds masks while the step's forward runs, so that
difference stays off the step's critical path unless masks outlast the forward.

A step's masks are filled row by row on MaskWorkers' threads, not by llguidance's LLExecutor: a row's
mask releases the GIL, and rows pulled one at a time from a shared queue spread llguidance's costly
states (1-1.5 ms a mask inside a `maxLength` string on a 151k vocabulary, against 20 us for most) over
the threads. LLExecutor gained 1.1-1.5x from 2 threads on such rows where the row queue gains 1.7x. On
2 cores, 32 rows of tools/bench/bench_structured's schema a step took 2.05 ms one by one, 1.57 ms on a queue
of 2 threads, 2.11 ms on LLExecutor(2), and 2.35 ms on 2 threads each with its own LLExecutor(1) (its
rayon hand-off costs 20% even at one thread); more threads than cores made the queue slower (2.3 ms at 12).
docs/benchmarks.md, "Structured output: what it costs a served decode step", has the served figures.

    grammar_of(constraint) -> str        llguidance's grammar text; GrammarError for a bad spec
    check_constraint(constraint)         the same check, for the api (400 before anything is queued)
    Grammars(tokenizer_json, vocab, eos) the rank's side: matchers, and masks for a batch of them

JSON output is compact (`", "` and `": "` between items, no other whitespace): a model cannot stall
a constrained answer in whitespace, and `json.loads` reads every finished answer.

A mask is a bitmask of int32 words, bit t of word t // 32 set when token t may come next; ids past
the tokenizer's vocabulary (the embedding's padding) are never allowed. Once the grammar is done
(or a matcher fell into an error state, which masks make impossible unless a caller forces a token)
only the EOS tokens are allowed, so the sequence finishes with "stop".
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

from hkv.engine.mask_cache import MaskCache, MaskCaches
from hkv.ipc.messages import CONSTRAINT_KINDS, MAX_CONSTRAINT_CHARS, Constraint

if TYPE_CHECKING:  # torch only in annotations: the api imports this module without loading torch
    import torch

log = logging.getLogger("hkv.grammar")
T = TypeVar("T")

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MASK_CACHE_MODES = ("off", "on", "verify")  # HKV_GRAMMAR_MASK_CACHE=0, unset or 1, verify (hkv/engine/mask_cache.py)


class GrammarError(ValueError):
    """A constraint that does not compile: the message says why (the api answers 400)."""


def _llg():
    import llguidance

    return llguidance


def _guarded(what: str, call: Callable[[], T]) -> T:
    """llguidance's Rust code can panic on a malformed grammar (a schema with a non-ASCII `required` string,
    say); pyo3 raises that as a BaseException, which would end a rank's process: turn it into GrammarError."""
    try:
        return call()
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except GrammarError:
        raise
    except BaseException as exc:  # pyo3's PanicException derives from BaseException
        raise GrammarError(f"{what} failed in llguidance: {type(exc).__name__}: {str(exc)[:300]}") from None


def grammar_of(constraint: Constraint) -> str:
    """The constraint as an llguidance grammar (its JSON text); raises GrammarError for a bad spec."""
    if constraint.kind not in CONSTRAINT_KINDS:
        raise GrammarError(f"unknown constraint kind {constraint.kind!r}, want one of {list(CONSTRAINT_KINDS)}")
    if len(constraint.spec) > MAX_CONSTRAINT_CHARS:
        raise GrammarError(f"a {constraint.kind} of {len(constraint.spec)} characters (at most {MAX_CONSTRAINT_CHARS})")
    matcher = _llg().LLMatcher
    if constraint.kind == "json_schema":
        try:
            schema = json.loads(constraint.spec)
        except ValueError as exc:
            raise GrammarError(f"the JSON schema is not JSON: {exc}") from None
        if schema is True:  # any JSON value
            schema = {}
        if not isinstance(schema, dict):
            raise GrammarError("a JSON schema must be an object (or true); false would allow nothing")
        try:
            return _guarded("the JSON schema", lambda: matcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS))
        except ValueError as exc:
            raise GrammarError(f"the JSON schema does not compile: {exc}") from None
    if constraint.kind == "regex":
        return _guarded("the regex", lambda: matcher.grammar_from_regex(constraint.spec))
    return _guarded("the grammar", lambda: matcher.grammar_from_lark(constraint.spec))


def check_constraint(constraint: Constraint) -> None:
    """Raise GrammarError unless the constraint compiles (its grammar is checked without a tokenizer)."""
    grammar = grammar_of(constraint)
    error = _guarded(f"the {constraint.kind}", lambda: _llg().LLMatcher.validate_grammar(grammar))
    if error and not error.startswith("WARNING"):
        raise GrammarError(f"the {constraint.kind.replace('_', ' ')} does not compile: {error}")


def mask_words(vocab_size: int) -> int:
    """int32 words of one token bitmask."""
    return (vocab_size + 31) // 32


class Matcher:
    """One sequence's place in its grammar."""

    def __init__(self, inner, eos_ids: Sequence[int], cache: MaskCache | None = None,
                 token_bytes: Sequence[bytes] = ()):
        self._inner = inner  # llguidance.LLMatcher; None for a matcher that only ends its sequence
        self._eos = list(eos_ids)
        self.failed = inner is None  # a token the grammar did not allow was forced in: only EOS from now on
        self._cache = cache  # its grammar's masks by state (HKV_GRAMMAR_MASK_CACHE), None without
        self._tracker = cache.tracker() if cache is not None else None  # where it stands, for the cache's key
        self._token_bytes = token_bytes  # each id's bytes, which the tracker follows (with a cache)

    @classmethod
    def ended(cls, eos_ids: Sequence[int]) -> "Matcher":
        """A matcher that allows only EOS (a grammar that could not be built on the rank)."""
        return cls(None, eos_ids)

    def consume(self, token: int) -> None:
        """Advance past a sampled token (EOS included: the matcher stops)."""
        if self.failed or self._inner.is_stopped():
            return
        try:
            taken = _guarded("a token", lambda: self._inner.consume_token(token))
        except GrammarError as exc:
            taken = False
            log.error("a constrained sequence's matcher failed on token %d: %s", token, exc)
        if not taken:
            self.failed = True
            log.warning("a constrained sequence took token %d its grammar does not allow (%s); it may only end "
                        "now", token, self._inner.get_error())
        elif self._tracker is not None:
            self._tracker.feed(self._token_bytes[token])

    def cache_key(self) -> tuple | None:
        """The key of its state in its grammar's mask cache; None without a cache, where the state has none, or
        where the tracker fails (then llguidance fills the mask: the cache may only ever save time)."""
        if self._tracker is None:
            return None
        try:
            return self._tracker.key()
        except Exception:
            log.exception("the grammar mask cache's tracker failed; this sequence's masks come from llguidance")
            self._tracker = None
            return None

    @property
    def done(self) -> bool:
        """Only EOS may follow: the grammar finished, or the matcher failed."""
        return self.failed or self._inner.is_stopped() or self._inner.is_error()

    def fill(self, row: torch.Tensor) -> None:
        """Write the next token's bitmask into `row` ([words] int32, contiguous, on the host)."""
        if self.done:
            self.eos_only(row, self._eos)
            return
        self.fill_ptr(row.data_ptr(), row.numel() * 4)

    def fill_ptr(self, ptr: int, size: int) -> None:
        """Write a live matcher's next bitmask into the `size` bytes of host memory at `ptr`: its grammar's cached
        mask where its state has a key there, else llguidance's. Every live row's mask takes this path."""
        key = self.cache_key()
        if key is None:
            self._inner.unsafe_compute_mask_ptr(ptr, size)
        else:
            self._cache.fill(key, ptr, size, lambda: self._inner.unsafe_compute_mask_ptr(ptr, size))

    @staticmethod
    def eos_only(row: torch.Tensor, eos_ids: Sequence[int]) -> None:
        words: dict[int, int] = {}
        for t in eos_ids:
            words[t // 32] = words.get(t // 32, 0) | 1 << (t % 32)
        row.zero_()
        for word, bits in words.items():
            if word < row.numel():
                row[word] = bits - (1 << 32) if bits >= 1 << 31 else bits  # the int32 of those bits


def byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character a byte-level BPE vocabulary spells a byte with -> it."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, shifted = {b: chr(b) for b in kept}, 0
    for b in range(256):
        if b not in chars:
            chars[b], shifted = chr(256 + shifted), shifted + 1
    return {c: b for b, c in chars.items()}


class _ByteLevelVocab:
    """A byte-level BPE tokenizer.json as llguidance.TokenizerWrapper reads it: each id's bytes, the special
    ids, and the tokenizer itself for the text a grammar forces. Added tokens count as special only where the
    file marks them so: Qwen's `<tool_call>`, `</tool_call>`, `<think>` and `</think>` are added tokens that
    are not, and a model writes its calls and closes its reasoning with them (llguidance's own reader takes
    every added token for a special one, so a forced call ended at its first tag)."""

    bos_token_id = None

    def __init__(self, spec: dict, text: str, vocab_size: int, eos_id: int):
        from tokenizers import Tokenizer

        alphabet = byte_alphabet()
        added = {a["id"]: a for a in spec.get("added_tokens", [])}
        vocab = spec["model"]["vocab"]
        # ids past the tokenizer's, up to the model's logit rows, spell nothing: no grammar allows them
        self.tokens: list[bytes] = [b""] * max([vocab_size, *(i + 1 for i in vocab.values()), *(i + 1 for i in added)])
        for token, i in vocab.items():
            self.tokens[i] = bytes(alphabet[c] for c in token)
        for i, a in added.items():
            self.tokens[i] = a["content"].encode()
        self.special_token_ids = sorted(i for i, a in added.items() if a.get("special"))
        self.eos_token_id = eos_id
        self._tokenizer = Tokenizer.from_str(text)

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids


def _byte_level_vocab(path: str, vocab_size: int, eos_id: int) -> _ByteLevelVocab | None:
    """A byte-level BPE tokenizer.json as _ByteLevelVocab (llguidance.LLTokenizer is built from it); None for
    any other, which llguidance's own reader takes."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    spec = json.loads(text)
    model = spec.get("model") or {}
    vocab = model.get("vocab")
    alphabet = set(byte_alphabet())
    if model.get("type") != "BPE" or "ByteLevel" not in json.dumps(spec.get("decoder")) \
            or not isinstance(vocab, dict) or any(not alphabet.issuperset(t) for t in vocab):
        return None
    return _ByteLevelVocab(spec, text, vocab_size, eos_id)


class Grammars:
    """The rank's grammar engine: the tokenizer as llguidance sees it, and matchers over it.

    tokenizer_json: the checkpoint's tokenizer.json; vocab_size: the model's logit rows (ids past the
    tokenizer's are never allowed); eos_ids: the tokens that end a sequence (allowed where the grammar
    may end, and alone once it has); threads: the mask threads (None: default_mask_threads()); mask_cache: one
    of MASK_CACHE_MODES, HKV_GRAMMAR_MASK_CACHE (a server's default is on; hkv/engine/mask_cache.py): json_schema masks
    inside bounded strings cached by the matcher's place in its schema, on a byte-level BPE tokenizer only
    (its tracker follows each token's bytes); `self.mask_cache` (None without) counts hits and misses."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Sequence[int], threads: int | None = None,
                 mask_cache: str = "off"):
        if mask_cache not in MASK_CACHE_MODES:
            raise ValueError(f"mask_cache {mask_cache!r}, want one of {MASK_CACHE_MODES}")
        llg = _llg()
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        byte_level = _byte_level_vocab(tokenizer_json, vocab_size, self.eos_ids[0])
        self.tokenizer = llg.LLTokenizer(llg.TokenizerWrapper(byte_level) if byte_level else tokenizer_json,
                                         n_vocab=vocab_size, eos_token=self.eos_ids)
        self.executor = MaskWorkers(threads or default_mask_threads())
        self.words = mask_words(vocab_size)
        self._token_bytes: list[bytes] = byte_level.tokens if byte_level else []
        self.mask_cache: MaskCaches | None = None
        if mask_cache != "off" and byte_level is None:  # on by default: a warning only where verify was asked for
            (log.warning if mask_cache == "verify" else log.info)(
                "no grammar mask cache: %s is not a byte-level BPE tokenizer (HKV_GRAMMAR_MASK_CACHE)", tokenizer_json)
        elif mask_cache != "off":
            self.mask_cache = MaskCaches(max(map(len, self._token_bytes)), verify=mask_cache == "verify")

    def matcher(self, constraint: Constraint, consumed: Sequence[int] = ()) -> Matcher:
        """A matcher at the start of the constraint's grammar, advanced past `consumed` (a resumed
        sequence's output so far); raises GrammarError if the grammar does not compile."""
        grammar = grammar_of(constraint)
        inner = _guarded(f"the {constraint.kind}", lambda: _llg().LLMatcher(self.tokenizer, grammar, log_level=0))
        if inner.is_error():
            raise GrammarError(inner.get_error())
        cache = None
        if self.mask_cache is not None and constraint.kind == "json_schema":
            cache = self.mask_cache.for_grammar(grammar, constraint.spec)
        matcher = Matcher(inner, self.eos_ids, cache, self._token_bytes)
        _guarded("replaying the output", lambda: [matcher.consume(token) for token in consumed])
        return matcher

    def fill(self, matchers: Sequence[Matcher], masks: torch.Tensor) -> None:
        """Row i of `masks` ([>= len(matchers), words] int32, contiguous, host) = matchers[i]'s next mask;
        the live ones in parallel on llguidance's threads."""
        fill_masks(matchers, masks, self.executor)


def default_mask_threads() -> int:
    """Mask threads when --grammar-threads is not given: a quarter of the CPUs this process may use, 1 to 8.

    Few on purpose: a row's call takes and gives back the GIL, and a thread that must wait for a core to take
    it back stalls the fill. A served H100 box (16 CPUs, the api, router, rank and client busy beside it)
    filled 32 rows of the bench schema in 4.8 ms a step on 12 threads, where one thread on a 2-core VM
    takes 2.05 ms; llguidance's LLExecutor on 12 threads took 2.8 ms on an H200 box and 3.2 ms on 16."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus // 4))


class MaskWorkers:
    """`threads` threads (the caller's among them) that fill a step's live masks, pulling rows one at a time
    from a shared queue: a row's llguidance call runs without the GIL, and a costly row holds up only its thread."""

    def __init__(self, threads: int):
        if threads < 1:
            raise ValueError(f"mask threads must be >= 1, not {threads}")
        self.threads = threads
        # the caller is one of the threads; the pool starts its own on the first fill that hands it rows
        self._pool = ThreadPoolExecutor(threads - 1, thread_name_prefix="grammar-mask") if threads > 1 else None

    def fill(self, rows: list[tuple[Matcher, int]], masks: torch.Tensor) -> list[tuple[int, str]]:
        """matcher's next mask into masks[i] for each (matcher, i) of `rows` (live matchers); returns the
        (i, error) of the rows whose llguidance call failed (their masks are left as they were)."""
        base, stride = masks.data_ptr(), masks.shape[1] * 4
        queue = iter(rows)  # next() on a list iterator is atomic under the GIL: each row is taken once
        failed: list[tuple[int, str]] = []

        def work() -> None:
            for matcher, i in queue:
                try:
                    matcher.fill_ptr(base + i * stride, stride)
                except (KeyboardInterrupt, SystemExit, GeneratorExit):
                    raise
                except BaseException as exc:  # pyo3's PanicException derives from BaseException
                    failed.append((i, f"{type(exc).__name__}: {str(exc)[:300]}"))

        helpers = min(len(rows), self.threads) - 1
        futures = [self._pool.submit(work) for _ in range(helpers)] if helpers > 0 and self._pool else []
        try:
            work()
        finally:
            for future in futures:
                future.result()
        return failed

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def fill_masks(matchers: Sequence[Matcher], masks: torch.Tensor, executor: MaskWorkers | None = None) -> None:
    """Row i of `masks` = matchers[i]'s next mask: the finished ones (EOS only) here, the live ones on
    `executor` (needed when any is live). A live row whose mask fails ends its sequence (EOS only), not the
    step of every row."""
    live = [(m, i) for i, m in enumerate(matchers) if not m.done]
    for i, m in enumerate(matchers):
        if m.done:
            m.fill(masks[i])
    if not live:
        return
    if masks.shape[0] < len(matchers) or not masks.is_contiguous() or masks.dtype.itemsize != 4:
        raise ValueError(f"masks of shape {tuple(masks.shape)} ({masks.dtype}) for {len(matchers)} matchers")
    for i, error in executor.fill(live, masks):
        log.error("a constrained sequence ends: its mask failed in llguidance: %s", error)
        matchers[i].failed = True
        matchers[i].fill(masks[i])
