"""Short one-sequence prefill chunks through the prefill graphs' arena and parts (replayed eagerly
on CPU, as the decode graphs are in test_model_runner), alone or beside decode rows (a mixed step:
the decode graph, then the chunk's parts), compute what the plain CPU path computes."""

from __future__ import annotations

import pytest
import torch

from hkv.engine.prefill_graphs import PREFILL_GRAPH_TOKENS, PrefillGraphs, bucket_set, buckets, parts_of
from hkv.ipc.messages import STEP_DECODE_GRAPH, STEP_EAGER, STEP_MIXED_GRAPHS, STEP_SHORT_PREFILL_GRAPHS
from hkv.ipc.request_table import RequestTable, TableLayout
from tests.engine.test_model_runner import SLOTS, Driver, _model, _runner


def test_parts_are_the_binary_digits_within_the_buckets():
    assert buckets(8) == [1, 2, 4, 8]
    assert buckets() == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048] and PREFILL_GRAPH_TOKENS == 2048
    # several sequences: powers of two up to 32 of them, 2,048 tokens at most, most tokens first
    assert bucket_set(8, 4, 8) == [(1, 8), (2, 4), (4, 2), (1, 4), (2, 2), (4, 1), (1, 2), (2, 1), (1, 1)]
    wide = bucket_set()
    assert len(wide) == 57 and wide[0] == (1, 2048) and (32, 64) in wide and (2, 1024) in wide
    assert all(b * t <= 2048 and b <= 32 for b, t in wide) and (4, 1024) not in wide and (64, 1) not in wide
    assert parts_of(64) == [64]
    assert parts_of(100) == [64, 32, 4]
    assert parts_of(13) == [8, 4, 1]
    assert parts_of(255) == [128, 64, 32, 16, 8, 4, 2, 1]
    assert parts_of(1) is None and parts_of(0) is None  # decode steps, empty chunks: not here
    assert parts_of(255, largest=128) == [128, 64, 32, 16, 8, 4, 2, 1] and parts_of(256, largest=128) is None
    assert parts_of(1023) == [512, 256, 128, 64, 32, 16, 8, 4, 2, 1] and parts_of(1024) is None  # longer: cost model
    assert parts_of(15, largest=4) is None and parts_of(7, largest=4) == [4, 2, 1]
    for n in range(2, 1024):
        parts = parts_of(n)
        assert sum(parts) == n and parts == sorted(set(parts), reverse=True) and set(parts) <= set(buckets())


def _spy(monkeypatch) -> list:
    """The parts of every step PrefillGraphs.replay_chunks runs (one list a chunk)."""
    calls = []
    original = PrefillGraphs.replay_chunks
    monkeypatch.setattr(PrefillGraphs, "replay_chunks", lambda self, inputs, plan, *a: calls.append(plan.parts)
                        or original(self, inputs, plan, *a))
    return calls


# (work, new sequences, checkpoints, parts replayed, how the step ran): which plans replay which parts
EAGER, DECODE, SHORT, MIXED = STEP_EAGER, STEP_DECODE_GRAPH, STEP_SHORT_PREFILL_GRAPHS, STEP_MIXED_GRAPHS
PLANS = [
    ([(0, list(range(3, 23)))], [0], None, [16, 4], SHORT),  # a fresh 20-token prompt
    ([(0, [11])], [], None, None, DECODE),  # a decode step: the decode graphs
    ([(0, [(5 * i) % 90 + 3 for i in range(13)])], [], None, [8, 4, 1], SHORT),  # a turn after 21 cached tokens
    ([(2, list(range(40, 47))), (0, [9])], [2], None, [4, 2, 1], MIXED),  # a new prompt beside a decode row
    ([(4, [(7 * i) % 96 for i in range(70)])], [4], {4: [[64, 5]]}, None, EAGER),  # in-chunk checkpoint: eager
    # 36 tokens after 70 between two decode rows: its logits go back in plan order
    ([(0, [10]), (4, [(3 * i) % 96 for i in range(36)]), (2, [12])], [], None, [32, 4], MIXED),
    ([(2, [1, 2]), (0, [13]), (4, [5, 6, 7])], [], None, None, EAGER),  # two chunks beside a decode row: eager
    ([(0, [14]), (4, [8, 9]), (2, [15])], [], None, [2], MIXED),
    ([(2, [3, 4])], [], None, [2], SHORT),
]


