"""Where a request's time to first token goes, as the router sees it: one log line per finished request.

    request 12: 8256 prompt tokens, cached gpu 0 cpu 8192 disk 0 peer 0; router 0.6 ms, tier 3.1 ms,
    admitted 3.4 ms (step 88, 64 tokens, 2 cache ops), first step done 21.0 ms (forward 9.8 ms),
    first token 21.3 ms, finished 980.0 ms (length)

Times count from the request's arrival at the api (its HTTP handler's
time.monotonic, which every process on the host shares; carried in
GenerateRequest.received_at, and the router's own clock when that is missing
or not plausible). Stages: `router` (the router took it in: it reads new
requests between steps, so a request that comes during a long step waits
here), `fetched` (decode mode: the peer's pages are in), `tier` (the CPU/disk
tier lookup answered), `admitted` (the first plan that runs it), `first step
done` (that plan's result), `first token` (published to the api),
`finished`. Off unless `--log-request-times`; then a stage costs one dict
update and a finish one log line (info).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

from hkv.ipc.messages import CACHE_TIERS, StepPlan, StepResult, TokenDelta

log = logging.getLogger("hkv.timeline")

MAX_TRACKED = 4096  # requests followed at once; the oldest is dropped past it (bounded, whatever the load)
MAX_WAIT_S = 3600.0  # an api receive time further back than this (or ahead of the router's clock) is not used


class Timeline:
    def __init__(self, enabled: bool, clock=time.monotonic):
        self.enabled = enabled
        self._clock = clock
        # req id -> (arrived at, prompt tokens, {stage: (seconds since arrival, detail)})
        self._reqs: OrderedDict[int, tuple[float, int, dict[str, tuple[float, str]]]] = OrderedDict()

    def arrived(self, req_id: int, prompt_len: int, received_at: float = 0.0) -> None:
        """The router took the request in; received_at: when the api did (time.monotonic, 0: unknown)."""
        if not self.enabled:
            return
        if len(self._reqs) >= MAX_TRACKED:
            self._reqs.popitem(last=False)
        now = self._clock()
        waited = now - received_at  # a value from another process: used only when plausible
        if 0.0 < received_at and 0.0 <= waited <= MAX_WAIT_S:
            self._reqs[req_id] = (received_at, prompt_len, {"router": (waited, "")})
        else:
            self._reqs[req_id] = (now, prompt_len, {})

    def mark(self, req_id: int | None, stage: str, detail: str = "") -> None:
        """The first time `req_id` reaches `stage` (later ones, after a preemption, are not the TTFT's)."""
        rec = self._reqs.get(req_id) if self.enabled and req_id is not None else None
        if rec is not None and stage not in rec[2]:
            rec[2][stage] = (self._clock() - rec[0], detail)

    def plan_sent(self, plan: StepPlan) -> None:
        if not self.enabled or not plan.new:
            return
        tokens = {c.slot: len(c.token_ids) for c in plan.chunks}
        for seq in plan.new:
            self.mark(seq.req_id, "admitted",
                      f"step {plan.step}, {tokens.get(seq.slot, 0)} tokens, {len(plan.ops)} cache ops")

    def plan_done(self, plan: StepPlan, result: StepResult) -> None:
        if not self.enabled:
            return
        for seq in plan.new:
            self.mark(seq.req_id, "first step done", f"forward {result.forward_s * 1e3:.1f} ms")

    def published(self, deltas: list[TokenDelta]) -> None:
        if not self.enabled:
            return
        for delta in deltas:
            if delta.token_ids:
                self.mark(delta.req_id, "first token")
            if delta.finish_reason is not None:
                self.mark(delta.req_id, "finished", delta.finish_reason)
                rec = self._reqs.pop(delta.req_id, None)
                if rec is not None:
                    log.info("%s", self.line(delta, rec))

    @staticmethod
    def line(delta: TokenDelta, rec: tuple[float, int, dict[str, tuple[float, str]]]) -> str:
        _, prompt_len, stages = rec
        tiers = delta.cache_tiers or {}
        cached = " ".join(f"{t} {tiers.get(t, 0)}" for t in CACHE_TIERS)
        times = ", ".join(f"{name} {at * 1e3:.1f} ms" + (f" ({detail})" if detail else "")
                          for name, (at, detail) in stages.items())
        return f"request {delta.req_id}: {prompt_len} prompt tokens, cached {cached}; {times}"
