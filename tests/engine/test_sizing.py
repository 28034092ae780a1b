"""The state pool's share of the GPU when --state-slots is not given (hkv/engine/sizing.py)."""

from hkv.engine.sizing import CHECKPOINT_SHARE, checkpoint_slots

MIB = 2**20


def test_checkpoints_get_a_quarter_of_the_room_after_the_weights():
    # the benchmark model on an H200 at 0.9: about 121.8 GiB left after 3.98 GB of weights,
    # 37.7 MB per checkpoint -> running + ~860 checkpoints, room for 64 prefixes' worth of
    # interval checkpoints (2,048 tokens / 256 = 8 each, plus their ends)
    room, slot = int(121.8 * 2**30), int(37.7e6)
    slots = checkpoint_slots(room, slot, max_running=64)
    assert slots - 64 == int(CHECKPOINT_SHARE * room) // slot
    assert 800 < slots - 64 < 900
    assert slots * slot <= CHECKPOINT_SHARE * room + 64 * slot  # live slots on top of the share


def test_a_small_room_still_gets_the_old_default():
    assert checkpoint_slots(10 * MIB, 50 * MIB, max_running=8) == 8 + 64
    assert checkpoint_slots(-5, 50 * MIB, max_running=8) == 8 + 64  # nothing left: no negative count


def test_the_warm_up_runs_mixed_and_single_prompt_steps_and_leaves_the_scratch_slot_zero():
    """CPU stand-in for the CUDA start-up warm-up: the same batches through the model's forward."""
    import torch

    from hkv.config import parse_cli
    from hkv.engine.sizing import warm_up
    from hkv.models.loader import load_model
    from hkv.storage.state_pool import StatePool

    cfg = parse_cli(["--device", "cpu", "--model", "tiny-hybrid", "--max-running-requests", "2"])
    import shutil

    shutil.rmtree(cfg.run_dir)
    model = load_model(cfg.model.path, cfg.model.dtype, cfg.model.device).model
    state = StatePool(model.state_layout(4, device="cpu"))
    state.recurrent.fill_(1.0)
    assert warm_up(model, cfg, state) > 0
    assert not state.recurrent[:, 3].any() and not state.conv[:, 3].any()  # the scratch slot, zeroed
    assert bool((state.recurrent[:, :3] == 1.0).all())  # no other slot touched


def test_the_graph_reserve_covers_the_largest_verify_bucket():
    """With --spec-tokens K the largest bucket's logits are its verify tokens: b (K + 1) rows, b capped
    so that they stay within MAX_VERIFY_TOKENS (the VerifyGraphs cap)."""
    import dataclasses
    import shutil

    from hkv.config import parse_cli
    from hkv.engine.sizing import graph_logit_rows
    from hkv.engine.spec_graphs import MAX_VERIFY_TOKENS

    cfg = parse_cli(["--device", "cpu", "--model", "tiny-hybrid", "--max-running-requests", "256"])
    shutil.rmtree(cfg.run_dir)

    def rows(max_bs: int, k: int) -> int:
        model = dataclasses.replace(cfg.model, cuda_graph_max_bs=max_bs)
        return graph_logit_rows(dataclasses.replace(cfg, model=model, spec=dataclasses.replace(cfg.spec, spec_tokens=k)))

    assert rows(256, 0) == 256  # decode: one row a sequence
    assert rows(16, 3) == 64 and rows(256, 3) == MAX_VERIFY_TOKENS == 128 * 4
    assert rows(256, 2) == 170 * 3 and rows(1, 8) == 9
