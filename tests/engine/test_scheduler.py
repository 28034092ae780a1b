"""Scheduler: chunking, page accounting, preemption with recompute, aborts."""

from __future__ import annotations

import dataclasses

import pytest

from hkv.cache.coordinator import CacheCoordinator
from hkv.cache.types import CacheSpec
from hkv.engine.scheduler import Scheduler, SchedulerLimits
from hkv.ipc.messages import GenerateRequest, Sampled, SamplingParams, StepResult
from hkv.ipc.request_table import RequestTable, SlotPhase, TableLayout

EOS = 99


def make(num_pages=16, page_size=4, max_running=4, budget=8, max_context=256, prefix_cache=False,
         hybrid=False, interval=None, state_slots=0, align=64, max_pages=64, spec_tokens=0, prefix_wait_min=256):
    layout = TableLayout(slots=max_running, max_pages=max_pages)
    table = RequestTable(layout, memoryview(bytearray(layout.nbytes())))
    limits = SchedulerLimits(page_size, max_running, budget, max_context, frozenset({EOS}), hybrid, interval, align,
                             spec_tokens=spec_tokens, prefix_wait_min=prefix_wait_min)
    spec = CacheSpec(page_size, num_pages, state_slots, 0, hybrid, interval, prefix_cache)
    return Scheduler(limits, CacheCoordinator(spec), table)


def free_pages(sched):
    return sched.coord.pages.free_count


def req(req_id, prompt_len, max_tokens=4, **kw):
    return GenerateRequest(req_id, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, **kw))


def step(sched, token_for=lambda slot: 7):
    """Run one step with a fake rank; returns (plan, deltas)."""
    plan = sched.schedule()
    if plan is None:
        return None, sched.take_finished()
    sampled = [Sampled(c.slot, token_for(c.slot), None, None) for c in plan.chunks if c.sample]
    return plan, sched.on_result(StepResult(plan.step, sampled, 0.0), plan)


def check_table_matches(sched):
    for seq in sched.running.values():
        n = sched.table.num_pages[seq.slot]
        assert sched.table.page_ids[seq.slot, :n].tolist() == seq.pages


def test_chunked_prefill_splits_by_budget_and_allocates_pages_per_chunk():
    sched = make(budget=8, page_size=4)
    sched.add(req(1, 10))
    plan, deltas = step(sched)
    assert [len(c.token_ids) for c in plan.chunks] == [8]
    assert plan.chunks[0].start_pos == 0 and not plan.chunks[0].sample
    assert plan.new[0].req_id == 1
    assert sched.running[1].pages == [0, 1]
    assert deltas == []
    plan, deltas = step(sched)
    assert plan.chunks[0].token_ids == [9, 10] and plan.chunks[0].start_pos == 8 and plan.chunks[0].sample
    assert sched.running[1].pages == [0, 1, 2]
    assert [d.token_ids for d in deltas] == [[7]]
    check_table_matches(sched)
    assert sched.table.phase[plan.chunks[0].slot] == SlotPhase.PREFILL


def test_decode_feeds_last_token_and_finishes_on_length():
    sched = make()
    sched.add(req(1, 3, max_tokens=3))
    outputs = []
    for _ in range(3):
        plan, deltas = step(sched, token_for=lambda s: 40 + len(outputs))
        outputs += [t for d in deltas for t in d.token_ids]
    assert outputs == [40, 41, 42]
    assert deltas[-1].finish_reason == "length"
    assert not sched.has_work()
    assert free_pages(sched) == sched.coord.spec.num_pages
    sched.coord.check_integrity()


def test_eos_finishes_unless_ignored():
    sched = make()
    sched.add(req(1, 3, max_tokens=5))
    sched.add(req(2, 3, max_tokens=2, ignore_eos=True))
    _, deltas = step(sched, token_for=lambda s: EOS)
    reasons = {d.req_id: d.finish_reason for d in deltas}
    assert reasons == {1: "stop", 2: None}


def test_abort_waiting_and_running_return_everything():
    sched = make(max_running=1)
    sched.add(req(1, 3, max_tokens=10))
    sched.add(req(2, 3, max_tokens=10))
    step(sched)
    sched.abort(2)  # still waiting
    sched.abort(1)  # running
    plan = sched.schedule()
    assert plan is None
    reasons = sorted((d.req_id, d.finish_reason) for d in sched.take_finished())
    assert reasons == [(1, "abort"), (2, "abort")]
    assert free_pages(sched) == sched.coord.spec.num_pages
    assert sched.table.phase.tolist() == [SlotPhase.FREE]


