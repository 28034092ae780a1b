"""Prometheus metrics of the api actor, in a private registry (names `hkv_*`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from hkv.ipc.messages import CACHE_TIERS, EngineState
from hkv.ipc.stats import GRAPH_KINDS
from hkv.openai.generation import Generation

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5)


class _MalformedCollector:
    """Reads the link counters at scrape time (they live in the channel objects)."""

    def __init__(self, sources: dict[str, Callable[[], int]]):
        self._sources = sources

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "hkv_malformed_messages", "Messages dropped: they did not decode or broke the contract", labels=["link"]
        )
        for link, read in self._sources.items():
            family.add_metric([link], read())
        yield family


class _EngineStatsCollector:
    """The router's live stats (its shared-memory block), read at scrape time."""

    POOLS = (("gpu_pages", "pages"), ("state_slots", "state_slots"), ("window_slots", "window_slots"))
    COUNTERS = (
        ("hkv_engine_steps", "Steps the engine ran", "steps"),
        ("hkv_engine_step_seconds", "Seconds of steps, scheduling to result applied", "step_wall_s"),
        ("hkv_engine_forward_seconds", "Seconds ranks spent in the model forward", "forward_s"),
        ("hkv_engine_grammar_steps", "Steps with live grammar rows (structured output)", "grammar_steps"),
        ("hkv_engine_grammar_mask_seconds", "Seconds ranks spent filling those steps' token masks (wall, "
         "llguidance)", "grammar_mask_s"),
        ("hkv_engine_grammar_rows", "Live grammar rows whose masks those steps filled", "grammar_rows"),
        ("hkv_engine_grammar_wait_seconds", "Seconds late-sampled grammar steps waited between their forward "
         "being queued and their masks starting (the step before's answer)", "grammar_wait_s"),
        ("hkv_engine_grammar_mask_cache_hits", "Grammar token masks taken from the mask cache (JSON schemas inside "
         "strings, HKV_GRAMMAR_MASK_CACHE)", "grammar_cache_hits"),
        ("hkv_engine_grammar_mask_cache_misses", "Grammar token masks the mask cache had not seen: computed by "
         "llguidance and kept", "grammar_cache_misses"),
        ("hkv_engine_prefill_tokens", "Prompt (and recomputed) tokens run", "prefill_tokens"),
        ("hkv_engine_preemptions", "Sequences preempted for pages", "preemptions"),
        ("hkv_engine_prefix_waits", "Requests that waited for a prefix another request was prefilling", "prefix_waits"),
        ("hkv_cache_flushes", "Cache flushes", "flushes"),
    )

    def __init__(self, read: Callable[[], dict[str, float] | None]):
        self._read = read

    def collect(self) -> Iterator[Metric]:
        values = self._read()
        if values is None:
            return
        for name, doc, key in self.COUNTERS:
            family = CounterMetricFamily(name, doc)
            family.add_metric([], values[key])
            yield family
        pools = GaugeMetricFamily("hkv_cache_pool", "Cache pool entries by pool and state", labels=["pool", "state"])
        for pool, prefix in self.POOLS:
            total, free, cached = (values[f"{prefix}_{k}"] for k in ("total", "free", "cached"))
            for state, value in (("free", free), ("cached", cached), ("in_use", total - free - cached)):
                pools.add_metric([pool, state], value)
        yield pools
        if values["spec_tokens"] > 0:
            yield from _speculative(values)
        graphs = CounterMetricFamily("hkv_engine_graph_steps", "Steps replayed from CUDA graphs, by graph kind",
                                     labels=["kind"])
        for kind in GRAPH_KINDS:
            graphs.add_metric([kind], values[f"graph_steps_{kind}"])
        yield graphs
        hits = CounterMetricFamily("hkv_cache_hit_tokens", "Prompt tokens served from the cache, by tier",
                                   labels=["tier"])
        for tier in CACHE_TIERS:
            hits.add_metric([tier], values[f"cached_tokens_{tier}"])
        yield hits
        pair = CounterMetricFamily("hkv_pd_pair_transfers", "Prefill/decode transfers over a pair process group "
                                   "(NCCL or gloo), by outcome", labels=["outcome"])
        pair.add_metric(["ok"], values["pd_pair_ok"])
        pair.add_metric(["failed"], values["pd_pair_failed"])
        yield pair
        yield CounterMetricFamily("hkv_pd_pair_pages", "KV pages those transfers moved (received by a decode "
                                  "instance, sent by a prefill one)", value=values["pd_pair_pages"])
        for name, doc, key in (("hkv_radix_nodes", "Radix tree nodes", "radix_nodes"),
                               ("hkv_radix_checkpoints", "Radix nodes carrying a state checkpoint", "radix_checkpoints"),
                               ("hkv_engine_live_waiting", "Sequences waiting at the router", "waiting"),
                               ("hkv_engine_live_running", "Sequences holding a slot", "running")):
            yield GaugeMetricFamily(name, doc, value=values[key])


