"""The decode rank's PeerCopy op (ModelRunner._peer_copy) on CPU tensors, with CUDA events faked.

The op runs only on CUDA in service (the peer's pools come through CUDA IPC);
here its validation, its choice between runs, copy_blocks and a captured graph
(PeerCopyGraphs, whose copies run eagerly off CUDA), the copied bytes and the
log line tools/bench/bench_pd.py parses are checked with CPU pools.
"""

import logging
import types

import pytest
import torch

from hkv.cache.types import PeerCopy
from hkv.engine import model_runner
from hkv.engine.model_runner import ModelRunner, _log_peer_copies
from hkv.engine.peer_copy_graphs import PeerCopyGraphs
from tools.bench.bench_pd import COPY_LINE



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
    runner.peer_graphs = None
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


@pytest.mark.parametrize("src,dst", [(list(range(5, 25)), list(range(10, 30))), ([3], [0]),
                                     ([3, 1, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31, 33, 35], list(range(17)))])
def test_peer_copy_graphs_move_what_the_eager_copy_moves(monkeypatch, caplog, src, dst):
    """PeerCopyGraphs on CPU runs its bucket's copies eagerly from the same padded arena: the pages land
    where the eager copy puts them, nothing else changes, and the log names the bucket."""
    runner, peer, own_kv = _runner(monkeypatch)
    eager, _, eager_kv = _runner(monkeypatch)
    runner.peer_graphs = PeerCopyGraphs(own_kv, runner.state.conv, runner.state.recurrent, max_pages=40)
    assert runner.peer_graphs.sizes == [16, 24, 32, 48]
    for r in (runner, eager):
        r._peer_copy(PeerCopy("doc", src, dst, 2, 1))
    assert torch.equal(own_kv.view(torch.int16), eager_kv.view(torch.int16))
    assert torch.equal(own_kv[:, dst].view(torch.int16), peer["kv"][:, src].view(torch.int16))
    for name in ("conv", "recurrent"):
        assert torch.equal(getattr(runner.state, name), getattr(eager.state, name))
    assert torch.equal(runner.state.recurrent[:, 1], peer["recurrent"][:, 2])
    bucket = 16 if len(src) <= 16 else 24
    with caplog.at_level(logging.INFO, logger=model_runner.log.name):
        _log_peer_copies(runner._peer_timings)
    (found,) = COPY_LINE.findall(caplog.text)
    assert int(found[0]) == len(src) and found[3].startswith(f"graph of {bucket} pages")


def test_peer_copy_graphs_fall_back_past_the_largest_bucket_and_on_a_failed_capture(monkeypatch, caplog):
    from hkv.engine import peer_copy_graphs
    runner, peer, own_kv = _runner(monkeypatch)
    graphs = PeerCopyGraphs(own_kv, runner.state.conv, runner.state.recurrent, max_pages=16)
    runner.peer_graphs = graphs
    assert graphs.bucket(16) == 16 and graphs.bucket(17) is None and graphs.bucket(0) is None
    runner._peer_copy(PeerCopy("doc", list(range(20)), list(range(20, 40)), 2, 1))  # 20 pages: past 16, eager
    assert torch.equal(own_kv[:, 20:40].view(torch.int16), peer["kv"][:, :20].view(torch.int16))
    assert runner._peer_timings[-1][4] == "1 run"

    def broken(self, peer, b):
        raise RuntimeError("capture refused")

    monkeypatch.setattr(peer_copy_graphs.PeerCopyGraphs, "_capture", broken)
    with caplog.at_level(logging.WARNING, logger=peer_copy_graphs.log.name):
        runner._peer_copy(PeerCopy("other doc", [1, 2], [0, 1], 2, 3))
        runner._peer_copy(PeerCopy("other doc", [3], [2], 2, 3))
    assert caplog.text.count("peer copy graphs not captured") == 1  # once per peer, then eager
    assert [t[4] for t in runner._peer_timings[-2:]] == ["1 run", "1 run"]
    assert torch.equal(own_kv[:, 0:3].view(torch.int16), peer["kv"][:, 1:4].view(torch.int16))
    assert torch.equal(runner.state.conv[:, 3], peer["conv"][:, 2])


