"""The rank actor: loads the model onto its device and executes step plans.

    router --StepPlan--> [inbox] -> execute -> StepResult --> router

It decides nothing: page ids come from the shared request table, the plan
says what to run.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path

import msgspec

from hkv.config import HkvConfig
from hkv.engine import sizing
from hkv.engine.logits_process import GrammarLoader, LogitsProcessor
from hkv.engine.model_runner import ModelRunner
from hkv.engine.prefill_graphs import SHORT_CHUNK_TOKENS
from hkv.engine.startup import StartupReporter, StartupStopped
from hkv.ipc import request_table
from hkv.ipc.dgram import DgramReceiver, DgramSender
from hkv.ipc.messages import RankInbound, RankOutbound, RankReady, Shutdown
from hkv.ipc.process import ActorContext, run_actor, run_until_stopped
from hkv.ipc.startup import StartupProgress, describe

log = logging.getLogger("hkv.rank")
PLAN_SPIN_S = 0.002
POLL_S = 20e-6  # between looks at the socket and the device while a step runs
TP_STORE = "tp_store"  # the tensor-parallel group's rendezvous file, in the run directory


def _build_runner(cfg: HkvConfig, table: request_table.RequestTable,
                  startup: StartupReporter, rank: int = 0) -> tuple[ModelRunner, int, int]:
    """Load the model, size and allocate its pools, compile the prefill kernels, capture the CUDA graphs,
    each a start-up phase of `startup`; (runner, usable KV pages, usable state slots). With --tp N the
    rank joins its group first and holds its shard of every weight and pool (hkv/models/parallel.py)."""
    import torch

    from hkv.engine import spec

    torch.manual_seed(cfg.model.seed)
    on_cuda = cfg.model.device == "cuda"
    if not on_cuda:
        torch.set_num_threads(cfg.model.cpu_threads)
    drafting = cfg.spec.spec_tokens > 0
    model, kv_scales = _load_weights(cfg, drafting, startup, _join_tp(cfg, rank, startup))
    # on CUDA one more page and state slot than the router hands out: padded graph rows write there
    extra = 1 if on_cuda else 0
    draft = spec.draft_spec(model, cfg.spec.draft_window) if drafting else None
    slots, state = _state_pool(cfg, model, table, draft, extra, startup)
    if on_cuda:  # compile and autotune the prefill kernels now, not in the first requests' TTFT
        from hkv.engine import parallel_compile

        parallel_compile.install(device=torch.cuda.current_device())  # autotuners compile configs in parallel
        _warm_up(cfg, model, state, startup)
    pages, kv = _kv_pool(cfg, model, state, draft, extra, startup, kv_scales)
    scratch = (pages, slots if state is not None else None) if on_cuda else None
    runner = ModelRunner(model, kv, state, table, cfg.cache.page_size, cfg.model.device, scratch=scratch,
                         max_tokens=cfg.scheduler.chunked_prefill_size + cfg.scheduler.max_running_requests,
                         graph_max_bs=0 if drafting else cfg.model.cuda_graph_max_bs,  # drafting: verify graphs
                         checkpoint_interval=cfg.cache.checkpoint_interval)
    runner.processor = LogitsProcessor(model.cfg.vocab_size, runner.device, _grammar_loader(cfg, model.cfg.vocab_size))
    if on_cuda and not drafting and cfg.scheduler.grammar_device_wait:
        runner.mask_wait = _mask_wait(runner.device)
    if drafting:
        spec.attach(runner, draft, cfg.spec.spec_tokens, slots + extra, cfg.spec.oracle, cfg.model.cuda_graph_max_bs)
        log.info("speculative decoding: %d MTP drafts a step, draft window %s, %.1f KiB of drafter state a slot",
                 cfg.spec.spec_tokens, draft.window or "full length (paged)", state.draft_bytes_per_slot() / 1024)
    if on_cuda and not drafting and cfg.server.mode in ("prefill", "decode"):
        _share_pools(cfg, runner)
    if cfg.pair_backend:
        _open_pair(cfg, runner)
    _log_graphs(runner, runner.capture_graphs(startup))
    return runner, pages, slots


def _join_tp(cfg: HkvConfig, rank: int, startup: StartupReporter):
    """This rank's tensor-parallel group (None at --tp 1): every rank of the instance joins before loading."""
    if cfg.model.tp == 1:
        return None
    from hkv.models.parallel import join_group

    with startup.phase("joining the tensor-parallel group"):
        group = join_group(rank, cfg.model.tp, cfg.model.device, os.path.join(cfg.run_dir, TP_STORE))
    log.info("rank %d of %d joined the tensor-parallel group", rank, cfg.model.tp)
    return group


