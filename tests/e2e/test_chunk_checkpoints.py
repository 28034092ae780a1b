"""Issue 12 end to end: a hybrid prompt is prefilled in budget-sized chunks and the checkpoints
inside each chunk come out of its forward.

A 720-token prompt with --chunked-prefill-size 512 and --checkpoint-interval 64 runs in two
prefill steps (before: twelve, one per interval), leaves a checkpoint at every interval
boundary and at the prompt's last page boundary, and requests branching off inside it hit
the deepest interval checkpoint before their branch point (one kept inside the first chunk,
one inside the second), with transformers-equal greedy output.

    prompt  [0 ........................ 512)[512 ........................... 720)
    steps    step 1                          step 2 (samples)
    ckpts     64 128 ... 448 (forward)  512   576 640 704 (forward)          720 (prompt end)
"""

from __future__ import annotations

import signal

import pytest

from tests.e2e.harness import assert_clean, launch
from tests.e2e.test_hybrid import _prompts, qwen3_5, tiny_dir  # noqa: F401 (fixtures)
from tests.e2e.test_prefix_cache import _body, _complete, inspect_json
from tests.reference import assert_greedy_parity

pytestmark = pytest.mark.e2e
FLAGS = ["--page-size", "16", "--checkpoint-interval", "64", "--chunked-prefill-size", "512"]


@pytest.fixture(scope="module")
def server(qwen3_5, tmp_path_factory):  # noqa: F811 (the fixture imported above)
    served = launch(["--model", str(qwen3_5[0]), *FLAGS], tmp_path_factory.mktemp("log"))
    pids = served.actor_pids()
    yield served
    assert served.stop(signal.SIGTERM) == 0, served.log()
    assert_clean(served, pids)


def test_a_long_prompt_takes_two_prefill_steps_and_keeps_every_interval_checkpoint(qwen3_5, server):  # noqa: F811
    reference = qwen3_5[1]
    (prompt,) = _prompts(31, [720])
    before = inspect_json(server.name)["steps"]
    first = _complete(server.url, _body(prompt, 2))
    after = inspect_json(server.name)
    answer = first["choices"][0]["token_ids"]
    assert_greedy_parity(reference, prompt, answer)
    # two prefill steps, then one decode step for the second token (721 tokens end off a page)
    assert after["steps"]["steps"] - before["steps"] == 3
    depths = sorted(node["tokens"] for node in after["radix"]["checkpoint_nodes"])
    assert depths == list(range(64, 720, 64)) + [720]
    assert after["pools"]["state_slots"]["cached"] == after["radix"]["checkpoints"] == len(depths)
    cases = {
        "branch inside the first chunk": (prompt[:300] + _prompts(32, [40])[0], 256),
        "branch inside the second chunk": (prompt[:650] + _prompts(33, [30])[0], 640),
        "the next turn": (prompt + answer + _prompts(34, [20])[0], 720),
    }
    for name, (ids, hit) in cases.items():
        result = _complete(server.url, _body(ids, 8))
        cached = result["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == hit, f"{name}: cached {cached}, expected {hit}"
        assert_greedy_parity(reference, ids, result["choices"][0]["token_ids"])
