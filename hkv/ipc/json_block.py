"""A bounded JSON document in shared memory with lock-free torn-read detection.

Writer: one actor. Readers: anyone, read-only. The block starts with a
sequence counter that is odd while a write is in progress; a reader copies
the document between two equal, even reads of the counter and retries
otherwise.

    [ seq u64 | length u32 | pad | JSON bytes ... ]
"""

from __future__ import annotations

import json
import struct

_HEADER = struct.Struct("<QI")
HEADER_BYTES = 16
_RETRIES = 1000


class JsonBlockBusy(RuntimeError):
    """The writer kept the block busy for every retry."""


def capacity(payload: memoryview) -> int:
    return len(payload) - HEADER_BYTES


def write(payload: memoryview, document: object) -> bool:
    """Writer only: store `document`; returns False (and writes nothing) if it does not fit."""
    data = json.dumps(document, separators=(",", ":")).encode()
    if len(data) > capacity(payload):
        return False
    seq, _ = _HEADER.unpack_from(payload, 0)
    _HEADER.pack_into(payload, 0, seq + 1, 0)  # odd: writing
    payload[HEADER_BYTES : HEADER_BYTES + len(data)] = data
    _HEADER.pack_into(payload, 0, seq + 2, len(data))
    return True


def read(payload: memoryview) -> object | None:
    """The last complete document, or None if none was ever written."""
    for _ in range(_RETRIES):
        seq, length = _HEADER.unpack_from(payload, 0)
        if seq % 2:
            continue
        data = bytes(payload[HEADER_BYTES : HEADER_BYTES + min(length, capacity(payload))])
        if _HEADER.unpack_from(payload, 0)[0] == seq:
            return json.loads(data) if seq else None
    raise JsonBlockBusy("the writer kept the block busy")
