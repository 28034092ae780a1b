"""Readers of the other actors' shared-memory blocks: stats for /metrics (read at scrape time), and the
launcher's start-up block for /ready (read while the instance starts)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

from hkv.config import HkvConfig
from hkv.ipc import json_block, startup, stats
from hkv.ipc.shm import ShmError, ShmRegion
from hkv.openai.router_link import RouterLink

EngineStats = Callable[[], dict[str, float] | None]
TierStats = Callable[[], dict | None]
StartupPhase = Callable[[], str | None]


def attach_startup(cfg: HkvConfig, stack: contextlib.AsyncExitStack) -> StartupPhase:
    """A reader of the launcher's start-up block: the current phase as text, with its time so far
    ("rank0: capturing decode graphs (6/24 graphs, 5.1 s)"); None before the first report or without the block."""
    try:
        region = ShmRegion.attach(cfg.server.name, startup.REGION, readonly=True)
    except ShmError:
        return lambda: None
    stack.callback(region.close)

    def read() -> str | None:
        block = startup.read(region.payload)
        if block is None:
            return None
        p = block.progress
        return f"{p.actor}: {startup.describe(p, None if p.ended else time.monotonic() - block.began_at)}"

    return read


def attach_engine_stats(cfg: HkvConfig, stack: contextlib.AsyncExitStack) -> EngineStats:
    """A reader of the router's stats block; reads nothing when there is none."""
    try:
        region = ShmRegion.attach(cfg.server.name, stats.REGION, readonly=True)
    except ShmError:
        return lambda: None
    view = stats.RouterStats(region.payload)

    def close() -> None:
        view.release_views()
        region.close()

    stack.callback(close)
    return view.read


def attach_tier_stats(cfg: HkvConfig, stack: contextlib.AsyncExitStack) -> TierStats:
    """A reader of the cache worker's stats block (a json_block); reads nothing without tiers."""
    from hkv.ipc.tier_regions import TIER_STATS_REGION

    return _attach_json_block(cfg, TIER_STATS_REGION, cfg.cache.tiers, stack)


def attach_pd_stats(cfg: HkvConfig, stack: contextlib.AsyncExitStack) -> TierStats:
    """A reader of the transporter's stats block (prefill and decode modes); reads nothing otherwise."""
    from hkv.ipc.tier_regions import PD_STATS_REGION

    return _attach_json_block(cfg, PD_STATS_REGION, cfg.server.mode in ("prefill", "decode"), stack)


def _attach_json_block(cfg: HkvConfig, region_name: str, enabled: bool, stack: contextlib.AsyncExitStack) -> TierStats:
    if not enabled:
        return lambda: None
    try:
        region = ShmRegion.attach(cfg.server.name, region_name, readonly=True)
    except ShmError:
        return lambda: None
    stack.callback(region.close)

    def read() -> dict | None:
        try:
            doc = json_block.read(region.payload)
        except json_block.JsonBlockBusy:
            return None
        return doc if isinstance(doc, dict) else None

    return read


def malformed_sources(link: RouterLink, engine_stats: EngineStats, tier_stats: TierStats) -> dict[str, Callable[[], int]]:
    """Dropped messages per link, wherever each link's receiver counts them."""

    def engine(field: str) -> Callable[[], int]:
        return lambda: int((engine_stats() or {}).get(field, 0))

    def tier() -> int:
        doc = tier_stats()
        return int(doc.get("malformed", 0)) if doc is not None else 0

    return {
        "api_in": lambda: link.inbox_malformed,
        "router_deltas": lambda: link.malformed,
        "router_in": engine("malformed_router_in"),
        "router_results": engine("malformed_router_results"),
        "rank_in": engine("malformed_rank_in"),
        "cache_in": tier,
    }