def test_preemption_recomputes_prompt_and_outputs():
    # 4 pages of 4 tokens: two sequences outgrow them and the newer one is preempted.
    sched = make(num_pages=4, page_size=4, budget=64, max_running=2)
    sched.add(req(1, 4, max_tokens=6))
    sched.add(req(2, 3, max_tokens=6))
    produced = {1: [], 2: []}
    preempted = False
    for _ in range(40):
        if not sched.has_work():
            break
        plan, deltas = step(sched, token_for=lambda s: 50 + s)
        if plan is not None and any(c.start_pos == 0 and len(c.token_ids) > 4 for c in plan.chunks):
            preempted = True  # a resumed sequence recomputes prompt + outputs in one chunk
        for d in deltas:
            produced[d.req_id] += d.token_ids
        sched.coord.check_integrity()
        check_table_matches(sched)
    assert preempted
    assert all(len(v) == 6 for v in produced.values())
    assert free_pages(sched) == 4


def test_request_that_cannot_fit_fails_instead_of_spinning():
    sched = make(num_pages=2, page_size=4, budget=64)
    sched.add(req(1, 12))
    assert sched.schedule() is None
    (delta,) = sched.take_finished()
    assert delta.finish_reason == "error" and "KV pages" in delta.error
    assert not sched.has_work()


def test_step_error_fails_its_requests_and_frees_pages():
    sched = make()
    sched.add(req(1, 5))
    plan = sched.schedule()
    deltas = sched.on_result(StepResult(plan.step, [], 0.0, "boom"), plan)
    assert [(d.req_id, d.finish_reason, d.error) for d in deltas] == [(1, "error", "boom")]
    assert free_pages(sched) == sched.coord.spec.num_pages


@pytest.mark.parametrize("prompt_len", [1, 4, 5, 16])
def test_freed_slots_are_reported_once(prompt_len):
    sched = make(budget=64)
    sched.add(req(1, prompt_len, max_tokens=1))
    plan, deltas = step(sched)
    first_slot = plan.chunks[0].slot
    assert deltas[0].finish_reason == "length"
    sched.add(req(2, 2, max_tokens=1))
    plan, deltas = step(sched)
    assert plan.freed == [first_slot]
    assert plan.new[0].slot == first_slot  # a freed slot is reused; ranks apply `freed` first
    assert deltas[0].finish_reason == "length"
    assert sched.schedule() is None
    assert sched.take_finished() == []


def run_to_end(sched, token_for=lambda slot: 7, limit=200):
    plans, deltas = [], []
    for _ in range(limit):
        if not sched.has_work():
            break
        plan, ds = step(sched, token_for)
        plans.append(plan)
        deltas += ds
        sched.coord.check_integrity()
        check_table_matches(sched)
    assert not sched.has_work()
    return plans, deltas


def test_dense_prefix_hit_starts_after_the_shared_pages():
    sched = make(prefix_cache=True, budget=64)
    sched.add(req(1, 10, max_tokens=2))
    run_to_end(sched)
    pages_of_first = sched.coord.tree.cached_pages
    assert pages_of_first == 2  # 11 computed tokens: two full pages published
    sched.add(GenerateRequest(2, list(range(1, 11)) + [60, 61, 62], SamplingParams(max_tokens=1)))
    plan = sched.schedule()
    (chunk,) = plan.chunks
    assert chunk.start_pos == 8 and chunk.token_ids == [9, 10, 60, 61, 62]
    deltas = sched.on_result(StepResult(plan.step, [Sampled(chunk.slot, 5, None, None)], 0.0), plan)
    assert deltas[0].cached_tokens == 8 and deltas[0].cache_tiers == {"gpu": 8, "cpu": 0, "disk": 0, "peer": 0}


def test_multi_turn_hits_prompt_and_output():
    sched = make(prefix_cache=True, budget=64)
    sched.add(req(1, 6, max_tokens=6))
    _, deltas = run_to_end(sched, token_for=lambda s: 40)
    history = list(range(1, 7)) + [40] * 6
    sched.add(GenerateRequest(2, history + [70, 71], SamplingParams(max_tokens=1)))
    plan = sched.schedule()
    assert plan.chunks[0].start_pos == 8  # 11 computed tokens of the first turn: two pages reused


