"""How many state slots and KV pages fit on the GPU: what --gpu-memory-fraction leaves after
weights, state slots, the activations of the largest step and the decode (or verify) graphs.

    fraction * total  [ weights | state slots | activations (measured) | graphs (reserve) | KV pages ... ]

Without --state-slots a hybrid model's state pool holds one live slot per running request
plus CHECKPOINT_SHARE of what the fraction leaves after the weights, in checkpoints: one
checkpoint weighs as much as thousands of tokens of KV (docs/sizing.md), and a hybrid
prefix hit needs its deepest checkpoint, so a pool of running + 64 slots let a few dozen
shared prefixes evict each other's checkpoints while the KV pool sat mostly empty.

The activation peak is measured: one eager forward of the step token budget over a
throwaway pool, with the allocator's peak counter reset. The graphs' share is a
reserve (the static logits of the largest bucket plus headroom: the short-prefill graphs'
pool, one sequence of at most 512 tokens, lives in that headroom), logged with the rest.
Explicit --max-total-tokens skips all of this.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from hkv.config import HkvConfig
from hkv.models.batch import ForwardBatch

log = logging.getLogger("hkv.rank")
GRAPH_HEADROOM = 512 * 2**20  # bytes kept for graph pools beyond their logits buffers
CHECKPOINT_SHARE = 0.25  # of the memory left after the weights, for checkpoint slots (no --state-slots)


def log_weight_bytes(model, dtype: str) -> tuple[int, int]:
    """Log (and return) the loaded weights' bytes: FP8 weights with their block scales, and the rest in
    `dtype` (all of them for an unquantized model)."""
    from hkv.models.fp8 import fp8_weight_bytes

    fp8, other = fp8_weight_bytes(model)
    gib = 2**30
    if fp8:
        log.info("weights: %.2f GiB (FP8 block-quantized %.2f GiB with scales, %s %.2f GiB)",
                 (fp8 + other) / gib, fp8 / gib, dtype, other / gib)
    else:
        log.info("weights: %.2f GiB in %s", other / gib, dtype)
    return fp8, other


def checkpoint_slots(room: int, slot_bytes: int, max_running: int) -> int:
    """State slots for `room` bytes left after the weights: the running requests' live slots plus
    CHECKPOINT_SHARE of the room in checkpoints (at least 64 of them, as the old default had)."""
    return max_running + max(64, int(CHECKPOINT_SHARE * max(room, 0)) // max(slot_bytes, 1))


def state_slots_from_memory(cfg: HkvConfig, model) -> int:
    """The state pool's slots when --state-slots was not given (CUDA, hybrid): see the module doc."""
    dev = next(model.parameters()).device
    total = torch.cuda.get_device_properties(dev).total_memory
    room = int(cfg.cache.gpu_memory_fraction * total) - torch.cuda.memory_allocated(dev)
    slot_bytes = model.state_layout(1, device="meta").bytes_per_slot
    slots = checkpoint_slots(room, slot_bytes, cfg.scheduler.max_running_requests)
    log.info("state pool sized from %.2f of %.1f GiB: %d slots (%d running + %d checkpoints) x %.1f MiB = %.1f GiB",
             cfg.cache.gpu_memory_fraction, total / 2**30, slots, cfg.scheduler.max_running_requests,
             slots - cfg.scheduler.max_running_requests, slot_bytes / 2**20, slots * slot_bytes / 2**30)
    return slots


