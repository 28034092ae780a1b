"""The runner's device path (one arena per step, page ids mirrored by row, decode buckets with
padded rows) computes what the plain CPU path computes, plan by plan.

On CPU the device path runs with `device_metadata=True`: the same arena packing, the same
DevicePageTable, the same bucket padding onto a scratch page and state slot, with graph
replays done eagerly; only the kernels and the capture itself need a GPU
(tests/e2e/test_cuda_launch.py)."""

from __future__ import annotations

import pytest
import torch

from hkv.engine.model_runner import ModelRunner
from hkv.ipc.messages import Chunk, NewSequence, SamplingParams, StepPlan
from hkv.ipc.request_table import RequestTable, TableLayout
from hkv.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from hkv.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForCausalLM
from hkv.storage.kv_pool import KVPool
from hkv.storage.state_pool import StatePool
from tests.models.test_qwen3_5 import TEXT_CONFIG, perturb

PAGE, PAGES, SLOTS = 4, 40, 6
SAMPLING = SamplingParams(max_tokens=64, logprobs=3)


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "hybrid":
        model = Qwen3_5ForCausalLM(Qwen3_5Config.from_hf({**TEXT_CONFIG, "model_type": "qwen3_5_text"}))
    else:
        model = Qwen3ForCausalLM(Qwen3Config.from_hf(dict(
            model_type="qwen3", vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256)))
    perturb(model, 1)
    return model.eval()


def _runner(model, table: RequestTable, device_metadata: bool, max_tokens: int = 64, pages: int = PAGES,
            device: str = "cpu", dtype: str = "float32", graphs: bool | None = None) -> ModelRunner:
    """A runner over `pages` pages (plus the scratch one on the device path); graphs (default: the device
    path) captures decode and short-prefill buckets, replayed eagerly off CUDA."""
    extra = 1 if device_metadata else 0
    kv = KVPool(model.kv_layout(pages + extra, PAGE, dtype, device), model.layer_map)
    layout = model.state_layout(SLOTS + extra, device=device)
    state = StatePool(layout) if layout is not None else None
    scratch = (pages, SLOTS if state is not None else None)
    graphs = device_metadata if graphs is None else graphs
    return ModelRunner(model, kv, state, table, PAGE, device, scratch=scratch if device_metadata else None,
                       max_tokens=max_tokens, graph_max_bs=4 if graphs else 0, device_metadata=device_metadata)


class Driver:
    """A router in miniature: pages per slot in the request table, one plan at a time."""

    def __init__(self, table: RequestTable):
        self.table = table
        self.free = list(range(PAGES))[::-1]
        self.pages: dict[int, list[int]] = {}
        self.done: dict[int, int] = {}
        self.step = 0

    def plan(self, work: list[tuple[int, list[int]]], new: list[int], checkpoints=None) -> StepPlan:
        """checkpoints: request-table row -> its chunk's in-chunk checkpoints ([tokens, state slot] pairs)."""
        chunks = []
        for slot, tokens in work:
            start = self.done.get(slot, 0)
            end = start + len(tokens)
            pages = self.pages.setdefault(slot, [])
            added = []
            while len(pages) * PAGE < end:
                added.append(self.free.pop())
                pages.append(added[-1])
            if start == 0:
                self.table.write_pages(slot, pages)
            elif added:
                self.table.append_pages(slot, added)
            self.done[slot] = end
            chunks.append(Chunk(slot, tokens, start, True, (checkpoints or {}).get(slot, [])))
        self.step += 1
        return StepPlan(self.step, [NewSequence(s, 100 + s, SAMPLING, s) for s in new], chunks, [])


PLANS = [
    ([(0, list(range(3, 23))), (2, [5, 6, 7, 8, 9])], [0, 2]),  # two prefills
    ([(0, [11]), (2, [12])], []),  # decode, bucket 2
    ([(0, [13]), (4, list(range(30, 37)))], [4]),  # decode + prefill: a mixed step (graphs on the device path)
    ([(0, [14]), (2, [15]), (4, [16])], []),  # decode, bucket 4 with one padded row
    ([(2, [17])], []),  # decode, bucket 1
]


