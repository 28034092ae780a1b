"""The api's side of the api <-> router link.

`RouterLink` owns two I/O tasks: one sends queued Inbound messages to the
router in order, one reads Outbound messages and routes each TokenDelta to
the `RequestStream` of the HTTP request that owns the sequence. Handlers
only call the synchronous `open` / `abort` / `close`, so an abort can be
issued from a `finally` block of a cancelled handler and is never lost.
`EngineProgress` judges from the router's EngineState reports whether the
engine still moves.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence

from hkv.ipc.channel import Receiver, Sender
from hkv.ipc.messages import (
    ENGINE_HEARTBEAT_S,
    AbortRequest,
    CacheFlushed,
    EngineState,
    FlushCache,
    GenerateRequest,
    Inbound,
    Outbound,
    SamplingParams,
    TokenDelta,
)

log = logging.getLogger("hkv.api")
OUTBOX_FLUSH_S = 1.0  # at shutdown: how long queued messages may take to leave


class StreamOverflow(Exception):
    """The router sent more deltas than a sequence's max_tokens allows."""


class RequestStream:
    """Deltas of one HTTP request's sequences, fed by the link, read by the handler.

    Bounded: a sequence can send at most max_tokens token-bearing deltas plus
    a final one, and the link may add one synthetic failure delta.
    """

    def __init__(self, req_ids: Sequence[int], bound: int):
        self.req_ids = tuple(req_ids)
        self.open_ids = set(req_ids)  # sequences the router may still be running
        self._bound = bound
        self._pending: deque[TokenDelta] = deque()
        self._wakeup = asyncio.Event()

    def push(self, delta: TokenDelta) -> None:
        if len(self._pending) >= self._bound:
            raise StreamOverflow(f"request {delta.req_id}: more than {self._bound} deltas queued")
        if delta.finish_reason is not None:
            self.open_ids.discard(delta.req_id)
        self._pending.append(delta)
        self._wakeup.set()

    async def next_batch(self) -> list[TokenDelta]:
        """Wait for deltas; return every one queued, in arrival order."""
        while not self._pending:
            self._wakeup.clear()
            await self._wakeup.wait()
        batch = list(self._pending)
        self._pending.clear()
        return batch

    def end(self, req_id: int, reason: str, finish_reason: str = "error") -> None:
        """Finish one sequence here, without the router (past the bound: it is the last delta)."""
        self.open_ids.discard(req_id)
        self._pending.append(TokenDelta(req_id, [], None, None, finish_reason, 0, 0, None, reason))
        self._wakeup.set()

    def fail(self, reason: str, finish_reason: str = "error") -> None:
        """End every open sequence now (engine died, shutdown)."""
        for req_id in sorted(self.open_ids):
            self.end(req_id, reason, finish_reason)


