"""How many KV pages fit on the GPU: what --gpu-memory-fraction leaves after weights, state
slots, the activations of the largest step and the decode graphs.

    fraction * total  [ weights | state slots | activations (measured) | graphs (reserve) | KV pages ... ]

The activation peak is measured: one eager forward of the step token budget over a
throwaway pool, with the allocator's peak counter reset. The graphs' share is a
reserve (the static logits of the largest bucket plus headroom), logged with the rest.
Explicit --max-total-tokens skips all of this.
"""

from __future__ import annotations

import logging

import torch

from hkv.config import HkvConfig
from hkv.models.batch import ForwardBatch

log = logging.getLogger("hkv.rank")
GRAPH_HEADROOM = 512 * 2**20  # bytes kept for graph pools beyond their logits buffers


def _activation_peak(model, cfg: HkvConfig, state) -> int:
    """Peak bytes one eager forward of the step token budget allocates beyond what is resident."""
    from hkv.storage.kv_pool import KVPool

    tokens = cfg.scheduler.chunked_prefill_size
    page_size = cfg.cache.page_size
    pages = -(-tokens // page_size)
    layout = model.kv_layout(pages, page_size, cfg.model.dtype, cfg.model.device)
    kv = KVPool(layout, model.layer_map)
    dev = kv.kv.device
    scratch_slot = [state.num_slots - 1] if state is not None else None
    group = model.cfg.num_attention_heads // model.cfg.num_key_value_heads
    batch = ForwardBatch.from_lists(
        input_ids=[0] * tokens, positions=range(tokens), q_lens=[tokens], kv_lens=[tokens],
        page_table=torch.arange(pages, device=dev)[None], slot_mapping=range(tokens), logits_indices=[tokens - 1],
        state_slots=scratch_slot, attn_dims=(group, model.cfg.head_dim, kv.k.dtype),
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


def pages_from_memory(cfg: HkvConfig, model, state) -> int:
    """KV pages for the memory the fraction leaves (at least two); logs the split."""
    dev = next(model.parameters()).device
    total = torch.cuda.get_device_properties(dev).total_memory
    resident = torch.cuda.memory_allocated(dev)  # weights and the state pool
    activations = _activation_peak(model, cfg, state)
    graphs = 0
    if cfg.model.cuda_graph_max_bs:
        graphs = cfg.model.cuda_graph_max_bs * model.cfg.vocab_size * 4 + GRAPH_HEADROOM
    room = int(cfg.cache.gpu_memory_fraction * total) - resident - activations - graphs
    page_bytes = model.kv_layout(1, cfg.cache.page_size, cfg.model.dtype, "meta").bytes_per_page()
    pages = max(2, room // page_bytes)
    gib = 2**30
    log.info("KV pool sized from %.2f of %.1f GiB: weights and state slots %.1f GiB, activations %.1f GiB, "
             "graphs %.1f GiB reserved -> %d pages (%d tokens)", cfg.cache.gpu_memory_fraction, total / gib,
             resident / gib, activations / gib, graphs / gib, pages, pages * cfg.cache.page_size)
    if room < 2 * page_bytes:
        log.warning("the GPU has no room for a KV pool at --gpu-memory-fraction %.2f", cfg.cache.gpu_memory_fraction)
    return pages
