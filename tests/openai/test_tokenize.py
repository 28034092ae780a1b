"""The tokenizer process (issue 16, item 1): same ids as the api's tokenizer, counts past the limit, restarts."""

from __future__ import annotations

import asyncio

import pytest

from hkv.openai.protocol import ModelLimits, ProtocolError
from hkv.openai.tokenize import INLINE_CHARS, PromptEncoder, TokenizeWorker, longest_token_chars
from tests.openai.tokenizer_fixture import tiny_dense_folder, tiny_tokenizer

pytestmark = pytest.mark.timeout(60)
TEXTS = ["Hello a😀b world! 你好", "  spaces\n\n\ttabs <|im_start|>user\nhi<|im_end|>", "café naïve " * 500]


@pytest.fixture
async def worker():
    w = TokenizeWorker(str(tiny_dense_folder()))
    await w.start()
    yield w
    await w.aclose()


async def test_the_worker_gives_the_ids_the_api_would(worker):
    tok = tiny_tokenizer()
    for add in (True, False):
        assert await worker.encode(TEXTS, add, 10**6) == [tok.encode(t, add_special_tokens=add) for t in TEXTS]


async def test_texts_past_the_limit_come_back_as_counts(worker):
    long = len(tiny_tokenizer().encode(TEXTS[2]))
    assert await worker.encode([TEXTS[2], "hi"], False, long - 1) == [long, tiny_tokenizer().encode("hi")]


async def test_a_dead_worker_fails_its_job_with_503_and_is_replaced(worker):
    await worker.encode(["warm"], False, 100)
    worker._proc.kill()
    with pytest.raises(ProtocolError) as failed:
        await worker.encode(["x"], False, 100)
    assert failed.value.status == 503
    assert await worker.encode(["hi"], False, 100) == [tiny_tokenizer().encode("hi")]


async def test_a_cancelled_job_does_not_hand_its_answer_to_the_next(worker):
    job = asyncio.create_task(worker.encode(["word " * 200_000], False, 10**7))
    await asyncio.sleep(0.05)
    job.cancel()
    await asyncio.gather(job, return_exceptions=True)
    assert await worker.encode(["hi"], False, 100) == [tiny_tokenizer().encode("hi")]


async def test_the_encoder_refuses_a_prompt_longer_than_the_context(worker):
    tok = tiny_tokenizer()
    limits = ModelLimits.of("tiny", str(tiny_dense_folder()), tok.vocab_size, 4096, 4096, longest_token_chars(tok))
    enc = PromptEncoder(tok, worker, limits)
    assert await enc.encode(["hi"], True) == [tok.encode("hi", add_special_tokens=True)]
    long = "a b " * (INLINE_CHARS // 2)  # > INLINE_CHARS characters, ~4096 tokens: goes to the worker
    with pytest.raises(ProtocolError, match="maximum context length is 4096 tokens"):
        await enc.encode([long], False)


def test_no_token_is_longer_than_the_bound():
    tok = tiny_tokenizer()
    chars = longest_token_chars(tok)
    assert all(len(tok.decode([i], skip_special_tokens=False)) <= chars for i in range(tok.vocab_size))
    assert chars == max(len(tok.decode([i], skip_special_tokens=False)) for i in range(tok.vocab_size))