def _load_weights(cfg: HkvConfig, drafting: bool, startup: StartupReporter, tp=None):
    """(the model with its weights on the device, this rank's shard under --tp; the checkpoint's FP8 KV
    scales by model layer), a start-up phase, a part per tensor."""
    from hkv.models.loader import find_weight_shards, load_model

    shards = find_weight_shards(Path(cfg.model.path))  # headers read once: the phase's total and the load
    with startup.phase("loading weights", sum(len(s.tensor_names) for s in shards), "tensors") as phase:
        loaded = load_model(cfg.model.path, cfg.model.dtype, cfg.model.device, mtp=drafting, progress=phase.advance,
                            quantize=cfg.model.quantize, tp=tp, shards=shards)
        model = loaded.model
        phase.hold(cfg.server.startup_stall_s)  # fault injection: tests see the instance starting
    sizing.log_weight_bytes(model, cfg.model.dtype)
    if tuple(sorted(model.layer_map)) != cfg.model.spec.full_layers:
        raise ValueError(f"the checkpoint's attention layers {sorted(model.layer_map)} differ from the "
                         f"description the launcher read ({cfg.model.spec.full_layers}): was it replaced?")
    return model, loaded.kv_scales


def _state_pool(cfg: HkvConfig, model, table: request_table.RequestTable, draft, extra: int,
                startup: StartupReporter):
    """(usable state slots, the state pool or None for a dense model), sized from memory without --state-slots."""
    from hkv.engine import spec
    from hkv.models.loader import TORCH_DTYPES
    from hkv.storage.state_pool import StatePool

    if model.state_layout(1, device="meta") is None:  # a dense family
        return cfg.cache.state_slots or 0, None
    sized = cfg.cache.state_slots is None  # CUDA, hybrid, no --state-slots: a share of the memory
    with startup.phase("sizing the state pool" if sized else "allocating the state pool"):
        slots = sizing.state_slots_from_memory(cfg, model) if sized else cfg.cache.state_slots
        # speculative decoding: (k + 1) scratch slots per request-table row for the verify states (hkv/engine/spec.py)
        keep = spec.keep_slots_needed(table.layout.slots, cfg.spec.spec_tokens)
        state_layout = model.state_layout(slots + extra + keep, device=cfg.model.device)
        state = StatePool(state_layout, draft, TORCH_DTYPES[cfg.model.dtype])
    log.info("state pool: %d slots, %.2f MiB each", slots, state_layout.bytes_per_slot / 2**20)
    return slots, state


def _warm_up(cfg: HkvConfig, model, state, startup: StartupReporter) -> None:
    """Compile (and autotune) the prefill kernels: a start-up phase, a part per warm-up forward."""
    try:
        with startup.phase("compiling prefill kernels", sizing.warm_up_steps(cfg), "steps") as phase:
            log.info("prefill kernels warmed up in %.1f s", sizing.warm_up(model, cfg, state, phase.advance))
    except Exception as exc:  # the first requests pay for the compiles instead; serving still works
        log.warning("prefill warm-up failed (%s: %s); the first prefills will compile their kernels",
                    type(exc).__name__, exc)


