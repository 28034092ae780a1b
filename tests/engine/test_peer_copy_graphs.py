"""Captured peer copies (hkv/engine/peer_copy_graphs.py) on a GPU: replays move exactly what the eager
copies move, bit for bit, for transfers of several sizes queued back to back without a sync between
them (each upload is ordered after the replay before it on the stream). The peer's pools here are
tensors of this process: a graph holds raw pointers, so CUDA IPC mappings behave the same
(tests/e2e/test_cuda_pd.py runs them through real instances)."""

import random

import pytest
import torch


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("hybrid", [True, False])
def test_peer_copy_graph_replays_equal_the_eager_copies(hybrid):
    from hkv.engine.peer_copy_graphs import PeerCopyGraphs
    from hkv_kernels.cache_copy.reference import copy_blocks_ref

    gen = torch.Generator(device="cuda").manual_seed(0)
    pages, slots = 700, 6
    peer = {"kv": torch.randn(12, pages, 16, 2, 64, device="cuda", generator=gen).to(torch.bfloat16)}
    own = {"kv": torch.zeros(12, pages + 1, 16, 2, 64, device="cuda", dtype=torch.bfloat16)}
    if hybrid:
        peer["conv"] = torch.randn(4, slots, 3, 96, device="cuda", generator=gen)
        peer["recurrent"] = torch.randn(4, slots, 8, 32, 32, device="cuda", generator=gen)
        own["conv"], own["recurrent"] = torch.zeros_like(peer["conv"]), torch.zeros_like(peer["recurrent"])
    expect = {k: v.clone() for k, v in own.items()}
    graphs = PeerCopyGraphs(own["kv"], own.get("conv"), own.get("recurrent"), max_pages=512)
    assert graphs.sizes == [16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512]
    graphs.warm_up()
    rng = random.Random(1)
    free = list(range(pages + 1))
    rng.shuffle(free)
    transfers = []
    for n in (1, 16, 17, 100, 511, 3, 20):  # 17 and 20 share the 24-page bucket
        src, dst = rng.sample(range(pages), n), [free.pop() for _ in range(n)]
        slot = (rng.randrange(slots), rng.randrange(slots)) if hybrid else (None, None)
        transfers.append((src, dst, *slot))
    with torch.inference_mode():
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # the stream is busy while every transfer is queued: nothing waits in between
        for src, dst, src_slot, dst_slot in transfers:
            replay, bucket = graphs.prepare("peer", peer, src, dst, src_slot, dst_slot)
            assert bucket == graphs.bucket(len(src)) and graphs._peers["peer"][1][bucket] is not None
            replay()  # the next transfer's upload queues behind this replay, into the same arena when it shares a bucket
        torch.cuda.synchronize()
    for src, dst, src_slot, dst_slot in transfers:  # the same copies, one by one, on the host's side of a sync
        copy_blocks_ref(peer["kv"], expect["kv"], torch.tensor(src, device="cuda"), torch.tensor(dst, device="cuda"))
        if hybrid:
            for name in ("conv", "recurrent"):
                expect[name][:, dst_slot] = peer[name][:, src_slot]
    for name in own:
        assert torch.equal(own[name].view(torch.int16) if name == "kv" else own[name],
                           expect[name].view(torch.int16) if name == "kv" else expect[name]), name
    assert graphs.prepare("peer", peer, list(range(513)), list(range(513)), *transfers[0][2:]) is None
