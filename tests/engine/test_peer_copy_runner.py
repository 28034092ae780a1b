"""The decode rank's PeerCopy op (ModelRunner._peer_copy) on CPU tensors, with CUDA events faked.

The op runs only on CUDA in service (the peer's pools come through CUDA IPC);
here its validation, its choice between runs and copy_blocks, the copied bytes
and the log line tools/bench_pd.py parses are checked with CPU pools.
"""

import logging
import types

import pytest
import torch

from hkv.cache.types import PeerCopy
from hkv.engine import model_runner
from hkv.engine.model_runner import ModelRunner, _log_peer_copies
from tools.bench_pd import COPY_LINE



class _Event:
    clock = 0.0

    def __init__(self, enable_timing=False):
        self.at = None

    def record(self):
        _Event.clock += 0.25
        self.at = _Event.clock

    def elapsed_time(self, other):
        return other.at - self.at


def _runner(monkeypatch, pages=40, slots=4):
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    gen = torch.Generator().manual_seed(0)
    peer = {"kv": torch.randn(4, pages, 2, 2, 4, generator=gen).to(torch.bfloat16),
            "conv": torch.randn(2, slots, 3, 5, generator=gen), "recurrent": torch.randn(2, slots, 2, 4, 4, generator=gen)}
    own_kv = torch.zeros(4, pages, 2, 2, 4, dtype=torch.bfloat16)
    runner = ModelRunner.__new__(ModelRunner)
    runner.peer_pools = types.SimpleNamespace(get=lambda doc: peer)
    runner.kv = types.SimpleNamespace(layers_view=lambda: own_kv, num_pages=pages)
    runner.state = types.SimpleNamespace(conv=torch.zeros(2, slots, 3, 5), recurrent=torch.zeros(2, slots, 2, 4, 4),
                                         num_slots=slots)
    runner.device = torch.device("cpu")
    runner._peer_timings = []
    return runner, peer, own_kv


@pytest.mark.parametrize("src,dst,how", [(list(range(5, 25)), list(range(10, 30)), "1 run"),
                                         ([3, 1, 7, 9, 11, 13, 15, 17, 19, 21], list(range(10)), "copy_blocks")])
def test_peer_copy_moves_the_pages_and_the_checkpoint(monkeypatch, caplog, src, dst, how):
    runner, peer, own_kv = _runner(monkeypatch)
    runner._peer_copy(PeerCopy("doc", src, dst, 2, 1))
    assert torch.equal(own_kv[:, dst].view(torch.int16), peer["kv"][:, src].view(torch.int16))
    untouched = [p for p in range(own_kv.shape[1]) if p not in dst]
    assert not own_kv[:, untouched].any()
    assert torch.equal(runner.state.conv[:, 1], peer["conv"][:, 2])
    assert torch.equal(runner.state.recurrent[:, 1], peer["recurrent"][:, 2])
    assert not runner.state.recurrent[:, [0, 2, 3]].any()
    with caplog.at_level(logging.INFO, logger=model_runner.log.name):
        _log_peer_copies(runner._peer_timings)
    (found,) = COPY_LINE.findall(caplog.text)
    assert int(found[0]) == len(src) and found[3].startswith(how) and "launched in" in found[3]


def test_a_peer_copy_outside_the_pools_copies_nothing(monkeypatch):
    runner, peer, own_kv = _runner(monkeypatch)
    for op in (PeerCopy("doc", [1, 40], [0, 1], 2, 1), PeerCopy("doc", [1], [-1], 2, 1),
               PeerCopy("doc", [1], [2], 4, 1)):
        with pytest.raises(IndexError):
            runner._peer_copy(op)
    with pytest.raises(ValueError):
        runner._peer_copy(PeerCopy("doc", [1, 2], [3], 2, 1))
    assert not own_kv.any() and not runner.state.recurrent.any() and runner._peer_timings == []
