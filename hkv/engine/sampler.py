"""Token sampling from a step's logits.

Greedy rows take the argmax. Random rows draw from a generator seeded by
(request seed, position of the sampled token), so a request's tokens do not
depend on what else shares its batch, nor on preemption and recompute.
Every valid parameter gives a distribution to draw from: a temperature below
GREEDY_BELOW is greedy (dividing by it overflows), and top-p and min-p always keep
the most likely token (a top_p below float32's resolution would keep none). A
random row applies temperature, top-k, top-p, then min-p; the logits arrive
processed already (bias, penalties, grammar: hkv/engine/logits_process.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hkv.ipc.messages import SamplingParams, TopLogprob

_MIX = 0x9E3779B97F4A7C15  # splits (seed, position) into well-spread generator seeds
GREEDY_BELOW = 1e-5  # temperatures this small are a point mass on the argmax anyway


@dataclass(frozen=True)
class SampleRow:
    """One sequence to sample: its params and the position the new token will take."""

    sampling: SamplingParams
    position: int


@dataclass(frozen=True)
class SampleOutput:
    token_id: int
    logprob: float | None
    top_logprobs: list[TopLogprob] | None


class PendingSample:
    """One step's sampled ids: on the device at once (the next step may feed them in), on the
    host once `outputs` waits for them."""

    def __init__(self, ids: torch.Tensor, host: torch.Tensor | None = None, outs: list[SampleOutput] | None = None):
        self.ids: torch.Tensor = ids  # [S] int64 on the logits' device
        self._host: torch.Tensor | None = host  # pinned copy in flight (CUDA, greedy rows only)
        self._event: torch.cuda.Event | None = None
        self._outs: list[SampleOutput] | None = outs
        if host is not None:
            self._event = torch.cuda.Event()
            self._event.record()

    def done(self) -> bool:
        """The ids have reached the host (or never had to travel)."""
        return self._event is None or self._event.query()

    def outputs(self) -> list[SampleOutput]:
        if self._outs is None:
            self._event.synchronize()
            self._outs = [SampleOutput(t, None, None) for t in self._host.tolist()]
        return self._outs


def samples_on_device(logits: torch.Tensor, rows: list[SampleRow]) -> bool:
    """`sample_async` leaves these rows on the device (it reads nothing back at once): CUDA, every row greedy
    and without logprobs."""
    return logits.is_cuda and all(r.sampling.temperature <= 0 and r.sampling.logprobs is None for r in rows)


def pinned_ids(rows: int) -> torch.Tensor:
    """A pinned host buffer for `rows` sampled ids (int64): sample_async's, allocated ahead by a caller that queues
    a device-side wait in between (hkv/engine/mask_wait.py)."""
    return torch.empty(rows, dtype=torch.long, pin_memory=True)


def sample_async(logits: torch.Tensor, rows: list[SampleRow], host: torch.Tensor | None = None) -> PendingSample:
    """`sample`, without waiting for the device when every row is greedy and wants no logprobs
    (the decode path): argmax on the device, a non-blocking copy of the ids to the host (into `host`, a
    pinned_ids buffer of len(rows), where given)."""
    if samples_on_device(logits, rows):
        ids = logits.argmax(dim=-1)
        host = pinned_ids(ids.shape[0]) if host is None else host
        host.copy_(ids, non_blocking=True)
        return PendingSample(ids, host=host)
    outs = sample(logits, rows)
    ids = torch.tensor([o.token_id for o in outs], dtype=torch.long).to(logits.device)
    return PendingSample(ids, outs=outs)


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> list[SampleOutput]:
    """Pick one token per row of `logits` ([S, vocab], fp32)."""
    tokens = logits.argmax(dim=-1).tolist()  # [S]; greedy rows keep these
    for i, row in enumerate(rows):
        if row.sampling.temperature >= GREEDY_BELOW:
            tokens[i] = _draw(logits[i], row)
    return [_with_logprobs(logits[i], tokens[i], row.sampling) for i, row in enumerate(rows)]


def _draw(logits: torch.Tensor, row: SampleRow) -> int:
    params = row.sampling
    scaled = logits.float() / params.temperature  # [V]
    if params.top_k is not None and params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)  # [V]
    if params.top_p < 1.0:
        probs = _top_p_filter(probs, params.top_p)
    if params.min_p > 0.0:  # the most likely token always stays
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    gen = torch.Generator(device=probs.device)
    gen.manual_seed((params.seed * _MIX + row.position) & 0x7FFF_FFFF_FFFF_FFFF)
    return int(torch.multinomial(probs, 1, generator=gen).item())


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p."""
    sorted_probs, order = torch.sort(probs, descending=True)  # [V]
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    drop = mass_before >= top_p
    drop[0] = False  # the most likely token stays, however small top_p is
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(0, order, sorted_probs)


def _with_logprobs(logits: torch.Tensor, token: int, params: SamplingParams) -> SampleOutput:
    if params.logprobs is None:
        return SampleOutput(token, None, None)
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [V]
    top = []
    if params.logprobs > 0:
        values, ids = torch.topk(logprobs, params.logprobs)
        top = [TopLogprob(int(t), float(v)) for t, v in zip(ids.tolist(), values.tolist())]
    return SampleOutput(token, float(logprobs[token]), top)
