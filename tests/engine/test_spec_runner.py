"""Speculative decoding on a real model in process: the scheduler, the coordinator and a ModelRunner
with the MTP drafter, on the random built-in hybrid (fp32, CPU).

Controlled drafters stand in for the MTP module's proposals: an oracle (the target's own greedy
tokens, from a run without speculation), an adversary (never right) and one right for the first
half. After every step, for every running sequence at length L: its live linear state equals the
run without speculation at L, its draft window holds the MTP entries of positions L - W .. L - 1
computed from scratch over the whole sequence, its stored hidden state is the target's at L - 1,
its cursor is L and the coordinator's books balance. The tokens equal the run without speculation.
"""

from __future__ import annotations

import pytest
import torch

from hkv.engine import spec
from hkv.engine.model_runner import ModelRunner
from hkv.engine.sampler import SampleRow
from hkv.engine.spec_verify import verify
from hkv.ipc.messages import STEP_EAGER, STEP_VERIFY_GRAPHS, GenerateRequest, SamplingParams
from hkv.models.batch import ForwardBatch
from hkv.models.loader import load_model
from hkv.models.tiny import builtin_folder
from hkv.storage.kv_pool import KVPool
from hkv.storage.state_pool import StatePool
from tests.engine.test_scheduler import make

PAGE, PAGES, SLOTS, ROWS = 16, 96, 24, 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = builtin_folder("tiny-hybrid-random", tmp_path_factory.mktemp("builtin"))
    return load_model(folder, "float32", "cpu", mtp=True).model


class Engine:
    """A router and a rank in one process, one plan at a time."""

    def __init__(self, model, spec_tokens: int, window: int, budget: int = 48, graphs: bool = False):
        """graphs: the device path (arena, device page table) with verify steps replayed from
        VerifyGraphs' static buffers, eagerly off CUDA, as on a GPU minus the capture."""
        self.sched = make(num_pages=PAGES, page_size=PAGE, max_running=ROWS, budget=budget, max_context=2048,
                          prefix_cache=True, hybrid=True, interval=64, state_slots=SLOTS, align=64, max_pages=64,
                          spec_tokens=spec_tokens)
        draft = spec.draft_spec(model, window)
        extra = 1 if graphs else 0  # the graph rows' scratch page and state slot
        layout = model.kv_layout(PAGES + extra, PAGE, "float32", "cpu")
        layout, layer_map = spec.with_paged_draft(model, layout, draft)
        kv = KVPool(layout, layer_map)
        keep = spec.keep_slots_needed(ROWS, spec_tokens)
        state = StatePool(model.state_layout(SLOTS + extra + keep, device="cpu"), draft)
        self.runner = ModelRunner(model, kv, state, self.sched.table, PAGE, "cpu",
                                  scratch=(PAGES, SLOTS) if graphs else None, max_tokens=budget + ROWS,
                                  device_metadata=graphs)
        self.spec = spec.attach(self.runner, draft, spec_tokens, SLOTS + extra,
                                graph_max_bs=ROWS if graphs else 0) if spec_tokens else None
        if graphs:
            assert self.spec.graphs is not None
            self.runner.capture_graphs()
        self.window = window
        self.graph_kinds: list[int] = []  # StepResult.graph of every step run

    def run(self, requests, on_step=None, limit=500):
        out: dict[int, list[int]] = {r.req_id: [] for r in requests}
        for r in requests:
            self.sched.add(r)
        for _ in range(limit):
            if not self.sched.has_work():
                break
            plan = self.sched.schedule()
            if plan is None:
                continue
            result = self.runner.execute(plan)
            assert result.error is None, result.error
            self.graph_kinds.append(result.graph)
            for d in self.sched.on_result(result, plan):
                out[d.req_id].extend(d.token_ids)
            self.sched.coord.check_integrity()
            if on_step is not None:
                on_step(self)
        assert not self.sched.has_work()
        return out


def _requests(lengths, max_tokens=24, **kw):
    g = torch.Generator().manual_seed(7)
    return [GenerateRequest(i + 1, torch.randint(3, 1500, (n,), generator=g).tolist(),
                            SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw))
            for i, n in enumerate(lengths)]