def _kv_pool(cfg: HkvConfig, model, state, draft, extra: int, startup: StartupReporter,
             kv_scales: dict[int, tuple[float, float]]):
    """(usable KV pages, the KV pool), sized from memory without --max-total-tokens; kv_scales: the
    checkpoint's FP8 scales by model layer."""
    from hkv.engine import spec
    from hkv.models.loader import TORCH_DTYPES
    from hkv.storage.kv_pool import FP8_DTYPE, KVPool

    pages = cfg.cache.num_pages
    with startup.phase("sizing the KV pool" if pages is None else "allocating the KV pool"):
        if pages is None:  # the paged draft layer (W = 0) is part of every page's bytes there
            pages = sizing.pages_from_memory(cfg, model, state)
        layout = model.kv_layout(pages + extra, cfg.cache.page_size, cfg.model.kv_cache_dtype, cfg.model.device)
        layout, layer_map = spec.with_paged_draft(model, layout, draft)  # W = 0: one more layer
        if kv_scales and layout.dtype != FP8_DTYPE:
            log.info("the checkpoint's KV scales are unused: the KV pages are %s (--kv-cache-dtype)", layout.dtype)
        scales = {layer_map[layer]: pair for layer, pair in kv_scales.items()} if layout.dtype == FP8_DTYPE else {}
        kv = KVPool(layout, layer_map, attn_dtype=TORCH_DTYPES[cfg.model.dtype], scales=scales)
    log.info("KV pool: %d pages x %d tokens, %.1f MiB; %s KV, %d bytes a token (%d layers x K and V x %d heads x %d "
             "x %d bytes)%s", pages, layout.page_size, layout.bytes_per_page() * pages / 2**20, layout.dtype,
             layout.bytes_per_page() // layout.page_size, layout.num_layers, layout.kv_heads, layout.head_dim,
             layout.torch_dtype.itemsize, f", {len(scales)} layers with checkpoint scales" if scales else "")
    return pages, kv


def _log_graphs(runner: ModelRunner, seconds: float) -> None:
    if runner.graphs is not None:
        log.info("CUDA graphs: %d decode buckets up to batch %d (all graphs captured in %.1f s)",
                 len(runner.graphs.graphs), runner.graphs.max_bs, seconds)
    if runner.prefill_graphs is not None:
        short = runner.prefill_graphs
        log.info("CUDA graphs: %d prefill buckets, one sequence of 1 to %d tokens and up to %d sequences of fewer (a "
                 "lone chunk below %d tokens replays them; other prefill steps do when their replays' device time "
                 "beats the eager step: at least %.1f ms on the host, %.1f ms keeping checkpoints)", len(short.graphs),
                 short.largest, max(b for b, _ in short.sizes), min(SHORT_CHUNK_TOKENS, 2 * short.largest),
                 short.budget_s * 1e3, short.budget_checkpoints_s * 1e3)
    verify_graphs = runner.spec.graphs if runner.spec is not None else None
    if verify_graphs is not None:
        log.info("CUDA graphs: %d verify buckets up to batch %d (%d tokens a row%s) in %.1f s",
                 len(verify_graphs.graphs), verify_graphs.max_bs, verify_graphs.q,
                 ", drafter included" if verify_graphs.ring else "", seconds)


def _grammar_loader(cfg: HkvConfig, vocab_size: int) -> GrammarLoader:
    """Structured output's tokenizer view, built in a thread while the rank starts."""
    path = os.path.join(cfg.model.path, "tokenizer.json")
    return GrammarLoader(path if os.path.isfile(path) else None, vocab_size, cfg.model.spec.eos_ids,
                         threads=cfg.scheduler.grammar_threads or None, mask_cache=cfg.scheduler.grammar_mask_cache)


def _mask_wait(device):
    """HKV_GRAMMAR_DEVICE_WAIT=1 (experimental): device-side waits for grammar masks where the driver can wait on
    host memory (hkv/engine/mask_wait.py), else None: steps with grammar rows sample late, as without it."""
    from hkv.engine.host_flag import HostFlag, supported
    from hkv.engine.mask_wait import MaskWait

    support = supported(device)
    if not support:
        log.warning("HKV_GRAMMAR_DEVICE_WAIT is set but device-side waits are unavailable (%s): grammar masks are "
                    "filled on the rank's main thread", support.reason)
        return None
    log.info("grammar masks: filled off the main thread, the device waits for them (%s; experimental)",
             support.reason)
    return MaskWait(HostFlag(device))


