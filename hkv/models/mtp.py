"""The checkpoint's MTP module as a drafter for speculative decoding (Qwen3.5 / Qwen3-Next layout).

Tensors (prefix `mtp.`): fc [H, 2H], pre_fc_norm_embedding, pre_fc_norm_hidden,
layers.0.* (a gated full-attention decoder layer with the family's MLP) and
norm; the embedding and output head are the target's. Convention (vLLM's
qwen3_next_mtp, what tools/train/train_tiny.py trains): from the target's final-norm
hidden state h_t at position t and the embedding of token t+1,

    x = fc(cat([pre_fc_norm_embedding(embed(token_{t+1})), pre_fc_norm_hidden(h_t)]))
    x = layers.0(x)      rope position t, causal attention over the MTP entries
    logits = lm_head(norm(x))                         a guess at token_{t+2}

Storage is shifted by one so it depends on the same tokens as the target's
K/V: the MTP entry of the pair (h_{p-1}, token_p) lives at position p (rope
position p - 1), so the draft K/V of positions [0, L) depend on tokens [0, L)
only, and a prefix's draft K/V can be shared and checkpointed like its pages.
Position 0 has no entry. Per sequence the drafter keeps, in its live state
slot (StatePool.mtp_hidden), h_{L-1}, the target's hidden state at its last
computed position L - 1: with the next token that is the next entry.

Draft K/V (one `DraftStore`):
- window W > 0: a ring of the last W entries per state slot
  (StatePool.draft_k/draft_v [slots, W, Hkv, D], entry p at p % W), attention
  over the last W entries; checkpoints (state-slot copies) carry it.
- W = 0: full length, paged like the target: one more storage layer of the
  KV pool, entry p at the slot of position p; pages and their tiers carry it.

A step first *commits* the entries of the tokens the target accepted (only
their K/V are needed: one projection, no attention), then *drafts*: entry L
from (h_{L-1}, the token just emitted), then K - 1 more, each from the
previous entry's output (after mtp.norm) and its own guess; draft entries are
never written to the store. Everything here is plain torch over small
per-sequence tensors: correct on every device, not yet fast (docs/spec.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hkv_kernels import dispatch
from hkv_kernels.kv_quant import dequantize, store_rows


@dataclass(frozen=True)
class DraftSpec:
    """How the draft layer's K/V are kept: W = window (0 = paged, full length) and the shapes."""

    window: int
    hidden_size: int
    kv_heads: int
    head_dim: int


class MTPLayer(nn.Module):
    """layers.0: pre-norm gated attention + the family's MLP (parameter names as in the checkpoint)."""

    def __init__(self, cfg, mlp: nn.Module) -> None:
        from hkv.models.qwen3_5 import GatedAttention, RMSNorm

        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = GatedAttention(cfg, cfg.num_hidden_layers)  # never run as a target layer
        self.mlp = mlp


