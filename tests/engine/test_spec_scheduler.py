"""Speculative decoding in the scheduler: verify chunks, the cursor moving back, the books.

A fake rank verifies drafts against a target whose token at position p is a function
of p (and of the request), and drafts with a controlled drafter: an oracle (proposes the
target's own tokens), an adversary (never matches) and one that matches the first half.
After every result the coordinator's books balance (check_integrity), every running
sequence's cursor equals its computed length, its pages are exactly those that length
needs, and every token the rank kept computed is the sequence's own; the tokens a client
sees equal a run without speculation.
"""

from __future__ import annotations

import pytest

from hkv.ipc.messages import Emitted, Sampled, StepPlan, StepResult
from tests.engine.test_scheduler import EOS, make, req

K = 3


def token_at(req_id: int, pos: int, eos_at: int | None = None) -> int:
    return EOS if pos == eos_at else 3 + (pos * 7 + req_id) % 83


def oracle(req_id, first, k):
    return [token_at(req_id, first + j) for j in range(k)]


def adversary(req_id, first, k):
    return [token_at(req_id, first + j) + 1 for j in range(k)]


def half(req_id, first, k):
    good = (k + 1) // 2
    return oracle(req_id, first, good) + adversary(req_id, first + good, k - good)


class FakeSpecRank:
    """Runs plans in order; keeps, per request, the token computed at every position it accepted."""

    def __init__(self, drafter, eos_at=None, k=K):
        self.drafter, self.eos_at, self.k = drafter, eos_at, k
        self.req_of: dict[int, int] = {}
        self.computed: dict[tuple[int, int], int] = {}
        self.verify_chunks = 0

    def run(self, plan: StepPlan) -> StepResult:
        for seq in plan.new:
            self.req_of[seq.slot] = seq.req_id
        sampled = []
        for c in plan.chunks:
            r = self.req_of[c.slot]
            assert not c.follows, "a drafting sequence was planned ahead of its result"
            kept = len(c.token_ids) - c.drafts
            emitted = []
            if c.drafts:
                self.verify_chunks += 1
                for i, d in enumerate(c.token_ids[1:]):
                    if d != token_at(r, c.start_pos + 1 + i, self.eos_at):
                        break
                    kept += 1
                    emitted.append(d)
            for i, t in enumerate(c.token_ids[:kept]):
                self.computed[(r, c.start_pos + i)] = t
            if not c.sample:
                continue
            end = c.start_pos + kept
            emitted.append(token_at(r, end, self.eos_at))
            proposals = self.drafter(r, end + 1, self.k)
            sampled.append(Sampled(c.slot, emitted[0], None, None,
                                   [Emitted(t, None, None) for t in emitted[1:]], proposals))
        return StepResult(plan.step, sampled, 0.0)


def drive(sched, rank, limit=600, on_step=None):
    out: dict[int, list] = {}
    for _ in range(limit):
        if not sched.has_work():
            break
        plan = sched.schedule()
        if plan is None:
            deltas = sched.take_finished()
            assert deltas, "stuck with nothing out"
        else:
            deltas = sched.on_result(rank.run(plan), plan)
            check_books(sched)
            if on_step is not None:
                on_step(sched)
        for d in deltas:
            out.setdefault(d.req_id, []).append(d)
    assert not sched.has_work()
    return out


def check_books(sched):
    sched.coord.check_integrity()
    ps = sched.limits.page_size
    for seq in sched.running.values():
        rec = sched.coord.requests[seq.req_id]
        assert rec.cursor == seq.kv_len <= seq.total_len - 1
        assert len(rec.pages) == -(-rec.cursor // ps), "look-ahead pages not given back"


def _sched(spec_tokens, hybrid=True, **kw):
    args = dict(num_pages=64, page_size=4, max_running=4, budget=16, prefix_cache=True, hybrid=hybrid,
                interval=8 if hybrid else None, state_slots=32 if hybrid else 0, align=4)
    args.update(kw)
    return make(spec_tokens=spec_tokens, **args)


PROMPTS = {1: 9, 2: 5, 3: 14, 4: 3, 5: 9}


def _run(spec_tokens, drafter, eos_at=None, hybrid=True, max_tokens=lambda r: 10 + 3 * r, **kw):
    sched = _sched(spec_tokens, hybrid, **kw)
    for r, n in PROMPTS.items():
        sched.add(req(r, n, max_tokens=max_tokens(r)))
    rank = FakeSpecRank(drafter, eos_at, k=max(1, spec_tokens))
    return sched, rank, drive(sched, rank)


def _tokens(out):
    return {r: [t for d in ds for t in d.token_ids] for r, ds in out.items()}


def _reasons(out):
    return {r: ds[-1].finish_reason for r, ds in out.items()}


@pytest.mark.parametrize("drafter", [oracle, adversary, half], ids=["oracle", "adversary", "half"])
@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "dense"])
def test_drafts_change_nothing_a_client_sees(drafter, hybrid):
    _, _, plain = _run(0, drafter, hybrid=hybrid)
    sched, rank, spec = _run(K, drafter, hybrid=hybrid)
    assert _tokens(spec) == _tokens(plain) and _reasons(spec) == _reasons(plain)
    for r, n in PROMPTS.items():  # every position the rank kept holds the sequence's own token
        sequence = list(range(1, n + 1)) + _tokens(spec)[r]
        assert all(rank.computed[(q, p)] == sequence[p] for (q, p) in rank.computed if q == r)
    accepted, verified = sched.spec_accepted, sched.spec_verified
    assert rank.verify_chunks == sum(sched.spec_histogram) > 0
    if drafter is oracle:
        assert accepted == verified and sched.spec_histogram[0] == 0
    elif drafter is adversary:
        assert accepted == 0 and sum(sched.spec_histogram[1:]) == 0
    else:
        assert 0 < accepted < verified
    assert len(sched.free_slots) == 4 and sched.coord.pages.free_count + sched.coord.tree.cached_pages == 64


