"""Steps of several prefill chunks (beside decode rows or not), long chunks and chunks with in-chunk
checkpoints replayed in rounds of parts from the prefill graphs (eagerly on CPU, through the same
arena, staging field, padding rows and checkpoint fields) compute what the plain CPU path computes,
and run eagerly when the cost model says so."""

from __future__ import annotations

import pytest
import torch

from hkv.engine.prefill_graphs import (
    ChunkParts, PrefillGraphs, checkpoint_room, long_parts, place_chunk, rounds_of, split_chunk,
)  # fmt: skip
from hkv.ipc.messages import STEP_EAGER, STEP_MIXED_GRAPHS, STEP_SHORT_PREFILL_GRAPHS, Chunk
from tests.engine.test_model_runner import SLOTS, _model
from tests.engine.test_prefill_graphs import _cuda_runner
from tests.engine.test_prefill_graphs import _pair as graph_pair


def test_pieces_cut_at_checkpoints_and_long_pieces_use_the_largest_bucket():
    assert long_parts(1) == [1] and long_parts(100) == [64, 32, 4]
    assert long_parts(1300, 512) == [512, 512, 256, 16, 4] and long_parts(1024, 512) == [512, 512]
    assert long_parts(1300) == [1024, 256, 16, 4] and long_parts(4200) == [2048, 2048, 64, 32, 8]
    assert long_parts(20, largest=8) == [8, 8, 4]
    assert split_chunk(70, []) == ChunkParts([64, 4, 2], {})
    assert split_chunk(200, [(64, 3), (128, 4)]) == ChunkParts([64, 64, 64, 8], {0: 3, 1: 4})
    assert split_chunk(140, [(128, 5)], largest=32) == ChunkParts([32, 32, 32, 32, 8, 4], {3: 5})
    for n in range(1, 700):
        plan = split_chunk(n, [(64, 1)] if n > 64 else [])
        assert sum(plan.parts) == n and all(p & (p - 1) == 0 and p <= 2048 for p in plan.parts)
        if n > 64:
            assert sum(plan.parts[: min(plan.saves) + 1]) == 64


def test_checkpoints_stay_inside_the_parts_they_fit():
    assert [checkpoint_room(t) for t in (64, 128, 256, 512, 2048)] == [0, 1, 1, 2, 8]
    assert checkpoint_room(256, every=64) == 3 and checkpoint_room(2048, every=4096) == 1
    # the wave's first prompt: 2,176 tokens, a checkpoint every 256: one 2,048-token part keeps seven, the
    # eighth is its end (the live state, saved after it)
    marks = [(256 * k, 10 + k) for k in range(1, 9)]
    assert place_chunk(2176, marks) == ChunkParts([2048, 128], {0: 18}, {0: [(256 * k, 10 + k) for k in range(1, 8)]})
    # after a hit at 1,088: interval boundaries 64 tokens off the parts' starts
    assert place_chunk(1100, [(192, 1), (448, 2), (960, 3)]) == ChunkParts([1024, 64, 8, 4], {}, {
        0: [(192, 1), (448, 2), (960, 3)]})
    # more than a part has room for: cut at every checkpoint (split_chunk)
    assert place_chunk(300, [(64, 1), (192, 2)]) == split_chunk(300, [(64, 1), (192, 2)])
    assert place_chunk(300, [(64, 1), (192, 2)], every=64).inside == {0: [(64, 1), (192, 2)]}
    assert place_chunk(200, [(64, 1), (128, 2)]) == ChunkParts([128, 64, 8], {0: 2}, {0: [(64, 1)]})


def test_rounds_take_every_chunk_whose_next_part_is_the_longest():
    plans = [ChunkParts([2048, 128], {0: 9}, {0: [(256, 8)]})] + [ChunkParts([128])] * 3 + [ChunkParts([64, 4])]
    rounds = rounds_of(plans, {2048: 1, 128: 16, 64: 32, 4: 32})
    assert [(r.bucket, [p.chunk for p in r.pieces]) for r in rounds] == [
        ((1, 2048), [0]), ((4, 128), [0, 1, 2, 3]), ((1, 64), [4]), ((1, 4), [4])]
    first, second = rounds[0].pieces[0], rounds[1].pieces[0]
    assert (first.start, first.inside, first.save, first.last) == (0, ((256, 8),), 9, False)
    assert (second.start, second.inside, second.save, second.last) == (2048, (), None, True)
    wide = rounds_of([ChunkParts([128])] * 40, {128: 16})  # wider than the widest bucket: 16 + 16 + 8
    assert [(r.bucket, len(r.pieces)) for r in wide] == [((16, 128), 16), ((16, 128), 16), ((8, 128), 8)]
    assert [r.bucket for r in rounds_of([ChunkParts([8, 8, 4]), ChunkParts([2])], {8: 1, 4: 1, 2: 1})] == [
        (1, 8), (1, 8), (1, 4), (1, 2)]  # a bucket twice: its second round is staged


