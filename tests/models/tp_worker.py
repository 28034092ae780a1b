"""One rank of a tensor-parallel group for tests/models/test_parallel.py, in its own process:

    python -m tests.models.tp_worker RANK WORLD STORE OUT_DIR FOLDER...

joins a gloo group through the file store STORE, loads each checkpoint FOLDER as rank RANK of WORLD,
runs `schedule_logits` on it and (rank 0) writes the logits to OUT_DIR/<index>.safetensors.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from hkv.models.loader import load_model
from hkv.models.parallel import TPGroup
from tests.models.test_qwen3_5 import SCHEDULE, SLOTS, PagedRun


class AnyRun(PagedRun):
    """PagedRun for dense models too (no state pool)."""

    def __init__(self, model: torch.nn.Module) -> None:
        if model.state_layout(1, device="meta") is not None:
            super().__init__(model)
            return
        from hkv.storage.kv_pool import KVPool
        from tests.models.test_qwen3_5 import PAGE

        self.model, self.state = model, None
        self.kv = KVPool(model.kv_layout(96, PAGE, "float32", "cpu"), model.layer_map)
        self.free_pages = torch.randperm(96, generator=torch.Generator().manual_seed(0)).tolist()
        self.seqs = {}

    def add(self, name: str, slot: int) -> None:
        if self.state is not None:
            self.state.zero_slot(slot)
        self.seqs[name] = {"done": 0, "pages": [], "slot": slot}


def schedule_logits(model: torch.nn.Module, vocab: int) -> dict[str, torch.Tensor]:
    """Four sequences through test_qwen3_5's ragged SCHEDULE: {sequence: logits [L, vocab]}."""
    gen = torch.Generator().manual_seed(0)
    ends = {n: max(hi for step in SCHEDULE for m, _, hi in step if m == n) for n in SLOTS}
    tokens = {n: torch.randint(0, vocab, (ends[n],), generator=gen).tolist() for n in SLOTS}
    run = AnyRun(model)
    for name, slot in SLOTS.items():
        run.add(name, slot)
    got: dict[str, list[torch.Tensor]] = {n: [] for n in SLOTS}
    for step in SCHEDULE:
        for (n, _, _), out in zip(step, run.step([(n, tokens[n][lo:hi]) for n, lo, hi in step])):
            got[n].append(out)
    return {n: torch.cat(parts).contiguous() for n, parts in got.items()}


def main() -> None:
    rank, world, store, out_dir, *folders = sys.argv[1:]
    rank, world = int(rank), int(world)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        for i, folder in enumerate(folders):
            model = load_model(folder, "float32", "cpu", tp=TPGroup(rank, world)).model
            # the rank holds its shard only: vocab rows and attention heads divided
            assert model.model.embed_tokens.num_embeddings == -(-model.cfg.vocab_size // world)
            heads = json.loads(Path(folder, "config.json").read_text())["num_attention_heads"]
            assert model.cfg.num_attention_heads * world == heads
            logits = schedule_logits(model, model.cfg.vocab_size)
            if rank == 0:
                save_file(logits, f"{out_dir}/{i}.safetensors")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
