"""Messages between the transporters of a decode and a prefill instance (docs/pd.md).

Each travels as msgpack inside one authenticated frame (hkv/ipc/auth.py) over
ZeroMQ tcp: the decode side's DEALER asks, the prefill side's ROUTER answers.

    decode                                      prefill
    PeerLookup(keys, layout, root) ---------->  pins its CPU tier's run of keys
              <----------------------------  PeerRun(pages, state)
    PeerPull(wanted pages, state) ---------->
              <----------------------------  PeerBytes(offset, data) ... (last=True)
    PeerDone ------------------------------->  unpins

    PeerRelease(hold) ---------------------->  a device hold copied over CUDA IPC (or not wanted)
    PeerPairSend(hold, pages, address) ----->  the prefill rank sends the held pages over the pair group
"""

from __future__ import annotations

import msgspec

CHUNK_BYTES = 4 << 20  # PeerBytes data at most this long
MAX_FRAME_PAYLOAD = CHUNK_BYTES + 4096  # the Verifier's bound: a chunk and its fields
MAX_KEYS = 1 << 16  # pages one lookup may name (a 1M-token prompt at page 16)


class PeerLookup(msgspec.Struct, frozen=True, tag="lookup"):
    fetch_id: int  # the decode side's id, echoed in every answer
    layout: str  # the CPU tier's layout descriptor: the bytes of an entry must mean the same at both ends
    root: bytes  # the fingerprint root key the keys chain from
    keys: list[bytes]  # chained page keys of pages [0, len(keys))
    need_state: bool  # hybrid: the run must end at a checkpoint


class PeerRun(msgspec.Struct, frozen=True, tag="run"):
    fetch_id: int
    pages: int  # the run held for pages [0, pages), pinned until PeerDone or the timeout
    state: bool  # a checkpoint after page pages - 1 comes with it
    error: str | None = None  # why nothing is held (busy, layout mismatch, ...)


class PeerPull(msgspec.Struct, frozen=True, tag="pull"):
    fetch_id: int
    wanted: list[int]  # run page indices to send, increasing, each in [0, pages)
    state: bool  # send the checkpoint too


class PeerBytes(msgspec.Struct, frozen=True, tag="bytes"):
    """A slice of the stream: the wanted pages' bytes in order, then the checkpoint's."""

    fetch_id: int
    offset: int  # where `data` starts in that stream
    data: bytes
    last: bool  # the stream ends with this slice


class PeerDone(msgspec.Struct, frozen=True, tag="done"):
    fetch_id: int  # the decode side is done with the run (committed or rolled back): unpin it


class PeerRelease(msgspec.Struct, frozen=True, tag="release"):
    hold_id: int  # the prefill router's device hold the decode side copied from (or gave up on)


class PeerPairSend(msgspec.Struct, frozen=True, tag="pair_send"):
    """Send the held pages `first` on of hold `hold_id` (and its checkpoint) over the pair group `prefix` to the
    decode rank at `address`, into `dst_pages` and `dst_slot`, under `transfer_id` (docs/pd.md)."""

    hold_id: int
    transfer_id: int
    address: str
    prefix: str
    first: int
    dst_pages: list[int]
    dst_slot: int | None


PeerAsk = PeerLookup | PeerPull | PeerDone | PeerRelease | PeerPairSend
PeerAnswer = PeerRun | PeerBytes