def test_at_least_one_prompt_token_is_recomputed():
    sched = make(prefix_cache=True, budget=64)
    sched.add(req(1, 8, max_tokens=2))
    run_to_end(sched)
    sched.add(req(2, 8, max_tokens=1))
    plan = sched.schedule()
    assert plan.chunks[0].start_pos == 4 and plan.chunks[0].sample


def test_no_prefix_cache_never_hits():
    sched = make(prefix_cache=False, budget=64)
    sched.add(req(1, 10, max_tokens=2))
    run_to_end(sched)
    sched.add(req(2, 13, max_tokens=1))
    assert sched.schedule().chunks[0].start_pos == 0


def test_hybrid_prefill_keeps_interval_checkpoints_inside_the_chunk_and_a_hit_restores_one():
    sched = make(prefix_cache=True, budget=64, hybrid=True, interval=8, state_slots=8, num_pages=32, align=4)
    sched.add(req(1, 22, max_tokens=2))
    plans, _ = run_to_end(sched)
    # one chunk up to the prompt's last page boundary (20), keeping the states at 8 and 16 from its forward
    (chunk,) = plans[0].chunks
    assert (chunk.start_pos, len(chunk.token_ids), chunk.checkpoints) == (0, 20, [[8, 1], [16, 2]])
    assert [(c.start_pos, len(c.token_ids)) for c in plans[1].chunks] == [(20, 2)]
    assert checkpoint_slots(sched) == {8: 1, 16: 2, 20: 3}
    saves = [op for p in plans for op in p.ops]
    assert [(op.src_slot, op.dst_slot, op.length) for op in saves] == [(0, 3, 20)]  # only the chunk's end copies
    sched.add(GenerateRequest(2, list(range(1, 23)) + [90, 91], SamplingParams(max_tokens=1)))
    plan = sched.schedule()
    (chunk,) = plan.chunks
    assert chunk.start_pos == 20
    restore = [op for op in plan.ops if type(op).__name__ == "RestoreCheckpoint"]
    assert len(restore) == 1 and restore[0].length == 20 and restore[0].dst_slot == plan.new[0].state_slot


def test_flush_after_everything_finished_frees_every_pool():
    sched = make(prefix_cache=True, budget=64, hybrid=True, interval=8, state_slots=8, num_pages=32, align=4)
    for i in range(3):
        sched.add(req(i + 1, 9 + 5 * i, max_tokens=3))
    run_to_end(sched)
    assert sched.coord.tree.cached_pages > 0
    pages, checkpoints = sched.flush()
    assert pages > 0 and checkpoints > 0
    sched.coord.check_integrity()
    assert free_pages(sched) == 32 and sched.coord.state_slots.free_count == 8


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_aborting_a_preempted_waiting_sequence_forgets_its_record(prefix_cache):
    """A preempted sequence waits with a paused record; its abort releases it, so nothing stays behind."""
    sched = make(num_pages=4, page_size=4, budget=64, max_running=2, prefix_cache=prefix_cache)
    sched.add(req(1, 4, max_tokens=6))
    sched.add(req(2, 3, max_tokens=6))
    deltas = []
    for _ in range(40):
        deltas += step(sched)[1]
        if sched.preemptions:
            break
    assert sched.preemptions == 1
    (paused,) = [s.req_id for s in sched.waiting]
    assert paused in sched.coord.requests
    sched.abort(paused)
    assert paused not in sched.coord.requests
    sched.coord.check_integrity()
    deltas += sched.take_finished() + run_to_end(sched)[1]
    finishes = sorted((d.req_id, d.finish_reason) for d in deltas if d.finish_reason)
    assert finishes == sorted([(1, "length"), (paused, "abort")])
    assert not sched.coord.requests
    assert free_pages(sched) + sched.coord.tree.evictable_pages == 4


def test_preemption_with_prefix_cache_resumes_from_published_pages():
    sched = make(num_pages=6, page_size=4, budget=64, max_running=2, prefix_cache=True)
    sched.add(req(1, 8, max_tokens=8))
    sched.add(req(2, 7, max_tokens=8))
    produced = {1: [], 2: []}
    plans, deltas = run_to_end(sched, token_for=lambda s: 50 + s)
    for d in deltas:
        produced[d.req_id] += d.token_ids
    assert sched.preemptions > 0
    assert all(len(v) == 8 for v in produced.values())
    resumed = [c for p in plans for c in p.chunks if c.start_pos > 0 and p.new and c.slot == p.new[0].slot]
    assert resumed, "a preempted sequence should resume from its cached prefix"


def checkpoint_slots(sched):
    """{depth: state slot} of every checkpoint in the tree."""
    return {n.depth: n.checkpoint.slot for n in sched.coord.tree.nodes() if n.checkpoint is not None}


