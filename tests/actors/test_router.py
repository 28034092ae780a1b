"""The router actor in-process against a fake rank and a fake api, over its real sockets and shm regions.

Issue 16: the router checks every field of every message before use (item 7: a
5,000-token prompt or a token id of 10**6 on router_in, a result naming a token
outside the vocabulary), keeps running and counts the drops; it reports its
state on a heartbeat, also while a step is in flight; an engine whose steps all
fail reports itself dead (item 3).
"""

from __future__ import annotations

import asyncio
import dataclasses
import contextlib
import os
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
import zmq
import zmq.asyncio

from hkv.actors.router import DEAD_AFTER_FAILED_STEPS, serve
from hkv.ipc import stats
from hkv.ipc.channel import Receiver, Sender
from hkv.ipc.dgram import DgramReceiver, DgramSender
from hkv.ipc.messages import (
    EngineState, GenerateRequest, Inbound, Outbound, RankInbound, RankReady, Sampled, SamplingParams,
    Shutdown, StepPlan, StepResult, TokenBatch, TokenDelta,
)  # fmt: skip
from hkv.ipc.process import ActorContext
from hkv.ipc.rundir import create_run_dir
from hkv.ipc.shm import ShmRegion
from hkv.launcher import Instance
from tests.actors.actor_config import make_cfg

pytestmark = pytest.mark.timeout(60)
TOKEN = 5


@dataclass
class FakeRank:
    """Answers each plan: `mode` "ok" samples TOKEN, "fail" fails the step, "bad" samples a token past the
    vocabulary, "hold" answers only once `release` is set, "graphs" samples TOKEN and reports the step as
    replayed from graph kind step % 6 (5: no kind there is). A rank past 0 only records its plans: rank 0
    answers for the group."""

    inbox: DgramReceiver
    outbox: DgramSender
    mode: str = "ok"
    release: asyncio.Event = field(default_factory=asyncio.Event)
    plans: list[StepPlan] = field(default_factory=list)
    state_slots: int = 0  # what RankReady reports
    rank: int = 0

    async def run(self) -> None:
        self.inbox.start()
        await self.outbox.send(RankReady(self.rank, 256, self.state_slots))
        while not isinstance(msg := await self.inbox.get(), Shutdown):
            self.plans.append(msg)
            if self.mode == "hold":
                await self.release.wait()
            if self.rank == 0:
                await self.outbox.send(self.answer(msg))

    def answer(self, plan: StepPlan) -> StepResult:
        if self.mode == "fail":
            return StepResult(plan.step, [], 0.0, "RuntimeError: the device is on fire")
        token = 10**6 if self.mode == "bad" else TOKEN
        graph = plan.step % 6 if self.mode == "graphs" else 0
        return StepResult(plan.step, [Sampled(c.slot, token, None, None) for c in plan.chunks if c.sample], 0.0,
                          graph=graph)


@dataclass
class Env:
    to_router: Sender[Inbound]
    raw: zmq.asyncio.Socket  # writes bytes that are no message at all
    from_router: Receiver[Outbound]
    rank: FakeRank  # rank 0
    stats: stats.RouterStats
    ranks: list[FakeRank] = field(default_factory=list)  # all of them, rank 0 first
    deltas: dict[int, list[TokenDelta]] = field(default_factory=dict)
    states: list[EngineState] = field(default_factory=list)

    async def generate(self, req_id: int, prompt: list[int], max_tokens: int = 3) -> None:
        await self.to_router.send(GenerateRequest(req_id, prompt, SamplingParams(max_tokens=max_tokens)))

    async def until(self, predicate, timeout: float = 10.0) -> None:
        async with asyncio.timeout(timeout):
            while not predicate():
                msg = await self.from_router.get()
                if isinstance(msg, EngineState):
                    self.states.append(msg)
                elif isinstance(msg, TokenBatch):
                    for d in msg.deltas:
                        self.deltas.setdefault(d.req_id, []).append(d)

    def finish(self, req_id: int) -> TokenDelta | None:
        return next((d for d in self.deltas.get(req_id, []) if d.finish_reason is not None), None)

    async def finished(self, *req_ids: int) -> dict[int, TokenDelta]:
        await self.until(lambda: all(self.finish(r) is not None for r in req_ids))
        return {r: self.finish(r) for r in req_ids}