def test_oracle_steps_are_fewer():
    sched_plain, _, _ = _run(0, oracle)
    sched, rank, _ = _run(K, oracle)
    assert next(sched._step) < next(sched_plain._step)


def test_every_page_boundary_is_a_length_a_hybrid_sequence_stops_at():
    """A verify chunk never crosses a page boundary, so the rolling checkpoint saves at each one."""
    lengths: dict[int, set[int]] = {}

    def record(sched):
        for seq in sched.running.values():
            lengths.setdefault(seq.req_id, set()).add(seq.kv_len)

    sched = _sched(K)
    sched.add(req(1, 6, max_tokens=40))
    drive(sched, FakeSpecRank(oracle), on_step=record)
    ps = sched.limits.page_size
    assert {b for b in range(8, 44, ps)} <= lengths[1]


@pytest.mark.parametrize("drafter", [oracle, half])
def test_an_eos_inside_the_accepted_drafts_ends_the_sequence_there(drafter):
    _, _, plain = _run(0, drafter, eos_at=14)
    sched, _, spec = _run(K, drafter, eos_at=14)
    assert _tokens(spec) == _tokens(plain) and _reasons(spec) == _reasons(plain)
    assert set(_reasons(spec).values()) == {"stop"}  # every request reaches position 14
    assert sched.coord.pages.free_count + sched.coord.tree.cached_pages == 64


def test_max_tokens_caps_the_drafts():
    _, _, plain = _run(0, oracle, max_tokens=lambda r: r + 1)
    _, _, spec = _run(K, oracle, max_tokens=lambda r: r + 1)
    assert _tokens(spec) == _tokens(plain)
    assert all(len(t) == r + 1 for r, t in _tokens(spec).items())


def test_preemption_and_abort_with_drafts_leave_the_books_balanced():
    sched = _sched(K, num_pages=12, budget=16)
    for r in (1, 2, 3):
        sched.add(req(r, 7, max_tokens=20))
    rank = FakeSpecRank(half)
    steps = 0
    while sched.has_work() and steps < 300:
        plan = sched.schedule()
        if plan is None:
            sched.take_finished()
            continue
        steps += 1
        if steps == 9:  # request 2 goes while its verify chunk is out
            sched.abort(2)
        sched.on_result(rank.run(plan), plan)
        check_books(sched)
    assert sched.preemptions >= 1 and not sched.has_work()
    assert sched.coord.pages.free_count + sched.coord.tree.cached_pages == 12
    assert not sched.coord.requests


def test_a_malformed_result_with_too_many_tokens_is_refused():
    from hkv.engine.validate import _result

    sched = _sched(K)
    sched.add(req(1, 4, max_tokens=8))  # one chunk, then a decode at a page boundary: room for K drafts
    plan = sched.schedule()
    sched.on_result(FakeSpecRank(oracle).run(plan), plan)
    plan = sched.schedule()
    c = plan.chunks[0]
    assert c.drafts == K
    many = Sampled(c.slot, 5, None, None, [Emitted(5, None, None)] * (K + 1), [])
    assert "tokens emitted" in _result(StepResult(plan.step, [many], 0.0), plan, 100)
    bad = Sampled(c.slot, 5, None, None, [], [100])
    assert "outside the vocabulary" in _result(StepResult(plan.step, [bad], 0.0), plan, 100)


def test_a_sequence_with_processed_logits_decodes_without_drafts(caplog):
    """Issue 37: the verify step samples raw logits, so a constrained or penalised sequence verifies no drafts
    (one token a step, said in the log) while the others beside it draft as before."""
    from hkv.ipc.messages import Constraint

    caplog.set_level("INFO", logger="hkv.router")
    sched = _sched(K)
    sched.add(req(1, 9, max_tokens=12, constraint=Constraint("regex", "[a-z]+")))
    sched.add(req(2, 9, max_tokens=12, repetition_penalty=1.2))
    sched.add(req(3, 9, max_tokens=12))
    assert "request 1 decodes without drafts" in caplog.text and "request 2 decodes" in caplog.text
    assert "request 3" not in caplog.text
    rank = FakeSpecRank(oracle)
    drafted: dict[int, int] = {}
    run = rank.run

    def counting(plan):
        result = run(plan)  # (req_of learns the plan's new sequences first)
        for c in plan.chunks:
            drafted[rank.req_of[c.slot]] = drafted.get(rank.req_of[c.slot], 0) + c.drafts
        return result

    rank.run = counting
    out = drive(sched, rank)
    assert drafted[1] == drafted[2] == 0 and drafted[3] > 0
    assert [len(_tokens(out)[r]) for r in (1, 2, 3)] == [12, 12, 12]