def test_hybrid_decode_moves_one_rolling_checkpoint_and_keeps_interval_ones():
    sched = make(prefix_cache=True, budget=64, hybrid=True, interval=16, state_slots=8, num_pages=32, align=4)
    sched.add(req(1, 6, max_tokens=20))
    plans, _ = run_to_end(sched, token_for=lambda s: 40)  # computes 6 + 19 tokens
    saves = [(op.length, op.dst_slot) for p in plans for op in p.ops]
    # the prompt's 4 and the interval's 16 stay; 8 and 20 start a rolling one that moves on a page
    assert saves == [(4, 1), (8, 2), (12, 2), (16, 2), (20, 3), (24, 3)]
    assert all(op.src_slot == plans[0].new[0].state_slot == 0 for p in plans for op in p.ops)
    assert checkpoint_slots(sched) == {4: 1, 16: 2, 24: 3}
    sched.add(GenerateRequest(2, list(range(1, 7)) + [40] * 20 + [70], SamplingParams(max_tokens=1)))
    plan = sched.schedule()
    assert plan.chunks[0].start_pos == 24  # the next turn hits the finish's checkpoint
    assert [(op.src_slot, op.length) for op in plan.ops] == [(3, 24)]


def test_hybrid_preemption_resumes_from_the_rolling_checkpoint():
    sched = make(num_pages=8, page_size=4, budget=64, max_running=2, prefix_cache=True, hybrid=True,
                 interval=64, state_slots=8)  # fmt: skip
    sched.add(req(1, 6, max_tokens=14))
    sched.add(req(2, 5, max_tokens=14))
    plans, deltas = run_to_end(sched, token_for=lambda s: 50 + s)
    assert sched.preemptions == 1
    assert sorted(len([t for d in deltas if d.req_id == r for t in d.token_ids]) for r in (1, 2)) == [14, 14]
    ops = [(type(op).__name__, op.src_slot, op.dst_slot, op.length) for p in plans for op in p.ops]
    # request 2 (live slot 1) rolls slot 4 through 8 and 12, is preempted at 13, resumes in live slot 0
    # from slot 4 at 12, and moves it on to 16 (its resumed pin went when it published deeper)
    assert [op for op in ops if op[2] == 4 or op[1] == 4] == [
        ("SaveCheckpoint", 1, 4, 8), ("SaveCheckpoint", 1, 4, 12), ("RestoreCheckpoint", 4, 0, 12),
        ("SaveCheckpoint", 0, 4, 16),
    ]  # fmt: skip


class OffloadLog:
    """A stand-in TierClient that finds nothing and records the published length of every copy out."""

    def __init__(self):
        self.sched: Scheduler | None = None
        self.lengths: list[int] = []

    def lookup(self, req_id, known, prompt_ids, device_hit) -> bool:
        return False

    def offload(self, req_id, known, token_ids) -> bool:
        self.lengths.append(self.sched.coord.hold(req_id).length)
        return True

    def plan_built(self, step) -> None:
        pass

    def step_done(self, step, ok) -> None:
        pass

    def forget_lookup(self, req_id) -> None:
        pass


def test_a_hybrid_prefix_is_copied_out_at_tier_checkpoints_prompt_end_and_finish():
    """Checkpoint interval 8, tier interval 16: the device keeps a checkpoint at 8, 16 and 24, the tiers
    get 16, the prompt's last page boundary (28), decode crossing 32 and the finish at 32 (already held)."""
    layout = TableLayout(slots=4, max_pages=64)
    table = RequestTable(layout, memoryview(bytearray(layout.nbytes())))
    limits = SchedulerLimits(4, 4, 8, 256, frozenset({EOS}), True, 8, chunk_align=4, tier_checkpoint_interval=16)
    tiers = OffloadLog()
    sched = Scheduler(limits, CacheCoordinator(CacheSpec(4, 32, 12, 0, True, 8, True)), table, tiers)
    tiers.sched = sched
    sched.add(req(1, 30, max_tokens=4))
    while sched.has_work():
        step(sched)
    assert tiers.lengths == [16, 28, 32, 32]


