"""Per-request output state: turns the router's TokenDeltas into choice updates.

One `Generation` per HTTP request holds one `ChoiceState` per sequence. The
same code path serves streaming and non-streaming responses, so both produce
identical text: a non-streaming response is the concatenation of the updates
a streaming one would have sent.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from hkv.ipc.messages import CACHE_TIERS, TokenDelta, TopLogprob
from hkv.openai.chat_output import ChatOutputParser, ParsedDelta, ToolCallDelta
from hkv.openai.detok import Decoder, IncrementalDetokenizer, StopMatcher
from hkv.openai.protocol import SequencePlan



@dataclass
class ChoiceUpdate:
    """What one delta changed in one choice: the unit of a streamed chunk."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[TopLogprob]] | None
    finish_reason: str | None
    stop_hit: bool  # a stop string ended the choice: the api must abort its sequence
    reasoning: str = ""  # chat with a reasoning parser: the part of `text`'s delta that was reasoning
    tool_calls: list[ToolCallDelta] = field(default_factory=list)  # chat with tools: call fragments completed


@dataclass
class ChoiceState:
    """The output so far of one sequence."""

    index: int
    prompt_index: int
    detok: IncrementalDetokenizer
    stops: StopMatcher | None
    want_logprobs: bool
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[TopLogprob]] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    cached_tokens: int = 0
    cache_tiers: dict[str, int] | None = None
    first_token_at: float | None = None  # monotonic seconds
    finished_at: float | None = None
    parser: ChatOutputParser | None = None  # chat: reasoning and tool calls split out of the text
    reasoning: list[str] = field(default_factory=list)
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def apply(self, delta: TokenDelta, now: float) -> ChoiceUpdate | None:
        """Fold one delta in; None once the choice has finished."""
        if self.finish_reason is not None:
            return None
        if delta.token_ids and self.first_token_at is None:
            self.first_token_at = now
        self.cached_tokens = delta.cached_tokens
        if delta.cache_tiers is not None:
            self.cache_tiers = delta.cache_tiers
        taken, text, stop_hit = self._consume(delta.token_ids)
        if stop_hit:
            self.finish_reason = "stop"
        elif delta.finish_reason is not None:
            text += self._flush()
            self.finish_reason = delta.finish_reason
            self.error = delta.error
        if self.finish_reason is not None:
            self.finished_at = now
        new_ids = list(delta.token_ids[:taken])
        logprobs, tops = self._record_logprobs(delta, taken)
        self.token_ids.extend(new_ids)
        parsed = self._parse(text)
        self.text.append(parsed.content)
        return ChoiceUpdate(self.index, parsed.content, new_ids, logprobs, tops, self.finish_reason, stop_hit,
                            parsed.reasoning, parsed.tool_calls)

    def _parse(self, text: str) -> ParsedDelta:
        """Content, reasoning and tool calls of new text (all content without a parser)."""
        if self.parser is None:
            return ParsedDelta(content=text)
        parsed = self.parser.feed(text)
        if self.finish_reason is not None:
            parsed.add(self.parser.flush())
            if self.parser.called and self.finish_reason == "stop":
                self.finish_reason = "tool_calls"
        self.reasoning.append(parsed.reasoning)
        self.tool_calls.extend(parsed.tool_calls)
        return parsed

    def _consume(self, token_ids: Sequence[int]) -> tuple[int, str, bool]:
        """Detokenize token by token so a stop string cuts at the token that completed it."""
        if self.stops is None:
            return len(token_ids), self.detok.feed(token_ids), False
        pieces = []
        for taken, token in enumerate(token_ids, start=1):
            pieces.append(self.stops.feed(self.detok.feed((token,))))
            if self.stops.matched is not None:
                return taken, "".join(pieces), True
        return len(token_ids), "".join(pieces), False

    def _flush(self) -> str:
        tail = self.detok.flush()
        if self.stops is None:
            return tail
        return self.stops.feed(tail) + self.stops.flush()

    def _record_logprobs(
        self, delta: TokenDelta, taken: int
    ) -> tuple[list[float] | None, list[list[TopLogprob]] | None]:
        if not self.want_logprobs:
            return None, None
        # A router that sent no logprobs despite the request: report 0-width alternatives.
        logprobs = list((delta.logprobs or [0.0] * taken)[:taken])
        tops = list((delta.top_logprobs or [[] for _ in range(taken)])[:taken])
        self.logprobs.extend(logprobs)
        self.top_logprobs.extend(tops)
        return logprobs, tops

    @property
    def output_text(self) -> str:
        """The content (without reasoning and tool calls when a parser split them out)."""
        return "".join(self.text)

    @property
    def reasoning_text(self) -> str | None:
        """The reasoning, None without a reasoning parser's split (or when there was none)."""
        return "".join(self.reasoning) or None


class Generation:
    """All choices of one HTTP request and what they used."""

    def __init__(
        self,
        plans: Sequence[SequencePlan],
        req_ids: Sequence[int],
        prompts: Sequence[Sequence[int]],
        tokenizer: Decoder,
        stops: Sequence[str],
        want_logprobs: bool,
        started_at: float,
        output_parser: Callable[[], ChatOutputParser] | None = None,
    ):
        self.started_at = started_at  # monotonic seconds when the HTTP request arrived
        self.prompt_lens = [len(p) for p in prompts]
        self.choices: list[ChoiceState] = []
        self.peer_holds: list = []  # prefill mode: the device holds its sequences' finishes named (PeerHold)
        self._by_req: dict[int, ChoiceState] = {}
        for plan, req_id in zip(plans, req_ids):
            choice = ChoiceState(
                index=plan.choice,
                prompt_index=plan.prompt_index,
                detok=IncrementalDetokenizer(tokenizer, prompts[plan.prompt_index]),
                stops=StopMatcher(stops) if stops else None,
                want_logprobs=want_logprobs,
                parser=output_parser() if output_parser is not None else None,
            )
            self.choices.append(choice)
            self._by_req[req_id] = choice

    def apply(self, delta: TokenDelta) -> ChoiceUpdate | None:
        choice = self._by_req.get(delta.req_id)
        if choice is None:
            return None
        return choice.apply(delta, time.monotonic())

    @property
    def done(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    @property
    def error(self) -> str | None:
        """The first engine error among the choices, if any failed."""
        for choice in self.choices:
            if choice.finish_reason == "error":
                return choice.error or "the engine failed to generate this sequence"
        return None

    def usage(self) -> dict:
        """OpenAI usage; a prompt shared by n choices counts once, with its first choice's cache hits."""
        completion = sum(len(c.token_ids) for c in self.choices)
        prompt = sum(self.prompt_lens)
        tiers = dict.fromkeys(CACHE_TIERS, 0)
        cached = 0
        seen: set[int] = set()
        for choice in self.choices:
            if choice.prompt_index in seen:
                continue
            seen.add(choice.prompt_index)
            cached += choice.cached_tokens
            for tier, count in (choice.cache_tiers or {}).items():
                if tier in tiers:
                    tiers[tier] += count
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
            "cache": tiers,
            # hkv's: each choice's own prompt cache hits, in choice order (n choices share one prefill)
            "choices_cached_tokens": [c.cached_tokens for c in sorted(self.choices, key=lambda c: c.index)],
        }