def _activation_peak(model, cfg: HkvConfig, state) -> int:
    """Peak bytes one eager forward of the step token budget allocates beyond what is resident."""

    tokens = cfg.scheduler.chunked_prefill_size
    page_size = cfg.cache.page_size
    pages = -(-tokens // page_size)
    kv = scratch_kv_pool(cfg, model, pages)
    dev = kv.kv.device
    scratch_slot = [state.num_slots - 1] if state is not None else None
    group = model.cfg.num_attention_heads // model.cfg.num_key_value_heads
    batch = ForwardBatch.from_lists(
        input_ids=[0] * tokens, positions=range(tokens), q_lens=[tokens], kv_lens=[tokens],
        page_table=torch.arange(pages, device=dev)[None], slot_mapping=range(tokens), logits_indices=[tokens - 1],
        state_slots=scratch_slot, attn_dims=(group, model.cfg.head_dim, kv.attn_dtype),
    )
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    with torch.inference_mode():
        model(batch, kv, state)
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - base
    if state is not None:
        state.zero_slot(state.num_slots - 1)
    del kv, batch
    torch.cuda.empty_cache()
    return peak


def scratch_kv_pool(cfg: HkvConfig, model, pages: int):
    """A throwaway KV pool of `pages` pages as the rank's (--kv-cache-dtype pages, attention in the model
    dtype, scales 1.0) for the measuring and warm-up forwards."""
    from hkv.models.loader import TORCH_DTYPES
    from hkv.storage.kv_pool import KVPool

    layout = model.kv_layout(pages, cfg.cache.page_size, cfg.model.kv_cache_dtype, cfg.model.device)
    return KVPool(layout, model.layer_map, attn_dtype=TORCH_DTYPES[cfg.model.dtype])


def pages_from_memory(cfg: HkvConfig, model, state) -> int:
    """KV pages for the memory the fraction leaves (at least two); logs the split."""
    dev = next(model.parameters()).device
    total = torch.cuda.get_device_properties(dev).total_memory
    resident = torch.cuda.memory_allocated(dev)  # weights and the state pool
    activations = _activation_peak(model, cfg, state)
    graphs = 0
    if cfg.model.cuda_graph_max_bs:  # the largest bucket's static logits: decode rows, or verify tokens
        graphs = graph_logit_rows(cfg) * model.cfg.vocab_size * 4 + GRAPH_HEADROOM
    room = int(cfg.cache.gpu_memory_fraction * total) - resident - activations - graphs
    page_bytes = kv_page_layout(cfg, model).bytes_per_page()
    pages = max(2, room // page_bytes)
    gib = 2**30
    log.info("KV pool sized from %.2f of %.1f GiB: weights and state slots %.1f GiB, activations %.1f GiB, "
             "graphs %.1f GiB reserved -> %d pages (%d tokens)", cfg.cache.gpu_memory_fraction, total / gib,
             resident / gib, activations / gib, graphs / gib, pages, pages * cfg.cache.page_size)
    if room < 2 * page_bytes:
        log.warning("the GPU has no room for a KV pool at --gpu-memory-fraction %.2f", cfg.cache.gpu_memory_fraction)
    return pages


def kv_page_layout(cfg: HkvConfig, model):
    """The KV pool's layout for one page, as the rank builds it: with --spec-tokens and --draft-window 0
    the paged draft layer is one more storage layer (hkv.engine.spec.with_paged_draft)."""
    from hkv.engine.spec import draft_spec, with_paged_draft

    layout = model.kv_layout(1, cfg.cache.page_size, cfg.model.kv_cache_dtype, "meta")
    draft = draft_spec(model, cfg.spec.draft_window) if cfg.spec.spec_tokens else None
    return with_paged_draft(model, layout, draft)[0]


def graph_logit_rows(cfg: HkvConfig) -> int:
    """Rows of the largest captured bucket's logits buffer: its decode batch, or with --spec-tokens K
    its verify tokens (hkv.engine.spec_graphs.verify_max_bs buckets of K + 1 tokens a row)."""
    from hkv.engine.spec_graphs import verify_max_bs

    k = cfg.spec.spec_tokens
    if not k:
        return cfg.model.cuda_graph_max_bs
    return verify_max_bs(cfg.model.cuda_graph_max_bs, k) * (k + 1)


WARM_UP_LENS = (129, 64, 1)  # two prompts (the first ends in a partial GDN chunk) and a decode row


def _warms_activations(cfg: HkvConfig) -> bool:
    """The warm-up runs the step budget's forward too: on CUDA with --max-total-tokens (sizing the KV pool
    from memory runs that forward otherwise)."""
    return cfg.model.device == "cuda" and cfg.cache.num_pages is not None


def warm_up_steps(cfg: HkvConfig) -> int:
    """The forwards `warm_up` runs (its start-up phase's parts)."""
    return 3 if _warms_activations(cfg) else 2


def warm_up(model, cfg: HkvConfig, state, progress: Callable[[], None] | None = None) -> float:
    """Eager steps over a throwaway KV pool so that Triton compiles, and fla-core autotunes, the
    prefill kernels at start-up instead of inside the first requests' TTFT (on a fresh machine
    the first shared-prefix wave waited 48 s for that): a mixed step of WARM_UP_LENS with an
    in-chunk checkpoint (fla's varlen path), then one prompt alone (its fixed-length path), then
    (on CUDA, when the KV pool is not sized from memory, which runs it anyway) one prompt of
    --chunked-prefill-size tokens (its lengths specialize other kernel variants: without
    it the first 8,192-token prompt of a server with --max-total-tokens compiled for 9 s on an
    H200). Sequences use the scratch state slot, zeroed after. `progress()` after each of the
    `warm_up_steps(cfg)` forwards. Returns the seconds it took."""
    started = time.perf_counter()
    scratch = state.num_slots - 1 if state is not None else None
    progress = progress or (lambda: None)
    try:
        _warm_up_steps(model, cfg, state, scratch, progress)
        if _warms_activations(cfg):
            _activation_peak(model, cfg, state)  # (sizing from memory runs it next anyway)
            progress()
    finally:
        if state is not None:
            state.zero_slot(scratch)
    return time.perf_counter() - started


def _warm_up_steps(model, cfg: HkvConfig, state, scratch: int | None, progress: Callable[[], None]) -> None:
    page_size = cfg.cache.page_size
    group = model.cfg.num_attention_heads // model.cfg.num_key_value_heads
    for lens, checkpoints in ((WARM_UP_LENS, ((0, 64, scratch),)), (WARM_UP_LENS[:1], ())):
        rows = [-(-n // page_size) for n in lens]
        kv = scratch_kv_pool(cfg, model, sum(rows))
        dev = kv.kv.device
        first = [sum(rows[:i]) for i in range(len(lens))]
        table = torch.tensor([[first[b] + min(p, rows[b] - 1) for p in range(max(rows))] for b in range(len(lens))],
                             device=dev)
        positions = [p for n in lens for p in range(n)]
        slot_mapping = [(first[b] + p // page_size) * page_size + p % page_size for b, n in enumerate(lens)
                        for p in range(n)]
        ends = [sum(lens[: b + 1]) - 1 for b in range(len(lens))]
        batch = ForwardBatch.from_lists(
            input_ids=[0] * sum(lens), positions=positions, q_lens=list(lens), kv_lens=list(lens), page_table=table,
            slot_mapping=slot_mapping, logits_indices=ends,
            state_slots=[scratch] * len(lens) if state is not None else None,
            attn_dims=(group, model.cfg.head_dim, kv.attn_dtype), checkpoints=checkpoints if state is not None else (),
        )
        with torch.inference_mode():
            model(batch, kv, state)
        del kv, batch
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            torch.cuda.empty_cache()
        progress()