def _share_pools(cfg: HkvConfig, runner: ModelRunner) -> None:
    """Prefill: publish the pools' CUDA IPC handles for decode ranks on this GPU; decode: map peers' pools."""
    from hkv.storage import ipc_pools

    state = runner.state
    conv, recurrent = (state.conv, state.recurrent) if state is not None else (None, None)
    if cfg.server.mode == "decode":
        runner.peer_pools = ipc_pools.PeerPools(runner.device, runner.kv.layers_view(), conv, recurrent)
        if cfg.model.cuda_graph_max_bs > 0:  # graphs on (not --no-cuda-graph): a transfer is one launch
            from hkv.engine.peer_copy_graphs import PeerCopyGraphs

            max_pages = min(runner.kv.num_pages, runner.pages.max_pages if runner.pages is not None else 1 << 30)
            runner.peer_graphs = PeerCopyGraphs(runner.kv.layers_view(), conv, recurrent, max_pages,
                                                live=runner.peer_pools.documents)
            try:  # compile the graphs' kernels now, not in the first transfer's step
                runner.peer_graphs.warm_up()
            except Exception as exc:
                log.warning("peer copy kernels not warmed up (%s: %s); the first transfer compiles them",
                            type(exc).__name__, exc)
        return
    doc = json.loads(ipc_pools.export_pools(runner.kv.layers_view(), conv, recurrent))
    _write_pools_doc(cfg, doc)
    log.info("device pools shared for decode instances on this GPU (CUDA IPC)")


def _open_pair(cfg: HkvConfig, runner: ModelRunner) -> None:
    """Pair-group transfers (docs/pd.md): the decode rank opens its rendezvous now (its address goes out in
    RankReady); a prefill rank off CUDA names the path in its pools document (on CUDA `_share_pools` does)."""
    from hkv.engine.pair_transfers import PairTransfers

    state = runner.state
    pools = [runner.kv.layers_view()] + ([state.conv, state.recurrent] if state is not None else [])
    runner.pair = PairTransfers(pools, cfg.pair_backend, cfg.server.host, cfg.server.pd_timeout_s)
    if cfg.server.mode == "decode":
        log.info("pair transfers (%s): prefill peers join at %s", cfg.pair_backend, runner.pair.address)
    elif cfg.model.device != "cuda":
        _write_pools_doc(cfg, {"version": 1})
        log.info("pair transfers (%s): held prompts are sent to decode peers", cfg.pair_backend)


def _write_pools_doc(cfg: HkvConfig, doc: dict) -> None:
    """The pools document the api names in a prefill answer (hkv/openai/pd_route.py), with the pair path and
    the KV dtype and cache fingerprint (a decode instance of others takes the CPU path, which refuses it)."""
    from hkv.openai.pd_route import POOLS_FILE

    doc["kv_dtype"] = cfg.model.kv_cache_dtype
    if cfg.cache.tiers:  # the CPU tier's fingerprint root (a PD instance has one): model, dtypes, pages, tokenizer
        from hkv.ipc.tier_regions import pool_layout

        doc["root"] = pool_layout(cfg.server.name)[1].hex()
    if cfg.pair_backend:
        doc["pair"] = cfg.pair_backend
    path = os.path.join(cfg.run_dir, POOLS_FILE)
    fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(doc, sort_keys=True))
    os.replace(path + ".tmp", path)