class EngineProgress:
    """Whether the engine moves, judged on the api's own clock from the router's reports.

    Stalled: the router has not reported for stall_s + ENGINE_HEARTBEAT_S (it
    reports at least every ENGINE_HEARTBEAT_S, even mid-step), or the ranks
    have not answered for stall_s while the router probes them (an idle
    engine: the last report's ranks_silent_s plus the time since it came), or
    work is pending and its finished-step count has not moved for stall_s
    (since the last step finished, which the report dates; or since the work
    arrived, if the engine was idle before). New tokens
    show that a step finished (on_tokens; not a state report): the router publishes
    its state on a change of its queues or once a second, so a stream could
    otherwise end, after the engine resumed, before /ready knew it had.
    """

    def __init__(self, stall_s: float, clock: Callable[[], float] = time.monotonic):
        self.stall_s = stall_s
        self._clock = clock
        self._heard_at: float | None = None  # None until the first report
        self._moved_at = 0.0  # when the step count last moved, or work arrived at an idle engine
        self._steps = 0
        self._pending = False
        self._ranks_silent_s: float | None = None  # the last report's: a probe is out, the ranks silent this long

    def on_state(self, state: EngineState) -> None:
        now = self._clock()
        pending = state.waiting + state.running > 0
        if pending and not self._pending:
            self._moved_at = now  # work arrived at an idle engine: its clock starts now
        elif state.steps != self._steps:  # dated when the step finished, not when the report came
            self._moved_at = max(self._moved_at, now - state.since_step_s)
        self._steps, self._pending, self._heard_at = state.steps, pending, now
        self._ranks_silent_s = state.ranks_silent_s

    def on_tokens(self) -> None:
        """The router sent sequences new tokens: a step finished (its reports are still owed: a router
        whose state reports stop counts as silent however many tokens it sends)."""
        if self._heard_at is not None:
            self._moved_at = self._clock()

    def stalled(self) -> str | None:
        """Why the engine counts as stalled now, or None."""
        if self._heard_at is None:
            return None
        now = self._clock()
        silent = now - self._heard_at
        if silent > self.stall_s + ENGINE_HEARTBEAT_S:
            return f"the router has not reported for {silent:.1f} s"
        ranks_silent = None if self._ranks_silent_s is None else self._ranks_silent_s + silent
        if ranks_silent is not None and ranks_silent > self.stall_s:
            return f"the ranks have not answered for {ranks_silent:.1f} s (idle, probed by the router)"
        idle = now - self._moved_at
        if self._pending and idle > self.stall_s:
            return f"no step finished for {idle:.1f} s with work pending"
        return None


