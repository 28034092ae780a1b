"""Grammar masks the device waits for, filled off the rank's main thread (HKV_GRAMMAR_DEVICE_WAIT=1; experimental).

Without it, a CUDA step whose grammar rows are behind samples late (hkv/engine/model_runner.py `complete`): once
the step before is answered, the main thread fills the masks, and only then queues the mask upload, apply and
sampling, and can launch the next step: the fill is on the host's per-step path. With it:

    launch N+1:  forward | wait(flag >= k) | copy masks | apply | sample       (queued at once; nothing blocks)
    answer N:    matchers take N's tokens -> `start`: the fill thread writes N+1's masks, then releases k
    launch N+2:  queued behind N+1's wait, while the fill runs

Every queued wait is released on every path: the fill's own (its errors end the rows with EOS-only masks), a launch
that fails after queueing the wait (the runner releases its value), and `close` at the rank's shutdown, which
releases all (otherwise the device waits forever and the rank hangs in its teardown). Values are released in order
(host_flag.FlagSequence), so an early release never lets an earlier step read unwritten masks.

Only steps whose every row samples on the device (greedy, no logprobs) wait here: a host-side sample would read
the logits at launch, before the fill that the same thread starts later, and deadlock. The others sample late.
For the same reason nothing queued behind a wait allocates pinned host memory: a cudaHostAlloc (a page-locked
allocation, which the CUDA programming guide lists among the implicitly synchronizing operations) could block the
rank's thread until the device drains, while the device waits for a fill that thread has yet to start. Their
host-to-device uploads and the sampled ids' pinned buffer are taken before the wait is queued. A device memory
allocation is on the same list, and the masking and sampling behind the wait do allocate (their [rows, vocab]
temporaries, from torch's caching allocator): so right before the wait the launch allocates and frees blocks as large
as that work's peak (`reserve`), and the allocator serves the work from them instead of calling cudaMalloc. The
2026-12-06 H100 run hung in the flag primitive's test at its first device allocation and kernel load, both queued
behind a wait (either may synchronize).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING, Protocol

import torch

from hkv.engine.host_flag import FlagSequence
from hkv.engine.logits_process import DeferredMasks, LogitsProcessor
from hkv.engine.sampler import PendingSample, pinned_ids, sample_async, samples_on_device

if TYPE_CHECKING:
    from hkv.engine.model_runner import LateSample


# bytes a grammar row's masking and sampling behind a wait may hold at once, per logit: the unpacked mask (int32) and
# its shift, the == 0 test (bool), the rows' index_select and masked_fill (fp32), with margin (LogitsProcessor._mask)
RESERVE_PER_LOGIT = 20
SMALL_RESERVE = 1 << 20  # bytes of the allocator's small pool (blocks up to 1 MiB: the bits, ids, indices, counts)


def reserve(device: torch.device, nbytes: int) -> None:
    """Allocate and free at once `nbytes` (and SMALL_RESERVE of small blocks) on `device`'s current stream, so that
    the caching allocator holds that much free memory for the device work queued right after (module docstring)."""
    if device.type != "cuda":
        return
    torch.empty(nbytes, dtype=torch.uint8, device=device)
    torch.empty(SMALL_RESERVE, dtype=torch.uint8, device=device)


class Flag(Protocol):
    """What MaskWait needs of a flag (hkv.engine.host_flag.HostFlag on CUDA, a recorder in tests)."""

    def wait(self, value: int) -> None: ...  # queue a device-side wait for `value`
    def set(self, value: int) -> None: ...  # let waits up to `value` pass


class PendingFill:
    """One launched step's masks: queued on the device behind the wait for `value`, written by the fill thread."""

    def __init__(self, value: int, masks: DeferredMasks, queued: float):
        self.value = value  # the flag value its wait is for
        self.masks = masks
        self.queued = queued  # perf_counter once its forward was queued
        self.future: Future | None = None  # the fill, once started

    def result(self) -> tuple[float, int, float]:
        """Wait for the fill; (mask fill seconds, live rows, seconds from the forward being queued to the fill
        starting): StepResult's grammar figures."""
        if self.future is None:
            raise RuntimeError("a deferred mask fill waited for before it was started")
        return self.future.result()

    def outcome(self) -> tuple[tuple[float, int, float], str | None]:
        """`result`, or zero figures and the error a fill that raised ends its step with."""
        try:
            return self.result(), None
        except Exception as exc:
            return (0.0, 0, 0.0), f"{type(exc).__name__}: {exc}"


class MaskWait:
    """The rank's device-side waits for grammar masks, and the one thread that fills them in step order."""

    def __init__(self, flag: Flag):
        self.flag = flag
        self.sequence = FlagSequence(flag.set)
        # one thread: fills run in launch order (a step's fill needs the step before answered), and each uses the
        # grammar's MaskWorkers with this thread as the caller
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-fill")
        self._closed = False

    def take(self) -> int:
        """The value the next queued wait is for; the caller releases it if it fails before `start`."""
        return self.sequence.take()

    def sample(self, processor: LogitsProcessor, slots: list[int], late: LateSample, last_tokens: torch.Tensor
               ) -> tuple[PendingSample, PendingFill]:
        """The runner's `_sample` for a step whose grammar rows are behind, without waiting for them: everything is
        queued now, the masks' copy behind a device-side wait that `start` later releases; the ids land in
        `last_tokens` on the device. A failure releases the wait (it may be queued already) and raises."""
        value = self.take()
        try:
            # uploads and pinned buffers first: behind the wait only device work is queued (module docstring)
            host = pinned_ids(len(late.rows)) if samples_on_device(late.logits, late.rows) else None
            counted = processor.count_rows(slots, late.processed)
            wait = partial(self._reserved_wait, value, late)
            masks = processor.apply_deferred(late.logits, slots, late.processed, wait)
            pending = sample_async(late.logits, late.rows, host)
            processor.sampled(slots, late.processed, pending.ids, counted)
            last_tokens.index_copy_(0, late.sample_rows, pending.ids)
        except BaseException:
            self.release(value)
            raise
        return pending, PendingFill(value, masks, late.queued)

    def queue_wait(self, value: int) -> None:
        self.flag.wait(value)

    def _reserved_wait(self, value: int, late: LateSample) -> None:
        """queue_wait, right after the launch's last allocation before the wait, with cached device memory reserved
        for the masking and sampling queued behind it (the grammar rows are among late.processed)."""
        reserve(late.logits.device, RESERVE_PER_LOGIT * len(late.processed) * late.logits.shape[-1])
        self.queue_wait(value)

    def release(self, value: int) -> None:
        self.sequence.release(value)

    def start(self, fill: PendingFill) -> None:
        """The step before `fill`'s is answered (its matchers are current): fill its masks in the background,
        then release its wait. Once per fill; after `close` it only releases."""
        if fill.future is not None:
            return
        if self._closed:
            self.release(fill.value)
            fill.future = Future()
            fill.future.set_result((0.0, 0, 0.0))
            return
        fill.future = self._thread.submit(self._run, fill)

    def _run(self, fill: PendingFill) -> tuple[float, int, float]:
        began = time.perf_counter()
        try:
            mask_s, live = fill.masks.fill()
        finally:
            self.release(fill.value)  # the masks are written (EOS-only where the fill failed)
        return mask_s, live, began - fill.queued if live else 0.0

    def close(self) -> None:
        """Release every queued wait and stop the fill thread without waiting for it (rank shutdown)."""
        self._closed = True
        self.sequence.release_all()
        self._thread.shutdown(wait=False, cancel_futures=True)
