"""The HTTP side of `hkv-bench`: streamed completions timed per SSE event, the dispatcher, /metrics scrapes.

Every request is a streamed `/v1/completions` with a token-id prompt,
`return_token_ids`, `ignore_eos` and greedy sampling. Tokens are counted from
each event's `token_ids`, never from its text: a random-weight model emits
ids that a small tokenizer prints as nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tools.bench.bench_workloads import Session, Tokens


@dataclass
class RequestResult:
    prompt: Tokens
    sent_at: float  # perf_counter when the request was sent
    session: int = 0  # index of its session in the workload
    turn: int = 0
    output: list[int] = field(default_factory=list)  # every token id the stream carried
    events: list[tuple[float, int]] = field(default_factory=list)  # (arrival, ids in it) per token event
    finished_at: float | None = None
    usage: dict | None = None  # the stream's final usage object
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        """Send to the first event carrying token ids."""
        return self.events[0][0] - self.sent_at if self.events else None

    @property
    def e2e(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.sent_at

    @property
    def tpot(self) -> float | None:
        """(e2e - ttft) / (output tokens - 1): the mean time per token after the first."""
        if self.ttft is None or self.e2e is None or len(self.output) < 2:
            return None
        return (self.e2e - self.ttft) / (len(self.output) - 1)

    def itls(self) -> list[float]:
        """Gaps between token events, an event of k ids counting as k gaps of gap / k.

        Ids that arrive with the first token add no gap, so a request of n
        tokens in one-id events gives n - 1 values.
        """
        gaps = []
        for (before, _), (at, count) in zip(self.events, self.events[1:]):
            gaps.extend([(at - before) / count] * count)
        return gaps


def _apply_event(result: RequestResult, event: dict, now: float) -> None:
    if "error" in event:
        error = event["error"]
        result.error = str(error.get("message", error) if isinstance(error, dict) else error)
        return
    if event.get("usage"):
        result.usage = event["usage"]
    for choice in event.get("choices") or ():
        ids = choice.get("token_ids") or []
        if ids:
            result.output.extend(ids)
            result.events.append((now, len(ids)))


async def stream_completion(http: aiohttp.ClientSession, url: str, body: dict, result: RequestResult) -> None:
    """POST one streamed completion and fill `result` as its events arrive (errors go in result.error)."""
    try:
        async with http.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: "):
                    continue
                payload = line[len(b"data: "):]
                if payload == b"[DONE]":
                    break
                _apply_event(result, json.loads(payload), time.perf_counter())
                if result.error is not None:
                    return
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return
    result.finished_at = time.perf_counter()
    if result.usage is None and result.error is None:
        result.error = "stream ended without usage"


def completion_body(model: str, prompt: Tokens, output_len: int) -> dict:
    return {
        "model": model, "prompt": list(prompt), "max_tokens": output_len, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True, "ignore_eos": True,
    }


Send = Callable[[Tokens], Awaitable[RequestResult]]


async def run_sessions(sessions: list[Session], send: Send, concurrency: int | None, request_rate: float,
                       seed: int, on_done: Callable[[RequestResult], None]) -> list[RequestResult]:
    """Run every session: at most `concurrency` at once, new ones arriving as a Poisson process of request_rate.

    A session's turns run in order, each prompt extended by the previous
    answer; a failed turn ends its session. request_rate is in sessions per
    second (inf: all arrive at once). Returns results in the order sent.
    """
    gate = asyncio.Semaphore(concurrency) if concurrency else None
    arrivals = random.Random(seed)
    results: list[RequestResult] = []

    async def run(index: int, session: Session) -> None:
        async with gate if gate is not None else contextlib.nullcontext():
            history: Tokens = ()
            for turn, new in enumerate(session.turns):
                result = await send(history + new)
                result.session, result.turn = index, turn
                results.append(result)
                on_done(result)
                if result.error is not None:
                    return
                history = result.prompt + tuple(result.output)

    tasks = []
    try:
        for index, session in enumerate(sessions):
            if request_rate != float("inf") and index:
                await asyncio.sleep(arrivals.expovariate(request_rate))
            tasks.append(asyncio.create_task(run(index, session)))
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
    return sorted(results, key=lambda r: r.sent_at)


async def scrape_metrics(http: aiohttp.ClientSession, url: str) -> dict[str, float] | None:
    """Every sample of /metrics as {'name{label="v",...}': value}; None when the page cannot be read."""
    try:
        async with http.get(f"{url}/metrics") as resp:
            if resp.status != 200:
                return None
            text = await resp.text()
    except aiohttp.ClientError:
        return None
    samples = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    except ValueError:  # not Prometheus text: a server without hkv's /metrics
        return None
    return samples
