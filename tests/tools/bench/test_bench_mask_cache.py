"""tools/bench/bench_mask_cache.py: the tracker's keys (hkv/engine/mask_cache.py) on hand-written bytes, and the
study on the built-in 4,096-token tokenizer, where its claim is checked in CI: a cache keyed by the tracker returns
llguidance's own mask bit for bit, while the naive key (no container state) is caught returning a wrong one."""

from __future__ import annotations

import json

import pytest

from hkv.engine.mask_cache import Tracker, Unsupported, compile_schema, min_bytes
from hkv.models.tiny import SHIPPED_DIR
from tools.bench import bench_mask_cache
from tools.bench.bench_mask_cache import SCHEMAS

ARRAYS = compile_schema(SCHEMAS["arrays"])
TAGS = ("", ("tags",))


def _key(data: bytes, horizon: int = 48):
    tracker = Tracker(ARRAYS, horizon)
    tracker.feed(data)
    return tracker.key()


def test_a_key_is_the_container_state_and_the_string_position_not_its_characters():
    # tags: minItems 2, maxItems 4 -> after item 0, 1 more must and 3 more may follow; maxLength 6, 2 written
    assert _key(b'{"tags": ["ab') == ((TAGS, ("/tags", 1, 3)), ("/tags/items", 4, 0, b""))
    assert _key(b'{"tags": ["xy') == _key(b'{"tags": ["ab')
    assert _key(b'{"tags": ["ab", "c"], "rows": [["x"], ["') == (
        (("", ("tags", "rows")), ("/rows", 0, 1), ("/rows/items", 0, 1)), ("/rows/items/items", 5, 1, b""))


def test_partial_characters_and_escapes_are_pending_bytes():
    assert _key(b'{"tags": ["ab", "a\xc3') == ((TAGS, ("/tags", 0, 2)), ("/tags/items", 5, 0, b"\xc3"))
    assert _key(b'{"tags": ["ab", "a\xc3\xa9') == ((TAGS, ("/tags", 0, 2)), ("/tags/items", 4, 0, b""))
    assert _key(b'{"tags": ["ab", "\\u00') == ((TAGS, ("/tags", 0, 2)), ("/tags/items", 6, 0, b"\\u00"))
    assert _key(b'{"tags": ["ab", "\\n') == ((TAGS, ("/tags", 0, 2)), ("/tags/items", 5, 0, b""))


@pytest.mark.parametrize("data", [b'{"tags": ["ab", ', b'{"tag', b'{"tags": ["ab", "\\ud800x', b'{"tags": {',
                                  b'{"tags": ["\\uzzzzab'])
def test_no_key_outside_a_value_string_or_where_the_tracker_cannot_follow(data):
    assert _key(data) is None


def test_counts_past_a_tokens_reach_are_capped():
    long = compile_schema(SCHEMAS["long"])  # 60-70 items of at least 2 bytes: a cap of 8 // 4 + 2 = 4
    assert min_bytes(long.items) == 2
    tracker = Tracker(long, 8)
    tracker.feed(b'["')
    assert tracker.key() == ((("", 4, 4),), ("/items", 3, 0, b"")) and tracker.capped


@pytest.mark.parametrize("schema", [{"type": "string", "pattern": "a+"}, {"type": "object", "properties": {}},
                                    {"enum": [[1]]}, {"enum": [1.5]}, {"anyOf": [{"type": "string"}]}, True,
                                    {"type": "object", "additionalProperties": False, "required": ["a"]},
                                    {"type": "string", "maxLength": "5"}])
def test_schemas_outside_the_family_are_refused(schema):
    with pytest.raises(Unsupported):
        compile_schema(schema)


def test_the_tracker_key_never_mismatches_and_the_naive_one_does(tmp_path):
    out = tmp_path / "cache.json"
    doc = bench_mask_cache.main(["--tokenizer", str(SHIPPED_DIR / "tokenizer.json"), "--schemas", "arrays,strings",
                                 "--walks", "6", "--steps", "60", "--seeds", "0", "--json", str(out)])
    tallies = {t["schema"]: t for t in doc["tallies"]}
    assert all(t["mismatches"] == 0 and t["hits"] > 0 for t in tallies.values())
    assert tallies["strings"]["capped_hits"] > 0  # the 300-character string's keys were capped and still exact
    assert tallies["arrays"]["naive_mismatches"] > 0  # the study does catch a key that misses state
    assert json.loads(out.read_text()) == doc
