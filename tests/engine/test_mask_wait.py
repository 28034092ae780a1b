"""HKV_GRAMMAR_DEVICE_WAIT's bookkeeping on CPU, with a recording flag in place of the device's: every queued wait
is released (fill, fill error, failed launch, shutdown), fills run off the calling thread in step order once the
step before is answered, and the masks are those of the right rows. The device side is tested in
tests/engine/test_host_flag.py and tests/e2e/test_cuda_grammar_wait.py (GPU only)."""

from __future__ import annotations

import threading

import pytest
import torch

from hkv.engine import mask_wait, model_runner
from hkv.engine.grammar import Matcher, fill_masks, mask_words
from hkv.engine.logits_process import DeferredMasks, GrammarLoader, LogitsProcessor
from hkv.engine.mask_wait import MaskWait, PendingFill
from hkv.ipc.messages import Constraint, NewSequence, SamplingParams, StepPlan
from hkv.models.tiny import SHIPPED_DIR

V = 4096
EOS = 0


class RecordingFlag:
    """The device's flag as calls: the values waited for, and those set (in order)."""

    def __init__(self):
        self.waits: list[int] = []
        self.sets: list[int] = []
        self.set_event = threading.Event()

    def wait(self, value: int) -> None:
        self.waits.append(value)

    def set(self, value: int) -> None:
        self.sets.append(value)
        self.set_event.set()


class FakeMasks:
    """A DeferredMasks stand-in: records the thread that filled it, or raises."""

    def __init__(self, fail: bool = False, gate: threading.Event | None = None):
        self.fail = fail
        self.gate = gate
        self.thread: str | None = None

    def fill(self) -> tuple[float, int]:
        if self.gate is not None:
            self.gate.wait(5)
        self.thread = threading.current_thread().name
        if self.fail:
            raise RuntimeError("llguidance fell over")
        return 0.001, 2


@pytest.fixture(scope="module")
def loader() -> GrammarLoader:
    return GrammarLoader(str(SHIPPED_DIR / "tokenizer.json"), V, [EOS])


def seq(slot: int, req_id: int, **params) -> NewSequence:
    return NewSequence(slot, req_id, SamplingParams(max_tokens=8, **params), None, [], [])


def test_a_fill_runs_off_the_calling_thread_and_then_releases_its_wait():
    flag = RecordingFlag()
    waits = MaskWait(flag)
    value = waits.take()
    waits.queue_wait(value)
    fill = PendingFill(value, FakeMasks(), queued=0.0)
    with pytest.raises(RuntimeError, match="before it was started"):
        fill.result()
    waits.start(fill)
    waits.start(fill)  # once only
    mask_s, live, wait_s = fill.result()
    assert (mask_s, live) == (0.001, 2) and wait_s > 0
    assert flag.waits == [1] and flag.sets == [1]
    assert fill.masks.thread.startswith("grammar-fill")
    waits.close()


def test_a_fill_that_raises_still_releases_its_wait():
    flag = RecordingFlag()
    waits = MaskWait(flag)
    fill = PendingFill(waits.take(), FakeMasks(fail=True), queued=0.0)
    waits.start(fill)
    with pytest.raises(RuntimeError, match="fell over"):
        fill.result()
    assert flag.sets == [1]
    waits.close()


def test_fills_release_in_step_order_and_a_failed_launch_waits_its_turn():
    flag = RecordingFlag()
    waits = MaskWait(flag)
    gate = threading.Event()
    first = PendingFill(waits.take(), FakeMasks(gate=gate), queued=0.0)
    failed = waits.take()  # its launch failed after queueing the wait
    waits.start(first)
    waits.release(failed)
    assert flag.sets == []  # the first step's masks are not written yet: its wait must hold
    gate.set()
    first.result()
    assert flag.sets == [2]
    waits.close()


def test_close_releases_every_queued_wait_and_later_starts_only_release():
    flag = RecordingFlag()
    waits = MaskWait(flag)
    gate = threading.Event()
    running = PendingFill(waits.take(), FakeMasks(gate=gate), queued=0.0)
    waits.start(running)
    never = PendingFill(waits.take(), FakeMasks(), queued=0.0)  # launched, its step before never answered
    waits.close()
    assert flag.sets == [2]
    waits.start(never)
    assert never.result() == (0.0, 0, 0.0) and never.masks.thread is None
    gate.set()
    assert flag.sets == [2]