class RouterLink:
    """Submits sequences to the router and routes their deltas back."""

    def __init__(self, receiver: Receiver[Outbound], sender: Sender[Inbound], outbox_bound: int,
                 stall_s: float = 10.0):
        self._receiver = receiver
        self._sender = sender
        self._outbox: asyncio.Queue[Inbound] = asyncio.Queue(maxsize=outbox_bound)
        self._routes: dict[int, RequestStream] = {}  # req_id -> its request's stream
        self._req_ids = itertools.count(1)
        self._tasks: list[asyncio.Task] = []
        self.state: EngineState | None = None  # the router's last report; None until the first
        self.progress = EngineProgress(stall_s)
        self._flushes: dict[int, asyncio.Future[CacheFlushed]] = {}  # flush id -> its answer
        self._flush_ids = itertools.count(1)
        self.first_ready = asyncio.Event()  # set once the router first reports it can admit
        self.malformed = 0  # deltas the router should never have sent (past a sequence's bound)
        self.broken: str | None = None  # why a pump task died; the link is then dead for good

    @property
    def alive(self) -> bool:
        return self.broken is None and (self.state is None or self.state.alive)

    @property
    def ready(self) -> bool:
        return self.alive and self.state is not None and self.state.ready and self.progress.stalled() is None

    @property
    def inbox_malformed(self) -> int:
        """Frames on api_in that did not decode."""
        return self._receiver.malformed

    @property
    def in_flight(self) -> int:
        """Sequences submitted and not yet finished or aborted."""
        return len(self._routes)

    def has_room(self, sequences: int) -> bool:
        """Whether the outbox can take this many GenerateRequests (it backs up only if the router stalls)."""
        return self._outbox.qsize() + sequences <= self._outbox.maxsize

    async def __aenter__(self) -> "RouterLink":
        loop = asyncio.get_running_loop()
        self._receiver.start()
        self._tasks = [
            loop.create_task(self._pump_out(), name="api:to-router"),
            loop.create_task(self._pump_in(), name="api:from-router"),
        ]
        for task in self._tasks:
            task.add_done_callback(self._on_pump_done)
        return self

    def _on_pump_done(self, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is None:
            return
        self.broken = f"{task.get_name()} failed: {task.exception()!r}"
        log.error("router link broken: %s", self.broken, exc_info=task.exception())
        self.fail_all("the link to the router failed", "error")

    async def __aexit__(self, *exc_info) -> None:
        # Give queued aborts a moment to reach the router before the sockets close.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._outbox.join(), OUTBOX_FLUSH_S)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._receiver.aclose()
        await self._sender.aclose()

    def open(self, requests: Sequence[tuple[list[int], SamplingParams]], bound: int, peer: str | None = None,
             for_peer: bool = False, peer_device=None, device_hold: bool = False,
             received_at: float = 0.0) -> RequestStream:
        """Queue one GenerateRequest per (prompt_ids, sampling); returns their stream. `peer`/`for_peer`/
        `peer_device`/`device_hold`: prefill/decode (hkv/openai/pd_route.py); received_at: when the
        HTTP request arrived (time.monotonic; the router's --log-request-times count from it)."""
        req_ids = [next(self._req_ids) for _ in requests]
        stream = RequestStream(req_ids, bound)
        for req_id, (prompt_ids, sampling) in zip(req_ids, requests):
            self._routes[req_id] = stream
            self._outbox.put_nowait(GenerateRequest(req_id, prompt_ids, sampling, peer, for_peer, peer_device,
                                                    device_hold, received_at))
        return stream

    def abort(self, stream: RequestStream, req_id: int) -> None:
        """Stop one sequence (stop string matched); later deltas for it are dropped."""
        if req_id in stream.open_ids:
            stream.open_ids.discard(req_id)
            self._send_abort(req_id)
        self._routes.pop(req_id, None)

    def close(self, stream: RequestStream) -> None:
        """The handler is done (or gone): abort what still runs and forget the stream."""
        for req_id in sorted(stream.open_ids):
            self._send_abort(req_id)
        stream.open_ids.clear()
        for req_id in stream.req_ids:
            self._routes.pop(req_id, None)

    def fail_all(self, reason: str, finish_reason: str) -> None:
        """Abort every sequence and end every stream (shutdown timeout, engine dead)."""
        for stream in set(self._routes.values()):
            for req_id in sorted(stream.open_ids):
                self._send_abort(req_id)
            stream.fail(reason, finish_reason)
        self._routes.clear()

    def _send_abort(self, req_id: int) -> None:
        try:
            self._outbox.put_nowait(AbortRequest(req_id))
        except asyncio.QueueFull:  # the router stopped reading; it has bigger problems
            log.error("outbox full: abort of request %d dropped", req_id)

    async def _pump_out(self) -> None:
        while True:
            msg = await self._outbox.get()
            await self._sender.send(msg)
            self._outbox.task_done()

    async def flush_cache(self) -> CacheFlushed:
        """Ask the router to drop every unreferenced cache entry; waits for its answer."""
        flush_id = next(self._flush_ids)
        answer: asyncio.Future[CacheFlushed] = asyncio.get_running_loop().create_future()
        self._flushes[flush_id] = answer
        try:
            self._outbox.put_nowait(FlushCache(flush_id))
            return await answer
        finally:
            self._flushes.pop(flush_id, None)

    async def _pump_in(self) -> None:
        while True:
            msg = await self._receiver.get()
            if isinstance(msg, EngineState):
                self._on_state(msg)
            elif isinstance(msg, CacheFlushed):
                answer = self._flushes.get(msg.flush_id)
                if answer is not None and not answer.done():
                    answer.set_result(msg)
            else:
                if any(delta.token_ids for delta in msg.deltas):
                    self.progress.on_tokens()
                for delta in msg.deltas:
                    self._route(delta)

    def _on_state(self, state: EngineState) -> None:
        self.progress.on_state(state)
        if state.alive is False and self.alive:
            log.error("the router reports the engine dead; failing %d sequences", len(self._routes))
            self.state = state
            self.fail_all("the engine failed", "error")
        self.state = state
        if state.ready:
            self.first_ready.set()

    def _route(self, delta: TokenDelta) -> None:
        stream = self._routes.get(delta.req_id)
        if stream is None:
            return  # aborted or finished: the router's late deltas are expected
        try:
            stream.push(delta)
        except StreamOverflow as exc:
            self.malformed += 1
            log.warning("dropping request %d: %s", delta.req_id, exc)
            self.abort(stream, delta.req_id)
            stream.end(delta.req_id, str(exc))
            return
        if delta.finish_reason is not None:
            del self._routes[delta.req_id]