class MTPModule(nn.Module):
    """The MTP weights and the drafter's math; the model owns it as `mtp` (names `mtp.*`)."""

    def __init__(self, cfg, mlp: nn.Module) -> None:
        from hkv.models.qwen3_5 import RMSNorm

        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(h, eps)
        self.pre_fc_norm_hidden = RMSNorm(h, eps)
        self.layers = nn.ModuleList([MTPLayer(cfg, mlp)])
        self.norm = RMSNorm(h, eps)

    @property
    def layer(self) -> MTPLayer:
        return self.layers[0]

    def entry_input(self, hidden: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """[n, H] target (or previous draft) hidden states and [n, H] next-token embeddings -> the layer's input."""
        e, _ = self.pre_fc_norm_embedding(embeds, None)
        h, _ = self.pre_fc_norm_hidden(hidden, None)
        return self.fc(torch.cat([e, h], dim=-1))

    def project(self, x: torch.Tensor, positions: torch.Tensor, rotary
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Entries x [n, H] stored at `positions` [n] -> (q [n, Hq, D] rotated, gate [n, Hq, D],
        k, v [n, Hkv, D] normed and rotated, the residual [n, H])."""
        att = self.layer.self_attn
        n = x.shape[0]
        h, residual = self.layer.input_layernorm(x, None)
        query_gate, k, v = att.qkv(h)
        query, gate = query_gate.view(n, att.num_heads, 2 * att.head_dim).chunk(2, dim=-1)
        # the entry of (h_{p-1}, token_p) sits at rope position p - 1 (position 0 has no entry: its row, clamped
        # into the rope tables, is computed and dropped)
        rope_pos = (positions - 1).clamp(min=0)
        cos, sin = rotary.for_batch(rope_pos, x.dtype)
        k_out = torch.empty(n, 1, att.kv_heads, att.head_dim, dtype=x.dtype, device=x.device)
        v_out = torch.empty_like(k_out)
        q = dispatch.attention_prep(
            query.contiguous(), k.reshape(n, att.kv_heads, att.head_dim), v.reshape(n, att.kv_heads, att.head_dim),
            cos, sin, rope_pos, att.q_norm.weight, att.k_norm.weight, att.q_norm.eps, True,
            k_out, v_out, torch.arange(n, device=x.device),
        )
        return q, gate, k_out[:, 0], v_out[:, 0], residual

    def finish(self, q: torch.Tensor, gate: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     visible: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """One query per row, q [B, Hq, D], over keys/values [B, M, Hkv, D] where `visible` [B, M] ->
        the entries' outputs [B, H] after mtp.norm."""
        att = self.layer.self_attn
        B = q.shape[0]
        out = F.scaled_dot_product_attention(
            q[:, :, None], keys.transpose(1, 2), values.transpose(1, 2), attn_mask=visible[:, None, None],
            scale=att.scale, enable_gqa=True,
        )[:, :, 0]  # [B, Hq, D]
        out = out * torch.sigmoid(gate)
        h = att.o_proj(out.reshape(B, -1))
        h, residual = self.layer.post_attention_layernorm(h, residual)
        h, _ = self.norm(self.layer.mlp(h), residual)
        return h


class DraftStore:
    """Where a rank keeps the draft layer's K/V: the state pool's rings (W > 0) or a KV storage layer (W = 0)."""

    def __init__(self, spec: DraftSpec, state, kv=None, layer: int | None = None) -> None:
        self.spec = spec
        self.state = state  # StatePool with mtp_hidden (and draft_k/draft_v when W > 0)
        self.kv = kv  # KVPool holding the paged draft layer (W = 0)
        self.layer = layer  # its storage layer

    def write(self, slots: torch.Tensor, flat: torch.Tensor | None, positions: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """Entries at `positions` [n] (k, v [n, Hkv, D]) of the sequences in state slots `slots` [n]; paged:
        at the flat KV slots `flat` [n] (page * page_size + offset). A ring takes at most W entries of a
        slot per call (the caller keeps the last W)."""
        if self.spec.window:
            dispatch.ring_write(self.state.draft_k, slots, positions, k.contiguous())
            dispatch.ring_write(self.state.draft_v, slots, positions, v.contiguous())
            return
        kc, vc = self.kv.k[self.layer], self.kv.v[self.layer]
        # the paged draft layer is a storage layer of the KV pool: FP8 pages when it is (scale 1.0)
        store_rows(kc.view(-1, *kc.shape[2:]), flat, k, self.kv.k_scale[self.layer])
        store_rows(vc.view(-1, *vc.shape[2:]), flat, v, self.kv.v_scale[self.layer])

    def read(self, slot: int, flat: torch.Tensor | None, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's committed entries at positions [lo, hi): k, v [hi - lo, Hkv, D] (tests);
        paged: `flat` holds the flat KV slots of positions 0 .. hi - 1."""
        if self.spec.window:
            idx = torch.arange(lo, hi, device=self.state.mtp_hidden.device) % self.spec.window
            return self.state.draft_k[slot].index_select(0, idx), self.state.draft_v[slot].index_select(0, idx)
        kc, vc = self.kv.k[self.layer], self.kv.v[self.layer]
        k = kc.reshape(-1, *kc.shape[2:]).index_select(0, flat[lo:hi])
        v = vc.reshape(-1, *vc.shape[2:]).index_select(0, flat[lo:hi])
        return self.dequantized(k, v)

    def dequantized(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Paged entries as read from the KV pool, in the model dtype (FP8 pages times their scales)."""
        dtype = self.state.mtp_hidden.dtype
        return (dequantize(k, dtype, self.kv.k_scale[self.layer]), dequantize(v, dtype, self.kv.v_scale[self.layer]))


@dataclass(frozen=True)
class DraftRow:
    """One sequence's part of a drafting step."""

    state_slot: int
    commit_tokens: list[int]  # the tokens whose entries to write (the ones the target kept), at positions
    commit_start: int  # ... commit_start, commit_start + 1, ...
    hidden: torch.Tensor  # [len(commit_tokens), H] the target's hidden states AT those positions
    next_token: int | None  # the token just emitted (drafting starts from it); None: nothing to draft
    flat: torch.Tensor | None = None  # paged (W = 0): flat KV slots of its positions 0 .. L - 1
    checkpoints: tuple[tuple[int, int], ...] = ()  # (depth, state slot): in-chunk checkpoints to give its state


class Drafter:
    """Commit and draft for a batch of sequences with the model's MTP module, batched across sequences."""

    def __init__(self, model, store: DraftStore) -> None:
        self.model = model
        self.mtp: MTPModule = model.mtp
        self.store = store

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.model.embed_tokens(tokens)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        from hkv.models.parallel import lm_logits

        return lm_logits(self.model, h)

    def commit(self, rows: list[DraftRow]) -> None:
        """Write every row's entries (entry p pairs h_{p-1} with token p; the first one's h is the stored
        one), give its in-chunk checkpoints the drafter's state at their depth, and store its new
        h_{L-1}. Only K/V are needed, no attention."""
        state, store, W = self.store.state, self.store, self.store.spec.window
        rows = [r for r in rows if r.commit_tokens]
        if not rows:
            return
        device = state.mtp_hidden.device
        hidden, tokens, positions, slots, flat = [], [], [], [], []
        for r in rows:
            n = len(r.commit_tokens)
            hidden += [state.mtp_hidden[r.state_slot][None], r.hidden[: n - 1]]
            tokens += r.commit_tokens
            positions.append(torch.arange(r.commit_start, r.commit_start + n))
            slots += [r.state_slot] * n
            if not W:
                flat.append(r.flat[r.commit_start : r.commit_start + n].cpu())
        h_in = torch.cat(hidden)
        pos = torch.cat(positions).to(device)
        slot_t = torch.tensor(slots, dtype=torch.long, device=device)
        x = self.mtp.entry_input(h_in, self.embed(torch.tensor(tokens, dtype=torch.long, device=device)))
        _, _, k, v, _ = self.mtp.project(x, pos, self.model.rotary)
        offset = 0
        for r in rows:  # in-chunk checkpoints first: they read the ring as it was before this chunk
            self._checkpoint_states(r, k[offset:], v[offset:])
            offset += len(r.commit_tokens)
        # entry 0 does not exist; a ring keeps each slot's last W entries (one write per ring cell)
        ends = torch.cat([torch.full((len(r.commit_tokens),), r.commit_start + len(r.commit_tokens)) for r in rows])
        keep = (pos >= 1) & ((pos >= ends.to(device) - W) if W else True)
        if bool(keep.any()):
            store.write(slot_t[keep], torch.cat(flat).to(device)[keep] if not W else None, pos[keep], k[keep], v[keep])
        for r in rows:
            state.mtp_hidden[r.state_slot].copy_(r.hidden[len(r.commit_tokens) - 1])

    def _checkpoint_states(self, r: DraftRow, k: torch.Tensor, v: torch.Tensor) -> None:
        """An in-chunk checkpoint at depth d gets h_{d-1} and, with a ring, the entries d - W + 1 .. d - 1
        (k, v: the commit's K/V from this row's first entry on)."""
        state, W = self.store.state, self.store.spec.window
        for depth, ckpt in r.checkpoints:
            state.mtp_hidden[ckpt].copy_(r.hidden[depth - r.commit_start - 1])
            if not W:
                continue
            state.draft_k[ckpt].copy_(state.draft_k[r.state_slot])
            state.draft_v[ckpt].copy_(state.draft_v[r.state_slot])
            lo = max(r.commit_start, depth - W + 1, 1)
            if lo >= depth:
                continue
            idx = torch.arange(lo - r.commit_start, depth - r.commit_start)
            pos = torch.arange(lo, depth, device=k.device)
            ids = torch.full_like(pos, ckpt)
            dispatch.ring_write(state.draft_k, ids, pos, k[idx.to(k.device)].contiguous())
            dispatch.ring_write(state.draft_v, ids, pos, v[idx.to(k.device)].contiguous())

    def draft(self, rows: list[DraftRow], count: int) -> list[list[int]]:
        """`count` greedy guesses per row after its next_token, all rows at once: the entry at L (the
        stored h_{L-1} and next_token), then each guess's entry from the previous output."""
        if not rows or count <= 0:
            return [[] for _ in rows]
        device = self.store.state.mtp_hidden.device
        L = torch.tensor([r.commit_start + len(r.commit_tokens) for r in rows], dtype=torch.long, device=device)
        slots = torch.tensor([r.state_slot for r in rows], dtype=torch.long, device=device)
        token = torch.tensor([r.next_token for r in rows], dtype=torch.long, device=device)
        committed = self._ring(L, slots) if self.store.spec.window else self._paged(rows, device)
        return self._draft(L, slots, token, count, committed).tolist()

    def draft_ring(self, L: torch.Tensor, slots: torch.Tensor, token: torch.Tensor, count: int) -> torch.Tensor:
        """draft() for ring windows from device tensors (a CUDA graph's drafter pass): L [B] lengths,
        slots [B] state slots, token [B] the tokens just emitted -> [B, count] guesses."""
        return self._draft(L, slots, token, count, self._ring(L, slots))

    def _draft(self, L, slots, token, count: int, committed) -> torch.Tensor:
        state, W = self.store.state, self.store.spec.window
        device = L.device
        old_k, old_v, old_pos = committed  # [B, M, Hkv, D] x2, [B, M] (-1: none)
        hidden = state.mtp_hidden.index_select(0, slots)  # [B, H]
        new_k, new_v, out = [], [], []
        for j in range(count):
            p = L + j  # [B] the entries' positions
            x = self.mtp.entry_input(hidden, self.embed(token))
            q, gate, k, v, residual = self.mtp.project(x, p, self.model.rotary)
            new_k.append(k[:, None])
            new_v.append(v[:, None])
            keys = torch.cat([old_k, *new_k], dim=1)  # [B, M + j + 1, Hkv, D]
            values = torch.cat([old_v, *new_v], dim=1)
            key_pos = torch.cat([old_pos, p[:, None] - torch.arange(j, -1, -1, device=device)[None]], dim=1)
            visible = (key_pos >= 1) & (key_pos <= p[:, None])
            if W:
                visible &= key_pos > (p[:, None] - W)
            hidden = self.mtp.finish(q, gate, keys, values, visible, residual)  # [B, H]
            token = self.logits(hidden).argmax(dim=-1)
            out.append(token)
        return torch.stack(out, dim=1)

    def _ring(self, L, slots):
        """Ring windows: every row's W cells, with the newest position each holds (< L; -1: none)."""
        store, W = self.store, self.store.spec.window
        cells = torch.arange(W, device=L.device)[None]  # [1, W]
        last = (L - 1)[:, None]
        pos = last - torch.remainder(last - cells, W)
        pos = torch.where(pos >= 1, pos, torch.full_like(pos, -1))
        return store.state.draft_k.index_select(0, slots), store.state.draft_v.index_select(0, slots), pos

    def _paged(self, rows, device):
        """Paged draft layer: positions 1 .. L - 1 of every row, padded, with each key's position (-1: padding)."""
        store = self.store
        M = max(1, max(r.commit_start + len(r.commit_tokens) for r in rows) - 1)
        kc, vc = store.kv.k[store.layer], store.kv.v[store.layer]
        kflat, vflat = kc.reshape(-1, *kc.shape[2:]), vc.reshape(-1, *vc.shape[2:])
        flat = torch.zeros(len(rows), M, dtype=torch.long)
        pos = torch.full((len(rows), M), -1, dtype=torch.long)
        for b, r in enumerate(rows):
            n = r.commit_start + len(r.commit_tokens) - 1  # positions 1 .. L - 1
            if n > 0:
                flat[b, :n] = r.flat[1 : n + 1].cpu()
                pos[b, :n] = torch.arange(1, n + 1)
        flat, pos = flat.to(device), pos.to(device)
        return (*store.dequantized(kflat[flat], vflat[flat]), pos)