def test_deferred_masks_are_the_grammar_rows_and_fill_as_fill_masks_does(loader):
    proc = LogitsProcessor(V, torch.device("cpu"), loader)
    proc.admit(seq(1, 5, constraint=Constraint("regex", "[0-9]{3}")))
    proc.admit(seq(2, 6, logit_bias={7: 2.0}))
    proc.admit(seq(3, 7, constraint=Constraint("regex", "[a-z]+")))
    slots = [2, 0, 3, 1]
    rows = proc.rows(slots)
    assert rows == [0, 2, 3]
    order: list[str] = []
    real_penalties = proc._penalties

    def penalties(sub, states):
        order.append("penalties")
        real_penalties(sub, states)

    proc._penalties = penalties
    logits = torch.zeros(4, V)
    deferred = proc.apply_deferred(logits, slots, rows, lambda: order.append("wait"))
    assert order == ["penalties", "wait"]
    assert deferred.matchers == [proc.slots[3].matcher, proc.slots[1].matcher]  # row order: slot 3, then slot 1
    assert deferred.masks.shape == (2, mask_words(V))
    assert logits[0, 7] == 2.0 and torch.equal(logits[1], torch.zeros(V))  # bias kept; a plain row untouched
    mask_s, live = deferred.fill()
    assert live == 2 and mask_s > 0
    want = torch.empty(2, mask_words(V), dtype=torch.int32)
    fill_masks(deferred.matchers, want, loader.get().executor)
    assert torch.equal(deferred.masks, want)
    with pytest.raises(ValueError, match="without grammar rows"):
        proc.apply_deferred(torch.zeros(1, V), [2], [0], lambda: None)


def test_a_deferred_fill_that_fails_ends_its_rows_with_eos_only(loader, monkeypatch, caplog):
    from hkv.engine import logits_process

    proc = LogitsProcessor(V, torch.device("cpu"), loader)
    proc.admit(seq(1, 5, constraint=Constraint("regex", "[0-9]{3}")))
    deferred = proc.apply_deferred(torch.zeros(1, V), [1], [0], lambda: None)

    def broken(*args, **kwargs):
        raise ValueError("no masks today")

    monkeypatch.setattr(logits_process, "fill_masks", broken)
    deferred.fill()
    eos = torch.empty(mask_words(V), dtype=torch.int32)
    Matcher.eos_only(eos, [EOS])
    assert torch.equal(deferred.masks[0], eos) and deferred.matchers[0].failed
    assert "no masks today" in caplog.text


def _runner(loader, flag: RecordingFlag):
    from tests.engine.test_model_runner import _grammar_runner

    runner, driver = _grammar_runner(V, loader)
    runner.mask_wait = MaskWait(flag)
    return runner, driver


def test_the_runner_defers_a_behind_step_and_fills_it_once_the_step_before_is_answered(loader, monkeypatch):
    """The rank's order (launch n+1, answer n, complete n+1) with device waits: on CPU the sampling reads whatever
    the mask buffer held at launch, so only the bookkeeping is checked here, not the tokens (the GPU test does)."""
    from tests.engine.test_model_runner import _decode_plan

    monkeypatch.setattr(model_runner, "samples_on_device", lambda logits, rows: True)
    monkeypatch.setattr(LogitsProcessor, "_mask_buffer",
                        lambda self, rows, words: torch.zeros(rows, words, dtype=torch.int32))
    behind_at_fill: list[int] = []
    real_fill = DeferredMasks.fill

    def fill(self):
        behind_at_fill.append(runner.processor.slots[0].behind)  # only the waiting step's own token pending
        return real_fill(self)

    monkeypatch.setattr(DeferredMasks, "fill", fill)
    flag = RecordingFlag()
    runner, driver = _runner(loader, flag)
    new = [NewSequence(0, 100, SamplingParams(max_tokens=16, constraint=Constraint("regex", "[a-z]+ = [0-9]{2}"))),
           NewSequence(1, 101, SamplingParams(max_tokens=16))]
    first = driver.plan([(0, [5, 6, 7]), (1, [8, 9])], [])
    launched = runner.launch(StepPlan(1, new, first.chunks, []))
    assert launched.fill is None and launched.late is None  # nothing behind yet: sampled at launch, as before
    figures = []
    for step in range(2, 6):
        nxt = runner.launch(_decode_plan(driver, step, None))
        assert nxt.fill is not None and nxt.late is None and nxt.fill.future is None
        result = runner.finish(launched)
        assert result.error is None
        figures.append((result.grammar_rows, result.grammar_mask_s, result.grammar_wait_s))
        runner.complete(nxt)
        assert nxt.fill.future is not None
        launched = nxt
    result = runner.finish(launched)
    figures.append((result.grammar_rows, result.grammar_mask_s, result.grammar_wait_s))
    assert flag.waits == [1, 2, 3, 4] and flag.sets == [1, 2, 3, 4]
    assert behind_at_fill == [1, 1, 1, 1]
    assert all(rows in (0, 1) for rows, _, _ in figures[1:]) and figures[0][0] == 1
    assert all((w > 0) == (r == 1) for r, _, w in figures[1:]), figures
    runner.mask_wait.close()