@pytest.mark.parametrize("kind", ["hybrid", "dense"])
def test_device_path_computes_the_cpu_path(kind, monkeypatch):
    from hkv.engine.cuda_graphs import DecodeGraphs

    replays = []
    original = DecodeGraphs.replay
    monkeypatch.setattr(DecodeGraphs, "replay", lambda self, inputs, *a: replays.append(len(inputs.q_lens))
                        or original(self, inputs, *a))
    model = _model(kind)
    tables = [RequestTable(TableLayout(slots=SLOTS, max_pages=16), memoryview(bytearray(
        TableLayout(slots=SLOTS, max_pages=16).nbytes()))) for _ in range(2)]
    plain, fast = _runner(model, tables[0], False), _runner(model, tables[1], True)
    assert fast.graphs is not None and sorted(fast.graphs.graphs) == []
    fast.capture_graphs()
    assert sorted(fast.graphs.graphs) == [1, 2, 4]
    drivers = [Driver(t) for t in tables]
    for work, new in PLANS:
        results = [runner.execute(d.plan(work, new)) for runner, d in zip((plain, fast), drivers)]
        assert results[0].error is None and results[1].error is None, results
        want, got = results[0].sampled, results[1].sampled
        assert [s.token_id for s in got] == [s.token_id for s in want]
        for a, b in zip(got, want):
            assert abs(a.logprob - b.logprob) < 1e-5
            assert [t.token_id for t in a.top_logprobs] == [t.token_id for t in b.top_logprobs]
    assert replays == [2, 1, 3, 1]  # the decode rows replayed their buckets (2, 1 in the mixed step, 4, 1)
    if kind == "hybrid":  # the live states match too; the scratch slot took the padded rows
        assert torch.allclose(fast.state.recurrent[:, :SLOTS], plain.state.recurrent, atol=1e-6)


def test_in_chunk_checkpoints_travel_through_both_paths():
    """Issue 12: a prefill chunk's checkpoints reach the forward from the plan (the arena on the
    device path) and land in their slots, the same on both paths; decode steps carry none."""
    model = _model("hybrid")
    layout = TableLayout(slots=SLOTS, max_pages=48)
    tables = [RequestTable(layout, memoryview(bytearray(layout.nbytes()))) for _ in range(2)]
    runners = [_runner(model, tables[0], False), _runner(model, tables[1], True, max_tokens=256)]
    drivers = [Driver(t) for t in tables]
    for runner in runners:
        runner.state.conv[:, 3:5] = float("nan")
        runner.state.recurrent[:, 3:5] = float("nan")
    work = [(0, [(7 * i) % 96 for i in range(140)]), (2, [5, 6, 7, 8, 9])]
    for runner, driver in zip(runners, drivers):
        result = runner.execute(driver.plan(work, [0, 2], checkpoints={0: [[64, 3], [128, 4]]}))
        assert result.error is None, result.error
    plain, fast = runners
    for pool in ("conv", "recurrent"):
        want, got = getattr(plain.state, pool), getattr(fast.state, pool)[:, :SLOTS]
        assert not torch.isnan(want).any() and torch.equal(got, want), pool
    bad = drivers[0].plan([(2, [10, 11])], [], checkpoints={2: [[1, 5]]})
    assert "multiple of 64" in plain.execute(bad).error



def _grammar_runner(vocab: int, loader) -> tuple[ModelRunner, Driver]:
    from hkv.engine.logits_process import LogitsProcessor

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config.from_hf(dict(
        model_type="qwen3", vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256))).eval()
    perturb(model, 1)
    layout = TableLayout(slots=SLOTS, max_pages=16)
    table = RequestTable(layout, memoryview(bytearray(layout.nbytes())))
    runner = _runner(model, table, True)
    runner.processor = LogitsProcessor(vocab, runner.device, loader)
    return runner, Driver(table)


def _decode_plan(driver: Driver, step: int, last: dict[int, int] | None) -> StepPlan:
    """One decode token for slots 0 and 1: the last sampled ones, or (last None) fed in by the rank."""
    plan = driver.plan([(s, [0]) for s in (0, 1)], [])
    return StepPlan(step, [], [Chunk(c.slot, [last[c.slot]] if last else [0], c.start_pos, True, [], last is None)
                               for c in plan.chunks], [])


