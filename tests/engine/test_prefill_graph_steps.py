"""Steps of several prefill chunks (beside decode rows or not), long chunks and chunks with in-chunk
checkpoints replayed part by part from the prefill graphs (eagerly on CPU, through the same arena,
staging field and checkpoint copies) compute what the plain CPU path computes, and run eagerly when
the cost model says so."""

from __future__ import annotations

import pytest
import torch

from hkv.engine.prefill_graphs import ChunkParts, PrefillGraphs, long_parts, split_chunk
from hkv.ipc.messages import STEP_EAGER, STEP_MIXED_GRAPHS, STEP_SHORT_PREFILL_GRAPHS, Chunk
from tests.engine.test_model_runner import SLOTS, _model
from tests.engine.test_prefill_graphs import _cuda_runner
from tests.engine.test_prefill_graphs import _pair as graph_pair


def test_pieces_cut_at_checkpoints_and_long_pieces_use_the_largest_bucket():
    assert long_parts(1) == [1] and long_parts(100) == [64, 32, 4]
    assert long_parts(1300) == [512, 512, 256, 16, 4] and long_parts(1024) == [512, 512]
    assert long_parts(20, largest=8) == [8, 8, 4]
    assert split_chunk(70, []) == ChunkParts([64, 4, 2], {})
    assert split_chunk(200, [(64, 3), (128, 4)]) == ChunkParts([64, 64, 64, 8], {0: 3, 1: 4})
    assert split_chunk(140, [(128, 5)], largest=32) == ChunkParts([32, 32, 32, 32, 8, 4], {3: 5})
    for n in range(1, 700):
        plan = split_chunk(n, [(64, 1)] if n > 64 else [])
        assert sum(plan.parts) == n and all(p & (p - 1) == 0 and p <= 512 for p in plan.parts)
        if n > 64:
            assert sum(plan.parts[: min(plan.saves) + 1]) == 64


def _pair(model, largest: int | None = None, max_pages: int = 80):
    """A plain CPU runner and a device-path one whose prefill graphs replay steps of several chunks."""
    pair = graph_pair(model, pages=160, max_pages=max_pages, largest=largest)
    graphs = pair[1][0].prefill_graphs  # what capture measures on CUDA: every replay cheap against the eager floor
    graphs.costs = dict.fromkeys(graphs.sizes, 1e-3)
    graphs.budget_s = 1.0
    return pair


def _same(results, tol: float = 1e-4):
    assert results[0].error is None and results[1].error is None, results
    want, got = results[0].sampled, results[1].sampled
    assert [(s.slot, s.token_id) for s in got] == [(s.slot, s.token_id) for s in want]
    for a, b in zip(got, want):
        assert abs(a.logprob - b.logprob) < tol
        assert [t.token_id for t in a.top_logprobs] == [t.token_id for t in b.top_logprobs]


def _record(monkeypatch) -> list:
    calls = []
    original = PrefillGraphs.replay_chunks
    monkeypatch.setattr(PrefillGraphs, "replay_chunks", lambda self, inputs, plans, *a: calls.append(
        [p.parts for p in plans]) or original(self, inputs, plans, *a))
    return calls


def _prompt(n: int, k: int) -> list[int]:
    return [(k * i + 5) % 96 for i in range(n)]


