"""Workloads of `hkv-bench` as token-id sessions, and the hit rate an ideal prefix cache would reach.

A session is a list of turns run one after another; each turn brings new
tokens, and its prompt is everything before it plus those tokens:

    turn 0 prompt = new[0]
    turn k prompt = prompt[k-1] + answer[k-1] + new[k]

shared-prefix and random sessions have one turn; multi-turn sessions have
`--turns`. Token ids are drawn uniformly from [MIN_TOKEN_ID, vocab) by a
seeded `random.Random`, so one seed gives the same prompts on every machine.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# small tokenizers keep their special tokens at the lowest ids (the built-in models use 0-2)
MIN_TOKEN_ID = 16

Tokens = tuple[int, ...]


@dataclass(frozen=True)
class Session:
    turns: tuple[Tokens, ...]  # the new tokens of each turn, in order


def _ids(rng: random.Random, count: int, vocab: int) -> Tokens:
    return tuple(rng.randrange(MIN_TOKEN_ID, vocab) for _ in range(count))


def shared_prefix(groups: int, per_group: int, system_len: int, question_len: int, vocab: int,
                  seed: int) -> list[Session]:
    """groups x per_group one-turn sessions; a group shares a system prompt, each prompt adds its own question.

    The order is shuffled (seeded), as in SGLang's generated-shared-prefix
    benchmark, so a group's prompts do not all arrive together.
    """
    rng = random.Random(seed)
    systems = [_ids(rng, system_len, vocab) for _ in range(groups)]
    sessions = [Session((system + _ids(rng, question_len, vocab),)) for system in systems for _ in range(per_group)]
    rng.shuffle(sessions)
    return sessions


def multi_turn(conversations: int, turns: int, user_len: int, vocab: int, seed: int) -> list[Session]:
    """Conversations of `turns` turns, each turn adding user_len new tokens after the previous answer."""
    rng = random.Random(seed)
    return [Session(tuple(_ids(rng, user_len, vocab) for _ in range(turns))) for _ in range(conversations)]


def random_prompts(count: int, input_len: int, range_ratio: float, vocab: int, seed: int) -> list[Session]:
    """count one-turn sessions of independent prompts, lengths uniform in [input_len * range_ratio, input_len]."""
    rng = random.Random(seed)
    low = max(1, int(input_len * range_ratio))
    return [Session((_ids(rng, rng.randint(low, input_len), vocab),)) for _ in range(count)]


def cap_requests(sessions: list[Session], limit: int | None) -> list[Session]:
    """The first sessions holding `limit` turns in all (the last one cut short); all of them when limit is None."""
    if limit is None:
        return sessions
    kept, left = [], limit
    for session in sessions:
        if left <= 0:
            break
        kept.append(Session(session.turns[:left]))
        left -= len(kept[-1].turns)
    return kept


def request_count(sessions: Iterable[Session]) -> int:
    return sum(len(s.turns) for s in sessions)


def _page_keys(tokens: Sequence[int], page_size: int) -> list[int]:
    """One key per full page, chained so a key names the whole prefix up to the end of its page."""
    keys, key = [], 0
    for end in range(page_size, len(tokens) + 1, page_size):
        key = hash((key, tuple(tokens[end - page_size:end])))
        keys.append(key)
    return keys


def ideal_hits(requests: Iterable[tuple[Sequence[int], Sequence[int]]], page_size: int) -> list[int]:
    """Prompt tokens an infinite page-aligned prefix cache serves to each request, in the order given.

    requests: (prompt, output) pairs in the order they were sent. The cache
    starts empty and, after each request, holds the pages of its prompt plus
    its output but the last token (the last output token is never run through
    the model, so no server has its KV). A hit is the longest run of cached
    pages from the start of the prompt, and at least one prompt token is
    always recomputed:

        prompt      [ page | page | page | pa ]
        reusable    [ page | page | page ]        (len(prompt) - 1) // page_size pages
        hit         the cached ones among those, from the left, up to the first miss
    """
    cached: set[int] = set()
    hits = []
    for prompt, output in requests:
        reusable = (len(prompt) - 1) // page_size
        matched = 0
        for key in _page_keys(prompt, page_size)[:reusable]:
            if key not in cached:
                break
            matched += 1
        hits.append(matched * page_size)
        written = [*prompt, *output][: len(prompt) + max(len(output) - 1, 0)]
        cached.update(_page_keys(written, page_size))
    return hits
