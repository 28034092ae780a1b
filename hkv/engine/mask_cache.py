"""Token masks inside bounded JSON strings, cached by where the matcher stands in its schema (issue 37).

On by default in a server (HKV_GRAMMAR_MASK_CACHE=0 turns it off, `verify` checks every hit). llguidance walks its whole
token trie for a state inside a string with `maxLength` (1.0-1.8 ms a mask on a 151k vocabulary, against
10-60 us for most states), and a step of constrained rows pays that on every row inside such a string. Within
one string lexeme llguidance's parser state stays put and only the lexer moves, so such a mask is a function of
where the string sits in the schema and how far into it the matcher is: the Tracker here follows the bytes a
matcher consumed and keys that state. tools/bench/bench_mask_cache.py tested the key against llguidance
itself (docs/benchmarks.md, "Can a mask cache inside bounded strings be exact?"): 0 mismatches in 7,546 keyed
fills on 6 schemas, 46-76% of the fill time saved, and wrong masks without the container state or the caps.

The key. A mask is the set of tokens whose bytes extend the output to a prefix of some answer, so it depends
only on the answer's possible continuations up to the longest token's bytes (H). The tracker keys a state
inside a value string by:
  - each enclosing container: an object's node and the keys written so far (llguidance writes properties in
    schema order, optional ones skippable); an array's node and, for the item being written, how many more
    items must follow and how many may, each capped at R = H // s + 2 (s: the fewest bytes `, ` and an item
    take; further items than R lie beyond any token's reach, so their count cannot change the mask);
  - the string's node, its characters still allowed (maxLength - written, capped at H + 1: a character takes
    a byte at least) and still required (minLength - written, capped alike), and the bytes of a partial
    UTF-8 character or escape pending (exactly: a lead byte constrains its continuation bytes).
Which characters were written does not enter it. Anything the tracker cannot follow (a schema outside the
family, an escape of a UTF-16 surrogate, whose counting is llguidance's business) gives no key.

The family: objects with fixed `properties` (`additionalProperties: false`; required and optional),
arrays with `items` (+ minItems / maxItems), strings with maxLength / minLength and nothing else, integers,
numbers, booleans, enums of strings without escapes, integers, booleans and null. JSON is compact
(grammar.JSON_OPTIONS). A cache is exact only for one grammar text, tokenizer, vocabulary size and llguidance
version: MaskCaches belongs to one grammar.Grammars and holds a MaskCache per grammar text.

    caches = MaskCaches(horizon, verify)       one Grammars' caches, under one byte budget (LRU)
    cache = caches.for_grammar(grammar, spec)  a json_schema grammar's cache; None outside the family
    cache.tracker()                            a new matcher's Tracker; feed() it each token's bytes
    cache.fill(key, ptr, size, compute)        the mask at `key` into host memory: cached, or compute()'s
"""

from __future__ import annotations

import ctypes
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("hkv.grammar")

# 64 MiB holds about 3,500 masks of a 151k vocabulary (19 KB each): the study's six schemas made 1,500 distinct
# keys between them (66 for bench_structured's bounded schema), so several busy schemas stay warm, at a small
# share of a rank's host memory beside its pinned buffers and CPU cache tier.
MASK_CACHE_BYTES = 64 << 20
# grammar texts a MaskCaches remembers (their caches, or that the tracker cannot follow them): a server that sees
# ever new schemas forgets the least recently used ones rather than growing without end
MASK_CACHE_GRAMMARS = 1024
_LITERALS = {"integer", "number", "boolean", "null"}


class Unsupported(ValueError):
    """A schema outside the family this tracker follows."""


@dataclass
class Node:
    """One schema node of the family, compiled: `path` names it (a JSON pointer into the schema)."""

    kind: str  # object, array, string, enum, or a literal kind (integer, number, boolean, null)
    path: str
    properties: dict[str, "Node"] = field(default_factory=dict)
    required: frozenset[str] = frozenset()
    items: "Node | None" = None
    item_step: int = 0  # an array's: the fewest bytes `, ` and one item take (min_bytes of items + 2)
    min_items: int = 0
    max_items: int | None = None
    min_length: int = 0
    max_length: int | None = None
    enum: tuple[bytes, ...] = ()