@pytest.mark.parametrize("kind", ["hybrid", "dense"])
def test_short_chunks_replay_their_parts_and_match_the_cpu_path(kind, monkeypatch):
    replays = _spy(monkeypatch)
    model = _model(kind)
    layout = TableLayout(slots=SLOTS, max_pages=80)
    tables = [RequestTable(layout, memoryview(bytearray(layout.nbytes()))) for _ in range(2)]
    plain, fast = (_runner(model, tables[0], False, pages=64),
                   _runner(model, tables[1], True, max_tokens=256, pages=64))
    fast.capture_graphs()
    # a row of 80 pages of 4 tokens: 320 positions
    assert sorted(t for b, t in fast.prefill_graphs.batches if b == 1) == buckets(256)
    drivers = [Driver(t) for t in tables]
    for d in drivers:
        d.free = list(range(64))[::-1]
    for work, new, checkpoints, parts, ran in PLANS:
        if kind == "dense" and checkpoints:  # dense models keep no linear state: no checkpoint, a graph
            checkpoints, parts, ran = None, [64, 4, 2], SHORT
        before = len(replays)
        results = [runner.execute(d.plan(work, new, checkpoints)) for runner, d in zip((plain, fast), drivers)]
        assert results[0].error is None and results[1].error is None, results
        assert replays[before:] == ([[parts]] if parts else [])
        assert (results[0].graph, results[1].graph) == (EAGER, ran)  # how each step ran, as the router counts it
        want, got = results[0].sampled, results[1].sampled
        assert [s.token_id for s in got] == [s.token_id for s in want]
        for a, b in zip(got, want):
            assert abs(a.logprob - b.logprob) < 1e-4
            assert [t.token_id for t in a.top_logprobs] == [t.token_id for t in b.top_logprobs]
    if kind == "hybrid":  # the live states agree (parts change only the float rounding)
        assert torch.allclose(fast.state.recurrent[:, :SLOTS], plain.state.recurrent, atol=1e-4)
        assert torch.allclose(fast.state.conv[:, :SLOTS], plain.state.conv, atol=1e-5)
    for slot in (0, 2, 4):  # and so do the K/V pages every sequence wrote
        pages = drivers[0].pages[slot]
        assert pages == drivers[1].pages[slot]
        assert torch.allclose(fast.kv.k[:, pages], plain.kv.k[:, pages], atol=1e-4)


def test_a_chunk_with_fed_in_tokens_or_no_graphs_stays_eager():
    model = _model("hybrid")
    layout = TableLayout(slots=SLOTS, max_pages=16)
    runner = _runner(model, RequestTable(layout, memoryview(bytearray(layout.nbytes()))), True)
    graphs = runner.prefill_graphs
    from hkv.ipc.messages import Chunk

    runner.table.write_pages(0, [0, 1])
    chunk = Chunk(0, [1, 2, 3], 0, True)
    assert graphs.plan_chunks([chunk]) is None  # nothing captured yet
    runner.capture_graphs()
    assert graphs.plan_chunks([chunk]).parts == [[2, 1]]  # a lone short chunk replays whatever budget_s says
    assert graphs.budget_s == 0 and graphs.plan_chunks([chunk, chunk]) is None  # others: the cost model's call
    assert graphs.plan_chunks([Chunk(0, [1, 2, 3], 0, True, follows=True)]) is None