@pytest.mark.parametrize("kind", ["hybrid", "dense"])
def test_several_chunks_replay_their_parts_and_match_the_cpu_path(kind, monkeypatch):
    calls = _record(monkeypatch)
    model = _model(kind)
    pair = _pair(model)
    (plain, _), (fast, _) = pair
    # two fresh prompts whose parts share the 4-token bucket: the second's part is staged
    steps = [([(0, _prompt(20, 7)), (2, _prompt(13, 3))], [0, 2], [[16, 4], [8, 4, 1]], STEP_SHORT_PREFILL_GRAPHS),
             # decode rows around two new prompts: logits back in plan order, 8 staged
             ([(0, [11]), (4, _prompt(9, 5)), (2, [12]), (1, _prompt(24, 11))], [4, 1], [[8, 1], [16, 8]],
              STEP_MIXED_GRAPHS),
             ([(0, [13]), (1, [14]), (2, [15]), (4, [16])], [], None, None),  # decode: the decode graphs
             # three turns after their cached tokens, one chunk twice the largest bucket's size
             ([(4, _prompt(300, 13)), (2, _prompt(6, 17)), (1, _prompt(6, 19))], [],
              [[256, 32, 8, 4], [4, 2], [4, 2]], STEP_SHORT_PREFILL_GRAPHS)]
    for work, new, parts, ran in steps:
        before = len(calls)
        results = [r.execute(d.plan(work, new)) for r, d in pair]
        _same(results)
        assert calls[before:] == ([parts] if parts else [])
        if ran is not None:
            assert (results[0].graph, results[1].graph) == (STEP_EAGER, ran)
    if kind == "hybrid":  # the live states agree (parts change only the float rounding)
        assert torch.allclose(fast.state.recurrent[:, :SLOTS], plain.state.recurrent, atol=1e-4)
        assert torch.allclose(fast.state.conv[:, :SLOTS], plain.state.conv, atol=1e-5)
    for slot in (0, 1, 2, 4):
        pages = pair[0][1].pages[slot]
        assert pages == pair[1][1].pages[slot]
        assert torch.allclose(fast.kv.k[:, pages], plain.kv.k[:, pages], atol=1e-4)
        assert torch.allclose(fast.kv.v[:, pages], plain.kv.v[:, pages], atol=1e-4)


def test_in_chunk_checkpoints_are_the_live_state_between_parts(monkeypatch):
    """A chunk's in-chunk checkpoints land in their slots as the plain path's forward leaves them there
    (the piece before each is replayed, then the live state copied); a chunk that does not sample
    returns no row and the sampling ones keep their order."""
    calls = _record(monkeypatch)
    model = _model("hybrid")
    pair = _pair(model, largest=32)
    for runner, _ in pair:
        runner.state.conv[:, 3] = float("nan")
        runner.state.recurrent[:, 5] = float("nan")
    work = [(0, _prompt(140, 7)), (2, _prompt(10, 3))]
    results = [r.execute(d.plan(work, [0, 2], checkpoints={0: [[64, 3], [128, 5]]})) for r, d in pair]
    _same(results)
    assert calls == [[[32, 32, 32, 32, 8, 4], [8, 2]]] and results[1].graph == STEP_SHORT_PREFILL_GRAPHS
    (plain, _), (fast, _) = pair
    for slot in (0, 2, 3, 5):
        assert not torch.isnan(fast.state.recurrent[:, slot]).any()
        assert torch.allclose(fast.state.recurrent[:, slot], plain.state.recurrent[:, slot], atol=1e-4), slot
        assert torch.allclose(fast.state.conv[:, slot], plain.state.conv[:, slot], atol=1e-5), slot
    results = []
    for runner, driver in pair:  # the middle chunk of a long prompt, between two sampling chunks
        plan = driver.plan([(2, [9]), (0, _prompt(40, 5)), (4, _prompt(7, 3))], [4])
        plan.chunks[1] = Chunk(0, plan.chunks[1].token_ids, plan.chunks[1].start_pos, False)
        results.append(runner.execute(plan))
    _same(results)
    assert [s.slot for s in results[1].sampled] == [2, 4] and results[1].graph == STEP_MIXED_GRAPHS
    assert calls[-1] == [[32, 8], [4, 2, 1]]