def prefill_sizes(plans):
    return [(c.start_pos, len(c.token_ids)) for p in plans for c in p.chunks if len(c.token_ids) > 1]


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_a_30k_prompt_takes_4_prefill_steps_of_8k(prefix_cache):
    """Issue 12, acceptance 2: chunks are sized by the budget and the prompt's end only."""
    sched = make(num_pages=2048, page_size=16, budget=8192, max_context=32768, prefix_cache=prefix_cache,
                 hybrid=True, interval=256, state_slots=130, max_pages=2048)
    sched.add(req(1, 30_000, max_tokens=2))
    plan = sched.schedule()
    (chunk,) = plan.chunks
    depths = [chunk.start_pos + tokens for tokens, _ in chunk.checkpoints]
    assert depths == (list(range(256, 8192, 256)) if prefix_cache else [])
    assert checkpoint_slots(sched) == {}  # nothing is published before the step's result
    sampled = [Sampled(c.slot, 7, None, None) for c in plan.chunks if c.sample]
    sched.on_result(StepResult(plan.step, sampled, 0.0), plan)
    kept = {depth: slot for depth, (_, slot) in zip(depths, chunk.checkpoints)}
    if prefix_cache:  # the chunk's end is attached too, its state copied by the next plan's op
        (save,) = sched._ops
        kept[8192] = save.dst_slot
    assert checkpoint_slots(sched) == kept
    plans, _ = run_to_end(sched)
    assert prefill_sizes([plan] + plans) == [(0, 8192), (8192, 8192), (16384, 8192), (24576, 5424)]
    if prefix_cache:
        assert sorted(checkpoint_slots(sched)) == list(range(256, 30_000, 256)) + [30_000]
        assert [op.length for p in plans for op in p.ops] == [8192, 16384, 24576, 30_000]
        assert len(set(checkpoint_slots(sched).values())) == 118
    else:
        assert checkpoint_slots(sched) == {} and sched.coord.state_slots.free_count == 130


def test_short_state_slots_keep_the_deepest_checkpoints_and_never_fail_the_step():
    sched = make(num_pages=160, page_size=16, budget=2048, max_context=4096, prefix_cache=True, hybrid=True,
                 interval=256, state_slots=4, max_pages=160)
    sched.add(req(1, 2500, max_tokens=1))
    plan = sched.schedule()
    (chunk,) = plan.chunks
    assert len(chunk.token_ids) == 2048 and [t for t, _ in chunk.checkpoints] == [1280, 1536, 1792]
    sched.on_result(StepResult(plan.step, [], 0.0), plan)
    assert sorted(checkpoint_slots(sched)) == [1536, 1792, 2048]  # the chunk end's save evicted the oldest
    plans, deltas = run_to_end(sched)
    assert deltas[-1].finish_reason == "length"
    assert prefill_sizes([plan] + plans) == [(0, 2048), (2048, 448), (2496, 4)]


def test_an_unaligned_hit_is_cut_at_its_first_boundary_then_chunks_align_again():
    sched = make(num_pages=128, page_size=16, budget=512, max_context=2048, prefix_cache=True, hybrid=True,
                 interval=64, state_slots=64, max_pages=128)
    sched.add(req(1, 700, max_tokens=1))
    plans, _ = run_to_end(sched)
    # 700 tokens: [0, 512) by the budget, then cut at the prompt's last page boundary, 688
    assert prefill_sizes(plans) == [(0, 512), (512, 176), (688, 12)]
    assert sorted(checkpoint_slots(sched)) == list(range(64, 689, 64)) + [688]
    sched.add(GenerateRequest(2, list(range(1, 701)) + list(range(800, 900)), SamplingParams(max_tokens=1)))
    plans, _ = run_to_end(sched)
    assert plans[0].chunks[0].start_pos == 688  # the prompt-end checkpoint
    assert prefill_sizes(plans) == [(688, 16), (704, 96)]
    assert [t for t, _ in plans[1].chunks[0].checkpoints] == [64]  # 768, from an aligned chunk again


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_a_budget_that_sets_the_end_rounds_it_down_to_the_gdn_chunk(prefix_cache):
    sched = make(num_pages=64, page_size=16, budget=100, max_context=1024, prefix_cache=prefix_cache,
                 hybrid=True, interval=64, state_slots=16, max_pages=64)
    sched.add(req(1, 300, max_tokens=1))
    plans, _ = run_to_end(sched)
    # the prompt's last page boundary (288) cuts: an unaligned chunk follows it
    sizes = [(192, 96), (288, 12)] if prefix_cache else [(192, 64), (256, 44)]
    assert prefill_sizes(plans) == [(0, 64), (64, 64), (128, 64)] + sizes
    sched = make(budget=10, prefix_cache=prefix_cache, hybrid=True, interval=64, state_slots=8, num_pages=64)
    sched.add(req(2, 30, max_tokens=1))
    plans, _ = run_to_end(sched)  # less than a GDN chunk: the end stays where the budget put it
    assert [n for _, n in prefill_sizes(plans)] == [10, 10, 8, 2] if prefix_cache else [10, 10, 10]


