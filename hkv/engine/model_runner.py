"""Executes one StepPlan on a rank: batch tensors, forward, sampling.

The runner owns the device pools and the per-slot sampling params. It reads
page ids from the request table (written by the router before the plan was
sent) and never decides anything.

On CUDA a step's arrays and kernel metadata go to the device in one copy (a
StepArena), page ids are mirrored incrementally (DevicePageTable), and decode
steps replay CUDA graphs (hkv/engine/cuda_graphs.py), so do steps of one short
prefill chunk (hkv/engine/prefill_graphs.py: graphs of b sequences of t tokens)
and mixed steps of decode rows and one short prefill chunk (the decode graph of
the rows, then the chunk's parts); steps of several or long prefill chunks,
beside decode rows or not, replay the chunks' parts in rounds when the graphs'
measured cost model says that beats the eager step; other steps run eagerly
over the same kind of batch. On CPU
the batch is built as plain tensors and the forward runs the pure-torch
references.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from hkv.cache.types import (
    LoadPages, LoadState, PeerCopy, PeerRecv, PeerSend, RestoreCheckpoint, SaveCheckpoint, StorePages, StoreState,
)  # fmt: skip
from hkv.engine.cuda_graphs import DecodeGraphs, buckets_up_to
from hkv.engine.logits_process import LogitsProcessor
from hkv.engine.mask_wait import MaskWait, PendingFill
from hkv.engine.pair_transfers import PairTransferError
from hkv.engine.prefill_graphs import PrefillGraphs, StepParts
from hkv.engine.sampler import PendingSample, SampleRow, sample_async, samples_on_device
from hkv.engine.startup import StartupReporter
from hkv.engine.step_inputs import DevicePageTable, StepInputs
from hkv.ipc.messages import (
    STEP_DECODE_GRAPH, STEP_EAGER, STEP_MIXED_GRAPHS, STEP_SHORT_PREFILL_GRAPHS, Chunk, Sampled, SamplingParams,
    StepPlan, StepResult, TransferDone,
)  # fmt: skip
from hkv.ipc.request_table import RequestTable
from hkv.models.batch import ForwardBatch
from hkv_kernels.cache_copy.runs import MAX_RUNS, copy_runs, page_runs
from hkv_kernels.dispatch import copy_blocks  # imports no kernel until a CUDA tensor asks
from hkv_kernels.gdn import GDN_CHUNK
from hkv_kernels.meta import StepArena, attention_tile, checkpoint_arrays, checkpoint_meta, kernel_meta, meta_arrays


log = logging.getLogger("hkv.rank")


def _log_peer_copies(timings: list) -> None:
    """A plan's peer copies ran (its result is in): how fast (tools/bench/bench_pd.py reads these lines)."""
    for start, pages_done, end, pages, how, nbytes, host_s in timings:
        ms = start.elapsed_time(end)
        log.info("peer copy: %d pages and their state, %.1f MiB in %.3f ms (%.1f GB/s; pages %.3f ms, %s, "
                 "launched in %.3f ms)", pages, nbytes / 2**20, ms, nbytes / ms / 1e6 if ms > 0 else 0.0,
                 start.elapsed_time(pages_done), how, host_s * 1e3)


@dataclass
class LateSample:
    """A step whose sampling waits for the previous step's tokens (a grammar row's matcher needs them):
    its logits and rows, sampled by `ModelRunner.complete`."""

    logits: torch.Tensor  # [S, vocab]
    sample_rows: torch.Tensor  # [S] request-table rows on the device (where last_tokens goes)
    rows: list[SampleRow]
    processed: list[int]  # indexes of the processed rows (hkv/engine/logits_process.py)
    queued: float = 0.0  # perf_counter once its forward was queued (a late one waits from there)


@dataclass
class Launched:
    """A plan the device is running: what `finish` needs to answer it."""

    plan: StepPlan
    slots: list[int]  # request-table rows of the sampling chunks, in plan order
    sample: PendingSample | None  # None: nothing sampled (a copies-only plan) or the launch failed
    started: float  # perf_counter at launch
    error: str | None = None
    spec_out: list[Sampled] | None = None  # speculative decoding: the step's answers, already on the host
    peer_timings: list | None = None  # CUDA events around its peer copies (logged once it is answered)
    graph: int = STEP_EAGER  # how its forward ran (StepResult.graph)
    late: LateSample | None = None  # sampled by `complete`, after the previous step's answer
    matched: dict[int, int] | None = None  # slot -> req_id of its grammar rows: their matchers take the tokens
    grammar: tuple[float, int, float] = (0.0, 0, 0.0)  # mask fill seconds, live rows, late wait seconds
    fill: PendingFill | None = None  # HKV_GRAMMAR_DEVICE_WAIT: masks its sampling waits for on the device

    def done(self) -> bool:
        """The device finished it (its sampled ids are on the host)."""
        return self.late is None and (self.sample is None or self.sample.done())