def test_a_launch_that_fails_after_its_wait_releases_it(loader, monkeypatch):
    from tests.engine.test_model_runner import _decode_plan

    monkeypatch.setattr(model_runner, "samples_on_device", lambda logits, rows: True)
    flag = RecordingFlag()
    runner, driver = _runner(loader, flag)
    new = [NewSequence(0, 100, SamplingParams(max_tokens=16, constraint=Constraint("regex", "[a-z]+"))),
           NewSequence(1, 101, SamplingParams(max_tokens=16))]
    first = driver.plan([(0, [5, 6, 7]), (1, [8, 9])], [])
    launched = runner.launch(StepPlan(1, new, first.chunks, []))

    def broken(*args):
        raise RuntimeError("sampling failed")

    monkeypatch.setattr(mask_wait, "sample_async", broken)
    nxt = runner.launch(_decode_plan(driver, 2, None))
    assert nxt.error is not None and "sampling failed" in nxt.error and nxt.fill is None
    assert flag.waits == [1] and flag.sets == [1]
    assert runner.finish(launched).error is None
    assert runner.finish(nxt).error is not None
    runner.mask_wait.close()


def test_nothing_queued_behind_a_wait_uploads_or_allocates_pinned_memory(loader, monkeypatch):
    """A pinned allocation (or an upload from one) behind the wait could block the rank's thread until the device
    drains, while the device waits for a fill that thread starts only after the launch: each deferred launch
    uploads its rows, penalty counts included, and takes the ids' pinned buffer before it queues its wait. A device
    allocation could block alike: right before the wait it reserves cached device memory for the work behind it."""
    from hkv.engine import sampler
    from tests.engine.test_model_runner import _decode_plan

    events: list[str] = []

    class OrderFlag(RecordingFlag):
        def wait(self, value: int) -> None:
            super().wait(value)
            events.append("wait")

    def pinned(rows: int) -> torch.Tensor:
        events.append("pin")
        return torch.empty(rows, dtype=torch.long)

    real_upload = LogitsProcessor._upload
    reserved: list[int] = []

    def reserving(device, nbytes: int) -> None:
        events.append("reserve")
        reserved.append(nbytes)

    def upload(self, values, dtype):
        events.append("upload")
        return real_upload(self, values, dtype)

    # the runner and MaskWait take the device path; the sampler itself (torch.cuda events) stays on the host path
    for module in (model_runner, mask_wait):
        monkeypatch.setattr(module, "samples_on_device", lambda logits, rows: True)
    monkeypatch.setattr(mask_wait, "pinned_ids", pinned)
    monkeypatch.setattr(sampler, "pinned_ids", pinned)  # would the sampler allocate its own, it would show
    monkeypatch.setattr(LogitsProcessor, "_upload", upload)
    monkeypatch.setattr(LogitsProcessor, "_mask_buffer",
                        lambda self, rows, words: torch.zeros(rows, words, dtype=torch.int32))
    monkeypatch.setattr(mask_wait, "reserve", reserving)
    flag = OrderFlag()
    runner, driver = _runner(loader, flag)
    constrained = SamplingParams(max_tokens=16, presence_penalty=0.5, constraint=Constraint("regex", "[a-z]+"))
    new = [NewSequence(0, 100, constrained), NewSequence(1, 101, SamplingParams(max_tokens=16))]
    first = driver.plan([(0, [5, 6, 7]), (1, [8, 9])], [])
    launched = runner.launch(StepPlan(1, new, first.chunks, []))
    for step in range(2, 5):
        start = len(events)
        nxt = runner.launch(_decode_plan(driver, step, None))
        assert nxt.fill is not None, "a deferred launch"
        seen = events[start:]
        assert seen.count("wait") == 1 and "pin" in seen and "upload" in seen, seen
        assert seen[seen.index("wait") + 1:] == [], seen  # nothing after the wait
        assert seen[seen.index("wait") - 1] == "reserve" and seen.count("reserve") == 1, seen  # right before it
        # the one processed row's masking peaks at 17 bytes a logit ([rows, vocab] int32 x2, bool, fp32 x2)
        assert reserved[-1] >= 17 * runner.model.cfg.vocab_size, reserved
        assert runner.finish(launched).error is None
        runner.complete(nxt)
        launched = nxt
    assert runner.finish(launched).error is None
    assert flag.sets == [1, 2, 3]
    runner.mask_wait.close()