def _attach_host_pool(cfg: HkvConfig, runner: ModelRunner, rank: int = 0):
    """Map the CPU tier's shm pool (pinned on CUDA) so tier copies reach it (this rank's shard of each
    entry under --tp); returns its region."""
    from hkv.ipc.tier_regions import attach_pool
    from hkv.storage.host_pool import HostPool, draft_part

    region, layout, _ = attach_pool(cfg.server.name)
    if layout.tp != cfg.model.tp:
        region.close()
        raise ValueError(f"the CPU tier holds shards of {layout.tp} ranks, this instance runs --tp {cfg.model.tp}")
    expect = runner.kv.layout
    if (layout.kv_layers, layout.page_size, layout.kv_heads, layout.head_dim, layout.kv_dtype) != (
        expect.num_layers, expect.page_size, expect.kv_heads, expect.head_dim, expect.dtype
    ):
        region.close()
        raise ValueError(f"the CPU tier's layout {layout.descriptor} does not match the KV pool {expect}")
    state = runner.state
    if state is not None:  # the linear state, then the drafter's part (StatePool.draft, None when not drafting)
        s = state.layout
        if (layout.lin_layers, layout.conv_dim, layout.conv_width, layout.v_heads, layout.k_dim, layout.v_dim,
                layout.draft_part) != (s.lin_layers, s.conv_dim, s.kernel_size - 1, s.v_heads, s.k_dim, s.v_dim,
                                       draft_part(state.draft)):
            region.close()
            raise ValueError(f"the CPU tier's layout {layout.descriptor} does not match the state pool {s} "
                             f"(drafter {state.draft})")
    elif layout.lin_layers:
        region.close()
        raise ValueError(f"the CPU tier's layout {layout.descriptor} has states, the rank has no state pool")
    runner.host = HostPool(layout, region.payload, rank)
    if cfg.model.device == "cuda" and layout.nbytes:
        import torch

        base = torch.frombuffer(region.payload, dtype=torch.uint8)
        err = torch.cuda.cudart().cudaHostRegister(base.data_ptr(), layout.nbytes, 3)  # portable | mapped
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of the CPU tier failed ({err})")
    log.info("CPU tier attached: %d pages, %d checkpoints", layout.num_pages, layout.num_states)
    return region


def use_compile_cache(cfg: HkvConfig) -> None:
    """Point Triton at --compile-cache-dir, for this process. Early enough at the start of `serve`: Triton
    reads its cache directory when it compiles a kernel, at its first launch, and an autotuner reads
    TRITON_CACHE_AUTOTUNING where it is defined, at fla-core's first import, in the prefill warm-up."""
    cfg.model.apply_compile_env()


def _startup_reporter(ctx: ActorContext) -> StartupReporter:
    """Start-up phases go to the launcher, which prints them (and to this log at debug level)."""

    def emit(progress: StartupProgress) -> None:
        log.debug("start-up: %s", describe(progress))
        ctx.progress(progress)

    return StartupReporter(emit, ctx.stopping)


def _warm_tier_loads(runner: ModelRunner, startup: StartupReporter) -> None:
    try:
        with startup.phase("warming up CPU tier loads"):
            log.info("CPU tier loads warmed up in %.2f s", runner.warm_tier_loads())
    except Exception as exc:  # the first tier hit pays for their first launch instead
        log.warning("CPU tier load warm-up failed (%s: %s)", type(exc).__name__, exc)


