"""tools/bench/device_time.py: how many weight copies a shape gets, the memory cap, the per-call division,
and (on CUDA) that a replay calls the op once on every copy."""

import pytest
import torch

from tools.bench import device_time
from tools.bench.device_time import EVICT_BYTES, EXTRA_BYTES_CAP, per_call_ms, tensor_bytes, weight_copies

MiB = 2**20


@pytest.mark.parametrize("nbytes,copies", [
    (8 * MiB, 17),  # 16 others hold 128 MiB
    (100 * MiB, 3),  # one other would hold only 100 MiB
    (128 * MiB, 2),
    (622 * MiB, 2),  # the bf16 lm_head: one other is already far beyond L2
    (EXTRA_BYTES_CAP, 2),  # the largest set that still gets a second copy
    (EXTRA_BYTES_CAP + 1, 1),  # a second copy would pass the cap
])
def test_weight_copies_hold_the_evict_bytes_in_the_other_copies(nbytes, copies):
    assert weight_copies(nbytes) == copies


def test_weight_copies_stop_at_the_memory_cap():
    assert weight_copies(MiB, evict=128 * MiB, cap=64 * MiB) == 65
    assert weight_copies(MiB, evict=32 * MiB, cap=64 * MiB) == 33


def test_weight_copies_are_the_fewest_that_evict_and_never_pass_the_cap():
    for nbytes in [2**e + extra for e in range(10, 32) for extra in (0, 12345)]:
        others = weight_copies(nbytes) - 1
        assert others * nbytes <= EXTRA_BYTES_CAP
        if nbytes <= EXTRA_BYTES_CAP:
            assert others >= 1
        assert others * nbytes >= EVICT_BYTES or others == EXTRA_BYTES_CAP // nbytes
        assert (others - 1) * nbytes < EVICT_BYTES


def test_per_call_ms_is_the_median_replay_over_the_calls():
    assert per_call_ms([3.0, 1.0, 2.0, 9.0, 2.0], 4) == 0.5
    assert per_call_ms([1.0, 3.0], 2) == 1.0
    with pytest.raises(AssertionError):
        per_call_ms([], 2)


def test_tensor_bytes_count_an_fp8_weight_and_its_fp32_scales():
    q = torch.zeros(256, 384, dtype=torch.float8_e4m3fn)
    scale = torch.ones(2, 3)
    assert tensor_bytes((q, scale)) == 256 * 384 + 6 * 4


def test_weight_sets_keep_the_original_first_and_clone_the_rest(monkeypatch):
    monkeypatch.setattr(device_time, "weight_copies", lambda nbytes: 3 if nbytes == 64 * 4 + 2 * 4 else 0)
    w, s = torch.randn(8, 8), torch.randn(2)
    sets = device_time.weight_sets((w, s))
    assert len(sets) == 3 and sets[0][0] is w and sets[0][1] is s
    for copy in sets[1:]:
        assert copy[0].data_ptr() != w.data_ptr() and copy[1].data_ptr() != s.data_ptr()
        assert torch.equal(copy[0], w) and torch.equal(copy[1], s)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_ms_calls_the_op_on_every_copy_once_a_replay():
    sets = [(torch.zeros(4, device="cuda"),) for _ in range(3)]
    ms = device_time.graph_ms(lambda t: t.add_(1), sets)
    replays = 1 + device_time.WARMUP + device_time.REPLAYS  # the capture itself runs nothing
    assert all(torch.equal(t.cpu(), torch.full((4,), float(replays))) for (t,) in sets)
    assert ms > 0