def _count(schema: dict, name: str, path: str) -> int | None:
    value = schema.get(name)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise Unsupported(f"{path or '/'}: {name} {value!r}")
    return value


def compile_schema(schema: dict, path: str = "") -> Node:
    """The schema as a Node tree; Unsupported for anything outside the family (a malformed schema included:
    the tracker must never guess what llguidance made of one)."""
    if not isinstance(schema, dict):
        raise Unsupported(f"{path or '/'}: {type(schema).__name__}, not an object")
    keys = set(schema)
    if "enum" in schema and keys == {"enum"}:
        values = schema["enum"]
        # no floats: json.dumps may spell one otherwise than llguidance (1.0, 1e100), and min_bytes counts bytes
        if not isinstance(values, list) or not values \
                or any(not (v is None or isinstance(v, (str, int))) or "\\" in json.dumps(v) for v in values):
            raise Unsupported(f"{path or '/'}: an enum of containers, floats or strings that need escapes")
        return Node("enum", path, enum=tuple(json.dumps(v).encode() for v in values))
    kind = schema.get("type")
    if kind == "object" and keys <= {"type", "properties", "required", "additionalProperties"} \
            and schema.get("additionalProperties") is False:
        properties, required = schema.get("properties", {}), schema.get("required", [])
        if not isinstance(properties, dict) or not isinstance(required, list) or not set(required) <= set(properties):
            raise Unsupported(f"{path or '/'}: properties or required malformed")
        if any(json.dumps(name) != f'"{name}"' for name in properties):
            raise Unsupported(f"{path or '/'}: a property name that needs an escape")
        return Node("object", path, required=frozenset(required),
                    properties={n: compile_schema(s, f"{path}/{n}") for n, s in properties.items()})
    if kind == "array" and keys <= {"type", "items", "minItems", "maxItems"} and isinstance(schema.get("items"), dict):
        items = compile_schema(schema["items"], f"{path}/items")
        return Node("array", path, items=items, item_step=min_bytes(items) + 2,
                    min_items=_count(schema, "minItems", path) or 0, max_items=_count(schema, "maxItems", path))
    if kind == "string" and keys <= {"type", "minLength", "maxLength"}:
        return Node("string", path, min_length=_count(schema, "minLength", path) or 0,
                    max_length=_count(schema, "maxLength", path))
    if kind in _LITERALS and keys == {"type"} or kind == "integer" and keys <= {"type", "minimum", "maximum"}:
        return Node(kind, path)
    raise Unsupported(f"{path or '/'}: {sorted(keys)} of type {kind!r}")


def min_bytes(node: Node) -> int:
    """A lower bound on the bytes of any compact JSON value of `node`."""
    if node.kind == "string":
        return 2 + node.min_length
    if node.kind == "enum":
        return min(map(len, node.enum))
    if node.kind == "object":
        members = [len(name) + 4 + min_bytes(node.properties[name]) for name in node.required]
        return 2 + sum(members) + 2 * max(len(members) - 1, 0)
    if node.kind == "array":
        return 2 + node.min_items * node.item_step - (2 if node.min_items else 0)
    return 4 if node.kind in ("boolean", "null") else 1


@dataclass
class _Frame:
    """One open value on the tracker's stack. phase: an object's `open` (a key or `}` next), `key` (inside
    one), `colon` (its value next), `value` (in it), `after` (`, ` or `}` next); an array's `open`, `next`
    (an item next), `value`, `after`; a string's and a literal's `value`."""

    node: Node
    phase: str = "open"
    keys: tuple[str, ...] = ()  # an object's keys written so far (the one being written last)
    name: bytearray = field(default_factory=bytearray)  # an object's key being read, a literal's bytes
    index: int = 0  # an array's item being written
    chars: int = 0  # a string's characters written
    pending: bytes = b""  # a string's partial UTF-8 character or escape
    surrogate: bool = False  # a string that holds a \\u escape of a UTF-16 surrogate: no key