def test_the_cost_model_and_its_limits_keep_steps_eager(monkeypatch):
    calls = _record(monkeypatch)
    model = _model("hybrid")
    pair = _pair(model)
    fast = pair[1][0]
    graphs = fast.prefill_graphs
    work = [(0, _prompt(20, 7)), (2, _prompt(13, 3))]
    graphs.budget_s = 7e-3  # the two chunks' five replays cost 5 ms, 6.75 with the margin: below
    chunks = pair[1][1].plan(work, [0, 2]).chunks  # (a plan not run)
    assert [p.parts for p in graphs.plan_chunks(chunks)] == [[16, 4], [8, 4, 1]]
    graphs.budget_s = 6e-3  # the margin puts them above the eager step's floor: eager
    assert graphs.plan_chunks(chunks) is None
    graphs.budget_s = 1.0
    graphs.costs.pop(8)  # a bucket never measured is never chosen
    assert graphs.plan_chunks(chunks) is None
    graphs.costs[8] = 1e-3
    assert graphs.plan_chunks([chunks[0], Chunk(2, [3, 4], 13, True, follows=True)]) is None  # a fed-in token
    for bad in ([[5, 3]], [[20, 3]], [[0, 3]], [[64, 3], [64, 4]]):  # off the GDN chunk, not inside, twice
        assert graphs.plan_chunks([Chunk(4, list(range(70)), 0, True, bad)]) is None
    assert graphs.plan_chunks([Chunk(4, list(range(70)), 0, True, [[64, 3]])]) == [ChunkParts([64, 4, 2], {0: 3})]
    assert graphs.plan_chunks(chunks * 33) is None  # more chunks than the sampling rows' field holds
    graphs.stage_room = graphs.blocks[4][1] - 1  # the repeated 4-token part does not fit the staging field
    assert graphs.plan_chunks(chunks) is None
    graphs.stage_room = graphs.blocks[4][1]
    assert graphs.plan_chunks(chunks) is not None
    fresh = _pair(model)
    fresh[1][0].prefill_graphs.budget_s = 0.0  # nothing measured (CPU): eager
    results = [r.execute(d.plan(work, [0, 2])) for r, d in fresh]
    _same(results)
    assert results[1].graph == STEP_EAGER and calls == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_steps_of_several_chunks_equal_the_eager_steps(dtype, monkeypatch):
    """On the GPU: captured prefill graphs replayed part by part for steps of several prompts, beside
    decode rows, with in-chunk checkpoints and a chunk above the largest bucket, give the eager forward's
    tokens and log-probabilities and checkpoint states; capture measured the cost model."""
    from hkv.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForCausalLM
    from tests.e2e.test_cuda_launch import HYBRID
    from tests.models.test_qwen3_5 import perturb

    torch.manual_seed(5)
    model = Qwen3_5ForCausalLM(Qwen3_5Config.from_hf({**HYBRID, "model_type": "qwen3_5_text"}))
    perturb(model, 5)
    model = model.to("cuda", getattr(torch, dtype)).eval()
    model.prepare_for_device()
    calls = _record(monkeypatch)
    pair = [_cuda_runner(model, dtype, with_graphs, pages=200, max_tokens=512) for with_graphs in (True, False)]
    (fast, fast_driver), (eager, eager_driver) = pair
    graphs = fast.prefill_graphs
    assert sorted(graphs.costs) == graphs.sizes and all(c > 0 for c in graphs.costs.values()) and graphs.budget_s > 0
    graphs.budget_s = 1.0  # this test checks the replays, not the host's launch speed
    plans = [([(0, _prompt(140, 7)), (2, _prompt(30, 3))], [0, 2], {0: [[64, 3], [128, 5]]}),
             ([(0, [7]), (4, _prompt(9, 5)), (2, [8]), (1, _prompt(13, 11))], [4, 1], None),
             ([(4, _prompt(graphs.largest + 37, 13)), (1, _prompt(6, 17))], [], None)]
    tol = 1e-3 if dtype == "float32" else 0.05
    for (work, new, checkpoints), how in zip(plans, (STEP_SHORT_PREFILL_GRAPHS, STEP_MIXED_GRAPHS,
                                                     STEP_SHORT_PREFILL_GRAPHS), strict=True):
        got, want = (r.execute(d.plan(work, new, checkpoints)) for r, d in ((fast, fast_driver), (eager, eager_driver)))
        assert got.error is None and want.error is None, (got.error, want.error)
        assert (got.graph, want.graph) == (how, STEP_EAGER)
        for a, b in zip(got.sampled, want.sampled, strict=True):
            assert a.slot == b.slot
            if a.token_id == b.token_id:
                assert abs(a.logprob - b.logprob) < tol
            else:  # bf16 rounding of another split may pick another near-tie, never a clearly worse token
                near = {t.token_id: t.logprob for t in b.top_logprobs}
                assert dtype != "float32" and a.token_id in near and b.logprob - near[a.token_id] < tol
    assert len(calls) == 3 and calls[0][0][-2:] == [8, 4]
    state_tol = 1e-3 if dtype == "float32" else 0.1
    for slot in (3, 5):  # the checkpoints: the live state between parts, as the eager in-chunk ones
        for pool in ("conv", "recurrent"):
            a, b = getattr(fast.state, pool)[:, slot].float(), getattr(eager.state, pool)[:, slot].float()
            assert torch.allclose(a, b, atol=state_tol, rtol=state_tol), (slot, pool)