def _speculative(values: dict[str, float]) -> Iterator[Metric]:
    """Drafted and accepted tokens, and the histogram of drafts accepted per verify step (--spec-tokens only)."""
    for name, doc, key in (("hkv_spec_draft_tokens", "Draft tokens the target verified", "spec_verified"),
                           ("hkv_spec_accepted_tokens", "Draft tokens accepted", "spec_accepted")):
        family = CounterMetricFamily(name, doc)
        family.add_metric([], values[key])
        yield family
    buckets = int(values["spec_tokens"]) + 1
    counts = [values[f"spec_accepted_{i}"] for i in range(buckets)]
    cumulative = [sum(counts[: i + 1]) for i in range(buckets)]
    yield HistogramMetricFamily(
        "hkv_spec_acceptance_length", "Drafts accepted per verify step of one sequence",
        buckets=[(str(i), c) for i, c in enumerate(cumulative)] + [("+Inf", cumulative[-1])],
        sum_value=values["spec_accepted"],
    )


class _TierStatsCollector:
    """The cache worker's CPU and disk tier figures (its stats block), read at scrape time."""

    def __init__(self, read: Callable[[], dict | None]):
        self._read = read

    def collect(self) -> Iterator[Metric]:
        doc = self._read()
        if doc is None or not isinstance(doc.get("cpu"), dict):
            return
        cpu, disk = doc["cpu"], doc.get("disk")
        pools = GaugeMetricFamily("hkv_tier_pool", "CPU tier entries by kind and state", labels=["pool", "state"])
        for pool in ("pages", "states"):
            for state in ("free", "cached", "in_use"):
                pools.add_metric([f"cpu_{pool}", state], cpu[pool][state])
        yield pools
        hits = CounterMetricFamily("hkv_tier_hit_pages", "Pages lookups found, by tier", labels=["tier"])
        hits.add_metric(["cpu"], cpu["hit_pages"])
        if isinstance(disk, dict):
            hits.add_metric(["disk"], disk["hit_pages"])
        yield hits
        for name, doc_text, value in (
            ("hkv_tier_stores", "Pages copied from the device into the CPU tier", cpu["stores"]),
            ("hkv_tier_evicted_pages", "CPU tier pages evicted", cpu["evicted_pages"]),
        ):
            yield CounterMetricFamily(name, doc_text, value=value)
        if not isinstance(disk, dict):
            return
        yield GaugeMetricFamily("hkv_tier_disk_files", "Entries in the disk tier", value=disk["files"])
        yield GaugeMetricFamily("hkv_tier_disk_bytes", "Bytes in the disk tier", value=disk["bytes"])
        for name, doc_text, key in (
            ("hkv_tier_disk_writes", "Disk tier entries written", "writes"),
            ("hkv_tier_disk_write_errors", "Disk tier writes that failed", "write_errors"),
            ("hkv_tier_disk_corrupt", "Disk tier files found corrupt or foreign and deleted", "corrupt"),
            ("hkv_tier_disk_evictions", "Disk tier files evicted for the budget", "evictions"),
        ):
            yield CounterMetricFamily(name, doc_text, value=disk[key])


class _CoverageCollector:
    """Per tier: tokens whose pages it holds, and tokens a hit on it alone could reach (docs/tiers.md)."""

    def __init__(self, engine: Callable[[], dict[str, float] | None], tiers: Callable[[], dict | None]):
        self._engine = engine
        self._tiers = tiers

    def collect(self) -> Iterator[Metric]:
        held = GaugeMetricFamily("hkv_cache_held_tokens", "Tokens whose KV pages a tier holds", labels=["tier"])
        reach = GaugeMetricFamily("hkv_cache_reachable_tokens", "Tokens a prefix hit on a tier alone could reach: "
                                  "pages held from a prompt's first page, down to a checkpoint on hybrid models",
                                  labels=["tier"])  # fmt: skip
        values = self._engine()
        if values is not None:
            page = values["page_size"]
            held.add_metric(["gpu"], values["pages_cached"] * page)
            reach.add_metric(["gpu"], values["radix_reachable_pages"] * page)
        doc = self._tiers()
        for tier in ("cpu", "disk"):
            figures = doc.get(tier) if isinstance(doc, dict) else None
            if isinstance(figures, dict):
                held.add_metric([tier], figures["held_tokens"])
                reach.add_metric([tier], figures["reachable_tokens"])
        yield held
        yield reach