def _cuda_runner(model, dtype: str, graphs: bool, pages: int = 64, max_tokens: int = 256):
    layout = TableLayout(slots=SLOTS, max_pages=80)
    table = RequestTable(layout, memoryview(bytearray(layout.nbytes())))
    runner = _runner(model, table, True, max_tokens=max_tokens, pages=pages, device="cuda", dtype=dtype, graphs=graphs)
    runner.capture_graphs()
    driver = Driver(table)
    driver.free = list(range(pages))[::-1]
    return runner, driver


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_replays_equal_the_eager_steps(dtype, monkeypatch):
    """On the GPU: captured short-prefill graphs (fla-core's chunk kernels inside for bf16, the
    recurrent kernel for fp32), alone and beside decode rows' graph, give the eager forward's tokens
    and log-probabilities."""
    from hkv.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForCausalLM
    from tests.e2e.test_cuda_launch import HYBRID
    from tests.models.test_qwen3_5 import perturb

    torch.manual_seed(3)
    model = Qwen3_5ForCausalLM(Qwen3_5Config.from_hf({**HYBRID, "model_type": "qwen3_5_text"}))
    perturb(model, 3)
    model = model.to("cuda", getattr(torch, dtype)).eval()
    model.prepare_for_device()
    replays = _spy(monkeypatch)
    (fast, fast_driver), (eager, eager_driver) = _cuda_runner(model, dtype, True), _cuda_runner(model, dtype, False)
    assert eager.prefill_graphs is None
    largest = fast.prefill_graphs.largest  # below 512: the context a row of 80 pages of 4 tokens reaches
    graphs = fast.prefill_graphs.graphs
    assert sorted(graphs) == sorted(bucket_set(largest, multi_tokens=largest)) and all(graphs.values())
    plans = [([(0, [(11 * i) % 1500 + 3 for i in range(120)])], [0]), ([(0, [7])], []),
             ([(0, [(5 * i) % 1500 + 3 for i in range(13)])], []), ([(0, [9, 10])], []),
             ([(0, [7]), (2, [(3 * i) % 1500 + 3 for i in range(9)])], [2]),  # mixed steps
             ([(2, [4]), (4, [(7 * i) % 1500 + 3 for i in range(20)]), (0, [5])], [4])]
    ran = [STEP_SHORT_PREFILL_GRAPHS, STEP_DECODE_GRAPH] + [STEP_SHORT_PREFILL_GRAPHS] * 2 + [STEP_MIXED_GRAPHS] * 2
    tol = 1e-3 if dtype == "float32" else 0.05
    for (work, new), how in zip(plans, ran, strict=True):
        got, want = (runner.execute(d.plan(work, new)) for runner, d in ((fast, fast_driver), (eager, eager_driver)))
        assert got.error is None and want.error is None, (got.error, want.error)
        assert (got.graph, want.graph) == (how, STEP_EAGER)
        for a, b in zip(got.sampled, want.sampled, strict=True):
            if a.token_id == b.token_id:
                assert abs(a.logprob - b.logprob) < tol
            else:  # bf16 rounding of another split may pick another near-tie, never a clearly worse token
                near = {t.token_id: t.logprob for t in b.top_logprobs}
                assert dtype != "float32" and a.token_id in near and b.logprob - near[a.token_id] < tol
    assert replays == [[[64, 32, 16, 8]], [[8, 4, 1]], [[2]], [[8, 1]], [[16, 4]]]


def _pair(model, pages: int, max_pages: int, largest: int | None = None, every: int | None = None):
    """A plain CPU runner and a device-path one over `pages` pages each, with their drivers."""
    from tests.engine.test_model_runner import PAGE

    out = []
    for device_path in (False, True):
        layout = TableLayout(slots=SLOTS, max_pages=max_pages)
        table = RequestTable(layout, memoryview(bytearray(layout.nbytes())))
        runner = _runner(model, table, device_path, max_tokens=512, pages=pages)
        if device_path and (largest is not None or every is not None):
            runner.prefill_graphs = PrefillGraphs(model, runner.kv, runner.state, runner.pages, runner.attn_dims,
                                                  runner.scratch[1], PAGE, largest=largest or 2048,
                                                  checkpoint_every=every)
        runner.capture_graphs()
        driver = Driver(table)
        driver.free = list(range(pages))[::-1]
        out.append((runner, driver))
    return out


def _same(results):
    assert results[0].error is None and results[1].error is None, results
    want, got = results[0].sampled, results[1].sampled
    assert [s.token_id for s in got] == [s.token_id for s in want]
    assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(got, want))