def test_peer_copy_graphs_hold_at_most_max_peers(monkeypatch):
    from hkv.storage.ipc_pools import MAX_PEERS

    runner, peer, own_kv = _runner(monkeypatch)
    graphs = PeerCopyGraphs(own_kv, runner.state.conv, runner.state.recurrent, max_pages=16)
    for i in range(MAX_PEERS + 3):
        assert graphs.prepare(f"doc {i}", peer, [i], [i], 0, 0) is not None
    assert list(graphs._peers) == [f"doc {i}" for i in range(3, MAX_PEERS + 3)]


@pytest.mark.parametrize("graph_max_bs", [0, 4])
def test_a_decode_rank_captures_peer_copies_only_with_cuda_graphs_on(monkeypatch, graph_max_bs):
    """rank._share_pools: a decode rank maps peers' pools; its transfers get graphs unless --no-cuda-graph
    (cuda_graph_max_bs 0), with buckets up to the pages a sequence can hold."""
    from hkv.actors import rank

    runner, _, own_kv = _runner(monkeypatch)
    runner.pages = types.SimpleNamespace(max_pages=20)
    cfg = types.SimpleNamespace(server=types.SimpleNamespace(mode="decode"),
                                model=types.SimpleNamespace(cuda_graph_max_bs=graph_max_bs))
    rank._share_pools(cfg, runner)
    assert runner.peer_pools is not None
    if graph_max_bs:
        assert runner.peer_graphs.sizes == [16, 24] and runner.peer_graphs.kv is own_kv
    else:
        assert runner.peer_graphs is None


def test_peer_copy_graphs_of_a_dense_model_copy_pages_only(monkeypatch):
    runner, peer, own_kv = _runner(monkeypatch)
    del peer["conv"], peer["recurrent"]
    runner.state = None
    runner.peer_graphs = PeerCopyGraphs(own_kv, None, None, max_pages=40)
    runner._peer_copy(PeerCopy("doc", [4, 9, 2], [0, 1, 39], None, None))
    assert torch.equal(own_kv[:, [0, 1, 39]].view(torch.int16), peer["kv"][:, [4, 9, 2]].view(torch.int16))
    assert not own_kv[:, 2:39].any()
    arena = runner.peer_graphs.arenas[16]
    assert arena[:, 16].tolist() == [-1, -1] and arena[0, 3:].eq(-1).all()  # no slot, padding skipped
    assert runner._peer_timings[-1][4] == "graph of 16 pages"


def test_with_graphs_on_a_bad_peer_copy_is_refused_before_any_capture_or_upload(monkeypatch):
    runner, peer, own_kv = _runner(monkeypatch)
    runner.peer_graphs = PeerCopyGraphs(own_kv, runner.state.conv, runner.state.recurrent, max_pages=40)
    for op in (PeerCopy("doc", [1, 40], [0, 1], 2, 1), PeerCopy("doc", [1], [-1], 2, 1), PeerCopy("doc", [1], [2], 4, 1)):
        with pytest.raises(IndexError):
            runner._peer_copy(op)
    with pytest.raises(ValueError):
        runner._peer_copy(PeerCopy("doc", [1, 2], [3], 2, 1))
    assert not runner.peer_graphs._peers and all(a.eq(-1).all() for a in runner.peer_graphs.arenas.values())
    assert not own_kv.any() and runner._peer_timings == []


def test_peer_copy_graphs_let_go_of_peers_whose_mapping_is_gone_and_warm_up_copies_nothing(monkeypatch):
    runner, peer, own_kv = _runner(monkeypatch)
    live = ["old", "new"]
    graphs = PeerCopyGraphs(own_kv, runner.state.conv, runner.state.recurrent, max_pages=40, live=lambda: live)
    graphs.warm_up()
    assert not own_kv.any() and not runner.state.recurrent.any()
    graphs.prepare("old", peer, [1], [1], 0, 0)
    live.remove("old")  # PeerPools evicted it (or the peer restarted with a new document)
    graphs.prepare("new", peer, [2], [2], 0, 0)
    assert list(graphs._peers) == ["new"]