class _PdStatsCollector:
    """The transporter's figures (prefill and decode modes): peer frames, transfers, pages moved."""

    def __init__(self, read: Callable[[], dict | None]):
        self._read = read

    def collect(self):
        doc = self._read()
        if not isinstance(doc, dict) or not isinstance(doc.get("frames"), dict):
            return
        frames = dict(doc["frames"])
        yield CounterMetricFamily("hkv_pd_frames_accepted", "Peer frames that passed every check",
                                  value=frames.pop("accepted", 0))
        rejected = CounterMetricFamily("hkv_pd_frames_rejected", "Peer frames dropped, by the check they failed",
                                       labels=["reason"])
        for reason, n in sorted(frames.items()):
            rejected.add_metric([reason], n)
        yield rejected
        fetches = CounterMetricFamily("hkv_pd_fetches", "Transfers this instance pulled, by outcome",
                                      labels=["outcome"])
        fetches.add_metric(["ok"], doc.get("fetches_ok", 0))
        fetches.add_metric(["failed"], doc.get("fetches_failed", 0))
        yield fetches
        pages = CounterMetricFamily("hkv_pd_pages", "KV pages moved between instances", labels=["direction"])
        pages.add_metric(["received"], doc.get("pages_received", 0))
        pages.add_metric(["sent"], doc.get("pages_sent", 0))
        yield pages
        moved = CounterMetricFamily("hkv_pd_bytes", "Bytes moved between instances", labels=["direction"])
        moved.add_metric(["received"], doc.get("bytes_received", 0))
        moved.add_metric(["sent"], doc.get("bytes_sent", 0))
        yield moved
        yield GaugeMetricFamily("hkv_pd_runs_held", "Runs pinned for a peer's pull", value=doc.get("runs_held", 0))
        yield CounterMetricFamily("hkv_pd_runs_expired", "Pinned runs released by the timeout (the peer never "
                                  "finished)", value=doc.get("runs_expired", 0))


class ApiMetrics:
    def __init__(
        self,
        malformed_sources: dict[str, Callable[[], int]],
        engine_stats: Callable[[], dict[str, float] | None] = lambda: None,
        tier_stats: Callable[[], dict | None] = lambda: None,
        pd_stats: Callable[[], dict | None] = lambda: None,
    ):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "hkv_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter("hkv_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("hkv_generation_tokens", "Generated tokens", registry=r)
        self.cached_tokens = Counter("hkv_cached_tokens", "Prompt tokens served from the cache", registry=r)
        self.in_flight = Gauge("hkv_requests_in_flight", "Generation requests being served", registry=r)
        self.ttft = Histogram(
            "hkv_time_to_first_token_seconds", "Request arrival to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "hkv_time_per_output_token_seconds", "Mean gap between output tokens", buckets=TOKEN_BUCKETS, registry=r
        )
        self.engine_ready = Gauge("hkv_engine_ready", "1 when the router can admit work", registry=r)
        self.engine_waiting = Gauge("hkv_engine_waiting_requests", "Requests queued at the router", registry=r)
        self.engine_running = Gauge("hkv_engine_running_requests", "Requests holding KV pages", registry=r)
        self.refused_connections = Counter(
            "hkv_http_connections_refused", "Connections refused past --max-connections", registry=r
        )
        r.register(_MalformedCollector(malformed_sources))
        r.register(_EngineStatsCollector(engine_stats))
        r.register(_TierStatsCollector(tier_stats))
        r.register(_CoverageCollector(engine_stats, tier_stats))
        r.register(_PdStatsCollector(pd_stats))

    def observe_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def observe_generation(self, gen: Generation) -> None:
        usage = gen.usage()
        self.prompt_tokens.inc(usage["prompt_tokens"])
        self.generation_tokens.inc(usage["completion_tokens"])
        self.cached_tokens.inc(usage["prompt_tokens_details"]["cached_tokens"])
        for choice in gen.choices:
            if choice.first_token_at is None:
                continue
            self.ttft.observe(choice.first_token_at - gen.started_at)
            if choice.finished_at is not None and len(choice.token_ids) > 1:
                self.tpot.observe((choice.finished_at - choice.first_token_at) / (len(choice.token_ids) - 1))

    def observe_engine(self, state: EngineState | None) -> None:
        if state is not None:
            self.engine_ready.set(1 if state.ready and state.alive else 0)
            self.engine_waiting.set(state.waiting)
            self.engine_running.set(state.running)

    def render(self) -> bytes:
        return generate_latest(self.registry)