@contextlib.asynccontextmanager
async def router(mode: str = "ok", cache: dict | None = None, ready_slots: int = 0,
                 stall_timeout_s: float = 600.0, tp: int = 1) -> AsyncIterator[Env]:
    """A router over `tp` FakeRanks; the long stall timeout keeps idle probes (issue 38) out of the tests
    that are not about them."""
    cfg = make_cfg(create_run_dir("rt"), name=f"rt{os.getpid()}", stall_timeout_s=stall_timeout_s)
    if cache:
        cfg = dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, **cache))
    if tp != 1:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, tp=tp))
    inst = Instance(cfg)
    inst.create_regions()
    zctx = zmq.asyncio.Context()
    status_r, status_w = os.pipe()
    from_router: Receiver[Outbound] = Receiver(zctx, cfg.ipc_address("api_in"), Outbound, "api_in")
    from_router.start()
    ranks = [FakeRank(DgramReceiver(cfg.ipc_address(f"rank{r}_in"), RankInbound, "rank_in"),
                      DgramSender(cfg.ipc_address("router_results"), "router_results"), mode,
                      state_slots=ready_slots, rank=r) for r in range(tp)]
    rank = ranks[0]
    raw = zctx.socket(zmq.PUSH)
    raw.connect(cfg.ipc_address("router_in"))
    region = ShmRegion.attach(cfg.server.name, stats.REGION, readonly=True)
    ctx = ActorContext(name="router", rank=0, status_fd=status_w)
    tasks = [asyncio.create_task(serve(cfg, ctx)), *(asyncio.create_task(r.run()) for r in ranks)]
    try:
        env = Env(Sender(zctx, cfg.ipc_address("router_in"), "router_in"), raw, from_router, rank,
                  stats.RouterStats(region.payload), ranks)
        await env.until(lambda: any(s.ready for s in env.states))
        yield env
    finally:
        for r in ranks:
            r.release.set()
        ctx.request_stop("test over")
        await asyncio.wait_for(tasks[0], 10)
        for task in tasks[1:]:
            task.cancel()
        await asyncio.gather(*tasks[1:], return_exceptions=True)
        env.stats.release_views()
        region.close()
        for channel in (from_router, *(c for r in ranks for c in (r.inbox, r.outbox)), env.to_router):
            await channel.aclose()
        raw.close(linger=0)
        zctx.destroy(linger=0)
        os.close(status_r)
        os.close(status_w)
        inst.cleanup()
        shutil.rmtree(cfg.run_dir, ignore_errors=True)


async def test_bad_requests_are_refused_counted_and_the_router_keeps_serving():
    async with router() as env:
        await env.generate(1, [TOKEN] * 5000)  # more pages than a request-table row holds
        await env.generate(2, [TOKEN, 10**6])  # outside the vocabulary
        await env.raw.send(b"\xc1 not msgpack")
        await env.generate(3, [TOKEN, 6, 7])
        done = await env.finished(1, 2, 3)
        assert done[1].finish_reason == "error" and "prompt of 5000 tokens" in done[1].error
        assert done[2].finish_reason == "error" and "token id 1000000" in done[2].error
        assert done[3].finish_reason == "length"
        assert [t for d in env.deltas[3] for t in d.token_ids] == [TOKEN] * 3
        assert all(10**6 not in c.token_ids and len(c.token_ids) < 5000 for p in env.rank.plans for c in p.chunks)
        await env.generate(3, [TOKEN])  # id 3 finished: reusable; a live id would be dropped
        assert (await env.finished(3))[3].finish_reason == "length"
        await env.until(lambda: env.stats.read()["malformed_router_in"] == 3)


async def test_a_reused_live_id_is_dropped_without_an_answer():
    async with router("hold") as env:
        # 30 tokens: request 1 is still running when the router reads the reuse (it reads its
        # inbox between steps; with 3, a loaded machine could finish request 1 first)
        await env.generate(1, [TOKEN], max_tokens=30)
        await env.until(lambda: env.rank.plans)
        await env.generate(1, [TOKEN, 6], max_tokens=1)  # read while request 1 still runs
        env.rank.release.set()
        done = await env.finished(1)
        assert done[1].finish_reason == "length" and [t for d in env.deltas[1] for t in d.token_ids] == [TOKEN] * 30
        await env.until(lambda: env.stats.read()["malformed_router_in"] == 1)
        assert all(len(c.token_ids) == 1 for p in env.rank.plans for c in p.chunks)


async def test_a_result_outside_the_vocabulary_fails_only_that_step():
    async with router("bad") as env:
        await env.generate(1, [TOKEN, 6])
        done = await env.finished(1)
        assert done[1].finish_reason == "error" and "malformed result" in done[1].error
        # every answer was bad: the prefill's and the decode step planned ahead behind it
        await env.until(lambda: env.rank.plans and env.stats.read()["malformed_router_results"] == len(env.rank.plans))
        env.rank.mode = "ok"
        await env.generate(2, [TOKEN, 6])
        assert (await env.finished(2))[2].finish_reason == "length"


async def test_heartbeat_reports_a_step_in_flight():
    async with router("hold") as env:
        await env.generate(1, [TOKEN, 6])
        await env.until(lambda: env.rank.plans)
        start = len(env.states)
        await env.until(lambda: len(env.states) >= start + 2, timeout=5)  # ~1 s apart, while the rank holds
        held = env.states[start:]
        assert all(s.running == 1 and s.steps == 0 and s.alive for s in held)
        env.rank.release.set()
        await env.finished(1)
        await env.until(lambda: env.states[-1].steps >= 3 and env.states[-1].running == 0)


