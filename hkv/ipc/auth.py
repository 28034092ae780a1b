"""Authenticated frames for control messages between hkv instances (prefill/decode, issue 15).

Every cross-instance control message travels as one frame sealed by a
`Signer` and opened by a `Verifier` with the secret of `--secret-file`:

    offset      size  field
    ----------  ----  ---------------------------------------------------------
    0           4     magic, b"HKVC"
    4           1     version, 1
    5           1     n: sender length, 1..64
    6           n     sender: the instance id of the peer that sealed the frame
    6+n         8     sequence: u64 big-endian, 1, 2, 3, ... per Signer
    14+n        4     m: payload length, u32 big-endian, <= the Verifier's max_payload
    18+n        m     payload: msgpack, decoded only after every check below passed
    18+n+m      32    tag: HMAC-SHA256(secret, bytes [0, 18+n+m))
    total: 50 + n + m bytes

`Verifier.open` checks, in this order, and never decodes before the last
check passed: the minimum length, magic and version; each declared length
against the frame's real length and `max_payload`; the tag, compared in
constant time; then the sequence against the highest one seen from that
sender. Each failure raises `Rejected` and counts in `Verifier.rejected`;
the caller drops the frame and keeps running.

Protects against: forged frames (no secret, no valid tag), tampering with
any byte, replay of a captured frame, oversized frames (sizes are checked
before anything is read or hashed past the header), and pickle-style code
execution (nothing here unpickles; payloads are decoded only by msgspec into
declared Structs, which never runs code).

Does not protect: confidentiality (frames are signed, not encrypted: a
deployment that needs secrecy runs over a private network or a tunnel),
availability (a flood of garbage still costs the receiver a header parse per
frame), or a peer that holds the secret (every instance does).

Replay state is bounded: a Verifier tracks at most `max_peers` senders and
forgets the least recently seen one beyond that; a forgotten sender's old
frames would verify again. That is acceptable because only frames with a
valid tag create state, so only holders of the secret can add senders, and
the senders are the configured instances, fewer than `max_peers`: eviction
(counted in `Verifier.evicted`) then signals a misconfiguration, not an
attack. The caller checks that `Opened.sender` is a configured peer, and not
the instance itself (a frame reflected back to its own sender verifies).

A Signer's sequence restarts with the process: a restarted instance either
uses a new sender id (e.g. the instance id plus a boot nonce) or passes
`first` above anything it sent before (e.g. `time.time_ns()`), else its
frames are rejected as replays until they pass the old high-water mark.

Neither class is thread-safe: each belongs to the one I/O task of its socket.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
import struct
from collections import OrderedDict
from typing import NamedTuple, TypeVar

import msgspec

T = TypeVar("T")

MAGIC = b"HKVC"
VERSION = 1
MIN_SECRET_BYTES = 32
MAX_SECRET_BYTES = 4096  # a larger file is not a secret file
MAX_SENDER_BYTES = 64
TAG_BYTES = 32  # HMAC-SHA256 digest size
MAX_SEQUENCE = (1 << 64) - 1
MAX_PAYLOAD_FIELD = (1 << 32) - 1

_PREFIX = struct.Struct(">4sBB")  # magic, version, sender length
_COUNTERS = struct.Struct(">QI")  # sequence, payload length
# The shortest frame: a one-byte sender and an empty payload.
MIN_FRAME_BYTES = _PREFIX.size + 1 + _COUNTERS.size + TAG_BYTES

REASONS = ("short", "magic", "version", "length", "too_large", "tag", "replay", "decode")


class AuthError(Exception):
    """A local setup problem: the secret file, a secret or a sender id the code was given."""


class Rejected(Exception):
    """A frame from the wire failed a check; `reason` is one of REASONS."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Opened(NamedTuple):
    """What a frame carried, once its tag and sequence were checked."""

    sender: bytes  # the sealing instance's id, authenticated (check it is a configured peer)
    sequence: int  # strictly greater than any earlier accepted frame of this sender
    payload: bytes  # not yet decoded: pass it to `decode`