@pytest.mark.parametrize("kind", ["hybrid", "dense"])
def test_a_turn_after_a_prefix_hit_uploads_its_pages_and_a_long_chunk_uses_every_bucket(kind, monkeypatch):
    """A new sequence that starts after a prefix hit sends its whole page-table row up (more pairs than the
    arena's table room: DevicePageTable.upload); a chunk that does not sample returns no rows; a 200-token
    chunk replays the 128-token bucket."""
    from hkv.engine.step_inputs import DevicePageTable
    from hkv.ipc.messages import Chunk, StepPlan
    from tests.engine.test_model_runner import PAGE

    uploads, replays = [], _spy(monkeypatch)
    original_upload = DevicePageTable.upload
    monkeypatch.setattr(DevicePageTable, "upload", lambda self, idx, vals: uploads.append(len(idx))
                        or original_upload(self, idx, vals))
    model = _model(kind)
    pair = _pair(model, pages=60, max_pages=60, largest=8)  # table room: 2 * 8 / 4 + 2 = 6 pages
    assert pair[1][0].prefill_graphs.table_room == 6
    prompt = [(13 * i) % 90 + 3 for i in range(40)]
    _same([r.execute(d.plan([(0, prompt)], [0])) for r, d in pair])  # 40 tokens: eager (above 15)
    for runner, driver in pair:  # slot 3 hits slot 0's first 8 pages (32 tokens), as a radix hit would
        driver.pages[3] = list(driver.pages[0][:8])
        driver.done[3] = 8 * PAGE
        runner.table.write_pages(3, driver.pages[3])
    _same([r.execute(d.plan([(3, [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19])], [3])) for r, d in pair])
    assert replays == [[[8, 4, 1]]] and uploads and uploads[0] > 6  # its 12 pages went up on their own
    results = []
    for runner, driver in pair:  # a chunk that does not sample (a long prompt's middle): no rows back
        chunk = driver.plan([(3, [20, 21, 22, 23, 24])], []).chunks[0]  # pages appended as the router would
        results.append(runner.execute(StepPlan(driver.step, [], [Chunk(3, chunk.token_ids, chunk.start_pos,
                                                                       False)], [])))
    assert all(r.error is None and r.sampled == [] for r in results) and replays[-1] == [[4, 1]]
    big = _pair(model, pages=60, max_pages=60)
    _same([r.execute(d.plan([(1, [(3 * i) % 90 + 3 for i in range(200)])], [1])) for r, d in big])
    assert replays[-1] == [[128, 64, 8]]


def test_buckets_stop_at_the_context_a_row_covers():
    """No bucket longer than a page-table row (the capture reads the scratch row that far) or the rope table."""
    model = _model("dense")  # max_position_embeddings 256
    short = _pair(model, pages=8, max_pages=10)[1][0]  # rows of 10 pages x 4 tokens: 40 positions
    # several sequences: no more tokens than the largest one-sequence bucket either
    assert short.prefill_graphs.largest == 32 and sorted(short.prefill_graphs.batches) == sorted(bucket_set(32, 32, 32))
    with pytest.raises(ValueError, match="power of two"):
        PrefillGraphs(model, short.kv, None, short.pages, short.attn_dims, None, 4, largest=100)


def test_a_failed_capture_leaves_those_steps_eager(monkeypatch, caplog):
    """A short-prefill capture that raises drops those graphs with a warning naming the first error;
    the decode graphs stay and the step still runs (eagerly) and samples."""
    model = _model("hybrid")
    layout = TableLayout(slots=SLOTS, max_pages=16)
    table = RequestTable(layout, memoryview(bytearray(layout.nbytes())))
    runner = _runner(model, table, True)

    def broken(self, progress=None):
        try:
            raise RuntimeError("operation not permitted when stream is capturing")
        except RuntimeError:
            raise RuntimeError("capture_end failed") from None

    monkeypatch.setattr(PrefillGraphs, "capture_all", broken)
    with caplog.at_level("WARNING", logger="hkv.rank"):
        runner.capture_graphs()
    assert runner.prefill_graphs is None and sorted(runner.graphs.graphs) == [1, 2, 4]
    assert "short-prefill CUDA graphs not captured (RuntimeError: operation not permitted" in caplog.text
    result = runner.execute(Driver(table).plan([(0, [3, 4, 5, 6, 7])], [0]))
    assert result.error is None and len(result.sampled) == 1
