"""Prompt text -> token ids without stalling the api.

    text prompts --size bound (protocol.py)--> at most INLINE_CHARS in all: encode here
                                               more: TokenizeWorker, a separate process

tokenizers' `encode` holds the GIL for the whole encode (10 s for 8 MiB on
the development VM) and a huge encoding costs hundreds of bytes per token,
so big prompts go to a process (hkv/openai/tokenize_worker.py): the event
loop only waits on a pipe, and the memory is the worker's, which retires
once it grew. One job runs at a time; QUEUE_BOUND may wait, more get 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import sys
from collections.abc import Sequence

import msgspec

from hkv.models.tokenizer import Tokenizer
from hkv.openai.protocol import ModelLimits, ProtocolError, check_prompt_len
from hkv.openai.tokenize_worker import TokenizeFailed, TokenizeJob, WorkerAnswer, frame, frame_length

log = logging.getLogger("hkv.api")
INLINE_CHARS = 4096  # ~4 ms of encode at most on the event loop
QUEUE_BOUND = 32  # big-prompt jobs waiting for the worker; more get 503
STOP_GRACE_S = 2.0


def longest_token_chars(tokenizer: Tokenizer) -> int:
    """Characters of the longest token text (added tokens included): no token covers more of a prompt,
    so a prompt of more than `tokens * this` characters has more than `tokens` tokens."""
    texts = tokenizer.backend.decode_batch([[i] for i in range(tokenizer.vocab_size)], skip_special_tokens=False)
    return max((len(t) for t in texts), default=1)


class TokenizeWorker:
    """The tokenizer process and the one job it runs; started lazily again after it retires or dies."""

    def __init__(self, folder: str):
        self._folder = folder
        self._proc: asyncio.subprocess.Process | None = None
        self._gone: list[asyncio.subprocess.Process] = []  # killed or retired, not yet reaped
        self._lock = asyncio.Lock()
        self._waiting = 0
        self._job_ids = itertools.count(1)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(WorkerAnswer)

    async def start(self) -> None:
        await self._ensure()

    async def encode(self, texts: list[str], add_special_tokens: bool, limit: int) -> list[list[int] | int]:
        """Per text its ids, or its token count when it has more than `limit` tokens."""
        if self._waiting >= QUEUE_BOUND:
            raise ProtocolError(503, "the tokenizer is busy with long prompts; retry later", None, "overloaded")
        self._waiting += 1
        try:
            async with self._lock:
                return await self._run(TokenizeJob(next(self._job_ids), texts, add_special_tokens, limit))
        finally:
            self._waiting -= 1

    async def _run(self, job: TokenizeJob) -> list[list[int] | int]:
        proc = await self._ensure()
        try:
            proc.stdin.write(frame(self._encoder.encode(job)))
            await proc.stdin.drain()
            head = await proc.stdout.readexactly(4)
            answer = self._decoder.decode(await proc.stdout.readexactly(frame_length(head)))
        except asyncio.CancelledError:
            self._discard()  # its answer would be read as the next job's
            raise
        except (ConnectionError, asyncio.IncompleteReadError, ValueError, msgspec.DecodeError) as exc:
            log.error("the tokenizer process failed: %r", exc)
            self._discard()
            raise ProtocolError(503, "the tokenizer process failed; retry", None, "tokenizer_failed") from None
        if answer.job_id != job.job_id:
            self._discard()
            raise ProtocolError(503, "the tokenizer process answered another job; retry", None, "tokenizer_failed")
        if isinstance(answer, TokenizeFailed):
            raise ProtocolError(400, f"the prompt could not be tokenized: {answer.error}", "prompt")
        if answer.retiring:
            self._retire()
        return [ids if ids is not None else count for ids, count in zip(answer.ids, answer.counts)]

    async def _ensure(self) -> asyncio.subprocess.Process:
        await self._reap()
        if self._proc is None or self._proc.returncode is not None:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "hkv.openai.tokenize_worker", "--folder", self._folder,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            )
        return self._proc

    def _retire(self) -> None:
        """It exits by itself after a retiring answer; reap it before the next start."""
        if self._proc is not None:
            self._gone.append(self._proc)
            self._proc = None

    def _discard(self) -> None:
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
        self._retire()

    async def _reap(self) -> None:
        gone, self._gone = self._gone, []
        for proc in gone:
            await proc.wait()

    async def aclose(self) -> None:
        if self._proc is not None and self._proc.stdin is not None:
            self._proc.stdin.close()  # EOF: the worker exits
            try:
                async with asyncio.timeout(STOP_GRACE_S):
                    await self._proc.wait()
            except TimeoutError:
                self._discard()
            self._retire()
        await self._reap()


class PromptEncoder:
    """Text prompts -> ids for the handlers: small ones here, big ones in the worker."""

    def __init__(self, tokenizer: Tokenizer, worker: TokenizeWorker, limits: ModelLimits):
        self.tokenizer = tokenizer
        self.worker = worker
        self.limits = limits

    async def encode(self, texts: Sequence[str], add_special_tokens: bool) -> list[list[int]]:
        """Ids of each text; raises ProtocolError (400) for a prompt longer than the context."""
        if sum(len(t) for t in texts) <= INLINE_CHARS:
            return [self.tokenizer.encode(t, add_special_tokens=add_special_tokens) for t in texts]
        out = await self.worker.encode(list(texts), add_special_tokens, self.limits.max_prompt_tokens)
        for result in out:
            if isinstance(result, int):
                check_prompt_len(result, self.limits)
        return out