def _utf8_len(lead: int) -> int:
    return 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4


class Tracker:
    """Where a matcher stands in a schema of the family, from the bytes it consumed (compact JSON).

    feed(data) advances it; key() / naive_key() are the cache keys of the state (None outside a value
    string, or once it lost track). It trusts the bytes to be a prefix of an answer (llguidance's masks made
    them so) and only checks what it needs to follow them; a byte it cannot place makes it `lost`."""

    def __init__(self, root: Node, horizon: int):
        self.root = root
        self.horizon = horizon  # the longest token's bytes
        self.stack: list[_Frame] = []
        self.expect = b""  # separator bytes that must come next
        self.done = False  # the root value is complete
        self.lost = False
        self.capped = False  # the last key() capped a count at what a token can reach

    def feed(self, data: bytes) -> None:
        for b in data:
            if self.lost:
                return
            try:
                self._byte(b)
            except Exception:  # a \\u escape of non-hex digits, or bytes it cannot follow: a rank's consume must
                self.lost = True  # not raise, and a lost tracker only gives no key (llguidance fills the mask)

    def _byte(self, b: int) -> None:
        if self.expect:
            self.lost = b != self.expect[0]
            self.expect = self.expect[1:]
            return
        if self.done:
            self.lost = True
        elif not self.stack:
            self._begin(self.root, b)
        elif self.stack[-1].node.kind == "object":
            self._object_byte(self.stack[-1], b)
        elif self.stack[-1].node.kind == "array":
            self._array_byte(self.stack[-1], b)
        elif self.stack[-1].node.kind == "string":
            self._string_byte(self.stack[-1], b)
        else:
            self._literal_byte(self.stack[-1], b)

    def _begin(self, node: Node, b: int) -> None:
        """Open a value of `node` whose first byte is b."""
        opening = {"object": ord("{"), "array": ord("["), "string": ord('"')}.get(node.kind)
        if opening is not None and b != opening:
            self.lost = True
            return
        frame = _Frame(node, phase="open" if node.kind in ("object", "array") else "value")
        self.stack.append(frame)
        if opening is None:
            frame.name.append(b)

    def _close(self) -> None:
        self.stack.pop()
        if self.stack:
            self.stack[-1].phase = "after"
        else:
            self.done = True

    def _object_byte(self, frame: _Frame, b: int) -> None:
        if frame.phase in ("open", "after") and b == ord("}"):
            self._close()
        elif frame.phase == "after" and b == ord(","):
            frame.phase, self.expect = "open", b" "
        elif frame.phase == "open" and b == ord('"'):
            frame.phase, frame.name = "key", bytearray()
        elif frame.phase == "key" and b == ord('"'):
            name = frame.name.decode("utf-8", "replace")
            if name not in frame.node.properties:
                self.lost = True
            frame.phase, frame.keys, self.expect = "colon", (*frame.keys, name), b": "
        elif frame.phase == "key":
            frame.name.append(b)
        elif frame.phase == "colon":
            frame.phase = "value"
            self._begin(frame.node.properties[frame.keys[-1]], b)
        else:
            self.lost = True

    def _array_byte(self, frame: _Frame, b: int) -> None:
        if frame.phase in ("open", "after") and b == ord("]"):
            self._close()
        elif frame.phase == "after" and b == ord(","):
            frame.phase, frame.index, self.expect = "next", frame.index + 1, b" "
        elif frame.phase in ("open", "next"):
            frame.phase = "value"
            self._begin(frame.node.items, b)
        else:
            self.lost = True

    def _string_byte(self, frame: _Frame, b: int) -> None:
        if frame.pending[:1] == b"\\":
            frame.pending += bytes([b])
            if frame.pending[1:2] == b"u" and len(frame.pending) < 6:
                return
            if frame.pending[1:2] == b"u":
                frame.surrogate |= 0xD800 <= int(frame.pending[2:], 16) <= 0xDFFF
            frame.chars, frame.pending = frame.chars + 1, b""
        elif frame.pending:
            frame.pending += bytes([b])
            if len(frame.pending) == _utf8_len(frame.pending[0]):
                frame.chars, frame.pending = frame.chars + 1, b""
        elif b == ord('"'):
            self._close()
        elif b == ord("\\") or b >= 0xC0:
            frame.pending = bytes([b])
        else:
            frame.chars += 1

    def _literal_byte(self, frame: _Frame, b: int) -> None:
        quoted = frame.name[:1] == b'"'
        if quoted:  # an enum's string: it ends at its next quote (compile_schema refused escapes in them)
            frame.name.append(b)
            if b == ord('"'):
                self._close()
        elif b in b",}]":  # a number, boolean, null or unquoted enum ends where its container goes on
            self._close()
            self._byte(b)
        else:
            frame.name.append(b)

    def _container_states(self) -> tuple:
        states = []
        for frame in self.stack[:-1]:
            node = frame.node
            if node.kind == "object":
                states.append((node.path, frame.keys))
                continue
            cap = self.horizon // node.item_step + 2
            must = max(node.min_items - frame.index - 1, 0)
            may = None if node.max_items is None else node.max_items - frame.index - 1
            self.capped |= must > cap or may is not None and may > cap
            states.append((node.path, min(must, cap), None if may is None else min(may, cap)))
        return tuple(states)

    def _string(self) -> _Frame | None:
        if self.lost or self.expect or not self.stack:
            return None
        frame = self.stack[-1]
        if frame.node.kind != "string" or frame.surrogate:
            return None
        return frame

    def _string_state(self, frame: _Frame) -> tuple:
        reach = self.horizon + 1  # more characters than a token holds bytes are out of its reach
        node = frame.node
        left = None if node.max_length is None else node.max_length - frame.chars
        short = max(node.min_length - frame.chars, 0)
        self.capped |= short > reach or left is not None and left > reach
        return node.path, None if left is None else min(left, reach), min(short, reach), frame.pending

    def key(self) -> tuple | None:
        """The state's cache key inside a value string; None elsewhere."""
        frame, self.capped = self._string(), False
        return None if frame is None else (self._container_states(), self._string_state(frame))

    def naive_key(self) -> tuple | None:
        """The string's node and position alone (what a text scan sees): no container state."""
        frame = self._string()
        return None if frame is None else self._string_state(frame)