def _pair(model, largest: int | None = None, max_pages: int = 80, every: int | None = None):
    """A plain CPU runner and a device-path one whose prefill graphs replay steps of several chunks."""
    pair = graph_pair(model, pages=160, max_pages=max_pages, largest=largest, every=every)
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


def _record(monkeypatch, rounds: list | None = None) -> list:
    """The parts of every step replay_chunks runs (one list a chunk); `rounds` gets their rounds' buckets."""
    calls = []
    original = PrefillGraphs.replay_chunks

    def spy(self, inputs, plan, *a):
        calls.append(plan.parts)
        if rounds is not None:
            rounds.append([r.bucket for r in plan.rounds])
        return original(self, inputs, plan, *a)

    monkeypatch.setattr(PrefillGraphs, "replay_chunks", spy)
    return calls


def _prompt(n: int, k: int) -> list[int]:
    return [(k * i + 5) % 96 for i in range(n)]


@pytest.mark.parametrize("kind", ["hybrid", "dense"])
def test_several_chunks_replay_their_parts_and_match_the_cpu_path(kind, monkeypatch):
    rounds = []
    calls = _record(monkeypatch, rounds)
    model = _model(kind)
    pair = _pair(model)
    (plain, _), (fast, _) = pair
    # two fresh prompts whose parts share the 4-token bucket: one round of two sequences runs both
    steps = [([(0, _prompt(20, 7)), (2, _prompt(13, 3))], [0, 2], [[16, 4], [8, 4, 1]], STEP_SHORT_PREFILL_GRAPHS),
             # decode rows around two new prompts: logits back in plan order
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
    # rounds: the longest next part first, every chunk whose next part it is together (padded to a power of two)
    assert rounds == [[(1, 16), (1, 8), (2, 4), (1, 1)], [(1, 16), (2, 8), (1, 1)],
                      [(1, 256), (1, 32), (1, 8), (4, 4), (2, 2)]]
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


def test_checkpoints_inside_parts_are_kept_by_the_forward_of_one_or_several_sequences(monkeypatch):
    """Checkpoints inside a part (a round of two sequences with one each; a part with three) land in their
    slots as the plain path's in-chunk checkpoints do; more than a part has room for cut the chunk there."""
    rounds = []
    calls = _record(monkeypatch, rounds)
    model = _model("hybrid")
    pair = _pair(model)
    for runner, _ in pair:
        runner.state.conv[:, (1, 3, 5)] = float("nan")
        runner.state.recurrent[:, (1, 3, 5)] = float("nan")
    work = [(0, _prompt(140, 7)), (2, _prompt(140, 3))]
    results = [r.execute(d.plan(work, [0, 2], checkpoints={0: [[64, 3]], 2: [[64, 5]]})) for r, d in pair]
    _same(results)
    assert calls == [[[128, 8, 4], [128, 8, 4]]] and rounds == [[(2, 128), (2, 8), (2, 4)]]
    work = [(4, _prompt(300, 5))]  # room for one in a 256-token part (interval 256): cut at both
    results = [r.execute(d.plan(work, [4], checkpoints={4: [[64, 1], [192, 3]]})) for r, d in pair]
    _same(results)
    assert calls[-1] == [[64, 128, 64, 32, 8, 4]]
    (plain, _), (fast, _) = pair
    for slot in (0, 1, 2, 3, 4, 5):
        assert not torch.isnan(fast.state.recurrent[:, slot]).any()
        assert torch.allclose(fast.state.recurrent[:, slot], plain.state.recurrent[:, slot], atol=1e-4), slot
        assert torch.allclose(fast.state.conv[:, slot], plain.state.conv[:, slot], atol=1e-5), slot
    dense = _pair(model, every=64)  # an interval of 64: three inside one 256-token part
    for runner, _ in dense:
        runner.state.recurrent[:, (1, 3, 5)] = float("nan")
    results = [r.execute(d.plan([(0, _prompt(300, 9))], [0], checkpoints={0: [[64, 1], [128, 3], [192, 5]]}))
               for r, d in dense]
    _same(results)
    assert calls[-1] == [[256, 32, 8, 4]] and rounds[-1] == [(1, 256), (1, 32), (1, 8), (1, 4)]
    for slot in (0, 1, 3, 5):
        a, b = dense[1][0].state.recurrent[:, slot], dense[0][0].state.recurrent[:, slot]
        assert not torch.isnan(a).any() and torch.allclose(a, b, atol=1e-4), slot


def test_the_cost_model_and_its_limits_keep_steps_eager(monkeypatch):
    calls = _record(monkeypatch)
    model = _model("hybrid")
    pair = _pair(model)
    fast = pair[1][0]
    graphs = fast.prefill_graphs
    work = [(0, _prompt(20, 7)), (2, _prompt(13, 3))]
    graphs.budget_s = 5e-3  # the two chunks' four rounds cost 4 ms, 4.8 with the margin: below
    chunks = pair[1][1].plan(work, [0, 2]).chunks  # (a plan not run)
    assert graphs.plan_chunks(chunks).parts == [[16, 4], [8, 4, 1]]
    graphs.budget_s = 4.5e-3  # the margin puts them above the eager step's floor: eager
    assert graphs.plan_chunks(chunks) is None
    # every sequence after the first adds seq_s to the eager step: 1 ms puts the two chunks' at 5.5 ms
    graphs.seq_s = 1e-3
    assert graphs.eager_estimate_s(chunks) == pytest.approx(5.5e-3) and graphs.plan_chunks(chunks) is not None
    graphs.seq_s = 0.25e-3  # 4.75 ms: eager again, unless decode rows beside them are the eager step's too
    assert graphs.plan_chunks(chunks) is None
    assert graphs.eager_estimate_s(chunks, rows=3) == pytest.approx(5.5e-3)
    assert graphs.plan_chunks(chunks, rows=3).parts == [[16, 4], [8, 4, 1]]
    # the rounds then pay for the rows' decode graph beside them: 4.8 + 1 ms against 5.5 ms
    assert graphs.plan_chunks(chunks, rows=3, rows_s=1e-3) is None
    assert graphs.plan_chunks(chunks, rows=3, rows_s=0.5e-3) is not None
    graphs.seq_s = 0.0
    # a chunk keeping a checkpoint weighs against the (larger) floor of an eager step that keeps them
    kept = [Chunk(4, list(range(70)), 0, True, [[64, 3]])]  # rounds 64 + 4 + 2: 3 ms, 3.6 with the margin
    graphs.budget_s, graphs.budget_checkpoints_s = 3e-3, 4e-3
    assert graphs.plan_chunks(kept) is not None and graphs.eager_estimate_s(kept) == 4e-3
    graphs.budget_checkpoints_s = 3.5e-3
    assert graphs.plan_chunks(kept) is None and graphs.eager_estimate_s(chunks) == 3e-3
    # a step of many tokens is device-bound eagerly too: its tokens at the best measured cost per token
    wide = max(graphs.sizes, key=lambda bt: bt[0] * bt[1])
    graphs.budget_s = 1e-5
    assert graphs.eager_estimate_s(chunks * 20) == pytest.approx(1e-3 / (wide[0] * wide[1]) * 33 * 20)
    graphs.budget_s = 1.0
    graphs.costs.pop((2, 4))  # a bucket never measured is never chosen
    assert graphs.plan_chunks(chunks) is None
    graphs.costs[(2, 4)] = 1e-3
    assert graphs.plan_chunks([chunks[0], Chunk(2, [3, 4], 13, True, follows=True)]) is None  # a fed-in token
    for bad in ([[5, 3]], [[20, 3]], [[0, 3]], [[64, 3], [64, 4]]):  # off the GDN chunk, not inside, twice
        assert graphs.plan_chunks([Chunk(4, list(range(70)), 0, True, bad)]) is None
    assert graphs.plan_chunks([Chunk(4, list(range(70)), 0, True, [[64, 3]])]).plans == [ChunkParts([64, 4, 2], {0: 3})]
    assert graphs.plan_chunks(chunks * 33) is None  # more chunks than the sampling rows' field holds
    long = [Chunk(4, list(range(600)), 0, True)]  # 256 + 256 + 64 + 16 + 8: the 256-token bucket twice
    graphs.stage_room = graphs.blocks[(1, 256)][1] - 1  # its second round does not fit the staging field
    assert graphs.plan_chunks(long) is None
    graphs.stage_room = graphs.blocks[(1, 256)][1]
    assert graphs.plan_chunks(long).parts == [[256, 256, 64, 16, 8]]
    fresh = _pair(model)
    fresh[1][0].prefill_graphs.budget_s = 0.0  # nothing measured (CPU): eager
    results = [r.execute(d.plan(work, [0, 2])) for r, d in fresh]
    _same(results)
    assert results[1].graph == STEP_EAGER and calls == []
    # through the runner: decode rows beside the chunks weigh in with their decode graph's measured cost
    rows_pair = _pair(model)
    runner = rows_pair[1][0]
    graphs = runner.prefill_graphs
    graphs.budget_s, graphs.seq_s = 4.5e-3, 0.25e-3  # 4.8 ms of rounds against 4.5 + 4 x 0.25 for 5 sequences
    runner.graphs.costs[runner.graphs.bucket(3)] = 1e-3  # 5.8 ms with the rows' graph: eager
    _same([r.execute(d.plan([(1, [3, 4]), (3, [5, 6]), (4, [7, 8])], [1, 3, 4])) for r, d in rows_pair])
    results = [r.execute(d.plan([(1, [7]), (0, _prompt(20, 7)), (3, [9]), (2, _prompt(13, 3)), (4, [11])], [0, 2]))
               for r, d in rows_pair]
    _same(results)
    assert results[1].graph == STEP_EAGER
    runner.graphs.costs[runner.graphs.bucket(3)] = 0.5e-3  # 5.3 ms: the rounds and the rows' graph
    results = [r.execute(d.plan([(1, [8]), (0, _prompt(20, 9)), (3, [10]), (2, _prompt(13, 5)), (4, [12])], []))
               for r, d in rows_pair]
    _same(results)
    assert results[1].graph == STEP_MIXED_GRAPHS


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_steps_of_several_chunks_equal_the_eager_steps(dtype, monkeypatch):
    """On the GPU: captured prefill graphs replayed in rounds for steps of several prompts, beside decode
    rows, with in-chunk checkpoints inside a round of two sequences and on a part's end, and a chunk
    above the largest bucket, give the eager forward's tokens and log-probabilities and checkpoint
    states; capture measured the cost model."""
    from hkv.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForCausalLM
    from tests.e2e.test_cuda_launch import HYBRID
    from tests.models.test_qwen3_5 import perturb

    torch.manual_seed(5)
    model = Qwen3_5ForCausalLM(Qwen3_5Config.from_hf({**HYBRID, "model_type": "qwen3_5_text"}))
    perturb(model, 5)
    model = model.to("cuda", getattr(torch, dtype)).eval()
    model.prepare_for_device()
    rounds = []
    calls = _record(monkeypatch, rounds)
    pair = [_cuda_runner(model, dtype, with_graphs, pages=200, max_tokens=512) for with_graphs in (True, False)]
    (fast, fast_driver), (eager, eager_driver) = pair
    graphs = fast.prefill_graphs
    assert sorted(graphs.costs) == sorted(graphs.sizes) and all(c > 0 for c in graphs.costs.values())
    assert graphs.budget_s > 0
    decode = fast.graphs  # the decode rows' side of a mixed step: every bucket's replay measured too
    assert sorted(decode.costs) == sorted(decode.graphs) and all(c > 0 for c in decode.costs.values())
    graphs.budget_s = 1.0  # this test checks the replays, not the host's launch speed
    plans = [([(0, _prompt(140, 7)), (2, _prompt(140, 3))], [0, 2], {0: [[64, 3], [128, 5]]}),
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
    assert len(calls) == 3 and calls[0] == [[128, 8, 4], [128, 8, 4]] and rounds[0] == [(2, 128), (2, 8), (2, 4)]
    state_tol = 1e-3 if dtype == "float32" else 0.1
    for slot in (3, 5):  # the checkpoints: the live state between parts, as the eager in-chunk ones
        for pool in ("conv", "recurrent"):
            a, b = getattr(fast.state, pool)[:, slot].float(), getattr(eager.state, pool)[:, slot].float()
            assert torch.allclose(a, b, atol=state_tol, rtol=state_tol), (slot, pool)
