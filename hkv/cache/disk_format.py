"""The `hkv-page-v2` file format of the disk tier: one page (and its checkpoint) per file.

One file (little-endian; L = layout length, H = 66 + L = header length;
docs/disk_format.md has the table and why each check exists):

    0        8        12       16            32       48       56        64       66       H
    +--------+--------+--------+-------------+--------+--------+---------+--------+--------+
    | magic  |version |header  |fingerprint  |key     |kv_len  |state_len|layout  |layout  |
    |hkvpage0| = 2 u32|len u32 |(root key h0)|(16 B)  |u64     |u64, 0 = |len u16 |utf-8   |
    |        |        | = H    |(16 B)       |        |        |none     | = L    |L bytes |
    +--------+--------+--------+-------------+--------+--------+---------+--------+--------+
    H                     H + kv_len                H + kv_len + state_len          end
    +---------------------+-------------------------+-------------------------------+
    | kv bytes            | state bytes (if any)    | zlib.crc32 of [0, end-4), u32 |
    +---------------------+-------------------------+-------------------------------+

The state bytes are a CPU-tier state entry (hkv/storage/host_pool.py): the
linear-attention checkpoint, then with speculative decoding the drafter's
state (mtp_hidden, and the draft K/V ring with a draft window), all fp32.

`PageFormat` builds and checks these files for one tier (fingerprint, layout,
lengths); `hkv/cache/disk.py` keeps the index, the budget and the locking.
A write lands in a temp file that is fsynced before the caller renames it, so
a reader sees a whole file or none; a read checks size, every header field
and the checksum, and raises CorruptFile on any mismatch.
"""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass

MAGIC = b"hkvpage\0"
VERSION = 2  # 2: a state payload may end with the drafter's state (HostLayout.draft_bytes)
# magic, version, header length, fingerprint, key, kv_len, state_len, layout length
FIXED = struct.Struct("<8sII16s16sQQH")
FIXED_FIELDS = ("magic", "version", "header_len", "fingerprint", "key", "kv_len", "state_len", "layout_len")
TRAILER = struct.Struct("<I")  # zlib.crc32 of header + payload
_SCRATCH_BYTES = 1 << 20  # chunk for verifying a checkpoint the caller did not ask for


class CorruptFile(Exception):
    """A file failed a check; the message names which."""


@dataclass(frozen=True)
class PageFormat:
    """What every file of one tier holds: its fingerprint, layout and payload lengths."""

    fingerprint: bytes  # the root key h_0 (16 bytes)
    layout: bytes  # utf-8 layout descriptor, at most 65535 bytes
    kv_len: int
    state_len: int  # 0: the model keeps no checkpoints

    @property
    def header_len(self) -> int:
        return FIXED.size + len(self.layout)

    def file_size(self, has_state: bool) -> int:
        return self.header_len + self.kv_len + (self.state_len if has_state else 0) + TRAILER.size

    def header(self, key: bytes, has_state: bool) -> bytes:
        """The exact header a file for (key, has_state) must start with."""
        state_len = self.state_len if has_state else 0
        fixed = FIXED.pack(MAGIC, VERSION, self.header_len, self.fingerprint, key, self.kv_len, state_len,
                           len(self.layout))  # fmt: skip
        return fixed + self.layout

    def write_temp(self, path: str, key: bytes, payload: list[memoryview]) -> None:
        """Write header, payload (kv, then the state if any) and checksum to a new file at `path`, fsynced.

        On any error the file is removed and the error re-raised.
        """
        header = self.header(key, len(payload) == 2)
        crc = zlib.crc32(header)
        for part in payload:
            crc = zlib.crc32(part, crc)
        fd = _create(path)
        try:
            try:
                for part in (header, *payload, TRAILER.pack(crc)):
                    _write_all(fd, part)
                # Raw fd writes leave nothing buffered in user space: fsync is the only flush.
                os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException:
            try:
                os.unlink(path)
            except OSError:
                pass  # the write's own error is the one to report
            raise

    def read(self, path: str, key: bytes, has_state: bool, kv_view: memoryview,
             state_view: memoryview | None) -> None:  # fmt: skip
        """Read and check one file into the views; raises CorruptFile or OSError."""
        # Unbuffered: readinto lands straight in the caller's buffers, no intermediate copy.
        with open(path, "rb", buffering=0) as f:
            size, expected_size = os.fstat(f.fileno()).st_size, self.file_size(has_state)
            if size != expected_size:
                raise CorruptFile(f"size {size} != {expected_size}")
            header = bytearray(self.header_len)
            _read_exact(f, header)
            expected = self.header(key, has_state)
            if header != expected:
                raise CorruptFile(_header_fault(header, expected))
            crc = zlib.crc32(header)
            _read_exact(f, kv_view)
            crc = zlib.crc32(kv_view, crc)
            if has_state:
                crc = self._read_state(f, state_view, crc)
            trailer = bytearray(TRAILER.size)
            _read_exact(f, trailer)
            (stored,) = TRAILER.unpack(trailer)
            if stored != crc:
                raise CorruptFile(f"checksum {stored:#010x} != computed {crc:#010x}")

    def _read_state(self, f, state_view: memoryview | None, crc: int) -> int:
        """Read the checkpoint into `state_view`, or through a scratch buffer; returns the running crc."""
        if state_view is not None:
            _read_exact(f, state_view)
            return zlib.crc32(state_view, crc)
        scratch = memoryview(bytearray(min(self.state_len, _SCRATCH_BYTES)))
        left = self.state_len
        while left:
            chunk = scratch[: min(left, len(scratch))]
            _read_exact(f, chunk)
            crc = zlib.crc32(chunk, crc)
            left -= len(chunk)
        return crc


def _header_fault(got: bytes, expected: bytes) -> str:
    """Name the first header field in which `got` differs from `expected`."""
    for name, a, b in zip(FIXED_FIELDS, FIXED.unpack_from(got), FIXED.unpack_from(expected)):
        if a != b:
            return f"header {name} {a!r} != {b!r}"
    return "header layout string differs"


def _create(path: str) -> int:
    """Open a new file 0600 for writing, creating its subdirectory (0700) on first use."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    try:
        return os.open(path, flags, 0o600)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        return os.open(path, flags, 0o600)


def _write_all(fd: int, data) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(f, view) -> None:
    """Fill `view` from `f`; a short file (changed since its size was checked) is corrupt."""
    view = memoryview(view)
    while view:
        n = f.readinto(view)
        if not n:
            raise CorruptFile("file ended early")
        view = view[n:]
