"""The api's tokenizer process: encodes big prompts away from the api's event loop and memory.

    api --TokenizeJob--> stdin  [python -m hkv.openai.tokenize_worker --folder F]  stdout --Tokenized--> api

Frames are a little-endian u32 length and a msgpack body (msgspec Structs,
no pickle), at most MAX_FRAME_BYTES. One job at a time: the api sends the
next only after the answer. A text longer than the job's `limit` tokens comes
back as its count alone, so the api never decodes more ids than a context
holds. The worker exits on EOF of stdin (the api is gone) and after an answer
that leaves its RSS above RECYCLE_RSS_BYTES (a huge encode's memory is not
given back to the OS), so the api starts a fresh one for the next job.
"""

from __future__ import annotations

import argparse
import os
import struct
import sys
from pathlib import Path

import msgspec

MAX_FRAME_BYTES = 64 * 2**20  # a job holds at most the api's request body, an answer at most `limit` ids
RECYCLE_RSS_BYTES = 256 * 2**20
_LENGTH = struct.Struct("<I")


class TokenizeJob(msgspec.Struct, frozen=True, tag="job"):
    job_id: int
    texts: list[str]
    add_special_tokens: bool
    limit: int  # ids come back only for texts of at most this many tokens


class Tokenized(msgspec.Struct, frozen=True, tag="done"):
    job_id: int
    ids: list[list[int] | None]  # per text; None when it has more than `limit` tokens
    counts: list[int]  # tokens per text
    retiring: bool  # the worker exits after this answer (its memory grew past RECYCLE_RSS_BYTES)


class TokenizeFailed(msgspec.Struct, frozen=True, tag="failed"):
    job_id: int
    error: str


WorkerAnswer = Tokenized | TokenizeFailed


def frame(payload: bytes) -> bytes:
    if len(payload) > MAX_FRAME_BYTES:
        raise ValueError(f"a {len(payload)} B frame exceeds {MAX_FRAME_BYTES} B")
    return _LENGTH.pack(len(payload)) + payload


def frame_length(head: bytes) -> int:
    """The body length a frame head announces; ValueError past MAX_FRAME_BYTES."""
    (length,) = _LENGTH.unpack(head)
    if length > MAX_FRAME_BYTES:
        raise ValueError(f"a frame of {length} B exceeds {MAX_FRAME_BYTES} B")
    return length


def _read_exactly(stream, size: int) -> bytes | None:
    data = stream.read(size)
    return data if len(data) == size else None


def _rss_bytes() -> int:
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _answer(backend, job: TokenizeJob) -> Tokenized:
    encodings = backend.encode_batch_fast(job.texts, add_special_tokens=job.add_special_tokens)
    counts = [len(e) for e in encodings]
    ids = [e.ids if n <= job.limit else None for e, n in zip(encodings, counts)]
    del encodings
    return Tokenized(job.job_id, ids, counts, retiring=_rss_bytes() > RECYCLE_RSS_BYTES)


def serve(folder: str) -> None:
    import tokenizers  # the api's Tokenizer reads the same file the same way

    backend = tokenizers.Tokenizer.from_file(str(Path(folder, "tokenizer.json")))
    decoder = msgspec.msgpack.Decoder(TokenizeJob)
    encoder = msgspec.msgpack.Encoder()
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        head = _read_exactly(stdin, _LENGTH.size)
        if head is None:
            return
        body = _read_exactly(stdin, frame_length(head))
        if body is None:
            return
        job = decoder.decode(body)
        try:
            answer: WorkerAnswer = _answer(backend, job)
        except Exception as exc:  # a tokenizer error fails this job, not the worker
            answer = TokenizeFailed(job.job_id, f"{type(exc).__name__}: {exc}")
        stdout.write(frame(encoder.encode(answer)))
        stdout.flush()
        if isinstance(answer, Tokenized) and answer.retiring:
            return


def main() -> None:
    p = argparse.ArgumentParser(description="hkv's api tokenizer process (started by the api, not by people)")
    p.add_argument("--folder", required=True, help="checkpoint folder holding tokenizer.json")
    serve(p.parse_args().folder)


if __name__ == "__main__":
    main()