def test_in_chunk_checkpoints_are_copied_out_to_the_cpu_tier_as_they_publish():
    from hkv.engine.tier_client import TierClient
    from hkv.ipc.messages import TierFound, TierLookup, TierReserve

    sched = make(num_pages=64, page_size=16, budget=512, max_context=1024, prefix_cache=True, hybrid=True,
                 interval=64, state_slots=16, max_pages=64)
    sched.tiers = TierClient(sched.coord, bytes(16), 16, True, 64, 16)
    sched.limits = dataclasses.replace(sched.limits, tier_checkpoint_interval=128)
    sched.add(req(1, 300, max_tokens=1))
    (lookup,) = sched.tiers.take_outbox()
    assert isinstance(lookup, TierLookup)
    sched.on_tier_found(TierFound(lookup.lookup_id, 0, [], [], None))
    plan = sched.schedule()
    assert [t for t, _ in plan.chunks[0].checkpoints] == [64, 128, 192, 256]  # then cut at 288
    sched.on_result(StepResult(plan.step, [], 0.0), plan)
    reserves = [m for m in sched.tiers.take_outbox() if isinstance(m, TierReserve)]
    # one offload per kept checkpoint at a tier interval multiple and at the prompt's last page
    # boundary, each covering the pages up to it, with its state
    assert [(len(m.keys) * 16, m.state) for m in reserves] == [(128, True), (256, True), (288, True)]


def test_a_cpu_tier_hit_becomes_a_device_prefix_with_its_checkpoint():
    """A hybrid prompt served from the CPU tier loads its pages and state, then keeps them on the device:
    the loaded prefix is published with a checkpoint at its end (saved from the live slot right after the
    load, before the forward moves it on), so the next prompt sharing it hits the device, with no load."""
    from hkv.cache.types import LoadPages, LoadState, RestoreCheckpoint, SaveCheckpoint
    from hkv.engine.tier_client import TierClient
    from hkv.ipc.messages import TierFound, TierLookup

    sched = make(num_pages=64, page_size=16, budget=512, max_context=1024, prefix_cache=True, hybrid=True,
                 interval=64, state_slots=16, max_pages=64)
    sched.tiers = TierClient(sched.coord, bytes(16), 16, True, 64, 16)
    prompt = list(range(1, 201))
    sched.add(GenerateRequest(1, prompt, SamplingParams(max_tokens=1)))
    (lookup,) = sched.tiers.take_outbox()
    assert isinstance(lookup, TierLookup) and lookup.first == 0
    sched.on_tier_found(TierFound(lookup.lookup_id, 0, list(range(20, 28)), [False] * 8, 5))  # pages 0..7
    plan = sched.schedule()
    (chunk,) = plan.chunks
    assert chunk.start_pos == 128
    live = sched.running[1].state_slot
    load_pages, load_state, save = plan.ops
    assert isinstance(load_pages, LoadPages) and load_pages.src_entries == list(range(20, 28))
    assert isinstance(load_state, LoadState) and (load_state.src_entry, load_state.dst_slot) == (5, live)
    assert isinstance(save, SaveCheckpoint) and (save.src_slot, save.length) == (live, 128)
    assert checkpoint_slots(sched)[128] == save.dst_slot
    sched.coord.check_integrity()
    sched.on_result(StepResult(plan.step, [Sampled(chunk.slot, 7, None, None)], 0.0), plan)
    run_to_end(sched)

    sched.add(GenerateRequest(2, prompt[:150] + [900, 901], SamplingParams(max_tokens=1)))
    for message in sched.tiers.take_outbox():  # its lookup, past the device hit, finds nothing
        if isinstance(message, TierLookup):
            sched.on_tier_found(TierFound(message.lookup_id, message.first, [], [], None))
    plan = sched.schedule()
    (chunk,) = plan.chunks
    assert chunk.start_pos == 128  # a device hit at the promoted checkpoint
    assert not any(isinstance(op, (LoadPages, LoadState)) for op in plan.ops)
    assert any(isinstance(op, RestoreCheckpoint) and op.length == 128 for op in plan.ops)


# --- waiting for a prefix another request is prefilling (Scheduler._waits_for_prefix) ---