async def test_an_engine_whose_steps_all_fail_reports_itself_dead():
    async with router("fail") as env:
        # a request fails with its prefill; the router has planned its first decode step behind it,
        # which fails too, so each request costs one or two steps until the bound is reached
        for req_id in range(1, DEAD_AFTER_FAILED_STEPS + 1):
            await env.generate(req_id, [TOKEN, req_id])
            assert (await env.finished(req_id))[req_id].finish_reason == "error"
        await env.until(lambda: env.states and not env.states[-1].alive)
        failed = len(env.rank.plans)
        assert DEAD_AFTER_FAILED_STEPS <= failed <= DEAD_AFTER_FAILED_STEPS + 1  # + the one planned ahead
        assert env.states[-1].failed_steps == failed == env.stats.read()["failed_steps"]
        await env.generate(99, [TOKEN])
        assert "engine is dead" in (await env.finished(99))[99].error
        assert len(env.rank.plans) == failed  # a dead engine is sent nothing


async def test_state_slots_sized_by_the_rank_are_what_the_coordinator_hands_out():
    """CUDA without --state-slots: the rank sizes the state pool from memory and reports it."""
    async with router(cache={"hybrid": True, "checkpoint_interval": 64, "state_slots": None}, ready_slots=40) as env:
        assert env.stats.read()["state_slots_total"] == 40
        await env.generate(1, [TOKEN] * 100, max_tokens=2)
        assert (await env.finished(1))[1].finish_reason == "length"
    async with router(cache={"hybrid": True, "checkpoint_interval": 64, "state_slots": 24}, ready_slots=24) as env:
        assert env.stats.read()["state_slots_total"] == 24  # an explicit --state-slots is the count


async def test_steps_are_counted_by_the_graph_kind_their_rank_reports():
    async with router("graphs") as env:
        for req_id in (1, 2, 3):
            await env.generate(req_id, [7, 8, 9], max_tokens=4)
            await env.finished(req_id)
        values = env.stats.read()
        kinds = [p.step % 6 for p in env.rank.plans]
        assert [values[f"graph_steps_{k}"] for k in stats.GRAPH_KINDS] == [kinds.count(g) for g in (1, 2, 3, 4)]
        assert sum(kinds.count(g) for g in (1, 2, 3, 4)) > 0  # some steps of each run replayed
        assert values["steps"] == len(env.rank.plans)  # a value past the kinds (5) counted as a step only


async def test_idle_ranks_are_probed_and_a_silent_one_is_reported_until_it_answers():
    """Issue 38: with nothing out for half the stall timeout the router sends the ranks a plan that runs
    nothing; it is no step (not counted), never sent twice while out, and while it goes unanswered every
    report says how long the ranks have been silent; its answer clears that at once, and a request that
    came meanwhile runs behind it, numbered on."""
    async with router(stall_timeout_s=0.6) as env:
        await env.until(lambda: len(env.rank.plans) >= 2)  # ~0.3 s apart
        assert [(p.new, p.chunks, p.ops, p.freed) for p in env.rank.plans[:2]] == [([], [], [], [])] * 2
        env.rank.mode = "hold"
        held = len(env.rank.plans) + 1
        await env.until(lambda: (env.states[-1].ranks_silent_s or 0) > 1.0)  # > 3 intervals
        assert len(env.rank.plans) == held and not env.rank.plans[-1].chunks  # one probe out, no second
        assert all(s.alive and s.steps == 0 for s in env.states)
        await env.generate(1, [TOKEN, 6], max_tokens=2)  # read once the probe is answered
        silent = len(env.states)
        env.rank.release.set()
        done = await env.finished(1)
        assert done[1].finish_reason == "length"
        probe, first = env.rank.plans[held - 1], env.rank.plans[held]
        assert first.step == probe.step + 1 and first.new[0].req_id == 1
        answered = next(s for s in env.states[silent:] if s.ranks_silent_s is None)
        assert answered.steps == 0  # reported before the request's first step finished: at the answer
        await env.until(lambda: env.states[-1].steps == 2)  # the request's two steps; probes are none
        assert env.stats.read()["steps"] == 2


async def test_every_rank_of_a_group_is_probed_and_rank_0_answers_for_it():
    """Tensor parallel (issue 38): the probe goes to every rank like any plan, and rank 0's answer, given
    once the group ran it (rank.py's contract), clears it; the other ranks' silence is rank 0's."""
    async with router(stall_timeout_s=0.6, tp=2) as env:
        await env.until(lambda: len(env.ranks[1].plans) >= 2 and env.states[-1].ranks_silent_s is None)
        assert [p.step for p in env.ranks[1].plans] == [p.step for p in env.ranks[0].plans][:len(env.ranks[1].plans)]
        await env.generate(1, [TOKEN, 6], max_tokens=2)
        assert (await env.finished(1))[1].finish_reason == "length"
        assert env.states[-1].alive
