"""Device pool of linear-attention (Gated DeltaNet) states, one slot per sequence or checkpoint.

A slot holds, for every linear layer, the conv state (the last kernel-1 conv
inputs) and the recurrent state. The router decides what a slot means (a
running request's live state or a prefix checkpoint); the rank only reads and
writes slots by index:

    conv      [lin_layers, slots, conv_dim, kernel_size - 1]   oldest input first
    recurrent [lin_layers, slots, v_heads, k_dim, v_dim]

Model layer i that is a linear layer stores its state at storage layer
`layer_map[i]`. A fresh sequence must start from a zeroed slot: the caller
calls `zero_slot` before its first prefill chunk (models never zero slots).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class StateLayout:
    """Shape and placement of a StatePool; two pools with equal layouts hold interchangeable slots."""

    lin_layers: int  # number of linear-attention layers (storage layers)
    num_slots: int
    conv_dim: int  # conv channels: 2 * k_heads * k_dim + v_heads * v_dim (q|k|v)
    kernel_size: int  # conv kernel width; the conv state keeps kernel_size - 1 columns
    v_heads: int
    k_dim: int
    v_dim: int
    layer_ids: tuple[int, ...] = ()  # model layer index of each storage layer, in order
    dtype: str = "float32"
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"state dtype {self.dtype!r} not one of {sorted(_DTYPES)}")
        if self.kernel_size < 2:
            raise ValueError(f"conv kernel_size {self.kernel_size} < 2 leaves no conv state")
        if self.layer_ids and len(self.layer_ids) != self.lin_layers:
            raise ValueError(f"{len(self.layer_ids)} layer_ids for {self.lin_layers} linear layers")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def conv_shape(self) -> tuple[int, ...]:
        return (self.lin_layers, self.num_slots, self.conv_dim, self.kernel_size - 1)

    @property
    def recurrent_shape(self) -> tuple[int, ...]:
        return (self.lin_layers, self.num_slots, self.v_heads, self.k_dim, self.v_dim)

    @property
    def bytes_per_slot(self) -> int:
        """Bytes one slot occupies across all linear layers (conv + recurrent)."""
        per_layer = self.conv_dim * (self.kernel_size - 1) + self.v_heads * self.k_dim * self.v_dim
        return self.lin_layers * per_layer * _DTYPES[self.dtype].itemsize


class StatePool:
    """The conv and recurrent state tensors of all slots, allocated zeroed.

    With speculative decoding (`draft`, hkv.models.mtp.DraftSpec) a slot also holds the drafter's
    state, in the model's dtype `draft_dtype`, so checkpoints carry it with the linear state:

        mtp_hidden [slots, hidden]                 the target's hidden state at the slot's last position
        draft_k / draft_v [slots, W, kv_heads, head_dim]   the draft layer's ring (window W > 0 only)
    """

    def __init__(self, layout: StateLayout, draft=None, draft_dtype: torch.dtype = torch.float32) -> None:
        self.layout: StateLayout = layout
        dtype, device = layout.torch_dtype, torch.device(layout.device)
        self.conv: torch.Tensor = torch.zeros(layout.conv_shape, dtype=dtype, device=device)
        self.recurrent: torch.Tensor = torch.zeros(layout.recurrent_shape, dtype=dtype, device=device)
        self.draft = draft
        self.mtp_hidden: torch.Tensor | None = None
        self.draft_k: torch.Tensor | None = None
        self.draft_v: torch.Tensor | None = None
        if draft is not None:
            n = layout.num_slots
            self.mtp_hidden = torch.zeros(n, draft.hidden_size, dtype=draft_dtype, device=device)
            if draft.window:
                ring = (n, draft.window, draft.kv_heads, draft.head_dim)
                self.draft_k = torch.zeros(ring, dtype=draft_dtype, device=device)
                self.draft_v = torch.zeros(ring, dtype=draft_dtype, device=device)
        layer_ids = layout.layer_ids or tuple(range(layout.lin_layers))
        # model layer -> storage layer
        self.layer_map: dict[int, int] = {layer: i for i, layer in enumerate(layer_ids)}

    @property
    def num_slots(self) -> int:
        return self.layout.num_slots

    @property
    def bytes_per_slot(self) -> int:
        return self.layout.bytes_per_slot

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.layout.num_slots:
            raise IndexError(f"state slot {slot} out of range [0, {self.layout.num_slots})")

    def copy_slot(self, src: int, dst: int) -> None:
        """Overwrite slot `dst` with slot `src` in every linear layer (checkpoint save or restore).

        Mutates only `dst`; `src == dst` is a no-op.
        """
        self._check_slot(src)
        self._check_slot(dst)
        if src == dst:
            return
        self.conv[:, dst].copy_(self.conv[:, src])
        self.recurrent[:, dst].copy_(self.recurrent[:, src])
        for t in self.draft_tensors():
            t[dst].copy_(t[src])

    def draft_tensors(self) -> list[torch.Tensor]:
        """The drafter's per-slot tensors (slot-major), empty without speculative decoding."""
        return [t for t in (self.mtp_hidden, self.draft_k, self.draft_v) if t is not None]

    def draft_bytes_per_slot(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.draft_tensors())

    def zero_slot(self, slot: int) -> None:
        """Reset `slot` to the state of an empty prefix (before a fresh sequence's first token)."""
        self._check_slot(slot)
        self.conv[:, slot].zero_()
        self.recurrent[:, slot].zero_()
        for t in self.draft_tensors():
            t[slot].zero_()
