"""hkv-bench's workload generators and the ideal hit-rate arithmetic (tools/bench/bench_workloads.py)."""

from __future__ import annotations

from tools.bench.bench_workloads import (
    MIN_TOKEN_ID, cap_requests, ideal_hits, multi_turn, random_prompts, request_count, shared_prefix,
)

PAGE = 16


def test_shared_prefix_groups_share_exactly_their_system_prompt():
    sessions = shared_prefix(groups=3, per_group=4, system_len=40, question_len=8, vocab=500, seed=1)
    prompts = [s.turns[0] for s in sessions]
    assert len(prompts) == 12 and all(len(p) == 48 and len(s.turns) == 1 for p, s in zip(prompts, sessions))
    systems = {p[:40] for p in prompts}
    assert len(systems) == 3 and all(sum(p[:40] == s for p in prompts) == 4 for s in systems)
    assert len({p[40:] for p in prompts}) == 12
    assert all(MIN_TOKEN_ID <= t < 500 for p in prompts for t in p)
    # shuffled: the first four prompts are not one group
    assert len({p[:40] for p in prompts[:4]}) > 1
    assert shared_prefix(3, 4, 40, 8, 500, seed=1) == sessions != shared_prefix(3, 4, 40, 8, 500, seed=2)


def test_multi_turn_and_random_shapes():
    conversations = multi_turn(conversations=2, turns=3, user_len=5, vocab=100, seed=0)
    assert [[len(t) for t in s.turns] for s in conversations] == [[5, 5, 5], [5, 5, 5]]
    prompts = random_prompts(count=50, input_len=40, range_ratio=0.5, vocab=100, seed=0)
    lengths = [len(s.turns[0]) for s in prompts]
    assert min(lengths) >= 20 and max(lengths) <= 40 and len(set(lengths)) > 5


def test_cap_requests_cuts_the_last_session_short():
    sessions = multi_turn(conversations=3, turns=4, user_len=2, vocab=100, seed=0)
    capped = cap_requests(sessions, 6)
    assert [len(s.turns) for s in capped] == [4, 2] and capped[1].turns == sessions[1].turns[:2]
    assert cap_requests(sessions, None) is sessions and request_count(sessions) == 12


def test_ideal_shared_prefix_matches_the_closed_form():
    groups, per_group, system, question = 4, 5, 200, 30
    sessions = shared_prefix(groups, per_group, system, question, vocab=1000, seed=3)
    hits = ideal_hits([(s.turns[0], [7] * 8) for s in sessions], PAGE)
    reuse = system // PAGE * PAGE
    # a group's first prompt caches nothing; the others reuse the system prompt rounded down to a page
    assert sorted(hits) == [0] * groups + [reuse] * (groups * (per_group - 1))
    first_seen = set()
    for session, hit in zip(sessions, hits):
        system_prompt = session.turns[0][:system]
        assert hit == (reuse if system_prompt in first_seen else 0)
        first_seen.add(system_prompt)


def test_ideal_recomputes_at_least_one_token_and_stops_at_the_first_miss():
    a = tuple(range(100, 164))  # four pages
    assert ideal_hits([(a, []), (a, [])], PAGE) == [0, 48]  # not 64: the last token is recomputed
    b = a[:16] + (9,) + a[17:]  # differs in the second page: later equal pages do not count
    assert ideal_hits([(a, []), (b, [])], PAGE) == [0, 16]
    assert ideal_hits([(a[:10], []), (a[:10], [])], PAGE) == [0, 0]


def test_ideal_multi_turn_reuses_the_answer_but_its_last_token():
    first, answer = tuple(range(200, 240)), list(range(300, 320))  # 40 prompt + 20 answer tokens
    second = first + tuple(answer) + tuple(range(400, 440))
    # cached after turn 1: 40 + 19 tokens -> 3 full pages
    assert ideal_hits([(first, answer), (second, [1])], PAGE) == [0, 48]
    longer = list(range(300, 330))  # 40 + 29 = 69 tokens computed -> 4 pages
    second = first + tuple(longer) + (5,)
    assert ideal_hits([(first, longer), (second, [1])], PAGE) == [0, 64]
