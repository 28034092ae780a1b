"""Verification of one sequence's draft tokens in a speculative decoding step.

The drafter proposes K tokens by taking its argmax, so its distribution is a point mass
on each draft. The target scores the K drafts and one more position in a single chunk;
`verify` decides how many drafts to keep and which token follows them. Every emitted
token has exactly the distribution plain decoding would give it, so speculation only
changes how many steps a completion takes, never what it can say.

Greedy rows keep drafts while they equal the target's argmax and then emit that argmax:
token for token what greedy decoding emits.

Random rows use the speculative rejection sampler (Leviathan et al. 2023; Chen et al.
2023) for a point-mass draft. At position i, with p the target's filtered distribution
(temperature, top_k and top_p, as `sampler._draw` applies them) and d the draft:
accept d with probability p(d); on rejection emit a token from the residual, p with d
zeroed and renormalized, and stop. The emitted token then has distribution p:
P(d) = p(d), and for x != d, P(x) = (1 - p(d)) * p(x) / (1 - p(d)) = p(x). Each kept
token is thereby a draw from the target given the tokens before it, so the argument
repeats at the next position; if all K are kept, a bonus token is drawn from the last row.

As in `sampler`, randomness comes from generators seeded by (request seed, position):
the acceptance uniform and the token draw at a position use two seeds that differ by a
salt, so they are independent streams and neither depends on the batch, the draft
length, or recompute after preemption. The token draw is seeded exactly as `_draw`
seeds it, so with no drafts `verify` returns what `sample` returns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hkv.engine.sampler import _MIX, GREEDY_BELOW, SampleOutput, SampleRow, _with_logprobs
from hkv.ipc.messages import SamplingParams

# XORed into the acceptance stream's seed. It must change the low 32 bits: a CPU
# generator (mt19937) only uses those of its seed.
_ACCEPT_SALT = 0x5851_F42D_4C95_7F2D
_SEED_BITS = 0x7FFF_FFFF_FFFF_FFFF


@dataclass(frozen=True)
class Verified:
    """One verify step's result for one sequence."""

    outputs: list[SampleOutput]  # the accepted drafts then the correction or bonus token; len = accepted + 1
    accepted: int  # how many drafts were kept (0..len(drafts))


def verify(logits: torch.Tensor, drafts: list[int], row: SampleRow, targets: list[int] | None = None) -> Verified:
    """Keep a prefix of `drafts` and emit one more token after it.

    logits: [len(drafts) + 1, vocab] fp32, the target's logits at the verify chunk's rows;
    row i scores the token at position row.position + i, which drafts[i] proposes
    (row.position is the position of the first token this step emits). Outputs carry the
    logprobs of the raw row that scored them, as `sample` gives them. targets: the rows' argmax
    when the caller has them on the host already (greedy rows then read no logits).
    """
    k = len(drafts)
    if logits.dim() != 2 or logits.shape[0] != k + 1:
        raise ValueError(f"verify needs [{k + 1}, vocab] logits for {k} drafts, got {list(logits.shape)}")
    params = row.sampling
    if params.temperature < GREEDY_BELOW:
        if targets is None:
            targets = logits.argmax(dim=-1).tolist()  # [k + 1]
        accepted = 0
        while accepted < k and drafts[accepted] == targets[accepted]:
            accepted += 1
        tokens = drafts[:accepted] + [targets[accepted]]
    else:
        accepted = _accepted_count(logits[:k], drafts, row) if k else 0
        rejected = drafts[accepted] if accepted < k else None
        tokens = drafts[:accepted] + [_final_draw(logits[accepted], rejected, params, row.position + accepted)]
    outputs = [_with_logprobs(logits[i], t, params) for i, t in enumerate(tokens)]
    return Verified(outputs, accepted)


def _filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The weights `sampler._draw` samples from, for logits [..., vocab]: temperature,
    then top_k, then top_p, then min_p. Not renormalized after top_p (multinomial does not need it);
    on a 1-D row it performs `_draw`'s operations exactly, so draws from it match."""
    scaled = logits.float() / params.temperature
    if params.top_k is not None and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop = mass_before >= params.top_p
        drop[..., 0] = False  # the most likely token stays, however small top_p is
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs.masked_fill(drop, 0.0))
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    return probs


def _generator(device: torch.device, seed: int, position: int, salt: int) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(((seed * _MIX + position) ^ salt) & _SEED_BITS)  # salt 0 is `_draw`'s seed
    return gen


def _accepted_count(logits: torch.Tensor, drafts: list[int], row: SampleRow) -> int:
    """How many leading drafts survive: draft i is kept when u_i < p_i(draft i), with u_i
    uniform from the acceptance stream at position + i. logits: [k, vocab]."""
    probs = _filtered_probs(logits, row.sampling)  # [k, V], all rows at once
    ids = torch.tensor(drafts, dtype=torch.long, device=logits.device)
    p_draft = probs.gather(1, ids[:, None])[:, 0] / probs.sum(dim=-1)  # [k]; exactly 1 when only the draft is left
    gens = [_generator(logits.device, row.sampling.seed, row.position + i, _ACCEPT_SALT) for i in range(len(drafts))]
    u = torch.cat([torch.rand(1, generator=g, device=logits.device) for g in gens])  # [k] in [0, 1)
    keep = (u < p_draft).tolist()
    return keep.index(False) if False in keep else len(drafts)


def _final_draw(logits: torch.Tensor, rejected: int | None, params: SamplingParams, position: int) -> int:
    """The token after the kept drafts, drawn as `_draw` draws at its position: from the
    residual (the rejected draft zeroed; multinomial renormalizes) or, when every draft was
    kept (rejected is None), from the row itself. An all-zero residual falls back to the row."""
    probs = _filtered_probs(logits, params)  # [V]
    if rejected is not None:
        residual = probs.clone()
        residual[rejected] = 0.0
        probs = torch.where(residual.sum() > 0, residual, probs)
    gen = _generator(probs.device, params.seed, position, 0)
    return int(torch.multinomial(probs, 1, generator=gen).item())
