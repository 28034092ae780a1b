"""Device pool of attention KV pages for the full-attention layers of a model.

Only full-attention layers store K/V; model layer i keeps its pages at storage
layer `layer_map[i]`. A page holds `page_size` consecutive token positions of
one sequence; a flat slot addresses one token position in one page:

    k, v      [storage_layers, num_pages, page_size, kv_heads, head_dim]   (two halves of one tensor)
    slot      = page * page_size + offset          (0 <= offset < page_size)

The router owns which page belongs to whom; the pool only reads and writes by
slot or page id. `write` and `gather` are the pure-torch CPU reference paths.

FP8 pages (`--kv-cache-dtype fp8_e4m3`, dtype float8_e4m3fn): each storage layer has a K and a
V scale (1.0 unless the checkpoint gives one); a value x is stored as fp8(x / scale), saturated
at +-448, and read as fp8 * scale in the attention's dtype (hkv_kernels/kv_quant.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hkv_kernels.kv_quant import store_rows

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float8_e4m3fn": torch.float8_e4m3fn}
FP8_DTYPE = "float8_e4m3fn"  # the KV dtype --kv-cache-dtype fp8_e4m3 resolves to


@dataclass(frozen=True)
class KVLayout:
    """Shape and placement of a KVPool; pools with equal layouts hold interchangeable pages."""

    num_layers: int  # storage layers: the model's full-attention layers only
    num_pages: int
    page_size: int  # token positions per page
    kv_heads: int
    head_dim: int
    dtype: str  # float32 | bfloat16 | float16 | float8_e4m3fn
    device: str  # cpu | cuda | cuda:N
    layer_ids: tuple[int, ...] = ()  # model layer index of each storage layer, in order; () = 0..num_layers-1

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"KV dtype {self.dtype!r} not one of {sorted(_DTYPES)}")
        for name in ("num_layers", "num_pages", "page_size", "kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVLayout.{name} must be positive, got {getattr(self, name)}")
        if self.layer_ids and len(self.layer_ids) != self.num_layers:
            raise ValueError(f"{len(self.layer_ids)} layer_ids for {self.num_layers} storage layers")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """Shape of the K tensor (and of the V tensor)."""
        return (self.num_layers, self.num_pages, self.page_size, self.kv_heads, self.head_dim)

    def bytes_per_page(self) -> int:
        """Bytes one page occupies across all storage layers, K and V together."""
        per_layer = self.page_size * self.kv_heads * self.head_dim * _DTYPES[self.dtype].itemsize
        return 2 * self.num_layers * per_layer


class KVPool:
    """The K and V tensors of all pages, allocated zeroed."""

    def __init__(self, layout: KVLayout, layer_map: dict[int, int] | None = None,
                 attn_dtype: torch.dtype | None = None, scales: dict[int, tuple[float, float]] | None = None) -> None:
        """Zeroed K/V; `layer_map` (model layer -> storage layer) defaults to the one layout.layer_ids implies.

        attn_dtype: the dtype attention computes in (the model's; default the pool's, bfloat16 for FP8);
        scales: storage layer -> (K scale, V scale) of FP8 pages, 1.0 for a layer not given.
        """
        self.layout: KVLayout = layout
        fp8 = layout.dtype == FP8_DTYPE
        self.attn_dtype: torch.dtype = attn_dtype or (torch.bfloat16 if fp8 else layout.torch_dtype)
        scales = scales or {}
        for layer, (k_scale, v_scale) in scales.items():
            if not 0 <= layer < layout.num_layers or not (k_scale > 0 and v_scale > 0 and math.isfinite(k_scale * v_scale)):
                raise ValueError(f"KV scales of storage layer {layer} must be finite and positive, got "
                                 f"{(k_scale, v_scale)}")
            if not fp8 and (k_scale, v_scale) != (1.0, 1.0):
                raise ValueError(f"KV scales apply to FP8 pages only, the pool is {layout.dtype}")
        # per storage layer: x is stored as fp8(x / scale) and read as fp8 * scale
        self.k_scale: list[float] = [float(scales.get(i, (1.0, 1.0))[0]) for i in range(layout.num_layers)]
        self.v_scale: list[float] = [float(scales.get(i, (1.0, 1.0))[1]) for i in range(layout.num_layers)]
        dtype, device = layout.torch_dtype, torch.device(layout.device)
        # K and V in one allocation: [2, L, N, P, H, D], so a page copy moves both in one launch
        self.kv: torch.Tensor = torch.zeros((2, *layout.shape), dtype=dtype, device=device)
        self.k: torch.Tensor = self.kv[0]
        self.v: torch.Tensor = self.kv[1]
        layer_ids = layout.layer_ids or tuple(range(layout.num_layers))
        implied = {layer: i for i, layer in enumerate(layer_ids)}
        self.layer_map: dict[int, int] = dict(layer_map) if layer_map is not None else implied
        if sorted(self.layer_map.values()) != list(range(layout.num_layers)):
            raise ValueError(
                f"layer_map must map onto storage layers 0..{layout.num_layers - 1} once each, got {self.layer_map}"
            )

    def layers_view(self) -> torch.Tensor:
        """K and V as 2L storage layers of one tensor: [2L, N, P, H, D] (K's layers first), a view."""
        lay = self.layout
        return self.kv.view(2 * lay.num_layers, lay.num_pages, lay.page_size, lay.kv_heads, lay.head_dim)

    @property
    def num_pages(self) -> int:
        return self.layout.num_pages

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    @property
    def num_slots(self) -> int:
        return self.layout.num_pages * self.layout.page_size

    @property
    def fp8(self) -> bool:
        return self.layout.dtype == FP8_DTYPE

    def scales(self, layer: int) -> tuple[float, float]:
        """(K scale, V scale) of model layer `layer`'s pages."""
        s = self._storage(layer)
        return self.k_scale[s], self.v_scale[s]

    def _storage(self, layer: int) -> int:
        if layer not in self.layer_map:
            raise KeyError(f"model layer {layer} has no KV storage (not a full-attention layer)")
        return self.layer_map[layer]

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V of new tokens of model layer `layer` at their flat slots.

        slot_mapping: [T] int64 flat slots; k, v: [T, kv_heads, head_dim] (cast, or quantized, to the pool dtype).
        Mutates only the T addressed slots of that layer; slots must be distinct.
        """
        s = self._storage(layer)
        lay = self.layout
        # [pages * page_size, kv_heads, head_dim] views share storage with the pool
        k_flat = self.k[s].view(-1, lay.kv_heads, lay.head_dim)
        v_flat = self.v[s].view(-1, lay.kv_heads, lay.head_dim)
        store_rows(k_flat, slot_mapping, k, self.k_scale[s])
        store_rows(v_flat, slot_mapping, v, self.v_scale[s])

    def gather(self, layer: int, page_row: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of positions [0, length) of one sequence, read through its page-table row.

            page_row:  p0 p1 p2 ...          (only the first ceil(length / page_size) are read)
            positions: [p0: 0..ps-1][p1: ps..2ps-1][p2: 2ps..length-1]

        Returns k, v: [length, kv_heads, head_dim] as stored (copies; the pool is not mutated).
        """
        s = self._storage(layer)
        lay = self.layout
        n_pages = -(-length // lay.page_size)
        if page_row.shape[0] < n_pages:
            raise ValueError(f"page-table row has {page_row.shape[0]} pages, {length} tokens need {n_pages}")
        pages = page_row[:n_pages]
        k = self.k[s].index_select(0, pages).reshape(-1, lay.kv_heads, lay.head_dim)[:length]  # [L, Hkv, D]
        v = self.v[s].index_select(0, pages).reshape(-1, lay.kv_heads, lay.head_dim)[:length]  # [L, Hkv, D]
        return k, v