def load_secret(path: str | os.PathLike) -> bytes:
    """The secret held in `path`, without one trailing newline.

    Refuses, with an AuthError naming the file and the reason: a file that
    cannot be opened, one that is not a regular file, one not owned by this
    process's user, one readable or writable by group or others, and a
    secret shorter than MIN_SECRET_BYTES or longer than MAX_SECRET_BYTES.
    The secret itself never appears in a message.
    """
    try:
        # O_NONBLOCK: a FIFO put at the path must not hang the start-up; fstat then refuses it.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise AuthError(f"secret file {os.fspath(path)!r} cannot be opened: {e.strerror}") from None
    try:
        # Checked on the open descriptor, so a file swapped in after the check is never read.
        _check_secret_file(path, os.fstat(fd))
        raw = os.read(fd, MAX_SECRET_BYTES + 3)  # room for "\r\n" and one byte too many
    except OSError as e:
        raise AuthError(f"secret file {os.fspath(path)!r} cannot be read: {e.strerror}") from None
    finally:
        os.close(fd)
    secret = raw.removesuffix(b"\n").removesuffix(b"\r")
    if len(secret) < MIN_SECRET_BYTES:
        raise AuthError(f"secret file {os.fspath(path)!r} holds {len(secret)} bytes; "
                        f"at least {MIN_SECRET_BYTES} are needed (e.g. `openssl rand -hex 32`)")
    if len(secret) > MAX_SECRET_BYTES:
        raise AuthError(f"secret file {os.fspath(path)!r} holds more than {MAX_SECRET_BYTES} bytes")
    return secret


def _check_secret_file(path: str | os.PathLike, st: os.stat_result) -> None:
    name = repr(os.fspath(path))
    if not stat.S_ISREG(st.st_mode):
        raise AuthError(f"secret file {name} is not a regular file")
    if st.st_uid != os.geteuid():
        raise AuthError(f"secret file {name} is owned by uid {st.st_uid}, not by this process's uid {os.geteuid()}")
    if st.st_mode & 0o077:
        raise AuthError(f"secret file {name} has mode {stat.S_IMODE(st.st_mode):04o}, open to group or others; "
                        f"`chmod 600` it")


def _check_secret(secret: bytes) -> None:
    if not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES:
        raise AuthError(f"the secret must be at least {MIN_SECRET_BYTES} bytes")


class Signer:
    """Seals payloads of one sender: frames with increasing sequences and an HMAC tag."""

    def __init__(self, secret: bytes, sender: bytes, *, first: int = 1):
        _check_secret(secret)
        if not isinstance(sender, bytes) or not 1 <= len(sender) <= MAX_SENDER_BYTES:
            raise AuthError(f"the sender id must be 1..{MAX_SENDER_BYTES} bytes")
        if not 1 <= first <= MAX_SEQUENCE:
            raise AuthError(f"the first sequence must be in 1..{MAX_SEQUENCE}")
        self.sender = sender
        self._mac = hmac.new(secret, digestmod=hashlib.sha256)  # keyed once, copied per frame
        self._next = first  # the sequence of the next frame

    def seal(self, payload: bytes) -> bytes:
        """One frame carrying `payload` (see the module docstring); consumes one sequence."""
        if len(payload) > MAX_PAYLOAD_FIELD:
            raise ValueError(f"payload of {len(payload)} bytes exceeds the frame's u32 length field")
        if self._next > MAX_SEQUENCE:
            raise AuthError("the sender's sequence numbers are exhausted; start a new sender id")
        body = b"".join((
            _PREFIX.pack(MAGIC, VERSION, len(self.sender)),
            self.sender,
            _COUNTERS.pack(self._next, len(payload)),
            payload,
        ))
        self._next += 1
        mac = self._mac.copy()
        mac.update(body)
        return body + mac.digest()


