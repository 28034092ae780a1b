"""Incremental detokenization and stop-string matching for streamed output.

Both pieces hold text back rather than emit something they might have to
take back: the detokenizer holds a trailing U+FFFD (a UTF-8 character split
across tokens) until the next token completes it; the stop matcher holds the
longest tail that could still grow into a stop string. So the concatenation
of every delta is the same however the tokens were chunked, and streamed
text equals non-streamed text.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

REPLACEMENT = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded alongside the output (SentencePiece spacing)


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Feed token ids, get newly printable text (vLLM's prefix/read offset scheme).

        ids:  [ ... context ... | printed ............ | not yet printed ]
                                ^ prefix_offset        ^ read_offset

    `decode(ids[prefix:read])` is text already emitted; `decode(ids[prefix:])`
    minus that is the candidate delta, emitted unless it ends in U+FFFD.
    """

    def __init__(self, tokenizer: Decoder, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        context = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        if context and self._decode(context).endswith(REPLACEMENT):
            context = []  # the prompt ends mid-character: its tail would garble the first delta
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def feed(self, token_ids: Iterable[int]) -> str:
        """Append tokens; return the text they made printable (may be empty)."""
        self._ids.extend(token_ids)
        if len(self._ids) == self._read_offset:
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._compact()
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """The sequence ended: emit whatever was held back, broken character included."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]

    def _compact(self) -> None:
        # Only ids from prefix_offset on are ever decoded again: drop the rest.
        if self._prefix_offset > 256:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0


class StopMatcher:
    """Finds the first stop string in streamed text; never emits any part of it.

    Emitted text never ends with a proper prefix of a stop string: that tail is
    held back, so a stop string spanning deltas is still caught, and a match can
    only start inside the held-back tail or the new text.
    """

    def __init__(self, stops: Sequence[str]):
        if not stops or not all(stops):
            raise ValueError("StopMatcher needs non-empty stop strings")
        self._stops = tuple(stops)
        self._held = ""
        self.matched: str | None = None  # the stop string that ended the text

    def feed(self, text: str) -> str:
        """Add text; return what is safe to emit. After a match, returns "" forever."""
        if self.matched is not None:
            return ""
        buf = self._held + text
        hit = self._first_match(buf)
        if hit is not None:
            start, stop = hit
            self.matched = stop
            self._held = ""
            return buf[:start]
        keep = self._partial_tail(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """The text ended without a match: release the held-back tail."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, buf: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self._stops:
            pos = buf.find(stop)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, stop)
        return best

    def _partial_tail(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(buf)), longest, -1):
                if buf.endswith(stop[:size]):
                    longest = size
                    break
        return longest
