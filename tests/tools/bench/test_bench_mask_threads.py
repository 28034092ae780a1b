"""tools/bench/bench_mask_threads.py on the built-in tokenizer: it walks, replays and reports both fillers."""

from __future__ import annotations

import json

import pytest

from hkv.models.tiny import SHIPPED_DIR
from tools.bench import bench_mask_threads


def test_it_reports_each_thread_count_and_load(tmp_path):
    out = tmp_path / "mask.json"
    doc = bench_mask_threads.main(["--tokenizer", str(SHIPPED_DIR / "tokenizer.json"), "--rows", "3", "--steps", "5",
                                   "--threads", "1,2", "--busy", "0,1", "--json", str(out)])
    assert [(r["busy"], r["threads"]) for r in doc["results"]] == [(0, 1), (0, 2), (1, 1), (1, 2)]
    assert all(r["queue_ms"] > 0 and r["llexecutor_ms"] > 0 for r in doc["results"])
    assert json.loads(out.read_text()) == doc


def test_the_cache_round_replays_warm():
    doc = bench_mask_threads.main(["--tokenizer", str(SHIPPED_DIR / "tokenizer.json"), "--rows", "3", "--steps", "40",
                                   "--threads", "1,2", "--busy", "0", "--cache"])
    assert all(r["cached_ms"] > 0 for r in doc["results"])
    # the warming replay missed; the 2 timed replays at each of 2 thread counts hit wherever it keyed
    assert doc["cache"]["hits"] >= 4 * doc["cache"]["misses"] > 0


def test_the_walks_stay_inside_the_schema():
    from hkv.engine.grammar import Grammars
    from hkv.ipc.messages import Constraint
    from tools.bench.bench_structured import schema_of

    tokenizer = str(SHIPPED_DIR / "tokenizer.json")
    grammars = Grammars(tokenizer, 4096, [0], 1)
    constraint = Constraint("json_schema", json.dumps(schema_of("bounded")))
    walks = bench_mask_threads.record_walks(grammars, constraint, rows=2, steps=12, eos=0)
    for walk in walks:
        matcher = grammars.matcher(constraint)
        for token in walk:
            matcher.consume(token)
        assert not matcher.failed  # every drawn token was one its mask allowed


@pytest.mark.parametrize("bad", [["--threads", "0"], ["--rows", "0"], ["--threads", "x"]])
def test_bad_arguments_are_refused(bad):
    with pytest.raises(SystemExit):
        bench_mask_threads.main(["--tokenizer", str(SHIPPED_DIR / "tokenizer.json"), *bad])
