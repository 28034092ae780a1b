"""The checkpoint's MTP module as a drafter for speculative decoding (Qwen3.5 / Qwen3-Next layout).

Tensors (prefix `mtp.`): fc [H, 2H], pre_fc_norm_embedding, pre_fc_norm_hidden,
layers.0.* (a gated full-attention decoder layer with the family's MLP) and
norm; the embedding and output head are the target's. Convention (vLLM's
qwen3_next_mtp, what tools/train_tiny.py trains): from the target's final-norm
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
        rope_pos = positions - 1  # the entry of (h_{p-1}, token_p) sits at rope position p - 1
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
               residual: torch.Tensor) -> torch.Tensor:
        """One query row [1, Hq, D] over its keys/values [m, Hkv, D] (all visible) -> the entry's output
        [1, H] after mtp.norm (what the output head reads and the next draft takes as its hidden)."""
        att = self.layer.self_attn
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), scale=att.scale, enable_gqa=True
        ).transpose(0, 1)  # [1, Hq, D]
        out = out * torch.sigmoid(gate)
        h = att.o_proj(out.reshape(1, -1))
        h, residual = self.layer.post_attention_layernorm(h, residual)
        h, _ = self.norm(self.layer.mlp(h), residual)
        return h


class DraftStore:
    """Where a rank keeps the draft layer's K/V: the state pool's rings (W > 0) or a KV storage layer (W = 0)."""

    def __init__(self, spec: DraftSpec, state, kv=None, layer: int | None = None, page_size: int = 0) -> None:
        self.spec = spec
        self.state = state  # StatePool with mtp_hidden (and draft_k/draft_v when W > 0)
        self.kv = kv  # KVPool holding the paged draft layer (W = 0)
        self.layer = layer  # its storage layer
        self.page_size = page_size

    def write(self, slot: int, pages: list[int], positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Entries at `positions` [n] (k, v [n, Hkv, D]) of the sequence in state slot `slot` / `pages`."""
        W = self.spec.window
        if W:
            rows = torch.full_like(positions, slot)
            dispatch.ring_write(self.state.draft_k, rows, positions, k)
            dispatch.ring_write(self.state.draft_v, rows, positions, v)
            return
        flat = self._flat_slots(pages, positions)
        kc, vc = self.kv.k[self.layer], self.kv.v[self.layer]
        kc.view(-1, *kc.shape[2:]).index_copy_(0, flat, k.to(kc.dtype))
        vc.view(-1, *vc.shape[2:]).index_copy_(0, flat, v.to(vc.dtype))

    def read(self, slot: int, pages: list[int], lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The committed entries at positions [lo, hi): k, v [hi - lo, Hkv, D]."""
        device = self.state.mtp_hidden.device
        positions = torch.arange(lo, hi, device=device)
        if self.spec.window:
            idx = positions % self.spec.window
            return self.state.draft_k[slot].index_select(0, idx), self.state.draft_v[slot].index_select(0, idx)
        flat = self._flat_slots(pages, positions)
        kc, vc = self.kv.k[self.layer], self.kv.v[self.layer]
        return (kc.reshape(-1, *kc.shape[2:]).index_select(0, flat),
                vc.reshape(-1, *vc.shape[2:]).index_select(0, flat))

    def visible(self, position: int) -> int:
        """The first committed position an entry at `position` attends to (entries start at 1)."""
        W = self.spec.window
        return max(1, position - W + 1) if W else 1

    def _flat_slots(self, pages: list[int], positions: torch.Tensor) -> torch.Tensor:
        P = self.page_size
        table = torch.tensor(pages, dtype=torch.long, device=positions.device)
        return table[positions // P] * P + positions % P


@dataclass(frozen=True)
class DraftRow:
    """One sequence's part of a drafting step."""

    state_slot: int
    pages: list[int]  # its page ids (W = 0), in order
    commit_tokens: list[int]  # the tokens whose entries to write (accepted this step), at positions
    commit_start: int  # ... commit_start, commit_start + 1, ...
    commit_hidden: torch.Tensor  # [len(commit_tokens), H]: the target's hidden states at the positions before them
    # (row 0 is ignored when the stored h_{start-1} is used, see Drafter.step)
    last_hidden: torch.Tensor | None  # [H] the target's hidden state at the last committed position
    next_token: int | None  # the token just emitted (drafting starts from it); None: nothing to draft
    count: int  # proposals to make


class Drafter:
    """Commit and draft for a batch of sequences with the model's MTP module."""

    def __init__(self, model, store: DraftStore) -> None:
        self.model = model
        self.mtp: MTPModule = model.mtp
        self.store = store

    def embed(self, tokens: list[int], device) -> torch.Tensor:
        return self.model.model.embed_tokens(torch.tensor(tokens, dtype=torch.long, device=device))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        weight = self.model.model.embed_tokens.weight if self.model.lm_head is None else self.model.lm_head.weight
        return F.linear(h, weight).float()

    @torch.inference_mode()
    def step(self, rows: list[DraftRow]) -> list[list[int]]:
        """Commit every row's accepted entries, then draft its proposals; returns them per row."""
        out = []
        for row in rows:
            self.commit(row)
            out.append(self.draft(row) if row.next_token is not None and row.count > 0 else [])
        return out

    def commit(self, row: DraftRow) -> None:
        """Write the entries of commit_tokens (positions commit_start...) and store the new h_{L-1}."""
        state = self.store.state
        n = len(row.commit_tokens)
        if n:
            device = state.mtp_hidden.device
            # entry p pairs h_{p-1} with token p: the first one's hidden is the stored one
            hidden = row.commit_hidden.clone()
            hidden[0] = state.mtp_hidden[row.state_slot]
            positions = torch.arange(row.commit_start, row.commit_start + n, device=device)
            keep = positions >= 1  # position 0 has no entry
            if bool(keep.any()):
                x = self.mtp.entry_input(hidden[keep], self.embed(row.commit_tokens, device)[keep])
                _, _, k, v, _ = self.mtp.project(x, positions[keep], self.model.rotary)
                self.store.write(row.state_slot, row.pages, positions[keep], k, v)
        if row.last_hidden is not None:
            state.mtp_hidden[row.state_slot].copy_(row.last_hidden)

    def draft(self, row: DraftRow) -> list[int]:
        """`count` greedy guesses after next_token, from the committed entries and the chain so far."""
        state, store = self.store.state, self.store
        device = state.mtp_hidden.device
        L = row.commit_start + len(row.commit_tokens)  # committed length; next_token sits at L
        hidden = state.mtp_hidden[row.state_slot][None]  # [1, H]: h_{L-1}
        token = row.next_token
        keys, values = [], []
        lo = store.visible(L)
        if lo < L:
            k_old, v_old = store.read(row.state_slot, row.pages, lo, L)
            keys, values = [k_old], [v_old]
        first_key = lo  # position of the first key kept in keys/values
        proposals = []
        for j in range(row.count):
            p = L + j
            x = self.mtp.entry_input(hidden, self.embed([token], device))
            q, gate, k, v, residual = self.mtp.project(x, torch.tensor([p], device=device), self.model.rotary)
            keys.append(k)
            values.append(v)
            k_all, v_all = torch.cat(keys), torch.cat(values)
            start = store.visible(p) - first_key  # a window drops the oldest keys as the chain grows
            hidden = self.mtp.finish(q, gate, k_all[start:], v_all[start:], residual)
            token = int(self.logits(hidden).argmax(dim=-1))
            proposals.append(token)
        return proposals
