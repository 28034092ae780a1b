"""The router actor: owns the scheduler and every page; drives the ranks step by step.

    api --Inbound--> [inbox] --+
                               v
    1. drain inbox -> 2. plan step n+1, send it -> 3. wait for step n's result, apply it,
       stream its tokens --> api

The router plans one step ahead: step n+1 is planned and sent while the ranks
run step n (the scheduler publishes what n computes before planning past it,
and the rank feeds in the tokens n samples). One StepPlan goes out and one
StepResult comes back per step; one TokenBatch per step goes to the api. Every
message is checked before use (hkv/engine/validate.py): a bad one is dropped
and counted, and the router keeps running. An owned heartbeat task sends the
api an EngineState when it changes and at least every ENGINE_HEARTBEAT_S,
also while a step is in flight, so the api can tell a stalled engine; after
DEAD_AFTER_FAILED_STEPS failed steps in a row the engine reports itself dead.
With nothing out for half the stall timeout, the router probes the ranks with a
plan that runs nothing, so a rank stopped while idle is noticed too
(hkv/engine/rank_probe.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque

import zmq.asyncio

from hkv.config import HkvConfig
from hkv.cache.coordinator import CacheCoordinator
from hkv.cache.types import CacheSpec
from hkv.engine.rank_probe import RankProbe
from hkv.engine.scheduler import Scheduler, SchedulerLimits
from hkv.engine.tier_client import TierClient
from hkv.engine.timeline import Timeline
from hkv.engine.validate import InboxCheck, RouterLimits
from hkv.ipc import json_block, request_table, stats
from hkv.ipc.channel import Receiver, Sender
from hkv.ipc.dgram import DgramReceiver, DgramSender
from hkv.ipc.messages import (
    CACHE_TIERS,
    ENGINE_HEARTBEAT_S,
    AbortRequest,
    CacheFlushed,
    EngineState,
    FlushCache,
    GenerateRequest,
    Outbound,
    PdFetched,
    PdHoldRelease,
    PdPairSend,
    RankInbound,
    RankOutbound,
    RankReady,
    RouterInbound,
    Shutdown,
    StepPlan,
    StepResult,
    TierFlush,
    TierFlushed,
    TierFound,
    TierInbound,
    TierReserved,
    TokenBatch,
    TokenDelta,
    TransporterInbound,
)
from hkv.ipc.process import ActorContext, run_actor, run_until_stopped
from hkv.ipc.shm import ShmRegion

log = logging.getLogger("hkv.router")
RADIX_EVERY_S = 0.5
STEP_EMA_WEIGHT = 0.2
RADIX_LIST_MAX = 2048  # checkpoint nodes listed; ~60 bytes each fits RADIX_BYTES
MAX_AHEAD = 2  # plans out at once: the one the ranks run and the next, planned while it runs
DEAD_AFTER_FAILED_STEPS = 5  # failed steps in a row after which the engine reports itself dead


class Router:
    """The actor's state and its named steps; the socket-free parts live in Scheduler."""

    def __init__(
        self,
        cfg: HkvConfig,
        zctx: zmq.asyncio.Context,
        table: request_table.RequestTable,
        router_stats: stats.RouterStats,
        radix_block: memoryview,
        tier_layout: tuple | None = None,  # (HostLayout, fingerprint root key) with --cpu-cache-gb
    ):
        self.cfg = cfg
        self.table = table
        self.tier_layout = tier_layout
        # the cache is opened once the ranks report their KV pool (they size it on CUDA)
        self.coord: CacheCoordinator | None = None
        self.tiers: TierClient | None = None
        self.scheduler: Scheduler | None = None
        self.check: InboxCheck | None = None  # needs the KV capacity too
        self.kv_pages: int | None = None
        self.steps_done = 0  # results applied, failed or not, probes' aside: the api's measure of progress
        self._stepped_at = time.monotonic()  # when steps_done last moved (reported as an age)
        self.probe = RankProbe(cfg.server.stall_timeout_s)  # asks idle ranks for a sign of life
        self.failed_in_a_row = 0
        self.alive = True  # False once DEAD_AFTER_FAILED_STEPS steps failed in a row
        self._refused: list[TokenDelta] = []  # answers to GenerateRequests that failed the check
        self._state_changed = asyncio.Event()  # wakes the heartbeat to publish at once
        self._published: tuple | None = None  # the EngineState figures the heartbeat last sent
        self.stats = router_stats
        self.debug = cfg.server.log_level == "debug"  # check the books after every step
        self.timeline = Timeline(cfg.server.log_request_times)  # --log-request-times: TTFT breakdowns
        self._pending_flushes: list[int] = []
        self._tier_flushes: dict[int, CacheFlushed] = {}  # flush id -> the device part, until the worker answers
        self._flush_answers: list[CacheFlushed] = []  # complete answers for the api
        self._step_ema = 0.0  # smoothed seconds from sending a plan to its result
        self.radix_block = radix_block  # the checkpoint listing hkv-inspect reads
        self._radix_written: tuple | None = None  # tree counters at the last write
        self._radix_written_at = 0.0
        self.inbox: Receiver[RouterInbound] = Receiver(zctx, cfg.ipc_address("router_in"), RouterInbound, "router_in")
        self.to_cache: Sender[TierInbound] | None = (
            Sender(zctx, cfg.ipc_address("cache_in"), "cache_in") if tier_layout is not None else None
        )
        self.to_transporter: Sender[TransporterInbound] | None = (
            Sender(zctx, cfg.ipc_address("transporter_in"), "transporter_in") if cfg.server.mode == "decode" else None
        )
        self.results: DgramReceiver[RankOutbound] = DgramReceiver(
            cfg.ipc_address("router_results"), RankOutbound, "router_results"
        )
        self.to_api: Sender[Outbound] = Sender(zctx, cfg.ipc_address("api_in"), "api_in")
        self.to_ranks: list[DgramSender[RankInbound]] = [
            DgramSender(cfg.ipc_address(f"rank{r}_in"), f"rank{r}_in") for r in range(cfg.model.tp)
        ]

    async def wait_for_ranks(self, count: int) -> None:
        """Wait for every rank's RankReady, then open the cache over the smallest KV pool."""
        pages, slots, gpus, pair = [], [], set(), ""
        while len(pages) < count:
            msg = await self.results.get()
            if isinstance(msg, RankReady):
                pages.append(msg.kv_pages)
                slots.append(msg.state_slots)
                gpus.add(msg.peer_gpu)
                pair = pair or msg.pair_address
                log.info("rank %d ready with %d KV pages, %d state slots", msg.rank, msg.kv_pages, msg.state_slots)
        self.open_cache(min(pages), min(slots))
        self.scheduler.peer_gpu = gpus.pop() if len(gpus) == 1 else ""  # device copies: one rank, one GPU
        self.scheduler.pair_address = pair if count == 1 else ""  # pair transfers: one rank a side

    def open_cache(self, kv_pages: int, state_slots: int) -> None:
        """The coordinator, tier client and scheduler over a device pool of `kv_pages` pages and
        `state_slots` state slots, as the ranks allocated them (--state-slots, or sized from memory)."""
        cfg, c = self.cfg, self.cfg.cache
        limits = SchedulerLimits(
            page_size=c.page_size,
            max_running=cfg.scheduler.max_running_requests,
            token_budget=cfg.scheduler.chunked_prefill_size,
            max_context=cfg.model.max_context,
            eos_ids=frozenset(cfg.model.spec.eos_ids),
            hybrid=c.hybrid,
            checkpoint_interval=c.checkpoint_interval,
            tier_checkpoint_interval=c.tier_checkpoint_interval,
            spec_tokens=cfg.spec.spec_tokens,
            prefix_wait_min=cfg.scheduler.prefix_wait_tokens,
        )
        spec = CacheSpec(c.page_size, kv_pages, state_slots, 0, c.hybrid, c.checkpoint_interval, c.prefix_cache)
        self.coord = CacheCoordinator(spec)
        if self.tier_layout is not None:
            layout, root = self.tier_layout
            self.tiers = TierClient(self.coord, root, c.page_size, c.hybrid, layout.num_pages, layout.num_states)
        self.scheduler = Scheduler(limits, self.coord, self.table, self.tiers)
        self.scheduler.pd_timeout_s = cfg.server.pd_timeout_s
        # prefill mode on CUDA (no drafter): prompts' device pages are held for decode peers on this GPU
        self.scheduler.peer_holds_enabled = (cfg.server.mode == "prefill" and cfg.spec.spec_tokens == 0
                                             and (cfg.model.device == "cuda" or bool(cfg.pair_backend)))
        self.scheduler.pair_backend = cfg.pair_backend  # across GPUs (NCCL), or gloo on CPU (docs/pd.md)
        self.scheduler.kv_dtype = cfg.model.kv_cache_dtype  # a peer's device pages of another are not taken
        self.check = InboxCheck(RouterLimits(cfg.model.spec.vocab_size, cfg.model.max_context,
                                             self.table.layout.max_pages * c.page_size, kv_pages * c.page_size,
                                             cfg.scheduler.max_queued_requests))
        self.kv_pages = kv_pages

    async def run(self) -> None:
        """The step loop, one step ahead: the next plan is planned and sent while the ranks run the
        current one, so neither waits for the other's host work.

            1. take in requests and aborts (wait only when nothing runs or can run)
            2. plan and send the next step, while fewer than MAX_AHEAD plans are out (nothing to run,
               nothing out, the ranks silent for half the stall timeout: a probe that runs nothing)
            3. apply the oldest plan's result and stream its tokens
        """
        self.record_pools()
        self.probe.heard()  # the ranks just reported ready
        self._state_changed.set()  # the heartbeat's first report tells the api we admit
        sent: deque[StepPlan] = deque()  # plans out, oldest first
        stuck = False  # nothing could run: only a new request or an abort can change that
        last_result = time.perf_counter()
        while True:
            # 1. take in requests and aborts
            self.scheduler.expire_peer_holds(self.cfg.server.pd_timeout_s)
            idle = not sent and (stuck or not self.scheduler.has_work())
            if idle:
                self.record_radix(force=True)
            await self.drain_inbox(block=idle)
            self.note_state()
            await self.answer_flushes()
            if idle:
                last_result = time.perf_counter()  # a step's wall time counts from leaving idle
            # 2. plan ahead
            if len(sent) < MAX_AHEAD:
                plan = self.scheduler.schedule()
                await self.send_tier()
                stuck = plan is None
                if plan is None and not sent and self.probe_in() == 0.0:
                    plan = self.probe_ranks()
                if plan is not None:
                    await self.send_plan(plan)
                    sent.append(plan)
                    if len(sent) < MAX_AHEAD and self.scheduler.has_work():
                        continue  # plan one more before waiting
            if not sent:
                await self.publish(self.scheduler.take_finished())
                continue
            # 3. the oldest plan's result (which may free what a plan that could not be made needs)
            plan = sent.popleft()
            result = await self.wait_result(plan)
            probe = self.probe.answered(plan.step)  # any answer is a sign of life; a probe's is no step of work
            result = self.count_result(result, plan, counted=not probe)
            self.timeline.plan_done(plan, result)
            deltas = self.scheduler.on_result(result, plan)
            stuck = False
            self.note_state()
            await self.send_tier()
            now = time.perf_counter()
            # counted before it is published: a client that has its answer reads /metrics that include it
            if not probe:
                self.record_step(plan, result, now - last_result)
            await self.publish(deltas)
            last_result = now

    async def drain_inbox(self, block: bool) -> None:
        """Apply every queued request and abort; with no work, wait for the first."""
        if block:
            # wake to probe the ranks, or (transfers out) to ask them about those
            waits = [w for w in (self.probe_in(), self.scheduler.pair_poll_in()) if w is not None]
            with contextlib.suppress(TimeoutError):  # (a cancelled queue get loses nothing)
                async with asyncio.timeout(min(waits, default=None)):
                    self.apply(await self.inbox.get())
        for msg in self.inbox.drain():
            self.apply(msg)

    def apply(self, msg: RouterInbound) -> None:
        if isinstance(msg, GenerateRequest):
            self.timeline.arrived(msg.req_id, len(msg.prompt_ids), msg.received_at)
            self.admit(msg)
        elif isinstance(msg, AbortRequest):
            self.scheduler.abort(msg.req_id)
        elif isinstance(msg, FlushCache):
            self._pending_flushes.append(msg.flush_id)
        elif isinstance(msg, PdFetched):
            if self.timeline.enabled:  # (the lookups only serve --log-request-times)
                self.timeline.mark(self.scheduler.fetching_request(msg.fetch_id), "fetched")
            self.scheduler.on_pd_fetched(msg)
        elif isinstance(msg, PdHoldRelease):
            self.scheduler.release_peer_hold(msg.hold_id)
        elif isinstance(msg, PdPairSend):
            self.scheduler.on_pair_send(msg)
        elif self.tiers is None:
            log.warning("ignoring a tier message without tiers: %r", msg)
        elif isinstance(msg, TierFound):
            if self.timeline.enabled:
                self.timeline.mark(self.tiers.waiting_lookups.get(msg.lookup_id), "tier")
            self.scheduler.on_tier_found(msg)
        elif isinstance(msg, TierReserved):
            self.scheduler.on_tier_reserved(msg)
        elif isinstance(msg, TierFlushed):
            self._tier_flushed(msg)

    def admit(self, msg: GenerateRequest) -> None:
        """Queue a checked request; answer one that fails the check (or arrives at a dead engine) with an error."""
        reason = self.check.generate(msg)
        if reason is None and self.alive:
            self.scheduler.add(msg)
            return
        # a request refused for its id gets no answer: that id may belong to a live one
        answer = reason is None or self.check.usable_id(msg)
        reason = reason or "the engine is dead (its steps keep failing)"
        log.warning("refusing request %d: %s", msg.req_id, reason)
        if answer:
            self._refused.append(TokenDelta(msg.req_id, [], None, None, "error", len(msg.prompt_ids), 0, None,
                                            f"refused by the router: {reason}"))

    def count_result(self, result: StepResult, plan: StepPlan, counted: bool = True) -> StepResult:
        """Count the step (`counted`: not a probe); a result that does not answer the plan fails the
        step instead of being used. A failed probe counts towards a dead engine like any step."""
        if counted:
            self.steps_done += 1
            self._stepped_at = time.monotonic()
        self.stats.set("malformed_rank_in", result.malformed)
        reason = self.check.result(result, plan)
        if reason is not None:
            log.error("step %d: dropping the rank's result: %s", plan.step, reason)
            result = StepResult(plan.step, [], result.forward_s, f"malformed result from the rank: {reason}",
                                transfers=result.transfers)  # (those ended all the same)
        if result.error is None:
            self.failed_in_a_row = 0
            return result
        self.failed_in_a_row += 1
        self.stats.add("failed_steps", 1)
        if self.alive and self.failed_in_a_row >= DEAD_AFTER_FAILED_STEPS:
            log.error("%d steps failed in a row (last: %s): the engine is dead", self.failed_in_a_row, result.error)
            self.alive = False
        return result

    def engine_state(self) -> EngineState:
        sched = self.scheduler
        return EngineState(ready=self.alive, alive=self.alive, waiting=len(sched.waiting), running=len(sched.running),
                           kv_tokens=self.kv_pages * self.cfg.cache.page_size, steps=self.steps_done,
                           failed_steps=self.failed_in_a_row, since_step_s=time.monotonic() - self._stepped_at,
                           ranks_silent_s=self.probe.silent_s())

    def note_state(self) -> None:
        """Wake the heartbeat when a figure the api shows has changed (not on every step): a probe
        going out or answered too, so /ready turns 200 as soon as a stopped rank answers."""
        sched = self.scheduler
        if (self.alive, len(sched.waiting), len(sched.running), self.probe.step is not None) != self._published:
            self._state_changed.set()

    async def heartbeat(self) -> None:
        """Send the api the engine's state on change and at least every ENGINE_HEARTBEAT_S (an owned task)."""
        while True:
            # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancel that meets the event
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(ENGINE_HEARTBEAT_S):
                    await self._state_changed.wait()
            self._state_changed.clear()
            state = self.engine_state()
            self._published = (state.alive, state.waiting, state.running, state.ranks_silent_s is not None)
            self.stats.set_many({"malformed_router_in": self.inbox.malformed + self.check.dropped_router_in
                                 + (self.tiers.malformed if self.tiers is not None else 0)
                                 + self.scheduler.pd_malformed,
                                 "malformed_router_results": self.results.malformed + self.check.dropped_results})
            await self.to_api.send(state)

    async def send_tier(self) -> None:
        """Send what the tier client queued (lookups, reservations, commits, releases)."""
        if self.tiers is not None and self.tiers.outbox:
            for msg in self.tiers.take_outbox():
                await self.to_cache.send(msg)
        if self.scheduler.pd_outbox:
            for msg in self.scheduler.take_pd_outbox():
                if self.to_transporter is not None:
                    await self.to_transporter.send(msg)

    async def answer_flushes(self) -> None:
        """Flush between steps (never inside a transaction) and tell the api what it freed;
        with tiers, the answer waits for the cache worker's part."""
        while self._flush_answers:
            await self.to_api.send(self._flush_answers.pop(0))
        while self._pending_flushes:
            flush_id = self._pending_flushes.pop(0)
            pages, checkpoints = self.scheduler.flush()
            self.stats.add("flushes", 1)
            self.record_pools()
            if self.tiers is None:
                await self.to_api.send(CacheFlushed(flush_id, pages, checkpoints))
            else:
                self._tier_flushes[flush_id] = CacheFlushed(flush_id, pages, checkpoints)
                await self.to_cache.send(TierFlush(flush_id))

    def _tier_flushed(self, msg: TierFlushed) -> None:
        device = self._tier_flushes.pop(msg.flush_id, None)
        if device is not None:
            self._flush_answers.append(CacheFlushed(msg.flush_id, device.pages, device.checkpoints, msg.pages, msg.files))

    def probe_in(self) -> float | None:
        """Seconds until a router with nothing out probes the ranks (0: now); None while a probe is out
        and once the engine is dead (it is sent nothing more)."""
        return self.probe.due_in() if self.alive else None

    def probe_ranks(self) -> StepPlan:
        """The ranks have been idle for half the stall timeout: a plan with nothing to run asks them
        for a sign of life (never a second while one is out: it is sent only with nothing out)."""
        plan = self.scheduler.probe_plan()
        self.probe.sent(plan.step)
        self.note_state()  # the api learns at once that the ranks owe an answer
        return plan

    async def send_plan(self, plan: StepPlan) -> None:
        self.timeline.plan_sent(plan)
        for sender in self.to_ranks:
            await sender.send(plan)

    async def wait_result(self, plan: StepPlan) -> StepResult:
        # Poll near the expected end of the step instead of paying a wake-up after it (a probe
        # runs nothing: its answer neither waits for nor moves the step time).
        sent = time.perf_counter()
        probe = plan.step == self.probe.step
        while True:
            due = None if probe else self._step_ema - (time.perf_counter() - sent)
            msg = await self.results.get(due_in_s=due)
            if isinstance(msg, StepResult) and msg.step == plan.step:
                if not probe:
                    self._step_ema += STEP_EMA_WEIGHT * (time.perf_counter() - sent - self._step_ema)
                return msg
            self.check.dropped_results += 1
            log.warning("ignoring an unexpected rank message: %r", msg)

    def record_step(self, plan: StepPlan, result: StepResult, wall_s: float) -> None:
        sampled = len(result.sampled)
        self.stats.add_many({
            "steps": 1,
            "step_wall_s": wall_s,
            "forward_s": result.forward_s,
            "decode_tokens": sampled + sum(len(s.extra) for s in result.sampled),  # a verify step emits extras
            # a verify chunk's drafts are neither prompt nor recompute: they count as the tokens they become
            "prefill_tokens": sum(len(c.token_ids) - c.drafts for c in plan.chunks) - sampled,
        })
        if result.grammar_rows:  # checked by count_result: 0..sampled rows, finite seconds
            self.stats.add_many({"grammar_steps": 1, "grammar_mask_s": result.grammar_mask_s,
                                 "grammar_rows": result.grammar_rows, "grammar_wait_s": result.grammar_wait_s})
        if result.grammar_cache_hits or result.grammar_cache_misses:  # checked by count_result: 0..MAX_CACHE_FILLS
            self.stats.add_many({"grammar_cache_hits": result.grammar_cache_hits,
                                 "grammar_cache_misses": result.grammar_cache_misses})
        if 0 < result.graph <= len(stats.GRAPH_KINDS):  # a rank's value: anything else counts as eager
            self.stats.add(f"graph_steps_{stats.GRAPH_KINDS[result.graph - 1]}", 1)
        self.record_pools()
        self.record_radix(force=False)
        if self.debug:
            self.coord.check_integrity()

    def record_radix(self, force: bool) -> None:
        """List the checkpoint-carrying nodes for hkv-inspect: when the tree changed, at most
        every RADIX_EVERY_S while busy (walking the tree costs O(nodes)), and on going idle."""
        tree = self.coord.tree
        counters = (tree.num_nodes, tree.num_checkpoints, tree.cached_pages, tree.evictable_pages)
        now = time.monotonic()
        if counters == self._radix_written or (not force and now - self._radix_written_at < RADIX_EVERY_S):
            return
        checkpoints = sorted(
            ({"tokens": n.checkpoint.length, "slot": n.checkpoint.slot, "pinned": n.checkpoint.holds > 0,
              "locked": n.lock_ref > 0} for n in tree.nodes() if n.checkpoint is not None),
            key=lambda c: c["tokens"],
        )
        doc = {"nodes": tree.num_nodes, "checkpoint_nodes": checkpoints[:RADIX_LIST_MAX],
               "listed_all": len(checkpoints) <= RADIX_LIST_MAX}
        json_block.write(self.radix_block, doc)
        reachable = tree.pages_under_checkpoints() if self.coord.spec.hybrid else tree.cached_pages
        self.stats.set_many({"radix_reachable_pages": reachable})
        self._radix_written, self._radix_written_at = counters, now

    def record_pools(self) -> None:
        """Queue, pool and radix gauges for hkv-inspect and /metrics (O(1) counters only)."""
        sched, coord, tree = self.scheduler, self.coord, self.coord.tree
        gauges = {
            "preemptions": sched.preemptions,
            "prefix_waits": sched.prefix_waits,
            "waiting": len(sched.waiting),
            "running": len(sched.running),
            "page_size": coord.spec.page_size,
            "radix_nodes": tree.num_nodes,
            "radix_checkpoints": tree.num_checkpoints,
            "radix_evictable_pages": tree.evictable_pages,
            "tier_offloads_skipped": self.tiers.skipped_offloads if self.tiers is not None else 0,
            "pd_pair_ok": sched.pair_ok,
            "pd_pair_failed": sched.pair_failed,
            "pd_pair_pages": sched.pair_pages,
            "spec_tokens": sched.limits.spec_tokens,
            "spec_verified": sched.spec_verified,
            "spec_accepted": sched.spec_accepted,
            **{f"spec_accepted_{i}": n for i, n in enumerate(sched.spec_histogram)},
        }
        for key, pool, cached in (
            ("pages", coord.pages, tree.cached_pages),
            ("state_slots", coord.state_slots, tree.num_checkpoints),
            ("window_slots", coord.window_slots, 0),
        ):
            gauges.update({f"{key}_total": pool.size, f"{key}_free": pool.free_count, f"{key}_cached": cached})
        self.stats.set_many(gauges)

    async def publish(self, deltas) -> None:
        if self._refused:
            deltas, self._refused = [*deltas, *self._refused], []
        for delta in deltas:
            if delta.finish_reason is not None:
                self.check.finished(delta.req_id)
                tiers = delta.cache_tiers or {}
                self.stats.add_many({
                    "requests_cached_tokens": delta.cached_tokens,
                    **{f"cached_tokens_{t}": tiers.get(t, 0) for t in CACHE_TIERS},
                })
        if deltas:
            self.timeline.published(deltas)
            await self.to_api.send(TokenBatch(deltas))

    async def aclose(self) -> None:
        for sender in self.to_ranks:
            sender.send_nowait(Shutdown("router stopping"))  # a rank that is already gone needs none
        for channel in (self.inbox, self.results, self.to_api, *self.to_ranks):
            await channel.aclose()
        for sender in (self.to_cache, self.to_transporter):
            if sender is not None:
                await sender.aclose()


