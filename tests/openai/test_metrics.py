"""ApiMetrics' collectors over the router's and the cache worker's stats blocks: tier coverage."""

from hkv.ipc import stats
from hkv.openai.metrics import ApiMetrics


def engine_values(**given) -> dict[str, float]:
    values = dict.fromkeys(stats.FIELDS, 0.0)
    values.update(given)
    return values


def tier_doc(cpu_held: int, cpu_reachable: int, disk: dict | None) -> dict:
    pool = {"free": 0, "cached": 0, "in_use": 0}
    cpu = {"pages": pool, "states": pool, "hit_pages": 0, "stores": 0, "evicted_pages": 0,
           "held_tokens": cpu_held, "reachable_tokens": cpu_reachable}
    return {"cpu": cpu, "disk": disk, "malformed": 0}


def render(engine, tiers) -> str:
    return ApiMetrics({}, engine_stats=lambda: engine, tier_stats=lambda: tiers).render().decode()


def test_coverage_per_tier_from_both_blocks():
    disk = {"files": 3, "bytes": 1, "hit_pages": 0, "writes": 0, "write_errors": 0, "corrupt": 0, "evictions": 0,
            "held_tokens": 48, "reachable_tokens": 32}
    text = render(engine_values(page_size=16, pages_cached=10, radix_reachable_pages=6), tier_doc(160, 144, disk))
    for tier, held, reachable in (("gpu", 160, 96), ("cpu", 160, 144), ("disk", 48, 32)):
        assert f'hkv_cache_held_tokens{{tier="{tier}"}} {float(held)}' in text
        assert f'hkv_cache_reachable_tokens{{tier="{tier}"}} {float(reachable)}' in text


def test_coverage_without_tiers_is_the_device_alone():
    text = render(engine_values(page_size=16, pages_cached=2, radix_reachable_pages=2), None)
    assert 'hkv_cache_held_tokens{tier="gpu"} 32.0' in text and 'held_tokens{tier="cpu"}' not in text
    assert "hkv_cache_held_tokens" in render(None, None)  # families exist before the engine reports


def test_graph_steps_by_kind():
    text = render(engine_values(graph_steps_decode=7, graph_steps_short_prefill=2, graph_steps_mixed=3), None)
    for kind, n in (("decode", 7), ("short_prefill", 2), ("verify", 0), ("mixed", 3)):
        assert f'hkv_engine_graph_steps_total{{kind="{kind}"}} {float(n)}' in text


def test_grammar_mask_figures():
    text = render(engine_values(grammar_steps=4, grammar_mask_s=0.006, grammar_rows=96, grammar_wait_s=0.002), None)
    for line in ("hkv_engine_grammar_steps_total 4.0", "hkv_engine_grammar_mask_seconds_total 0.006",
                 "hkv_engine_grammar_rows_total 96.0", "hkv_engine_grammar_wait_seconds_total 0.002"):
        assert line in text
