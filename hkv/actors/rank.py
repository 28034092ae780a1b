"""The rank actor: loads the model onto its device and executes step plans.

    router --StepPlan--> [inbox] -> execute -> StepResult --> router

It decides nothing: page ids come from the shared request table, the plan
says what to run.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec

from hkv.config import HkvConfig
from hkv.engine.model_runner import ModelRunner
from hkv.ipc import request_table
from hkv.ipc.dgram import DgramReceiver, DgramSender
from hkv.ipc.messages import RankInbound, RankOutbound, RankReady, Shutdown
from hkv.ipc.process import ActorContext, run_actor, run_until_stopped

log = logging.getLogger("hkv.rank")
PLAN_SPIN_S = 0.002


def _build_runner(cfg: HkvConfig, table: request_table.RequestTable) -> ModelRunner:
    import torch

    from hkv.models.loader import load_model
    from hkv.storage.kv_pool import KVPool
    from hkv.storage.state_pool import StatePool

    torch.manual_seed(cfg.model.seed)
    if cfg.model.device == "cpu":
        torch.set_num_threads(cfg.model.cpu_threads)
    loaded = load_model(cfg.model.path, cfg.model.dtype, cfg.model.device)
    if tuple(sorted(loaded.model.layer_map)) != cfg.model.spec.full_layers:
        raise ValueError(f"the checkpoint's attention layers {sorted(loaded.model.layer_map)} differ from the "
                         f"description the launcher read ({cfg.model.spec.full_layers}): was it replaced?")
    layout = loaded.model.kv_layout(cfg.cache.num_pages, cfg.cache.page_size, cfg.model.dtype, cfg.model.device)
    kv = KVPool(layout, loaded.model.layer_map)
    log.info("KV pool: %d pages x %d tokens, %.1f MiB", layout.num_pages, layout.page_size,
             layout.bytes_per_page() * layout.num_pages / 2**20)
    # Live states and checkpoints share one pool of slots (hybrid models only).
    state_layout = loaded.model.state_layout(cfg.cache.state_slots, device=cfg.model.device)
    state = StatePool(state_layout) if state_layout is not None else None
    if state is not None:
        log.info("state pool: %d slots, %.2f MiB each", state_layout.num_slots, state_layout.bytes_per_slot / 2**20)
    return ModelRunner(loaded.model, kv, state, table, cfg.cache.page_size, cfg.model.device)


def _attach_host_pool(cfg: HkvConfig, runner: ModelRunner):
    """Map the CPU tier's shm pool (pinned on CUDA) so tier copies reach it; returns its region."""
    from hkv.ipc.tier_regions import attach_pool
    from hkv.storage.host_pool import HostPool

    region, layout, _ = attach_pool(cfg.server.name)
    expect = runner.kv.layout
    if (layout.kv_layers, layout.page_size, layout.kv_heads, layout.head_dim, layout.kv_dtype) != (
        expect.num_layers, expect.page_size, expect.kv_heads, expect.head_dim, expect.dtype
    ):
        region.close()
        raise ValueError(f"the CPU tier's layout {layout.descriptor} does not match the KV pool {expect}")
    runner.host = HostPool(layout, region.payload)
    if cfg.model.device == "cuda" and layout.nbytes:
        import torch

        base = torch.frombuffer(region.payload, dtype=torch.uint8)
        err = torch.cuda.cudart().cudaHostRegister(base.data_ptr(), layout.nbytes, 3)  # portable | mapped
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of the CPU tier failed ({err})")
    log.info("CPU tier attached: %d pages, %d checkpoints", layout.num_pages, layout.num_states)
    return region


async def serve(cfg: HkvConfig, ctx: ActorContext) -> None:
    region, table = request_table.attach(cfg.server.name, readonly=True)
    # The step link is a Unix datagram pair (hkv/ipc/dgram.py); the rank polls briefly for the
    # next plan after answering, since the router sends it within a fraction of a millisecond.
    inbox = DgramReceiver(cfg.ipc_address(f"rank{ctx.rank}_in"), RankInbound, "rank_in", spin_s=PLAN_SPIN_S)
    outbox: DgramSender[RankOutbound] = DgramSender(cfg.ipc_address("router_results"), "router_results")
    host_region = None
    try:
        runner = await asyncio.to_thread(_build_runner, cfg, table)
        if cfg.cache.tiers:
            host_region = _attach_host_pool(cfg, runner)
        inbox.start()
        await outbox.send(RankReady(ctx.rank, runner.kv.layout.num_pages))
        ctx.ready(rank=ctx.rank)
        await run_until_stopped(_step_loop(ctx, inbox, outbox, runner), ctx.stop)
    finally:
        await inbox.aclose()
        await outbox.aclose()
        table.release_views()
        region.close()
        if host_region is not None:
            runner.host.release()
            host_region.close()


async def _step_loop(ctx: ActorContext, inbox, outbox, runner: ModelRunner) -> None:
    while True:
        # 1. wait for a plan
        msg = await inbox.get()
        if isinstance(msg, Shutdown):
            return
        # 2. run it and 3. answer (rank 0 answers for the group)
        result = runner.execute(msg)
        if result.error:
            log.error("step %d failed: %s", msg.step, result.error)
        if ctx.rank == 0:
            await outbox.send(msgspec.structs.replace(result, malformed=inbox.malformed) if inbox.malformed else result)


def main() -> None:
    run_actor("rank", serve)


if __name__ == "__main__":
    main()