async def serve(cfg: HkvConfig, ctx: ActorContext) -> None:
    region, table = request_table.attach(cfg.server.name, readonly=False)
    stats_region = ShmRegion.attach(cfg.server.name, stats.REGION)
    router_stats = stats.RouterStats(stats_region.payload)
    radix_region = ShmRegion.attach(cfg.server.name, stats.RADIX_REGION)
    tier_layout = None
    if cfg.cache.tiers:
        from hkv.ipc.tier_regions import pool_layout

        tier_layout = pool_layout(cfg.server.name)
    zctx = zmq.asyncio.Context()
    router = Router(cfg, zctx, table, router_stats, radix_region.payload, tier_layout)
    router.inbox.start()
    router.results.start()
    try:
        if await run_until_stopped(router.wait_for_ranks(cfg.model.tp), ctx.stop):
            ctx.ready()
            await run_until_stopped(_steps_and_heartbeat(router), ctx.stop)
    finally:
        await router.aclose()
        zctx.term()
        table.release_views()
        router_stats.release_views()
        router.radix_block = None
        region.close()
        stats_region.close()
        radix_region.close()


async def _steps_and_heartbeat(router: Router) -> None:
    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(router.heartbeat(), name="router:heartbeat")
        await router.run()


def main() -> None:
    run_actor("router", serve)


if __name__ == "__main__":
    main()