class MaskCache:
    """One grammar text's masks: Tracker key -> the mask's bytes. Its entries count against the byte budget of
    the MaskCaches that made it; `masks` and `enabled` change only under that one's lock."""

    def __init__(self, caches: MaskCaches, root: Node):
        self.root = root
        self.masks: dict[tuple, bytes] = {}
        self.enabled = True  # False once `verify` caught a wrong mask: nothing is looked up or kept again
        self._caches = caches

    def tracker(self) -> Tracker:
        """A Tracker at the start of this grammar, for a new matcher."""
        return Tracker(self.root, self._caches.horizon)

    def fill(self, key: tuple, ptr: int, size: int, compute: Callable[[], None]) -> None:
        """Write the mask of the state at `key` into the `size` bytes of host memory at `ptr`: the cached copy on
        a hit, else `compute()`'s (llguidance writes it there), kept for the next matcher at `key`. Safe from
        several threads at once (each writing its own row)."""
        self._caches.fill(self, key, ptr, size, compute)


class MaskCaches:
    """The mask caches of one grammar.Grammars (one tokenizer and vocabulary), a MaskCache per grammar text, under
    one byte budget across them, the least recently used mask evicted first.

    horizon: the longest token's bytes (the key's caps assume no token reaches further); verify: compute every
    mask with llguidance too and use that one; a hit whose cached bytes differ logs an error once and disables
    its grammar's cache. hits / misses count keyed fills (a miss computes and keeps its mask), mismatches the
    hits `verify` caught; read them from any thread (they are written under the lock)."""

    def __init__(self, horizon: int, verify: bool = False, budget: int = MASK_CACHE_BYTES,
                 grammars: int = MASK_CACHE_GRAMMARS):
        self.horizon = horizon
        self.verify = verify
        self.budget = budget
        self.hits = 0
        self.misses = 0
        self.mismatches = 0
        self.bytes = 0  # the masks' bytes held, at most `budget`
        self._max_grammars = grammars
        self._lock = threading.Lock()  # MaskWorkers' threads fill one step's rows at once
        self._grammars: OrderedDict[str, MaskCache | None] = OrderedDict()  # grammar text -> its cache, None: none
        self._order: OrderedDict[tuple[MaskCache, tuple], int] = OrderedDict()  # (cache, key) -> bytes; LRU first

    def for_grammar(self, grammar: str, spec: str) -> MaskCache | None:
        """The cache of `grammar`, the grammar text of the json_schema constraint `spec`; None where the
        Tracker cannot follow the schema (compile_schema raised Unsupported)."""
        with self._lock:
            if grammar in self._grammars:
                self._grammars.move_to_end(grammar)
                return self._grammars[grammar]
        try:
            cache = MaskCache(self, compile_schema(json.loads(spec)))
        except (Unsupported, ValueError):
            cache = None
        with self._lock:
            cache = self._grammars.setdefault(grammar, cache)  # another thread's, if it got there first
            while len(self._grammars) > self._max_grammars:
                _, forgotten = self._grammars.popitem(last=False)
                if forgotten is not None:  # its matchers still fill right: their masks just stop being kept
                    self._drop(forgotten)
        return cache

    def fill(self, cache: MaskCache, key: tuple, ptr: int, size: int, compute: Callable[[], None]) -> None:
        """MaskCache.fill of `cache`."""
        cached = self._get(cache, key, size)
        if cached is not None and not self.verify:
            ctypes.memmove(ptr, cached, size)
            return
        compute()
        if cached is None:
            self._put(cache, key, ctypes.string_at(ptr, size))
        elif cached != ctypes.string_at(ptr, size):
            self._mismatch(cache, key)

    def _get(self, cache: MaskCache, key: tuple, size: int) -> bytes | None:
        with self._lock:
            if not cache.enabled:
                return None
            mask = cache.masks.get(key)
            if mask is None or len(mask) != size:
                self.misses += 1
                return None
            self.hits += 1
            self._order.move_to_end((cache, key))
            return mask

    def _put(self, cache: MaskCache, key: tuple, mask: bytes) -> None:
        with self._lock:
            if not cache.enabled or len(mask) > self.budget:
                return
            self._forget(cache, key)  # a mask of another size under this key (a row of another length)
            cache.masks[key] = mask
            self._order[cache, key] = len(mask)
            self.bytes += len(mask)
            while self.bytes > self.budget:
                (old, old_key), size = self._order.popitem(last=False)
                del old.masks[old_key]
                self.bytes -= size

    def _mismatch(self, cache: MaskCache, key: tuple) -> None:
        with self._lock:
            self.mismatches += 1
            if not cache.enabled:
                return
            cache.enabled = False
            self._drop(cache)
        log.error("the grammar mask cache returned a mask llguidance disagrees with at %r: the cache is off for "
                  "this grammar from now on (HKV_GRAMMAR_MASK_CACHE=verify; the masks used were llguidance's)", key)

    def _forget(self, cache: MaskCache, key: tuple) -> None:
        """Drop one mask (under the lock)."""
        if cache.masks.pop(key, None) is not None:
            self.bytes -= self._order.pop((cache, key))

    def _drop(self, cache: MaskCache) -> None:
        """Drop all of a cache's masks (under the lock)."""
        for key in list(cache.masks):
            self._forget(cache, key)