async def serve(cfg: HkvConfig, ctx: ActorContext) -> None:
    use_compile_cache(cfg)
    region, table = request_table.attach(cfg.server.name, readonly=True)
    # The step link is a Unix datagram pair (hkv/ipc/dgram.py); the rank polls briefly for the
    # next plan after answering, since the router sends it within a fraction of a millisecond.
    inbox = DgramReceiver(cfg.ipc_address(f"rank{ctx.rank}_in"), RankInbound, "rank_in", spin_s=PLAN_SPIN_S)
    outbox: DgramSender[RankOutbound] = DgramSender(cfg.ipc_address("router_results"), "router_results")
    host_region = None
    runner = None
    startup = _startup_reporter(ctx)
    try:
        try:  # in threads, which SIGTERM stops at their next start-up report
            runner, pages, slots = await asyncio.to_thread(_build_runner, cfg, table, startup, ctx.rank)
            if cfg.cache.tiers:
                host_region = _attach_host_pool(cfg, runner, ctx.rank)
                if cfg.model.device == "cuda":
                    await asyncio.to_thread(_warm_tier_loads, runner, startup)
        except StartupStopped:
            log.info("stopped while starting")
            return
        inbox.start()
        uuid = ipc_uuid(runner)
        address = runner.pair.address if runner.pair is not None and cfg.server.mode == "decode" else ""
        await outbox.send(RankReady(ctx.rank, pages, slots, uuid, address))
        ctx.ready(rank=ctx.rank)
        profiler = None
        if cfg.model.profile_rows:  # $HKV_PROFILE_STEPS (hkv/engine/step_profile.py)
            from hkv.engine.step_profile import StepProfiler

            profiler = StepProfiler(cfg.model.profile_rows, cfg.model.profile_dir, ctx.rank, cfg.model.tp, runner.device)
        await run_until_stopped(_step_loop(ctx, inbox, outbox, runner, profiler), ctx.stop)
    finally:
        if runner is not None and runner.mask_wait is not None:
            runner.mask_wait.close()  # a step in flight waiting for masks must not hold the device (and teardown)
        if runner is not None and runner.pair is not None:
            await asyncio.to_thread(runner.pair.close)  # fails what is queued; waits for a transfer in progress
        await inbox.aclose()
        await outbox.aclose()
        table.release_views()
        region.close()
        if cfg.model.tp > 1:
            from hkv.models.parallel import leave_group

            leave_group()
        if host_region is not None:
            runner.host.release()
            host_region.close()


async def _step_loop(ctx: ActorContext, inbox, outbox, runner: ModelRunner, profiler=None) -> None:
    """Keep the device fed: the router sends the next plan before the last one's result is in,
    so the rank launches it behind the step on the device, then answers that step.

        plan n launched ... plan n+1 arrives -> launch n+1 -> answer n -> (n+1 runs) ...

    profiler: a StepProfiler ($HKV_PROFILE_STEPS), told of every launch and of the rank going idle."""
    running = None  # a launched plan not yet answered
    # on CPU a launch computes the whole step, so launching the next first would only delay this answer
    behind = runner.device.type == "cuda"
    while True:
        # 1. the next plan: wait for one when idle, else take one that arrives before the step ends
        msg = await inbox.get() if running is None else _next_or_done(inbox, running)
        if msg is None or isinstance(msg, Shutdown):
            if running is not None:
                await _answer(ctx, inbox, outbox, runner, running)
                running = None
            if profiler is not None:
                profiler.idle()
            if msg is None:
                continue
            return
        # 2. launch it behind the running one, 3. answer the running one (rank 0 for the group)
        if profiler is not None:
            profiler.before_launch(msg)
        if not behind:
            await _answer(ctx, inbox, outbox, runner, runner.launch(msg))
            continue
        launched = runner.launch(msg)
        if running is not None:
            await _answer(ctx, inbox, outbox, runner, running)
        runner.complete(launched)  # a step with grammar rows samples now, its masks built while it runs
        running = launched


def _next_or_done(inbox, running) -> object | None:
    """A plan (or Shutdown) that arrives while `running` is on the device, or None once it is done."""
    while True:
        msg = inbox.poll()
        if msg is not None or running.done():
            return msg
        time.sleep(POLL_S)


async def _answer(ctx: ActorContext, inbox, outbox, runner: ModelRunner, launched) -> None:
    result = runner.finish(launched)
    if result.error:
        log.error("step %d failed: %s", result.step, result.error)
    # Rank 0 answers for the group. A tensor-parallel group must answer a plan only once every rank ran it,
    # an empty one too: the router's probe of idle ranks (hkv/engine/rank_probe.py) vouches for them all.
    if ctx.rank == 0:
        malformed = inbox.malformed
        await outbox.send(msgspec.structs.replace(result, malformed=malformed) if malformed else result)


def ipc_uuid(runner: ModelRunner) -> str:
    """The GPU's uuid when this rank can copy from a prefill peer's pools on it, else ""."""
    if runner.peer_pools is None:
        return ""
    from hkv.storage.ipc_pools import gpu_uuid

    return gpu_uuid(runner.device)


def main() -> None:
    run_actor("rank", serve)


if __name__ == "__main__":
    main()
