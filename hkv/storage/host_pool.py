"""The CPU tier's page pool: one shared-memory buffer of page-size units, pages and checkpoints in one budget.

The cache worker decides which entry holds what; ranks copy contents between
their device pools and these entries; the worker reads and writes whole
entries for the disk tier. A page entry is one unit; a checkpoint (state)
entry is one block of `state_units` units, k = ceil(state_bytes / page_bytes),
its bytes at the start of the block (hkv/cache/slab.py says who holds which):

    buffer  [ unit 0 | unit 1 | ... | unit k-1 | unit k | ... | unit N-1 ]
    block   [ state entry 0 ................... | state entry 1 ....      ]
    page    [2 (K, V), kv_layers, page_size, kv_heads, head_dim]       the KV pool's dtype, one unit
    state   [conv: lin_layers, conv_dim, kernel-1][recurrent: lin_layers, v_heads, k_dim, v_dim]   fp32
            [mtp_hidden: hidden][draft_k: W, kv_heads, head_dim][draft_v: W, kv_heads, head_dim]  fp32,
            the drafter's part (--spec-tokens only; draft_k/v with --draft-window W > 0 only)

Under `--tp N` an entry holds every rank's shard of it, rank-major, under one key (the
cache worker and the disk tier see whole entries; `descriptor` names N, so a tier or disk entry
of another N never matches), and rank r's HostPool views only its shard:

    page    [rank 0: 2, kv_layers, page_size, kv_heads / N, head_dim][rank 1: ...] ...
    state   [rank 0: conv | recurrent | drafter][rank 1: ...] ...        (each rank's heads and channels)

Every entry is contiguous, so it is also one disk payload. `HostPool` gives
torch views in the device pools' axis order (layer first), so one
`copy_blocks` call per tensor moves any list of pages or slots; page and
state views alias the same bytes, and the worker never hands out a unit as
a page while its block holds a checkpoint. `HostLayout.for_model` sizes the
pool from KV and state layouts (and the drafter's shapes, hkv.models.mtp.DraftSpec:
with W = 0 the draft K/V are one more KV layer, so pages carry them); the
launcher gets those from a meta-device model (`tier_layout` in hkv/launcher.py).
The device keeps the drafter's tensors in the model dtype; the tier stores
them as fp32, so a copy converts (hkv/engine/model_runner.py `_copy_state`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from hkv.storage.kv_pool import KVLayout
from hkv.storage.state_pool import StateLayout

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float8_e4m3fn": torch.float8_e4m3fn}  # the KV pages' dtypes: the tier keeps their bytes as they are


@dataclass(frozen=True)
class HostLayout:
    """Shapes of the CPU tier's entries; two pools (or a disk file) with equal `descriptor` interchange entries."""

    num_pages: int  # page-size units: page entry ids 0 .. num_pages-1 (a multiple of state_units)
    state_units: int  # units one checkpoint takes (0 for dense models): state entry b is units [b*k, (b+1)*k)
    kv_layers: int
    page_size: int
    kv_heads: int
    head_dim: int
    kv_dtype: str
    lin_layers: int = 0
    conv_dim: int = 0
    conv_width: int = 0  # kernel_size - 1 columns of conv state
    v_heads: int = 0
    k_dim: int = 0
    v_dim: int = 0
    draft_hidden: int = 0  # the drafter's part of a state entry (0: not drafting): mtp_hidden [hidden]
    draft_window: int = 0  # W of the draft K/V ring [W, draft_kv_heads, draft_head_dim] (0: none, paged)
    draft_kv_heads: int = 0
    draft_head_dim: int = 0
    tp: int = 1  # ranks whose shards an entry holds (the shapes above are one rank's)

    def __post_init__(self):
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")
        per_block = max(1, self.state_units)
        if self.num_pages < 0 or self.num_pages % per_block:
            raise ValueError(f"num_pages ({self.num_pages}) must be a multiple of state_units ({self.state_units})")
        if (self.state_units > 0) != (self.lin_layers > 0):
            raise ValueError("state_units must be > 0 exactly when the layout has linear-attention state")
        if self.draft_hidden and not self.lin_layers:
            raise ValueError("the drafter's state needs a layout with linear-attention state")
        if not self.draft_hidden and any(self.draft_part):
            raise ValueError("draft_window / draft_kv_heads / draft_head_dim without draft_hidden")
        if (self.draft_window > 0) != (self.draft_kv_heads > 0) or (self.draft_window > 0) != (self.draft_head_dim > 0):
            raise ValueError("draft_window, draft_kv_heads and draft_head_dim are all > 0 (a ring) or all 0")
        if self.state_units and self.state_units * self.page_bytes < self.state_bytes:
            raise ValueError(f"{self.state_units} units of {self.page_bytes} bytes cannot hold a "
                             f"{self.state_bytes}-byte checkpoint")  # fmt: skip

    @classmethod
    def for_model(cls, kv: KVLayout, state: StateLayout | None, budget_bytes: int, draft=None,
                  tp: int = 1) -> "HostLayout":
        """As many units as `budget_bytes` holds, in whole checkpoint blocks (a hybrid tier holds one at least).

        `draft` (hkv.models.mtp.DraftSpec, or None): the drafter's shapes; `kv` must then already have
        the paged draft layer when its window is 0 (hkv.engine.spec.with_paged_draft). tp: the ranks;
        kv, state and draft are then one rank's layouts."""
        fields = dict(kv_layers=kv.num_layers, page_size=kv.page_size, kv_heads=kv.kv_heads,
                      head_dim=kv.head_dim, kv_dtype=kv.dtype, tp=tp)
        if state is not None:
            if state.dtype != "float32":
                raise ValueError(f"the CPU tier stores fp32 states, the state pool is {state.dtype}")
            fields.update(lin_layers=state.lin_layers, conv_dim=state.conv_dim, conv_width=state.kernel_size - 1,
                          v_heads=state.v_heads, k_dim=state.k_dim, v_dim=state.v_dim)
        if draft is not None:
            if state is None:
                raise ValueError("the drafter's state lives in state entries; a dense model has none")
            fields.update(zip(("draft_hidden", "draft_window", "draft_kv_heads", "draft_head_dim"),
                              draft_part(draft)))
        page_bytes = tp * kv.bytes_per_page()  # the same bytes as a page entry (asserted below)
        state_bytes = tp * (state.bytes_per_slot + 4 * _draft_numel(draft_part(draft))) if state is not None else 0
        per_block = -(-state_bytes // page_bytes) if state is not None else 1
        units = max(0, budget_bytes) // page_bytes // per_block * per_block
        layout = cls(num_pages=units, state_units=per_block if state is not None else 0, **fields)
        assert layout.page_bytes == page_bytes and layout.state_bytes == state_bytes
        return layout

    @property
    def num_states(self) -> int:
        """State entry ids: one per block of state_units units (0 for dense models)."""
        return self.num_pages // self.state_units if self.state_units else 0

    @property
    def kv_shape(self) -> tuple[int, ...]:
        """One page entry: [2, kv_layers, page_size, kv_heads, head_dim]."""
        return (2, self.kv_layers, self.page_size, self.kv_heads, self.head_dim)

    @property
    def rank_page_bytes(self) -> int:
        """One rank's shard of a page entry."""
        return math.prod(self.kv_shape) * _DTYPES[self.kv_dtype].itemsize

    @property
    def page_bytes(self) -> int:
        return self.tp * self.rank_page_bytes

    @property
    def conv_numel(self) -> int:
        return self.lin_layers * self.conv_dim * self.conv_width

    @property
    def recurrent_numel(self) -> int:
        return self.lin_layers * self.v_heads * self.k_dim * self.v_dim

    @property
    def draft_part(self) -> tuple[int, int, int, int]:
        """(hidden, W, kv_heads, head_dim) of the drafter's part of a state entry; all 0 when not drafting."""
        return (self.draft_hidden, self.draft_window, self.draft_kv_heads, self.draft_head_dim)

    @property
    def ring_numel(self) -> int:
        """Floats of one of draft_k / draft_v in a state entry (0 without a ring)."""
        return self.draft_window * self.draft_kv_heads * self.draft_head_dim

    @property
    def draft_bytes(self) -> int:
        """Bytes the drafter adds to a state entry (fp32): mtp_hidden, then draft_k and draft_v."""
        return 4 * _draft_numel(self.draft_part)

    @property
    def rank_state_bytes(self) -> int:
        """One rank's shard of a checkpoint."""
        return (self.conv_numel + self.recurrent_numel) * 4 + self.draft_bytes

    @property
    def state_bytes(self) -> int:
        return self.tp * self.rank_state_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes of one checkpoint block: state_units units (a checkpoint uses its first state_bytes)."""
        return self.state_units * self.page_bytes

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.page_bytes

    @property
    def descriptor(self) -> str:
        """What one entry holds, independent of the entry counts (disk headers and attach checks)."""
        kv = "x".join(map(str, self.kv_shape))
        text = f"kv:{kv}:{self.kv_dtype}"
        if self.lin_layers:
            text += (f"|state:conv{self.lin_layers}x{self.conv_dim}x{self.conv_width}"
                     f"+rec{self.lin_layers}x{self.v_heads}x{self.k_dim}x{self.v_dim}:float32")
        if self.draft_hidden:
            text += f"|draft:hidden{self.draft_hidden}"
            if self.draft_window:
                ring = f"{self.draft_window}x{self.draft_kv_heads}x{self.draft_head_dim}"
                text += f"+k{ring}+v{ring}"
            text += ":float32"
        if self.tp > 1:
            text += f"|tp{self.tp}"
        return text

    def to_dict(self) -> dict:
        return asdict(self)


def kv_dtype_of(descriptor: str) -> str:
    """The KV pages' dtype a layout descriptor names ("kv:<shape>:<dtype>|..."); "" when it names none."""
    head = descriptor.split("|", 1)[0].split(":")
    return head[2] if len(head) == 3 and head[0] == "kv" else ""


def tp_of(descriptor: str) -> int | None:
    """The ranks a layout descriptor's entries are sharded over: its "|tp<N>" part, 1 without one;
    None when that part is not a positive integer."""
    parts = [p for p in descriptor.split("|") if p.startswith("tp")]
    if not parts:
        return 1
    digits = parts[-1][2:]
    if len(parts) > 1 or not digits.isdigit() or len(digits) > 6 or int(digits) < 2:
        return None
    return int(digits)


def draft_part(draft) -> tuple[int, int, int, int]:
    """(hidden, W, kv_heads, head_dim) a state entry holds for `draft` (a DraftSpec or None): all 0 when
    not drafting, the ring's shape 0 when W = 0 (the draft K/V are then paged, in page entries)."""
    if draft is None:
        return (0, 0, 0, 0)
    if draft.window:
        return (draft.hidden_size, draft.window, draft.kv_heads, draft.head_dim)
    return (draft.hidden_size, 0, 0, 0)


def _draft_numel(part: tuple[int, int, int, int]) -> int:
    hidden, window, heads, dim = part
    return hidden + 2 * window * heads * dim


class HostPool:
    """Torch views over a HostLayout buffer (an shm payload, or any writable buffer in tests).

        k, v      [kv_layers, num_pages, page_size, kv_heads, head_dim]   (views; entry-major in memory)
        kv_layers [2 * kv_layers, num_pages, page_size, kv_heads, head_dim]   K's layers then V's
        conv      [lin_layers, num_states, conv_dim, conv_width]
        recurrent [lin_layers, num_states, v_heads, k_dim, v_dim]
        mtp_hidden [num_states, draft_hidden]                                  (drafting only)
        draft_k, draft_v [num_states, draft_window, draft_kv_heads, draft_head_dim]   (a ring only)

    The drafter's views are slot-major like StatePool's (and fp32, the device's are the model dtype).
    Under --tp the views are rank `rank`'s shard of every entry.
    """

    def __init__(self, layout: HostLayout, buffer: memoryview, rank: int = 0):
        if memoryview(buffer).nbytes < layout.nbytes:
            raise ValueError(f"host pool buffer has {memoryview(buffer).nbytes} bytes, the layout needs {layout.nbytes}")
        self.layout: HostLayout = layout
        self.buffer: memoryview = memoryview(buffer).cast("B")  # views, never copies, of any buffer
        lay = layout
        if not 0 <= rank < lay.tp:
            raise ValueError(f"rank {rank} out of range for a tier of {lay.tp} ranks")
        dtype = _DTYPES[lay.kv_dtype]
        self.pages: torch.Tensor | None = None  # [num_pages, 2, L, P, H, D]
        self.k = self.v = self.kv_layers = self.conv = self.recurrent = None
        self.mtp_hidden = self.draft_k = self.draft_v = None
        if lay.num_pages:
            flat = torch.frombuffer(self.buffer, dtype=dtype, count=lay.num_pages * lay.page_bytes // dtype.itemsize)
            self.pages = flat.view(lay.num_pages, lay.tp, *lay.kv_shape)[:, rank]
            self.k = self.pages[:, 0].transpose(0, 1)  # [L, N, P, H, D]
            self.v = self.pages[:, 1].transpose(0, 1)
            # [2L, N, P, H, D]: K's layers then V's, the axis order of KVPool.layers_view()
            self.kv_layers = self.pages.view(lay.num_pages, 2 * lay.kv_layers, *lay.kv_shape[2:]).transpose(0, 1)
        if lay.num_states:
            # [S, block floats]: each checkpoint is the first state_bytes of its block
            blocks = torch.frombuffer(self.buffer, dtype=torch.float32, count=lay.nbytes // 4).view(lay.num_states, -1)
            blocks = blocks[:, rank * lay.rank_state_bytes // 4 :]  # this rank's shard of each checkpoint
            conv = blocks[:, : lay.conv_numel].view(lay.num_states, lay.lin_layers, lay.conv_dim, lay.conv_width)
            rec = blocks[:, lay.conv_numel : lay.conv_numel + lay.recurrent_numel]
            rec = rec.view(lay.num_states, lay.lin_layers, lay.v_heads, lay.k_dim, lay.v_dim)
            self.conv = conv.transpose(0, 1)  # [lin, S, conv_dim, width]
            self.recurrent = rec.transpose(0, 1)  # [lin, S, v_heads, k_dim, v_dim]
            start = lay.conv_numel + lay.recurrent_numel
            if lay.draft_hidden:
                self.mtp_hidden = blocks[:, start : start + lay.draft_hidden]  # [S, hidden]
                start += lay.draft_hidden
            if lay.draft_window:
                ring = (lay.num_states, lay.draft_window, lay.draft_kv_heads, lay.draft_head_dim)
                self.draft_k = blocks[:, start : start + lay.ring_numel].view(ring)  # [S, W, kv_heads, head_dim]
                start += lay.ring_numel
                self.draft_v = blocks[:, start : start + lay.ring_numel].view(ring)

    def page_view(self, entry: int) -> memoryview:
        """The bytes of page entry `entry` (its disk payload)."""
        lay = self.layout
        if not 0 <= entry < lay.num_pages:
            raise IndexError(f"page entry {entry} out of range [0, {lay.num_pages})")
        start = entry * lay.page_bytes
        return self.buffer[start : start + lay.page_bytes]

    def state_view(self, entry: int) -> memoryview:
        """The bytes of state entry `entry`."""
        lay = self.layout
        if not 0 <= entry < lay.num_states:
            raise IndexError(f"state entry {entry} out of range [0, {lay.num_states})")
        start = entry * lay.block_bytes
        return self.buffer[start : start + lay.state_bytes]

    def draft_tensors(self) -> list[torch.Tensor]:
        """The drafter's views (entry-major), in StatePool.draft_tensors() order; empty when not drafting."""
        return [t for t in (self.mtp_hidden, self.draft_k, self.draft_v) if t is not None]

    def release(self) -> None:
        """Drop every view so the shm mapping can close."""
        self.pages = self.k = self.v = self.kv_layers = self.conv = self.recurrent = None
        self.mtp_hidden = self.draft_k = self.draft_v = None
        self.buffer = None
