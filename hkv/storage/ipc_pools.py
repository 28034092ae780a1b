"""Device pools across processes on one GPU (CUDA IPC), for prefill/decode transfers (docs/pd.md).

    prefill rank: export_pools(kv, conv, recurrent) -> a JSON document (handles as hex, shapes, dtypes,
                  the GPU's uuid), written once at start-up to `device_pools.json` in its run directory
    decode rank:  PeerPools.open(document) -> the prefill instance's pool tensors, mapped into this
                  process; a PeerCopy op then copies pages and a state slot device to device

Nothing is unpickled: the document holds plain numbers and hex strings, and
every field is checked before torch maps the memory. The tensors stay valid
while the prefill instance lives (its pools are allocated once); a decode
rank maps a document once and keeps the mapping (at most MAX_PEERS, the
oldest let go first), so a restarted prefill instance, whose document names
new handles, is mapped afresh.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

import torch

from hkv.openai.pd_route import POOLS_FILE  # noqa: F401  (named there: the api reads it without torch)

MAX_PEERS = 8
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
           "float8_e4m3fn": torch.float8_e4m3fn}


class PeerPoolError(ValueError):
    """A pools document that does not describe pools this rank can copy from."""


def gpu_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def _export_tensor(t: torch.Tensor) -> dict[str, Any]:
    storage = t.untyped_storage()
    device, handle, size, offset, ref_handle, ref_offset, event, event_sync = storage._share_cuda_()
    return {
        "device": int(device), "handle": bytes(handle).hex(), "storage_bytes": int(size),
        "storage_offset_bytes": int(offset), "ref_handle": bytes(ref_handle).hex(), "ref_offset": int(ref_offset),
        "event": bytes(event).hex() if event else None, "event_sync": bool(event_sync),
        "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "stride": list(t.stride()),
        "offset": int(t.storage_offset()),
    }  # fmt: skip


def export_pools(kv_layers: torch.Tensor, conv: torch.Tensor | None, recurrent: torch.Tensor | None) -> str:
    """The pools' IPC document (JSON): KV as [2L, pages, ...] storage layers, the state as [L, slots, ...]."""
    doc: dict[str, Any] = {"version": 1, "uuid": gpu_uuid(kv_layers.device), "kv": _export_tensor(kv_layers)}
    if conv is not None and recurrent is not None:
        doc["conv"], doc["recurrent"] = _export_tensor(conv), _export_tensor(recurrent)
    return json.dumps(doc, sort_keys=True)


def _open_tensor(spec: Any, device: torch.device) -> torch.Tensor:
    try:
        dtype = _DTYPES[spec["dtype"]]
        shape, stride, offset = [int(x) for x in spec["shape"]], [int(x) for x in spec["stride"]], int(spec["offset"])
        handle, ref_handle = bytes.fromhex(spec["handle"]), bytes.fromhex(spec["ref_handle"])
        event = bytes.fromhex(spec["event"]) if spec["event"] is not None else None
        size, storage_offset = int(spec["storage_bytes"]), int(spec["storage_offset_bytes"])
        ordinal, ref_offset, event_sync = int(spec["device"]), int(spec["ref_offset"]), bool(spec["event_sync"])
    except (KeyError, TypeError, ValueError) as exc:
        raise PeerPoolError(f"malformed pool entry: {exc}") from None
    if ordinal != (device.index or 0):
        raise PeerPoolError(f"the peer's pool is on device {ordinal}, this rank on {device}")
    span = offset + sum((n - 1) * s for n, s in zip(shape, stride)) + 1 if all(shape) else 0
    if min(shape + stride + [offset]) < 0 or span * dtype.itemsize > size:
        raise PeerPoolError("a pool entry's shape runs past its storage")
    storage = torch.UntypedStorage._new_shared_cuda(ordinal, handle, size, storage_offset, ref_handle, ref_offset,
                                                    event, event_sync)
    typed = torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)
    return torch._utils._rebuild_tensor(typed, offset, tuple(shape), tuple(stride))


class PeerPools:
    """The decode rank's mappings of prefill instances' pools, keyed by their document."""

    def __init__(self, device: torch.device, kv_layers: torch.Tensor, conv: torch.Tensor | None,
                 recurrent: torch.Tensor | None):  # fmt: skip
        self.device = device
        self.own = {"kv": kv_layers, "conv": conv, "recurrent": recurrent}
        self._open: OrderedDict[str, dict[str, torch.Tensor]] = OrderedDict()

    def documents(self) -> list[str]:
        """The peers' documents whose pools are mapped now (oldest first)."""
        return list(self._open)

    def get(self, document: str) -> dict[str, torch.Tensor]:
        """The peer's tensors ("kv", and "conv"/"recurrent" for hybrid models), checked against this rank's."""
        pools = self._open.get(document)
        if pools is not None:
            self._open.move_to_end(document)
            return pools
        try:
            doc = json.loads(document)
        except ValueError:
            raise PeerPoolError("the pools document is not JSON") from None
        if not isinstance(doc, dict) or doc.get("version") != 1 or doc.get("uuid") != gpu_uuid(self.device):
            raise PeerPoolError("the peer's pools are not on this GPU (or of another version)")
        pools = {}
        for name, own in self.own.items():
            if own is None:
                continue
            if name not in doc:
                raise PeerPoolError(f"the peer has no {name} pool")
            spec = doc[name]
            if not isinstance(spec, dict) or spec.get("dtype") != str(own.dtype).removeprefix("torch."):
                raise PeerPoolError(f"the peer's {name} pool has another dtype")
            shape = spec.get("shape")
            if not isinstance(shape, list) or len(shape) != own.dim() or shape[0] != own.shape[0] or shape[2:] != list(
                    own.shape[2:]):
                raise PeerPoolError(f"the peer's {name} pool {shape} does not match this rank's {list(own.shape)}")
            pools[name] = _open_tensor(spec, self.device)
        self._open[document] = pools
        while len(self._open) > MAX_PEERS:
            self._open.popitem(last=False)
        return pools