def shared_req(req_id, shared, own, max_tokens=2):
    """A prompt of `shared` common tokens (1, 2, ...) then `own` tokens of its own."""
    own_ids = [1000 * req_id + i for i in range(own)]
    return GenerateRequest(req_id, list(range(1, shared + 1)) + own_ids, SamplingParams(max_tokens=max_tokens))


def starts(plan):
    return {c.slot: c.start_pos for c in plan.chunks}


def test_a_burst_sharing_a_prefix_prefills_it_once():
    sched = make(prefix_cache=True, budget=256, num_pages=64, page_size=4, prefix_wait_min=8)
    for r in (1, 2, 3):
        sched.add(shared_req(r, 32, 4))
    plan, _ = step(sched)
    assert [(c.start_pos, len(c.token_ids)) for c in plan.chunks] == [(0, 36)]  # the other two wait for it
    assert [s.req_id for s in sched.waiting] == [2, 3] and sched.prefix_waits == 2
    plan, _ = step(sched)
    prefills = [c for c in plan.chunks if not c.follows and c.start_pos != 36]
    assert [(c.start_pos, len(c.token_ids)) for c in prefills] == [(32, 4), (32, 4)]  # from the hit
    assert {r: sched.running[r].cached_tokens for r in (2, 3)} == {2: 32, 3: 32}
    run_to_end(sched)
    assert sched.prefix_waits == 2  # once each
    sched.coord.check_integrity()


@pytest.mark.parametrize("minimum", [64, 0], ids=["share-below-the-minimum", "minimum-0-turns-it-off"])
def test_without_the_wait_a_burst_computes_the_prefix_beside_itself(minimum):
    """A share below prefix_wait_min never waits, and --prefix-wait-tokens 0 waits for nothing: the
    burst is admitted together, as before the wait existed."""
    sched = make(prefix_cache=True, budget=256, num_pages=64, page_size=4, prefix_wait_min=minimum)
    for r in (1, 2, 3):
        sched.add(shared_req(r, 32, 4))
    plan, _ = step(sched)
    assert sorted(c.start_pos for c in plan.chunks) == [0, 0, 0] and sched.prefix_waits == 0


def test_no_prefix_cache_never_waits():
    sched = make(prefix_cache=False, budget=256, num_pages=64, page_size=4, prefix_wait_min=8)
    for r in (1, 2):
        sched.add(shared_req(r, 32, 4))
    plan, _ = step(sched)
    assert len(plan.chunks) == 2 and sched.prefix_waits == 0


def test_a_request_sharing_nothing_passes_a_held_one():
    sched = make(prefix_cache=True, budget=256, num_pages=64, page_size=4, prefix_wait_min=8)
    sched.add(shared_req(1, 32, 4))
    sched.add(shared_req(2, 32, 4))
    sched.add(GenerateRequest(3, [500 + i for i in range(20)], SamplingParams(max_tokens=2)))
    plan, _ = step(sched)
    assert sorted(n.req_id for n in plan.new) == [1, 3] and [s.req_id for s in sched.waiting] == [2]
    run_to_end(sched)


def test_a_held_request_starts_once_the_prefix_is_published():
    """The budget would take both in one step; the waiter shares 48 tokens and starts there a step later."""
    sched = make(prefix_cache=True, budget=72, num_pages=64, page_size=4, prefix_wait_min=8, max_pages=32)
    sched.add(shared_req(1, 64, 0))
    sched.add(shared_req(2, 48, 8))
    plan, _ = step(sched)
    assert [n.req_id for n in plan.new] == [1]
    plan, _ = step(sched)
    assert [n.req_id for n in plan.new] == [2] and sched.running[2].cached_tokens == 48
    run_to_end(sched)


def test_a_feeder_that_needs_several_steps_is_waited_for_to_the_shared_boundary():
    sched = make(prefix_cache=True, budget=20, num_pages=64, page_size=4, prefix_wait_min=8, max_pages=32)
    sched.add(shared_req(1, 64, 0))
    sched.add(shared_req(2, 48, 8))
    first = {}
    for _ in range(8):
        plan, _ = step(sched)
        first.update({n.req_id: sched.by_slot[n.slot].cached_tokens for n in plan.new if n.slot in sched.by_slot})
        if len(first) == 2:
            break
    assert first == {1: 0, 2: 48}
    run_to_end(sched)


