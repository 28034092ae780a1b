"""tools/bench/bench_structured.py: the ranks' grammar figures from two /metrics scrapes, the two schemas,
and the report's line for them."""

from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hkv.ipc import stats
from hkv.openai.metrics import ApiMetrics
from tools.bench.bench_structured import SCHEMA, build_parser, grammar_figures, report, schema_of


def scrape(**values) -> dict[str, float]:
    """What bench_client.scrape_metrics reads from the api's real /metrics text over these stats values."""
    engine = dict.fromkeys(stats.FIELDS, 0.0) | values
    text = ApiMetrics({}, engine_stats=lambda: engine, tier_stats=lambda: None).render().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def test_grammar_figures_are_the_means_between_two_scrapes():
    before = scrape(grammar_steps=10, grammar_mask_s=0.5, grammar_rows=100, grammar_wait_s=0.1, grammar_cache_hits=4)
    after = scrape(grammar_steps=110, grammar_mask_s=0.8, grammar_rows=3300, grammar_wait_s=0.15, grammar_cache_hits=900,
                   grammar_cache_misses=60)
    g = grammar_figures(before, after)
    assert g["steps"] == 100 and g["rows"] == pytest.approx(32.0)
    assert g["mask_ms"] == pytest.approx(3.0) and g["wait_ms"] == pytest.approx(0.5)
    assert g["mask_us_per_row"] == pytest.approx(1e6 * 0.3 / 3200)
    assert (g["cache_hits"], g["cache_misses"]) == (896, 60)


def test_no_grammar_steps_or_no_scrape_gives_none():
    same = scrape(grammar_steps=4, grammar_mask_s=0.1, grammar_rows=8)
    assert grammar_figures(same, same) is None
    assert grammar_figures(None, same) is None and grammar_figures(same, {}) is None


def test_the_unbounded_schema_drops_only_the_max_length():
    assert schema_of("bounded") is SCHEMA and SCHEMA["items"]["properties"]["name"] == {"type": "string",
                                                                                      "maxLength": 16}
    unbounded = schema_of("unbounded")
    assert unbounded["items"]["properties"]["name"] == {"type": "string"}
    assert "maxLength" not in json.dumps(unbounded) and "maxLength" in json.dumps(SCHEMA)  # SCHEMA is untouched
    assert build_parser().parse_args([]).schema == "bounded"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--schema", "loose"])


def test_the_report_prints_the_mask_figures():
    round_ = {"step_ms": 4.0, "itl_median_ms": 4.2, "groups": {}, "grammar": None}
    g = grammar_figures(scrape(), scrape(grammar_steps=2, grammar_mask_s=0.01, grammar_rows=64, grammar_wait_s=0.002,
                                         grammar_cache_hits=50, grammar_cache_misses=6))
    out = {"streams": 64, "constrained": 32, "schema": "unbounded", "input_len": 128, "output_len": 256,
           "plain": round_, "mixed": {**round_, "grammar": g}, "sample": "[", "malformed": 0}
    text = report(out)
    assert "(unbounded schema)" in text
    assert "grammar masks: 5.000 ms a step with grammar rows (2 steps, 32.0 live rows, 156.2 us a row), " \
           "late wait 1.000 ms; mask cache 50 hits, 6 misses" in text
