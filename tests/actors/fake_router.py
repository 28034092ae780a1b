"""A stand-in router for api tests: real ZeroMQ links, scripted deterministic tokens.

Each GenerateRequest is answered with tokens of SCRIPT (greedy: from the start;
sampled: from an offset picked by the seed), a few per step, one TokenBatch
per step for all running sequences, until max_tokens ("length"). A prompt
whose text contains "EOS" gets the end-of-sequence token after EOS_AFTER
tokens ("stop", unless ignore_eos). AbortRequest ends a sequence with an
empty "abort" delta, as the real router does. Like the real router it reports
its EngineState (with a step count) on a heartbeat; `freeze()` stops its steps
(a stalled engine) until `thaw()` while the reports go on, `silent` stops the
reports too.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import zmq.asyncio

from hkv.config import HkvConfig
from hkv.ipc.channel import Receiver, Sender
from hkv.ipc.messages import (
    AbortRequest,
    CacheFlushed,
    FlushCache,
    EngineState,
    GenerateRequest,
    Inbound,
    Outbound,
    TokenBatch,
    TokenDelta,
    TopLogprob,
)

SCRIPT = "Hello a😀b world! 你好 and STOP then more text after the stop. "
EOS_AFTER = 3


@dataclass
class _Sequence:
    request: GenerateRequest
    script: list[int]
    offset: int
    cached: int
    emitted: int = 0
    eos_at: int | None = None


@dataclass
class FakeRouter:
    cfg: HkvConfig
    tokenizer: object
    step_s: float = 0.002
    tokens_per_step: tuple[int, ...] = (1, 2, 3)  # cycled: deltas of varying size
    received: list[Inbound] = field(default_factory=list)
    running: dict[int, _Sequence] = field(default_factory=dict)
    seen_prompts: set[tuple[int, ...]] = field(default_factory=set)
    pending_aborts: list[TokenDelta] = field(default_factory=list)
    pending_flushes: list[FlushCache] = field(default_factory=list)
    heartbeat_s: float = 0.1
    steps: int = 0
    ready: bool = True
    alive: bool = True
    silent: bool = False  # no reports
    thawed: asyncio.Event = field(default_factory=asyncio.Event)  # clear: no steps (see freeze)

    async def __aenter__(self) -> "FakeRouter":
        self._zctx = zmq.asyncio.Context()
        self.inbox: Receiver[Inbound] = Receiver(self._zctx, self.cfg.ipc_address("router_in"), Inbound, "router_in")
        self.to_api: Sender[Outbound] = Sender(self._zctx, self.cfg.ipc_address("api_in"), "api_in")
        self.inbox.start()
        self._script = self.tokenizer.encode(SCRIPT)
        self._eos = self.tokenizer.eos_token_ids[0]
        self.thaw()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._run()), loop.create_task(self._heartbeat())]
        await self.send_state(ready=True)
        return self

    async def __aexit__(self, *exc_info) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.inbox.aclose()
        await self.to_api.aclose()
        self._zctx.destroy(linger=0)

    async def send_state(self, ready: bool, alive: bool = True) -> None:
        self.ready, self.alive = ready, alive
        await self.to_api.send(EngineState(ready=ready, alive=alive, waiting=0, running=len(self.running),
                                           steps=self.steps))

    def freeze(self) -> None:
        self.thawed.clear()

    def thaw(self) -> None:
        self.thawed.set()

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            if not self.silent:
                await self.send_state(self.ready, self.alive)

    @property
    def aborted(self) -> list[int]:
        return [m.req_id for m in self.received if isinstance(m, AbortRequest)]

    @property
    def generated(self) -> list[GenerateRequest]:
        return [m for m in self.received if isinstance(m, GenerateRequest)]

    async def wait_for(self, predicate, timeout: float = 5.0) -> None:
        async with asyncio.timeout(timeout):
            while not predicate():
                await asyncio.sleep(0.005)

    async def _run(self) -> None:
        step = 0
        while True:
            await self.thawed.wait()
            if not self.running:
                self._handle(await self.inbox.get())
            for msg in self.inbox.drain():
                self._handle(msg)
            for flush in self.pending_flushes:
                await self.to_api.send(CacheFlushed(flush.flush_id, pages=3, checkpoints=1))
            self.pending_flushes = []
            deltas, self.pending_aborts = self.pending_aborts, []
            size = self.tokens_per_step[step % len(self.tokens_per_step)]
            deltas += [self._advance(seq, size) for seq in list(self.running.values())]
            if deltas:
                await self.to_api.send(TokenBatch(deltas))
            step += 1
            self.steps += 1
            await asyncio.sleep(self.step_s)

    def _handle(self, msg: Inbound) -> None:
        self.received.append(msg)
        if isinstance(msg, GenerateRequest):
            self._start(msg)
        elif isinstance(msg, FlushCache):
            self.pending_flushes.append(msg)
        elif msg.req_id in self.running:
            seq = self.running.pop(msg.req_id)
            abort = TokenDelta(msg.req_id, [], None, None, "abort", len(seq.request.prompt_ids), seq.cached)
            self.pending_aborts.append(abort)

    def _start(self, req: GenerateRequest) -> None:
        prompt = tuple(req.prompt_ids)
        cached = len(prompt) // 2 if prompt in self.seen_prompts else 0
        self.seen_prompts.add(prompt)
        offset = 0 if req.sampling.temperature == 0 else req.sampling.seed % len(self._script)
        seq = _Sequence(req, self._script, offset, cached)
        if "EOS" in self.tokenizer.decode(req.prompt_ids) and not req.sampling.ignore_eos:
            seq.eos_at = EOS_AFTER
        self.running[req.req_id] = seq

    def _advance(self, seq: _Sequence, size: int) -> TokenDelta:
        req = seq.request
        ids: list[int] = []
        finish = None
        while len(ids) < size and finish is None:
            if seq.eos_at is not None and seq.emitted == seq.eos_at:
                ids.append(self._eos)
                finish = "stop"
            else:
                ids.append(seq.script[(seq.offset + seq.emitted) % len(seq.script)])
            seq.emitted += 1
            if finish is None and seq.emitted >= req.sampling.max_tokens:
                finish = "length"
        logprobs, tops = self._logprobs(ids, req.sampling.logprobs)
        if finish is not None:
            del self.running[req.req_id]
        tiers = {"gpu": seq.cached, "cpu": 0, "disk": 0, "peer": 0} if finish else None
        return TokenDelta(req.req_id, ids, logprobs, tops, finish, len(req.prompt_ids), seq.cached, tiers)

    @staticmethod
    def _logprobs(ids: list[int], top_n: int | None) -> tuple[list[float] | None, list[list[TopLogprob]] | None]:
        if top_n is None:
            return None, None
        logprobs = [-0.5 for _ in ids]
        tops = [[TopLogprob(t, -0.5), TopLogprob(7, -2.0), TopLogprob(8, -3.0)][:top_n] for t in ids]
        return logprobs, tops