def test_the_wait_ends_when_the_feeder_is_aborted():
    """Mid-prompt (40 of 64 tokens published, short of the 48 shared) the feeder leaves: the waiter
    starts next step from what was published, where it would otherwise wait on."""
    sched = make(prefix_cache=True, budget=40, num_pages=64, page_size=4, prefix_wait_min=8, max_pages=32)
    sched.add(shared_req(1, 64, 0))
    sched.add(shared_req(2, 48, 8))
    step(sched)
    sched.abort(1)
    plan, _ = step(sched)
    assert [n.req_id for n in plan.new] == [2] and sched.running[2].cached_tokens == 40
    run_to_end(sched)
    sched.coord.check_integrity()


def test_a_hybrid_burst_waits_for_the_interval_checkpoint():
    """Hybrid: the hit a waiter can get is an interval multiple (or the feeder prompt's last page)."""
    sched = make(prefix_cache=True, budget=1024, num_pages=128, page_size=16, max_pages=32, hybrid=True,
                 interval=64, align=64, state_slots=32, prefix_wait_min=64)
    sched.add(shared_req(1, 150, 50))
    sched.add(shared_req(2, 150, 20))
    plan, _ = step(sched)
    assert [n.req_id for n in plan.new] == [1] and sched.prefix_waits == 1
    plan, _ = step(sched)
    assert sched.running[2].cached_tokens == 128  # 150 shared: the checkpoint at 128
    run_to_end(sched)
    sched.coord.check_integrity()


def test_a_next_turn_waits_for_the_whole_previous_prompt():
    """A prompt that extends another's whole prompt waits for its last page boundary's checkpoint."""
    sched = make(prefix_cache=True, budget=1024, num_pages=128, page_size=16, max_pages=32, hybrid=True,
                 interval=256, align=64, state_slots=32, prefix_wait_min=64)
    sched.add(shared_req(1, 200, 0))
    sched.add(shared_req(2, 200, 30))
    step(sched)
    assert sched.prefix_waits == 1
    step(sched)
    assert sched.running[2].cached_tokens == 192  # the feeder's prompt's last page boundary
    run_to_end(sched)


def test_a_resumed_sequence_with_processed_logits_brings_its_history():
    """Issue 37: the ranks rebuild a processed sequence's counts and matcher at every admission, from the
    prompt (with a repetition penalty) and the tokens it generated before it was preempted."""
    sched = make(num_pages=4, page_size=4, budget=64, max_running=2)
    sched.add(req(1, 4, max_tokens=6))
    sched.add(req(2, 3, max_tokens=6, repetition_penalty=1.5))
    announced = []
    for _ in range(40):
        if not sched.has_work():
            break
        plan, _ = step(sched, token_for=lambda s: 50 + s)
        announced += [(n.req_id, n.prompt_ids, n.output_ids) for n in plan.new] if plan is not None else []
    assert sched.preemptions >= 1
    first, *again = [a for a in announced if a[0] == 2]
    assert first == (2, [1, 2, 3], []) and again
    assert all(prompt == [1, 2, 3] and output and set(output) <= {50, 51} for _, prompt, output in again)
    assert all(prompt == output == [] for r, prompt, output in announced if r == 1)  # plain: nothing extra


def test_a_probe_plan_runs_nothing_and_keeps_numbers_and_slots_in_order():
    """Issue 38: the router asks idle ranks for a sign of life with a plan like any other: next in number,
    carrying the slots freed since the last plan; its result closes those books and brings back what
    happened meanwhile (an abort), and the plans after it number on."""
    sched = make(max_running=2)
    sched.add(req(1, 3, max_tokens=1))
    plan, deltas = step(sched)
    assert [d.finish_reason for d in deltas] == ["length"] and not sched.has_work()
    assert sched.schedule() is None
    probe = sched.probe_plan()
    assert (probe.step, probe.new, probe.chunks, probe.ops) == (plan.step + 1, [], [], [])
    assert probe.freed == [plan.chunks[0].slot] and sched.in_flight == 1
    sched.add(req(2, 3))  # arrives and leaves while the probe is out
    sched.abort(2)
    deltas = sched.on_result(StepResult(probe.step, [], 0.0), probe)
    assert [(d.req_id, d.finish_reason) for d in deltas] == [(2, "abort")] and sched.in_flight == 0
    sched.add(req(3, 3, max_tokens=1))
    after, deltas = step(sched)
    assert after.step == probe.step + 1 and after.freed == [] and after.chunks[0].slot == plan.chunks[0].slot
    assert [d.finish_reason for d in deltas] == ["length"]
    assert free_pages(sched) == sched.coord.spec.num_pages
    sched.coord.check_integrity()