def _record_states(engine, states):
    """(request, length) -> the live conv / recurrent state of every running sequence."""
    r = engine.runner
    for seq in engine.sched.running.values():
        slot = seq.state_slot
        states[(seq.req_id, seq.kv_len)] = (r.state.conv[:, slot].clone(), r.state.recurrent[:, slot].clone())


@torch.inference_mode()
def _reference_entries(model, tokens: list[int]):
    """The target's final-norm hidden states of `tokens` in one prefill, and the MTP entries' K/V
    of positions 1 .. len - 1 from them (entry p: hidden p - 1, token p)."""
    n = len(tokens)
    layout = model.kv_layout(-(-n // PAGE), PAGE, "float32", "cpu")
    kv = KVPool(layout, model.layer_map)
    state = StatePool(model.state_layout(1, device="cpu"))
    batch = ForwardBatch.from_lists(tokens, list(range(n)), [n], [n], torch.arange(layout.num_pages)[None],
                                    list(range(n)), [n - 1], state_slots=[0])
    _, hidden = model(batch, kv, state, hidden_out=True)
    mtp = model.mtp
    x = mtp.entry_input(hidden[:-1], model.model.embed_tokens(torch.tensor(tokens[1:])))
    _, _, k, v, _ = mtp.project(x, torch.arange(1, n), model.rotary)
    return hidden, k, v  # k, v row i = position i + 1


DRAFTERS = {
    "oracle": lambda future: (lambda row, first, got: future(row, first, len(got))),
    "adversary": lambda future: (lambda row, first, got: [(t + 1) % 1536 for t in future(row, first, len(got))]),
    "half": lambda future: (lambda row, first, got: [
        t if j < (len(got) + 1) // 2 else (t + 1) % 1536 for j, t in enumerate(future(row, first, len(got)))]),
}


@pytest.mark.parametrize("window", [16, 0], ids=["ring16", "paged"])
@pytest.mark.parametrize("drafter", list(DRAFTERS))
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_controlled_drafters_keep_every_state_the_run_without_them_has(model, window, drafter, graphs):
    requests = _requests([5, 40, 90])
    baseline_states: dict = {}
    plain = Engine(model, 0, 0)
    expected = plain.run(requests, on_step=lambda e: _record_states(e, baseline_states))
    prompts = {r.req_id: r.prompt_ids for r in requests}

    engine = Engine(model, 3, window, graphs=graphs)

    def future(row, first, count):  # the target's own tokens at positions first, first + 1, ...
        req_id = int(engine.sched.table.req_id[row])
        seq = prompts[req_id] + expected[req_id]
        return [seq[p] if p < len(seq) else 0 for p in range(first, first + count)]

    engine.spec.propose = DRAFTERS[drafter](future)
    checked = []

    def check(e):
        r = e.runner
        for seq in e.sched.running.values():
            L, slot = seq.kv_len, seq.state_slot
            rec = e.sched.coord.requests[seq.req_id]
            assert rec.cursor == L and len(rec.pages) == -(-L // PAGE)
            if (seq.req_id, L) in baseline_states:
                conv, rec_state = baseline_states[(seq.req_id, L)]
                torch.testing.assert_close(r.state.conv[:, slot], conv, rtol=1e-4, atol=1e-5)
                torch.testing.assert_close(r.state.recurrent[:, slot], rec_state, rtol=1e-4, atol=1e-5)
            if L < 2 or len(checked) > 40:
                continue
            hidden, k, v = _reference_entries(model, seq.all_ids()[:L])
            torch.testing.assert_close(r.state.mtp_hidden[slot], hidden[L - 1], rtol=1e-4, atol=1e-5)
            positions = range(max(1, L - window), L) if window else range(1, L)
            flat = torch.tensor([seq.pages[i // PAGE] * PAGE + i % PAGE for i in range(L)])
            got_k, got_v = e.spec.drafter.store.read(slot, flat, positions[0], L)
            torch.testing.assert_close(got_k, k[positions[0] - 1 : L - 1], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(got_v, v[positions[0] - 1 : L - 1], rtol=1e-4, atol=1e-5)
            checked.append(L)

    got = engine.run(requests, on_step=check)
    assert got == expected
    if graphs:  # the decode steps went through the graphs' buffers (three requests, 23 tokens, <= 4 a step)
        assert engine.spec.graphs.rows_run >= 3 * 23 // 4
        assert STEP_VERIFY_GRAPHS in engine.graph_kinds  # whole steps replayed, as the router counts them
    assert set(engine.graph_kinds) <= {STEP_EAGER, STEP_VERIFY_GRAPHS} and (graphs or set(engine.graph_kinds) == {0})
    s = engine.sched
    assert checked, "no step compared the draft state"
    if drafter == "oracle":
        assert s.spec_accepted == s.spec_verified > 0
    elif drafter == "adversary":
        assert s.spec_accepted == 0 and s.spec_verified > 0
    else:
        assert 0 < s.spec_accepted < s.spec_verified


@pytest.mark.parametrize("window", [16, 0], ids=["ring16", "paged"])
@pytest.mark.parametrize("base_len, shared, hit, budget, graphs",
                         [(70, 66, 64, 48, False), (150, 140, 128, 192, False), (150, 140, 128, 192, True)],
                         ids=["chunk-end", "in-chunk", "in-chunk-graphs"])
def test_second_requests_hit_the_cached_prefix_and_keep_drafting(model, window, base_len, shared, hit, budget,
                                                                   graphs):
    """A prompt sharing a prefix restores the checkpoint there (one saved at a chunk's end, or one the
    forward kept inside a 144-token chunk), the drafter's state included: the MTP drafter proposes
    exactly what it proposes in a cold run of that prompt."""
    base = _requests([base_len], max_tokens=8)[0]
    again = GenerateRequest(2, base.prompt_ids[:shared] + [11, 12, 13], base.sampling)

    def logged(engine):
        log = []
        engine.spec.propose = lambda row, first, got: log.append((first, list(got))) or got
        return log

    def drafter_states(engine, states):
        """length -> (stored hidden, committed draft K of the window) of the running sequence."""
        for seq in engine.sched.running.values():
            L, slot = seq.kv_len, seq.state_slot
            flat = torch.tensor([seq.pages[i // PAGE] * PAGE + i % PAGE for i in range(L)])
            k, _ = engine.spec.drafter.store.read(slot, flat, max(1, L - window) if window else 1, L)
            states[L] = (engine.runner.state.mtp_hidden[slot].clone(), k.clone())

    cold = Engine(model, 2, window, budget, graphs)
    cold_log, cold_states = logged(cold), {}
    cold_out = cold.run([again], on_step=lambda e: drafter_states(e, cold_states))
    warm = Engine(model, 2, window, budget, graphs)
    warm.run([base])
    warm_log, warm_states = logged(warm), {}
    hits, tokens = [], []
    warm.sched.add(again)
    while warm.sched.has_work():
        plan = warm.sched.schedule()
        deltas = warm.sched.on_result(warm.runner.execute(plan), plan)
        tokens += [t for d in deltas for t in d.token_ids]
        hits += [d.cached_tokens for d in deltas if d.finish_reason]
        warm.sched.coord.check_integrity()
        drafter_states(warm, warm_states)
    assert hits == [hit]
    assert tokens == cold_out[2] and len(tokens) == 8
    assert warm_log == cold_log and len(cold_log) >= 4
    assert len(warm_states) >= 4 and set(warm_states) <= set(cold_states)
    for L, (hidden, k) in warm_states.items():  # the restored drafter state went on like the cold one
        torch.testing.assert_close(hidden, cold_states[L][0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(k, cold_states[L][1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("window", [16, 0], ids=["ring16", "paged"])
def test_sampled_and_logprob_rows_take_the_host_verdict_in_the_graphs(model, window):
    """Seeded rows at temperature 0.8 and a greedy row with logprobs are verified on the host even when
    their step replays the verify graphs: their tokens equal the eager speculative run's."""
    sampled = _requests([5, 40], max_tokens=16, temperature=0.8, seed=11)
    greedy = _requests([30], max_tokens=16, logprobs=2)[0]
    requests = [*sampled, GenerateRequest(3, greedy.prompt_ids, greedy.sampling)]
    eager = Engine(model, 2, window)
    graphs = Engine(model, 2, window, graphs=True)
    expected, got = eager.run(requests), graphs.run(requests)
    assert got == expected and all(len(t) == 16 for t in got.values())
    assert graphs.spec.graphs.host_rows == graphs.spec.graphs.rows_run > 10


def test_the_graphs_take_verify_and_decode_rows_only(model):
    """Prefill chunks, chunks with in-chunk checkpoints, rows whose K + 1 places would pass the page-table
    row's end and rows past the largest bucket run eagerly."""
    from hkv.ipc.messages import Chunk

    graphs = Engine(model, 3, 16, graphs=True).spec.graphs
    end = graphs.capacity
    verify, decode = Chunk(0, [5, 6, 7, 8], 40, True, drafts=3), Chunk(1, [9], 41, True)
    short = Chunk(2, [5, 6], 47, True, drafts=1)  # capped at a page boundary
    assert graphs.take([verify, decode, short]) == [verify, decode, short]
    prefill = Chunk(3, [1, 2, 3], 0, True)
    middle = Chunk(3, [1] * 64, 64, False)
    ckpt = Chunk(3, [1] * 128, 0, True, [[64, 9]])
    near_end = Chunk(2, [5, 6], end - 3, True, drafts=1)
    at_end = Chunk(1, [9], end - 4, True)
    assert graphs.take([prefill, middle, ckpt, near_end, at_end, verify]) == [at_end, verify]
    many = [Chunk(r, [9], 41, True) for r in range(graphs.max_bs + 1)]
    assert graphs.take(many) == many[: graphs.max_bs]


def test_sampling_with_speculation_keeps_the_distribution(model):
    """Temperature 0.8 (top_k 8, so the chi-square has few bins) on a fixed context: the first token a
    verify step emits, over 3,000 seeds, is distributed like a plain sample of that position
    (two-sample chi-square, p = 0.001)."""
    from tests.engine.test_spec_verify import _chi2_same

    context = _requests([20])[0].prompt_ids
    n = len(context)
    layout = model.kv_layout(4, PAGE, "float32", "cpu")
    kv = KVPool(layout, model.layer_map)
    state = StatePool(model.state_layout(1, device="cpu"))
    with torch.inference_mode():
        batch = ForwardBatch.from_lists(context, list(range(n)), [n], [n], torch.arange(4)[None], list(range(n)),
                                        list(range(n - 3, n)), state_slots=[0])
        logits = model(batch, kv, state)  # rows: positions n - 2, n - 1, n (the drafts' and the bonus')
    drafts = [int(logits[0].topk(3).indices[2]), int(logits[1].argmax())]  # the third likeliest, then the first
    spec_counts, plain_counts = [0] * logits.shape[1], [0] * logits.shape[1]
    for seed in range(3000):
        params = SamplingParams(max_tokens=4, temperature=0.8, top_k=8, seed=seed)
        first = verify(logits, drafts, SampleRow(params, n - 2)).outputs[0].token_id
        spec_counts[first] += 1
        other = SamplingParams(max_tokens=4, temperature=0.8, top_k=8, seed=10_000 + seed)
        plain_counts[verify(logits[:1], [], SampleRow(other, n - 2)).outputs[0].token_id] += 1
    assert 0 < spec_counts[drafts[0]] < 3000  # the draft is accepted sometimes, not always
    _chi2_same(spec_counts, plain_counts)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_processed_rows_decode_without_drafts_and_equal_the_run_without_speculation(model, graphs):
    """Issue 37: a row with a logit bias and penalties beside plain ones, with speculation on (graphs or not):
    it runs eagerly, one token a step, its logits processed, and every row's tokens equal the run without
    speculation (whose rows are processed the same)."""
    plain = _requests([12, 30], max_tokens=12)
    biased = GenerateRequest(3, plain[0].prompt_ids, SamplingParams(
        max_tokens=12, ignore_eos=True, logit_bias={7: 8.0, 11: 8.0}, frequency_penalty=1.5, presence_penalty=0.5))
    requests = [*plain, biased]
    cold = Engine(model, 0, 16).run(requests)
    engine = Engine(model, 2, 16, graphs=graphs)
    got = engine.run(requests)
    assert got == cold
    assert set(got[3]) & {7, 11} and got[3] != got[1]  # the bias and the penalties show in its tokens
    assert engine.sched.spec_verified > 0  # the plain rows drafted