class Verifier:
    """Opens frames sealed with the same secret, rejecting forged, malformed and replayed ones.

    `rejected[reason]` counts the frames refused for each reason of REASONS
    (exported by the transporter to /metrics); `accepted` counts those that
    passed; `evicted` counts senders forgotten past `max_peers`.
    """

    def __init__(self, secret: bytes, max_peers: int = 64, max_payload: int = 1 << 20):
        _check_secret(secret)
        if max_peers < 1:
            raise ValueError("max_peers must be at least 1")
        if not 0 <= max_payload <= MAX_PAYLOAD_FIELD:
            raise ValueError(f"max_payload must be in 0..{MAX_PAYLOAD_FIELD}")
        self.max_peers = max_peers
        self.max_payload = max_payload
        self.rejected: dict[str, int] = dict.fromkeys(REASONS, 0)
        self.accepted = 0
        self.evicted = 0
        self._mac = hmac.new(secret, digestmod=hashlib.sha256)
        # sender -> highest accepted sequence, least recently seen first
        self._highest: OrderedDict[bytes, int] = OrderedDict()
        self._decoders: dict[object, msgspec.msgpack.Decoder] = {}  # one per message type in the code

    @property
    def peer_count(self) -> int:
        """Senders whose highest sequence is tracked (at most max_peers)."""
        return len(self._highest)

    @property
    def peers(self) -> tuple[bytes, ...]:
        """The tracked senders, least recently seen (the next to be evicted) first."""
        return tuple(self._highest)

    def open(self, frame: bytes) -> Opened:
        """The checked contents of `frame`; raises Rejected (and counts it) on any failed check."""
        try:
            opened = self._open(memoryview(frame))
        except Rejected as e:
            self.rejected[e.reason] += 1
            raise
        self._remember(opened.sender, opened.sequence)
        self.accepted += 1
        return opened

    def decode(self, frame: bytes, type_: type[T]) -> T:
        """`open` then `decode` into `type_` (a Struct or a tagged union), counting a failure as "decode"."""
        opened = self.open(frame)
        decoder = self._decoders.get(type_)
        if decoder is None:
            decoder = self._decoders[type_] = msgspec.msgpack.Decoder(type_)
        try:
            return _decode_with(decoder, opened.payload)
        except Rejected:
            self.rejected["decode"] += 1
            raise

    def _open(self, frame: memoryview) -> Opened:
        sender_end, payload_end = self._check_layout(frame)
        mac = self._mac.copy()
        mac.update(frame[:payload_end])
        if not hmac.compare_digest(mac.digest(), frame[payload_end:]):
            raise Rejected("tag")
        sequence, _ = _COUNTERS.unpack_from(frame, sender_end)
        sender = bytes(frame[_PREFIX.size:sender_end])
        if sequence <= self._highest.get(sender, 0):
            raise Rejected("replay")
        return Opened(sender, sequence, bytes(frame[sender_end + _COUNTERS.size:payload_end]))

    def _check_layout(self, frame: memoryview) -> tuple[int, int]:
        """Where the sender and the payload end, once the header agrees with the frame's real size.

            0      6        6+n            18+n         18+n+m       +32
            | head | sender | seq, m       | payload    | tag        |
                            ^ sender_end                ^ payload_end
        """
        if len(frame) < MIN_FRAME_BYTES:
            raise Rejected("short")
        magic, version, sender_len = _PREFIX.unpack_from(frame, 0)
        if magic != MAGIC:
            raise Rejected("magic")
        if version != VERSION:
            raise Rejected("version")
        sender_end = _PREFIX.size + sender_len
        if not 1 <= sender_len <= MAX_SENDER_BYTES or sender_end + _COUNTERS.size + TAG_BYTES > len(frame):
            raise Rejected("length")
        _, payload_len = _COUNTERS.unpack_from(frame, sender_end)
        if payload_len > self.max_payload:
            raise Rejected("too_large")
        payload_end = sender_end + _COUNTERS.size + payload_len
        if payload_end + TAG_BYTES != len(frame):
            raise Rejected("length")
        return sender_end, payload_end

    def _remember(self, sender: bytes, sequence: int) -> None:
        self._highest[sender] = sequence
        self._highest.move_to_end(sender)
        if len(self._highest) > self.max_peers:
            self._highest.popitem(last=False)
            self.evicted += 1


def decode(opened: Opened, type_: type[T]) -> T:
    """The payload of `opened` decoded into `type_`; raises Rejected("decode") (not counted) on bad input."""
    return _decode_with(msgspec.msgpack.Decoder(type_), opened.payload)


def _decode_with(decoder: msgspec.msgpack.Decoder, payload: bytes):
    try:
        return decoder.decode(payload)
    # RecursionError: deeply nested input to a field typed loosely enough to take it
    except (msgspec.DecodeError, RecursionError):
        raise Rejected("decode") from None
