"""The benchmark oracle (HKV_SPEC_ORACLE): a file that may appear and change while the server runs."""

from __future__ import annotations

import json
import os

from hkv.engine.spec import ORACLE_KEY, OracleProposer
from hkv.ipc.messages import Chunk, NewSequence, SamplingParams, StepPlan

PROMPT = list(range(100, 100 + ORACLE_KEY + 8))
OUTPUT = [7, 8, 9, 10, 11, 12]


def _admit(slot: int, step: int, prompt=PROMPT) -> StepPlan:
    return StepPlan(step, [NewSequence(slot, 50 + step, SamplingParams(max_tokens=8), slot)],
                    [Chunk(slot, prompt, 0, True)], [])


def _write(path, entries) -> None:
    path.write_text(json.dumps(entries))
    st = path.stat()  # a distinct stamp even within one mtime tick
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))


def test_the_oracle_file_is_read_when_it_appears_and_again_when_it_changes(tmp_path):
    path = tmp_path / "oracle.json"
    oracle = OracleProposer(str(path))
    first = len(PROMPT) + 1  # the first draft's position: after the prompt and the token it samples
    oracle.observe(_admit(0, 1))
    assert oracle(0, first, [1, 2]) == [1, 2]  # no file yet: the MTP module's proposals go through

    _write(path, [{"prompt": PROMPT, "output": OUTPUT}])
    oracle.observe(_admit(1, 2))
    assert oracle(1, first, [1, 2]) == OUTPUT[1:3]
    assert oracle(1, len(PROMPT) + len(OUTPUT) - 1, [1, 2]) == [1, 2]  # past the known continuation
    assert oracle(0, first, [1, 2]) == [1, 2]  # admitted before the file: unknown to it

    _write(path, [{"prompt": PROMPT, "output": [5, 4, 3, 2]}])
    oracle.observe(_admit(2, 3))
    assert oracle(2, first, [1]) == [4]

    path.write_text("[{\"prompt\": [1, 2")  # a torn file: the previous continuations stay
    oracle.observe(_admit(3, 4))
    assert oracle(3, first, [1]) == [4]

    other = [1] * len(PROMPT)  # a prompt it does not know, in a row that knew one
    oracle.observe(_admit(3, 5, other))
    assert oracle(3, first, [1, 2]) == [1, 2]