def test_a_grammar_row_planned_ahead_samples_once_the_step_before_is_answered():
    """Issue 37: with the next plan launched before the last one's tokens are on the host (the rank's
    order on CUDA: launch n+1, answer n, complete n+1), a constrained row waits to sample until its
    matcher has the token before; it samples what a run that waits for every result samples, and every
    token keeps to the grammar."""
    import re

    from tokenizers import Tokenizer

    from hkv.engine.logits_process import GrammarLoader
    from hkv.ipc.messages import Constraint
    from hkv.models.tiny import SHIPPED_DIR

    vocab, steps = 4096, 8
    loader = GrammarLoader(str(SHIPPED_DIR / "tokenizer.json"), vocab, [0])
    pattern = "[a-z]+ = [0-9]{2}"
    new = [NewSequence(0, 100, SamplingParams(max_tokens=16, constraint=Constraint("regex", pattern))),
           NewSequence(1, 101, SAMPLING)]
    runs = []
    for ahead in (False, True):
        runner, driver = _grammar_runner(vocab, loader)
        tokens: dict[int, list[int]] = {0: [], 1: []}
        figures = []  # (grammar_rows, grammar_mask_s, grammar_wait_s) of each result
        first = driver.plan([(0, [5, 6, 7]), (1, [8, 9])], [])
        launched, late = runner.launch(StepPlan(1, new, first.chunks, [])), 0
        for step in range(2, steps + 1):
            if ahead:
                nxt = runner.launch(_decode_plan(driver, step, None))
                late += nxt.late is not None
                result = runner.finish(launched)
                runner.complete(nxt)
            else:
                result = runner.finish(launched)
            for s in result.sampled:
                tokens[s.slot].append(s.token_id)
            figures.append((result.grammar_rows, result.grammar_mask_s, result.grammar_wait_s))
            launched = nxt if ahead else runner.launch(_decode_plan(driver, step, {s: t[-1] for s, t in tokens.items()}))
        for s in runner.finish(launched).sampled:
            tokens[s.slot].append(s.token_id)
        runs.append((tokens, late))
        # the constrained row is live until its grammar is done (then EOS only, no live row); one row at most
        live = [rows for rows, _, _ in figures]
        assert live[0] == 1 and all(r in (0, 1) for r in live) and live == sorted(live, reverse=True), live
        assert all((m > 0) == (r == 1) for r, m, _ in figures), figures
        # a late step waited for the step before's answer; one sampled at launch waited for nothing
        assert all((w > 0) == (ahead and r == 1 and i > 0) for i, (r, _, w) in enumerate(figures)), figures
    (want, _), (got, late) = runs
    assert got == want and late == steps - 1  # every step after the first sampled late
    ended = want[0].index(0) if 0 in want[0] else len(want[0])  # EOS ends it once the grammar is done
    assert all(t == 0 for t in want[0][ended:])
    matcher = loader.get().matcher(new[0].sampling.constraint)
    for token in want[0][:ended]:
        matcher.consume(token)
        assert not matcher.failed
    text = Tokenizer.from_file(str(SHIPPED_DIR / "tokenizer.json")).decode(want[0][:ended])
    assert re.fullmatch(pattern, text) if ended < len(want[0]) else re.fullmatch("[a-z]+( = [0-9]?)?|[a-z]+ ?=?", text)


def test_step_results_carry_the_mask_caches_fills_since_the_last_result():
    """HKV_GRAMMAR_MASK_CACHE (on in a server): a JSON-schema row inside a bounded string fills its mask through
    the cache; the step results' grammar_cache_hits / misses are deltas whose sums are the cache's own counts."""
    import json

    from hkv.engine.logits_process import GrammarLoader
    from hkv.ipc.messages import Constraint
    from hkv.models.tiny import SHIPPED_DIR

    vocab = 4096
    loader = GrammarLoader(str(SHIPPED_DIR / "tokenizer.json"), vocab, [0], mask_cache="on")
    schema = json.dumps({"type": "array", "minItems": 4, "maxItems": 4,
                         "items": {"type": "string", "minLength": 2, "maxLength": 3}})
    new = [NewSequence(0, 100, SamplingParams(max_tokens=24, constraint=Constraint("json_schema", schema))),
           NewSequence(1, 101, SAMPLING)]
    runner, driver = _grammar_runner(vocab, loader)
    first = driver.plan([(0, [5, 6, 7]), (1, [8, 9])], [])
    result = runner.finish(runner.launch(StepPlan(1, new, first.chunks, [])))
    fills = [(result.grammar_cache_hits, result.grammar_cache_misses)]
    for step in range(2, 25):
        last = {s.slot: s.token_id for s in result.sampled}
        result = runner.finish(runner.launch(_decode_plan(driver, step, last)))
        fills.append((result.grammar_cache_hits, result.grammar_cache_misses))
    hits, misses = loader.cache_counts()
    assert misses > 0 and (sum(h for h, _ in fills), sum(m for _, m in fills)) == (hits, misses), (fills, hits, misses)
    assert all(h + m <= 1 for h, m in fills), fills  # one constrained row: at most one keyed fill a step