class ModelRunner:
    """Runs plans on one device. On CUDA, pass `scratch` = (a KV page and a state slot the router
    never uses; the state slot None for dense models) so padded graph rows have somewhere to write,
    `max_tokens` (the step token budget), `graph_max_bs` (0: no CUDA graphs) and the checkpoint interval
    (what the prefill graphs size their room for in-chunk checkpoints by)."""

    def __init__(self, model: torch.nn.Module, kv, state, table: RequestTable, page_size: int, device: str,
                 host=None, scratch: tuple[int, int | None] | None = None, max_tokens: int = 0,
                 graph_max_bs: int = 0, device_metadata: bool | None = None, checkpoint_interval: int | None = None):
        self.model = model
        self.host = host  # HostPool: the CPU tier's shm entries (pinned on CUDA), None without tiers
        self.kv = kv  # KVPool: K/V pages of the full-attention layers
        self.state = state  # StatePool of the linear-attention layers, None for dense models
        self.table = table
        self.page_size = page_size
        self.device = torch.device(device)
        self.sampling: dict[int, SamplingParams] = {}  # slot -> params of the sequence in it
        # bias, penalties and grammar masks of the sequences that ask for them; set by the rank (with its
        # grammar loader), a plain processor without grammars otherwise
        self.processor = LogitsProcessor(model.cfg.vocab_size, self.device, None)
        self.state_slots: dict[int, int] = {}  # slot -> live linear-state slot of its sequence
        # the token each request-table row sampled last, where the device wrote it: a plan sent
        # before that token's result was in feeds it in from here (Chunk.follows)
        self.last_tokens: torch.Tensor = torch.zeros(table.layout.slots + 1, dtype=torch.long, device=self.device)
        cfg = model.cfg
        self.attn_dims: tuple[int, int] = (cfg.num_attention_heads // cfg.num_key_value_heads, cfg.head_dim)
        self.pages: DevicePageTable | None = None  # CUDA: page ids mirrored on the device
        self.arena: StepArena | None = None  # CUDA: the eager steps' metadata buffer
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None  # prefill chunks by parts (hkv/engine/prefill_graphs.py)
        self.spec = None  # hkv.engine.spec.SpecDecoder when drafting (--spec-tokens), set by its builder
        # CUDA, HKV_GRAMMAR_DEVICE_WAIT=1 (experimental): steps with grammar rows behind queue their sampling behind a
        # device-side wait for masks filled off the main thread (hkv/engine/mask_wait.py); set by the rank
        self.mask_wait: MaskWait | None = None
        self.scratch: tuple[int, int | None] | None = None  # CUDA: the graph rows' scratch page and state slot
        self.peer_pools = None  # decode mode on CUDA: hkv.storage.ipc_pools.PeerPools, for PeerCopy ops
        self.peer_graphs = None  # with CUDA graphs: hkv.engine.peer_copy_graphs.PeerCopyGraphs for those copies
        self.pair = None  # PD over a pair group: hkv.engine.pair_transfers.PairTransfers, for PeerSend / PeerRecv
        self._refused: list[TransferDone] = []  # pair transfers refused before they were queued, for the next result
        self._handed: set[int] = set()  # the launching plan's pair transfers handed over (or refused) so far
        self._peer_timings: list[tuple] = []  # CUDA events around this plan's peer copies, logged at its finish
        # the CUDA path's arena, mirrored page table and decode buckets; tests also take it on CPU
        if self.device.type == "cuda" if device_metadata is None else device_metadata:
            self._init_cuda(scratch, max_tokens, graph_max_bs, checkpoint_interval)

    def _init_cuda(self, scratch: tuple[int, int | None] | None, max_tokens: int, graph_max_bs: int,
                   checkpoint_interval: int | None) -> None:
        if scratch is None or max_tokens <= 0:
            raise ValueError("a CUDA runner needs a scratch page (and slot) and the step token budget")
        self.scratch = scratch
        layout = self.table.layout
        self.pages = DevicePageTable(layout.slots, layout.max_pages, self.device, scratch[0])
        seqs = layout.slots
        # every field of a step, worst case: 7 of up to max_tokens entries, the rest per sequence,
        # 5 per in-chunk checkpoint (at most one per GDN chunk of the step's tokens) and fla's chunk
        # metadata (2 per GDN chunk, each sequence's last one partial, and B + 1 offsets)
        chunks = max_tokens // GDN_CHUNK + seqs
        self.arena = StepArena(7 * max_tokens + 19 * (seqs + 2) + 5 * (max_tokens // GDN_CHUNK) + 2 * chunks + 520,
                               self.device)
        if graph_max_bs > 0 and getattr(self.model, "graph_safe", True):
            self.graphs = DecodeGraphs(self.model, self.kv, self.state, self.pages, min(graph_max_bs, seqs),
                                       self.attn_dims, scratch[1], self.page_size)
            self.prefill_graphs = PrefillGraphs(self.model, self.kv, self.state, self.pages, self.attn_dims,
                                                scratch[1], self.page_size, stage_tokens=max_tokens,
                                                checkpoint_every=checkpoint_interval)

    def capture_graphs(self, startup: StartupReporter | None = None) -> float:
        """Capture the decode graphs, the short-prefill graphs and, when speculating, the verify graphs
        (start-up, each set a phase of `startup`); returns the seconds it took (0 without graphs). Prefill
        graphs that fail to capture are dropped with a warning: those steps run eagerly, as before."""
        startup = startup or StartupReporter.silent()
        seconds = 0.0
        if self.graphs is not None:
            with startup.phase("capturing decode graphs", len(buckets_up_to(self.graphs.max_bs)), "graphs") as phase:
                seconds += self.graphs.capture_all(phase.advance)
        if self.prefill_graphs is not None:
            stream = torch.cuda.current_stream() if self.device.type == "cuda" else None
            try:
                with startup.phase("capturing prefill graphs", len(self.prefill_graphs.sizes), "graphs") as phase:
                    seconds += self.prefill_graphs.capture_all(phase.advance)
            except Exception as exc:
                # a capture that fails inside torch.cuda.graph raises again from capture_end, which skips
                # restoring the stream: put it back, and name the first error
                if stream is not None:
                    torch.cuda.set_stream(stream)
                first = exc.__context__ or exc
                log.warning("short-prefill CUDA graphs not captured (%s: %s); those steps run eagerly",
                            type(first).__name__, first)
                self.prefill_graphs = None
                self._sync()
        verify = self.spec.graphs if self.spec is not None else None
        if verify is not None:
            with startup.phase("capturing verify graphs", len(buckets_up_to(verify.max_bs)), "graphs") as phase:
                seconds += verify.capture_all(phase.advance)
        return seconds

    def warm_tier_loads(self) -> float:
        """Run the CPU tier's load copies once, into the scratch page and state slot, so that the first
        tier hit does not pay for their first launch (on an H200 the first hit's step took 74 ms, the
        next ones 10). They only read the tier (its first entries); returns the seconds it took."""
        if self.host is None or self.scratch is None or not self.host.layout.num_pages:
            return 0.0
        started = time.perf_counter()
        page, slot = self.scratch
        with torch.inference_mode():
            self._copy_pages(to_host=False, pages=[page], entries=[0])
            if slot is not None and self.host.conv is not None and self.host.layout.num_states:
                self._copy_state(to_host=False, slot=slot, entry=0)
                self.state.zero_slot(slot)
        self._sync()
        return time.perf_counter() - started

    def execute(self, plan: StepPlan) -> StepResult:
        """Run the plan and wait for its result; failures become a StepResult with `error` set."""
        return self.finish(self.launch(plan))

    def launch(self, plan: StepPlan) -> "Launched":
        """Start the plan: cache ops, forward and sampling are queued on the device, the sampled
        ids land in `last_tokens` there (a following plan may feed them in), and nothing waits
        for the device unless a row samples on the host. `finish` waits and builds the result."""
        self._take_membership(plan)
        started = time.perf_counter()
        self._handed = set()
        try:
            with torch.inference_mode():
                self._run_cache_ops(plan)
                timings, self._peer_timings = self._peer_timings, []
                if not plan.chunks:  # a copies-only plan (tier stores while nothing runs)
                    self._sync()
                    return Launched(plan, [], None, started)
                self._reset_fresh_states(plan)
                if self.spec is not None:
                    out, graph = self.spec.run(plan)
                    return Launched(plan, [s.slot for s in out], None, started, spec_out=out, graph=graph,
                                    matched=self.processor.matched([s.slot for s in out]))
                logits, sample_rows, graph = self.forward(plan)  # [S, vocab], [S], how it ran
                slots = [c.slot for c in plan.chunks if c.sample]
                rows = [SampleRow(self.sampling[c.slot], c.start_pos + len(c.token_ids))
                        for c in plan.chunks if c.sample]
                processed = self.processor.rows(slots)
                matched = self.processor.matched(slots)
                late = LateSample(logits, sample_rows, rows, processed, time.perf_counter())
                if processed and self.processor.behind(slots):  # sampled once the step before is answered
                    if self.mask_wait is not None and samples_on_device(logits, rows):  # ... on the device
                        pending, fill = self.mask_wait.sample(self.processor, slots, late, self.last_tokens)
                        return Launched(plan, slots, pending, started, peer_timings=timings, graph=graph,
                                        matched=matched, fill=fill)
                    return Launched(plan, slots, None, started, peer_timings=timings, graph=graph, late=late,
                                    matched=matched)
                pending, grammar = self._sample(slots, late)
        except Exception as exc:  # a failed step fails its requests, not the rank
            # a pair transfer the failure kept from its worker ends now: its router must not wait for it
            self._refused += [TransferDone(op.transfer_id, False, f"its step failed first: {type(exc).__name__}")
                              for op in plan.ops if isinstance(op, (PeerSend, PeerRecv))
                              and op.transfer_id not in self._handed]
            return Launched(plan, [], None, started, f"{type(exc).__name__}: {exc}")
        return Launched(plan, slots, pending, started, peer_timings=timings, graph=graph, matched=matched,
                        grammar=grammar)

    def _sample(self, slots: list[int], late: LateSample, wait_s: float = 0.0
                ) -> tuple[PendingSample, tuple[float, int, float]]:
        """Process and sample a step's logits; the ids land in last_tokens on the device. Also returns
        (mask fill seconds, live grammar rows, `wait_s`) for StepResult's grammar figures."""
        mask_s, live = self.processor.apply(late.logits, slots, late.processed) if late.processed else (0.0, 0)
        pending = sample_async(late.logits, late.rows)
        if late.processed:
            self.processor.sampled(slots, late.processed, pending.ids)
        if late.rows:
            self.last_tokens.index_copy_(0, late.sample_rows, pending.ids)
        return pending, (mask_s, live, wait_s if live else 0.0)

    def complete(self, launched: "Launched") -> None:
        """Sample a launched step that waited for its predecessor's tokens (`Launched.late`), or start the fill of
        the masks it waits for on the device (`Launched.fill`); the rank calls this once that step is answered,
        while the forward still runs on the device. No-op otherwise."""
        if launched.fill is not None:
            self.mask_wait.start(launched.fill)
        late, launched.late = launched.late, None
        if late is None or launched.error is not None:
            return
        try:
            with torch.inference_mode():
                wait_s = time.perf_counter() - late.queued  # for the step before's answer
                launched.sample, launched.grammar = self._sample(launched.slots, late, wait_s)
        except Exception as exc:  # as a failed launch: the step fails its requests
            launched.error = f"{type(exc).__name__}: {exc}"

    def finish(self, launched: "Launched") -> StepResult:
        """Wait for a launched plan's sampled ids (only they, and requested logprobs, come back)."""
        plan = launched.plan
        self.complete(launched)
        if launched.fill is not None and launched.error is None:  # the fill is done before `_consume`
            launched.grammar, launched.error = launched.fill.outcome()
        if launched.error is not None:
            return StepResult(plan.step, [], 0.0, launched.error, transfers=self._transfers())
        if launched.spec_out is not None:
            self._consume(launched, launched.spec_out)
            return StepResult(plan.step, launched.spec_out, time.perf_counter() - launched.started,
                              graph=launched.graph, transfers=self._transfers())
        outs = launched.sample.outputs() if launched.sample is not None else []
        forward_s = time.perf_counter() - launched.started
        if launched.peer_timings:
            _log_peer_copies(launched.peer_timings)
        sampled = [Sampled(s, o.token_id, o.logprob, o.top_logprobs) for s, o in zip(launched.slots, outs)]
        self._consume(launched, sampled)
        (mask_s, rows, wait_s), fills = launched.grammar, self.processor.cache_fills()
        return StepResult(plan.step, sampled, forward_s, graph=launched.graph, transfers=self._transfers(),
                          grammar_mask_s=mask_s, grammar_rows=rows, grammar_wait_s=wait_s, **fills)

    def _consume(self, launched: "Launched", sampled: list[Sampled]) -> None:
        """Grammar rows' matchers take the tokens their step emitted."""
        if not launched.matched:
            return
        for s in sampled:
            req_id = launched.matched.get(s.slot)
            if req_id is not None:
                self.processor.consume(s.slot, req_id, [s.token_id, *(e.token_id for e in s.extra)])

    def _take_membership(self, plan: StepPlan) -> None:
        for slot in plan.freed:
            self.sampling.pop(slot, None)
            self.state_slots.pop(slot, None)
            self.processor.drop(slot)
        for seq in plan.new:
            self.sampling[seq.slot] = seq.sampling
            self.processor.admit(seq)
            if seq.state_slot is not None:
                self.state_slots[seq.slot] = seq.state_slot
            if self.pages is not None:
                self.pages.reset(seq.slot)

    def _run_cache_ops(self, plan: StepPlan) -> None:
        """Checkpoint saves and restores and tier copies, in the order the router emitted them."""
        for op in plan.ops:
            if isinstance(op, (SaveCheckpoint, RestoreCheckpoint)):
                if op.src_window is not None or op.dst_window is not None:
                    # the server's coordinator has no window pool: a draft window lives in its state slot
                    raise ValueError("a checkpoint op naming a draft-window slot (windows live in state slots)")
                self.state.copy_slot(op.src_slot, op.dst_slot)
            elif isinstance(op, StorePages):
                self._copy_pages(to_host=True, pages=op.src_pages, entries=op.dst_entries)
            elif isinstance(op, LoadPages):
                self._copy_pages(to_host=False, pages=op.dst_pages, entries=op.src_entries)
            elif isinstance(op, StoreState):
                self._copy_state(to_host=True, slot=op.src_slot, entry=op.dst_entry)
            elif isinstance(op, LoadState):
                self._copy_state(to_host=False, slot=op.dst_slot, entry=op.src_entry)
            elif isinstance(op, PeerCopy):
                self._peer_copy(op)
            elif isinstance(op, (PeerSend, PeerRecv)):
                self._pair_transfer(op)

    def _pair_transfer(self, op: PeerSend | PeerRecv) -> None:
        """Hand a pair-group transfer to the worker of its peer; it ends in a later StepResult's `transfers`
        (a refused one in the next), never failing the step: the request's router rolls it back."""
        self._handed.add(op.transfer_id)
        try:
            if self.pair is None:
                raise PairTransferError("this rank has no pair transfers (not a prefill or decode instance)")
            if len(op.src_pages) != len(op.dst_pages) or (op.src_slot is None) != (op.dst_slot is None) or (
                    (op.src_slot is None) != (self.state is None)):
                raise PairTransferError("unequal page lists, or a state slot that does not fit the pools")
            runs = [page_runs(op.src_pages, op.dst_pages)]
            if self.state is not None:
                runs += [[(op.src_slot, op.dst_slot, 1)]] * 2  # conv, recurrent
            if isinstance(op, PeerSend):
                self.pair.send(op.transfer_id, op.address, op.prefix, runs)
            else:
                self.pair.recv(op.transfer_id, op.peer, op.prefix, runs)
        except (PairTransferError, ValueError) as exc:
            self._refused.append(TransferDone(op.transfer_id, False, str(exc)))

    def _transfers(self) -> list[TransferDone]:
        """The pair transfers that ended (or were refused) since the last result."""
        done, self._refused = self._refused, []
        if self.pair is not None:
            done += [TransferDone(t, ok, why) for t, ok, why in self.pair.finished()]
        return done

    def _peer_copy(self, op: PeerCopy) -> None:
        """A prefill peer's pages and checkpoint into this rank's pools, device to device (CUDA IPC)."""
        if self.peer_pools is None:
            raise ValueError("a peer copy on a rank that cannot map peer pools (CUDA, no drafter)")
        peer = self.peer_pools.get(op.pools)
        if len(op.src_pages) != len(op.dst_pages) or (op.src_slot is None) != (op.dst_slot is None) or (
                (op.src_slot is None) == ("conv" in peer)):
            raise ValueError("a peer copy with unequal page lists, or a state copy that does not fit the pools")
        src_n, dst_n = peer["kv"].shape[1], self.kv.num_pages
        if not all(0 <= s < src_n for s in op.src_pages) or not all(0 <= d < dst_n for d in op.dst_pages):
            raise IndexError("a peer copy names pages outside the pools")
        if op.src_slot is not None and not (0 <= op.src_slot < peer["conv"].shape[1]
                                            and 0 <= op.dst_slot < self.state.num_slots):
            raise IndexError("a peer copy names a state slot outside the pools")
        kv = self.kv.layers_view()
        # one captured graph (hkv/engine/peer_copy_graphs.py), its index upload queued before the timed window
        captured = self.peer_graphs.prepare(op.pools, peer, op.src_pages, op.dst_pages, op.src_slot, op.dst_slot) \
            if self.peer_graphs is not None else None  # (replay, its bucket) or None: copied below
        runs = page_runs(op.src_pages, op.dst_pages) if captured is None else []
        # else few runs (a fresh prompt's pages are consecutive on both sides): a strided copy each, a cheap
        # launch; many: one copy_blocks launch, its index upload queued before the timed window
        idx = self._indexes(op.src_pages, op.dst_pages) if len(runs) > MAX_RUNS else None
        # the copy's own device time: the events go around the copies
        timing = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        timing[0].record()
        launch_started = time.perf_counter()  # host time inside the window: the GPU may wait on it
        if captured is not None:
            captured[0]()  # pages and state in one launch: the pages' time is the whole transfer's
            timing[1].record()
        else:
            if idx is not None:
                copy_blocks(peer["kv"], kv, idx[0], idx[1])
            else:
                copy_runs(peer["kv"], kv, runs)
            timing[1].record()
            if op.src_slot is not None:  # one slot of each state tensor: one run each, launched while the pages copy
                # (copy_blocks for the recurrent state measured slower in the served step: its Python launch)
                for src, dst in ((peer["conv"], self.state.conv), (peer["recurrent"], self.state.recurrent)):
                    copy_runs(src, dst, [(op.src_slot, op.dst_slot, 1)])
        timing[2].record()
        host_s = time.perf_counter() - launch_started
        nbytes = len(op.src_pages) * kv[:, 0].numel() * kv.element_size()
        if op.src_slot is not None:
            nbytes += sum(t[:, 0].numel() * t.element_size() for t in (self.state.conv, self.state.recurrent))
        how = f"graph of {captured[1]} pages" if captured is not None else "copy_blocks" if idx is not None else \
            f"{len(runs)} run{'s' if len(runs) != 1 else ''}"
        self._peer_timings.append((*timing, len(op.src_pages), how, nbytes, host_s))

    def _indexes(self, *lists: list[int]) -> torch.Tensor:
        """The index lists as one [n, M] int64 tensor on the device: one host-to-device transfer."""
        idx = torch.tensor(lists, dtype=torch.long)
        if self.device.type == "cuda":
            return idx.pin_memory().to(self.device, non_blocking=True)
        return idx

    def _copy_pages(self, to_host: bool, pages: list[int], entries: list[int]) -> None:
        """Pages between the device pool and the CPU tier: K and V of every layer in one copy.
        Out-of-range pairs are skipped by the copy."""
        if self.host is None or len(pages) != len(entries):
            raise ValueError("a tier copy without a CPU tier, or with unequal index lists")
        if not pages:
            return
        idx = self._indexes(pages, entries)
        device_side, host_side = self.kv.layers_view(), self.host.kv_layers
        if to_host:
            copy_blocks(device_side, host_side, idx[0], idx[1])
        else:
            copy_blocks(host_side, device_side, idx[1], idx[0])

    def _copy_state(self, to_host: bool, slot: int, entry: int) -> None:
        """One checkpoint between a state slot and a CPU-tier state entry."""
        if self.host is None or self.state is None or self.host.conv is None:
            raise ValueError("a state copy without a CPU tier or a state pool")
        if not (0 <= slot < self.state.num_slots and 0 <= entry < self.host.layout.num_states):
            raise IndexError(f"state copy slot {slot} / entry {entry} out of range")
        # the drafter's tensors (speculative decoding): model dtype on the device, fp32 in the tier
        drafter = [(self.state.mtp_hidden, self.host.mtp_hidden), (self.state.draft_k, self.host.draft_k),
                   (self.state.draft_v, self.host.draft_v)]
        if any((dev is None) != (host is None) for dev, host in drafter):
            raise ValueError("the state pool and the CPU tier disagree on the drafter's state")
        idx = self._indexes([slot], [entry])
        for dev, host in ((self.state.conv, self.host.conv), (self.state.recurrent, self.host.recurrent)):
            if to_host:
                copy_blocks(dev, host, idx[0], idx[1])
            else:
                copy_blocks(host, dev, idx[1], idx[0])
        # small tensors of unequal dtypes, which copy_blocks does not convert: plain copy_ (a synchronous
        # transfer on the current stream, after the copies above)
        for dev, host in drafter:
            if dev is None:
                continue
            if to_host:
                host[entry].copy_(dev[slot])
            else:
                dev[slot].copy_(host[entry])

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _reset_fresh_states(self, plan: StepPlan) -> None:
        """A sequence computing from position 0 starts from zero linear state (after the ops)."""
        if self.state is None:
            return
        for chunk in plan.chunks:
            if chunk.start_pos == 0:
                self.state.zero_slot(self.state_slots[chunk.slot])

    def forward(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The plan's forward: logits [S, vocab] of its sampling chunks, their request-table rows [S]
        on the device, and how it ran (StepResult.graph): a graph replay for decode steps that fit a
        captured bucket, graph replays of its parts for one short prefill chunk, both for decode rows
        beside one short prefill chunk, the same for several or long chunks where the cost model of
        PrefillGraphs.plan_chunks prefers it, an eager forward otherwise. Fed-in tokens (Chunk.follows)
        come from `last_tokens`."""
        inputs = StepInputs.of(plan.chunks, self.table, self.page_size,
                               self.state_slots if self.state is not None else None)
        if self.pages is None:
            batch = self.cpu_batch(inputs)
            self.feed(batch.input_ids, torch.from_numpy(inputs.follow_idx), torch.from_numpy(inputs.follow_rows))
            return self.model(batch, self.kv, self.state), torch.from_numpy(inputs.sample_rows), STEP_EAGER
        idx, vals = self.pages.updates(inputs, self.table, self.page_size)
        decode = bool((inputs.q_lens == 1).all()) and len(inputs.logits_indices) == len(inputs.q_lens)
        if self.graphs is not None and decode and self.graphs.bucket(len(inputs.q_lens)) is not None:
            return *self.graphs.replay(inputs, idx, vals, self.feed), STEP_DECODE_GRAPH
        chosen = self._graph_parts(plan.chunks)
        if chosen is not None:
            return self._replay_parts(plan.chunks, *chosen, idx, vals)
        batch, views = self.cuda_batch(inputs, idx, vals)
        self.feed(batch.input_ids, views["follow_idx"], views["follow_rows"])
        return self.model(batch, self.kv, self.state), views["sample_rows"], STEP_EAGER

    def _graph_parts(self, chunks: list[Chunk]) -> tuple[list[int], list[StepInputs], StepParts] | None:
        """(indexes, one-chunk inputs, parts) of the prefill chunks of a step the prefill graphs run,
        decode rows beside them from their bucket's graph, or None (eager: the rows fit no bucket, or
        PrefillGraphs.plan_chunks keeps the chunks eager)."""
        graphs = self.prefill_graphs
        if graphs is None:
            return None
        prefill = [i for i, c in enumerate(chunks) if len(c.token_ids) != 1 or not c.sample]
        rows = len(chunks) - len(prefill)
        bucket = self.graphs.bucket(rows) if rows and self.graphs is not None else None
        if not prefill or rows and bucket is None:
            return None
        rows_s = self.graphs.costs.get(bucket, 0.0) if rows else 0.0
        plan = graphs.plan_chunks([chunks[i] for i in prefill], rows=rows, rows_s=rows_s)
        if plan is None:
            return None
        state_of = self.state_slots if self.state is not None else None
        return prefill, [StepInputs.of([chunks[i]], self.table, self.page_size, state_of) for i in prefill], plan

    def _replay_parts(self, chunks: list[Chunk], prefill: list[int], inputs: list[StepInputs], plan: StepParts,
                      idx: np.ndarray, vals: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The decode rows (if any) from their bucket's graph, then the prefill chunks from their rounds'
        graphs (forwards over disjoint sequences); logits and sampling rows in plan order, and how it ran."""
        def prefill_forward(i, v):
            return self.prefill_graphs.replay_chunks(inputs, plan, i, v)

        if len(prefill) == len(chunks):
            return *prefill_forward(idx, vals), STEP_SHORT_PREFILL_GRAPHS
        chosen = set(prefill)
        decode = [c for i, c in enumerate(chunks) if i not in chosen]
        rows = StepInputs.of(decode, self.table, self.page_size, self.state_slots if self.state is not None else None)
        its = np.isin(idx // self.pages.max_pages, [chunks[i].slot for i in prefill])  # the prefill rows' pairs
        row_logits, row_rows = self.graphs.replay(rows, idx[~its], vals[~its], self.feed)
        chunk_logits, chunk_rows = prefill_forward(idx[its], vals[its])
        # back in plan order: runs of sampled chunks from one side or the other
        pieces, at = [], [0, 0]  # (source, start, stop) runs; at: the next row of each side
        for i, c in enumerate(chunks):
            if not c.sample:
                continue
            side = 1 if i in chosen else 0
            if pieces and pieces[-1][0] == side:
                pieces[-1][2] += 1
            else:
                pieces.append([side, at[side], at[side] + 1])
            at[side] += 1
        sources = ((row_logits, row_rows), (chunk_logits, chunk_rows))
        logits = torch.cat([sources[side][0][a:b] for side, a, b in pieces])
        sample_rows = torch.cat([sources[side][1][a:b] for side, a, b in pieces])
        return logits, sample_rows, STEP_MIXED_GRAPHS

    def feed(self, input_ids: torch.Tensor, idx: torch.Tensor, rows: torch.Tensor) -> None:
        """input_ids[idx[i]] = the token row rows[i] sampled last (a device gather, no wait)."""
        if idx.numel():
            input_ids.index_copy_(0, idx, self.last_tokens.index_select(0, rows))

    def cpu_batch(self, inputs: StepInputs) -> ForwardBatch:
        """The CPU forward's batch: page table rows per sequence, in batch order."""
        return ForwardBatch.from_lists(
            inputs.input_ids, inputs.positions, inputs.q_lens, inputs.kv_lens,
            torch.from_numpy(inputs.page_rows(self.table)), inputs.slot_mapping, inputs.logits_indices,
            state_slots=inputs.state_slots, checkpoints=inputs.checkpoints,
        )

    def cuda_batch(self, inputs: StepInputs, idx: np.ndarray, vals: np.ndarray
                   ) -> tuple[ForwardBatch, dict[str, torch.Tensor]]:
        """An eager CUDA step's batch (and the arena views): every array in one copy, page ids by
        request-table row."""
        group, head_dim = self.attn_dims
        tile = attention_tile(int(inputs.q_lens.max()), group, head_dim, self.kv.attn_dtype)
        block_t = max(1, tile[0] // group)
        arrays = meta_arrays(inputs.q_lens, inputs.kv_lens, inputs.rows, block_t)
        arrays.update(input_ids=inputs.input_ids, positions=inputs.positions, slot_mapping=inputs.slot_mapping,
                      logits_indices=inputs.logits_indices, sample_rows=inputs.sample_rows,
                      follow_idx=inputs.follow_idx, follow_rows=inputs.follow_rows)
        if inputs.state_slots is not None:
            arrays["state_slots"] = inputs.state_slots
        if inputs.checkpoints:
            arrays.update(checkpoint_arrays(inputs.checkpoints, inputs.q_lens))
        fits = sum(len(a) + 2 for a in arrays.values()) + 2 * len(idx) + 8 <= self.arena.capacity
        if fits:
            arrays.update(table_idx=idx, table_val=vals)
        else:
            self.pages.upload(idx, vals)
        views = self.arena.pack(arrays)
        if fits:
            self.pages.apply(views["table_idx"], views["table_val"])
        return ForwardBatch(
            input_ids=views["input_ids"], positions=views["positions"], slot_mapping=views["slot_mapping"],
            logits_indices=views["logits_indices"], page_table=self.pages.table,
            meta=kernel_meta(views, inputs.q_lens, tile, block_t), state_slots=views.get("state_slots"),
            checkpoints=checkpoint_meta(views),
        ), views
