"""Device time of one GEMM-like op with its weights read from HBM, as a served decode step pays it.

The decode step replays CUDA graphs, so a projection there costs its kernels' device time, and its
weight is not in L2 (every other layer's weights went through L2 since its last read). triton's
do_bench times each call from the host with events around it: a kernel shorter than the op's Python
and launches reads as their cost, the same for every tile of every size. graph_ms instead captures the
op once per copy of its weights in one CUDA graph, so that between two reads of one copy at least
EVICT_BYTES of the other copies pass through L2, replays the graph, and divides a replay by the copies.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import torch

EVICT_BYTES = 128 * 2**20  # above 2x the 50 MB L2 of an H100 or H200
EXTRA_BYTES_CAP = 1536 * 2**20  # the most the copies beyond the original may allocate, per weight set
WARMUP = 3  # replays queued ahead of the timed ones
REPLAYS = 10

Weights = tuple[torch.Tensor, ...]


def tensor_bytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def weight_copies(nbytes: int, evict: int = EVICT_BYTES, cap: int = EXTRA_BYTES_CAP) -> int:
    """How many copies of an nbytes weight set to call in turn: the original and enough others to hold
    `evict` bytes, fewer where the others would pass `cap`. A set larger than `cap` runs alone: it is
    far beyond L2 by itself, and the 1 + 1 copies the evict rule asks for would pass the cap."""
    assert nbytes > 0
    return 1 + min(-(-evict // nbytes), cap // nbytes)


def weight_sets(weights: Weights) -> list[Weights]:
    """weights itself, then weight_copies - 1 clones of the set (each tensor cloned, same device)."""
    copies = weight_copies(tensor_bytes(weights))
    return [weights] + [tuple(t.clone() for t in weights) for _ in range(copies - 1)]


def per_call_ms(replay_ms: Sequence[float], calls: int) -> float:
    """Median replay time over the calls a replay makes: ms per call."""
    assert calls > 0 and replay_ms
    return statistics.median(replay_ms) / calls


def graph_ms(op: Callable[..., object], sets: Sequence[Weights]) -> float:
    """Median device ms of one op(*weights) call, each call on the next set of `sets` (weight_sets).

    The graph is replayed once and synchronized (its upload), then WARMUP replays are queued ahead of
    the REPLAYS timed ones with no host wait between: the GPU is busy when each timed replay's start
    event runs, so the events see device time, not the host launching the graph. Outputs are dropped
    inside the capture, so the graph's pool reuses one output's memory."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for weights in sets:
            op(*weights)
    graph.replay()
    torch.cuda.synchronize()
    marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(REPLAYS)]
    for _ in range(WARMUP):
        graph.replay()
    for start, end in marks:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return per_call_ms([start.elapsed_time(end) for start, end in marks], len(sets))
