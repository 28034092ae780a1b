"""Shared-memory regions, the per-instance registry, and orphan sweeping.

Every segment is `/hkv-<instance>-<region>` (a file `/dev/shm/hkv-...` on
Linux), created exclusively with mode 0600, and starts with a fixed header:

    | 0 magic 8s | 8 header ver u32 | 12 layout ver u32 | 16 pid u64 | 24 start u64 |
    | 32 pid ns u64 | 40 payload offset u64 | 48 payload size u64 | 56 writer 16s |
    | 72 region 32s | 104 zero pad | 128 payload ...

All integers are little endian. `start` is the creator's start time in clock
ticks (/proc/<pid>/stat field 22), so a reused pid is not mistaken for the
creator. `pid ns` is the inode of the creator's pid namespace (0 if unknown):
a segment made in another pid namespace is never judged dead from this one.
The payload starts at byte 128, so it is 64-byte aligned in every mapping.

Each region has a single writer (named in the header); everyone else attaches
read-only. The registry region lists each region's layout for readers such as
`hkv-inspect`; only the launcher writes it.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import struct
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

import posix_ipc

from hkv.ipc.creator import Creator, creator_alive, pid_namespace, process_start_ticks

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "hkv-"
MAGIC = b"HKVSHM01"
HEADER_VERSION = 1
HEADER_SIZE = 128
REGISTRY_REGION = "registry"

_INSTANCE_RE = re.compile(r"[A-Za-z0-9_.]{1,32}")
_REGION_RE = re.compile(r"[a-z0-9_]{1,32}")
_WRITER_RE = re.compile(r"[A-Za-z0-9_.]{1,16}")
_HEADER = struct.Struct("<8sIIQQQQQ16s32s24x")
_U32_MAX = 2**32 - 1
assert _HEADER.size == HEADER_SIZE


class ShmError(Exception):
    """Base of every shared-memory error raised here."""


class RegionExists(ShmError, FileExistsError):
    """`create` found a segment of that name already present."""


class RegionMissing(ShmError, FileNotFoundError):
    """`attach` found no segment of that name."""


class RegionCorrupt(ShmError):
    """The segment's header or contents fail validation (foreign, truncated or torn)."""


class LayoutMismatch(ShmError):
    """The segment is valid but carries a layout version the caller does not speak."""


class RegistryFull(ShmError):
    """The registry already holds `capacity` entries."""


class RegistryBusy(ShmError):
    """Readers saw the registry mid-write on every retry (a writer died mid-add?)."""


def _validated(value: str, pattern: re.Pattern[str], what: str) -> str:
    """Return `value` if it fully matches `pattern`, else raise ValueError."""
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise ValueError(f"bad {what} name {value!r}: want {pattern.pattern}")
    return value


def validate_instance(instance: str) -> str:
    return _validated(instance, _INSTANCE_RE, "instance")


def validate_region(region: str) -> str:
    return _validated(region, _REGION_RE, "region")


def _validate_writer(writer: str) -> str:
    return _validated(writer, _WRITER_RE, "writer")


def _check_version(version: int) -> None:
    if not isinstance(version, int) or not 0 <= version <= _U32_MAX:
        raise ValueError(f"layout version must fit in u32, got {version!r}")


def segment_name(instance: str, region: str) -> str:
    """The POSIX shm name `/hkv-<instance>-<region>`; raises ValueError on a bad name."""
    return f"/{SEGMENT_PREFIX}{validate_instance(instance)}-{validate_region(region)}"


def parse_segment_file(filename: str) -> tuple[str, str] | None:
    """Split a /dev/shm file name `hkv-<instance>-<region>`; None if it is not one."""
    if not filename.startswith(SEGMENT_PREFIX):
        return None
    # Instance names never contain '-', so the first '-' ends the instance.
    instance, sep, region = filename[len(SEGMENT_PREFIX):].partition("-")
    if not sep or not _INSTANCE_RE.fullmatch(instance) or not _REGION_RE.fullmatch(region):
        return None
    return instance, region


@dataclass(frozen=True)
class SegmentHeader:
    """The parsed fixed header at byte 0 of every hkv segment."""

    header_version: int  # HEADER_VERSION when written by this code
    layout_version: int  # the region's own payload layout version
    creator_pid: int
    creator_start_ticks: int  # /proc/<pid>/stat field 22 of the creator
    creator_pid_ns: int  # pid namespace inode of the creator, 0 if unknown
    payload_offset: int  # always HEADER_SIZE today
    payload_size: int  # bytes of payload after the header
    writer: str  # actor allowed to write the payload
    region: str  # region name, must match the segment name

    def pack(self) -> bytes:
        """Encode with MAGIC; tests use this to forge headers."""
        return _HEADER.pack(
            MAGIC, self.header_version, self.layout_version, self.creator_pid,
            self.creator_start_ticks, self.creator_pid_ns, self.payload_offset,
            self.payload_size, self.writer.encode("ascii"), self.region.encode("ascii"))

    @classmethod
    def unpack(cls, raw: bytes, segment_size: int) -> SegmentHeader:
        """Decode and validate the header of a `segment_size`-byte segment; raises RegionCorrupt."""
        if len(raw) < HEADER_SIZE:
            raise RegionCorrupt(f"segment holds {len(raw)} bytes, header needs {HEADER_SIZE}")
        magic, hver, lver, pid, start, pid_ns, offset, size, writer, region = _HEADER.unpack(
            raw[:HEADER_SIZE])
        if magic != MAGIC:
            raise RegionCorrupt(f"bad magic {magic!r}")
        if hver != HEADER_VERSION:
            raise RegionCorrupt(f"header version {hver}, this code reads {HEADER_VERSION}")
        if offset != HEADER_SIZE or pid == 0:
            raise RegionCorrupt(f"bad payload offset {offset} or creator pid {pid}")
        if offset + size > segment_size:
            raise RegionCorrupt(f"payload of {size} B overruns the {segment_size} B segment")
        try:
            writer_s = writer.rstrip(b"\0").decode("ascii")
            region_s = region.rstrip(b"\0").decode("ascii")
        except UnicodeDecodeError as e:
            raise RegionCorrupt(f"non-ascii writer or region name: {e}") from None
        return cls(hver, lver, pid, start, pid_ns, offset, size, writer_s, region_s)


def _read_header_bytes(path: str) -> tuple[bytes, int, int]:
    """Read (header bytes, file size, inode) of a /dev/shm file without mapping it."""
    # O_NONBLOCK so a FIFO planted under an hkv- name cannot hang the scan.
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        return os.pread(fd, HEADER_SIZE, 0), st.st_size, st.st_ino
    finally:
        os.close(fd)


class ShmRegion:
    """One mapped hkv segment: a validated header followed by the payload.

    Build with `create` (the region's writer) or `attach` (anyone). Using it as a
    context manager closes the mapping on exit; it never unlinks.
    """

    def __init__(self, name: str, mapping: mmap.mmap, header: SegmentHeader,
                 readonly: bool) -> None:
        self._name: str = name
        self._mmap: mmap.mmap | None = mapping
        self._view: memoryview | None = memoryview(mapping)
        self._header: SegmentHeader = header
        self._readonly: bool = readonly
        self._unmapped: bool = False  # set by close() once munmap actually happened

    @classmethod
    def create(cls, instance: str, region: str, payload_size: int, writer: str,
               version: int = 1) -> ShmRegion:
        """Create `/hkv-<instance>-<region>` exclusively, mode 0600, zero-filled, with header.

        Raises RegionExists if the name is taken, ValueError on bad names or sizes.
        """
        name = segment_name(instance, region)
        _validate_writer(writer)
        if not isinstance(payload_size, int) or payload_size < 0:
            raise ValueError(f"payload_size must be an int >= 0, got {payload_size!r}")
        _check_version(version)
        pid = os.getpid()
        start = process_start_ticks(pid)
        if start is None:
            raise ShmError("cannot read this process's start time from /proc")
        header = SegmentHeader(HEADER_VERSION, version, pid, start, pid_namespace(),
                               HEADER_SIZE, payload_size, writer, region)
        try:
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600,
                                         size=HEADER_SIZE + payload_size)
        except posix_ipc.ExistentialError:
            raise RegionExists(f"shared memory segment {name} already exists") from None
        try:
            # The umask may have stripped or the mode may not be ours: force 0600.
            os.fchmod(shm.fd, 0o600)
            mapping = mmap.mmap(shm.fd, HEADER_SIZE + payload_size)
        except BaseException:
            shm.close_fd()
            unlink_segment(name)
            raise
        shm.close_fd()
        packed = header.pack()
        # Magic goes last so a concurrent reader never accepts a half-written header.
        mapping[8:HEADER_SIZE] = packed[8:]
        mapping[0:8] = packed[0:8]
        return cls(name, mapping, header, readonly=False)

    @classmethod
    def attach(cls, instance: str, region: str, readonly: bool = False,
               version: int | None = None) -> ShmRegion:
        """Map an existing segment after validating its header.

        `readonly` maps with PROT_READ only: writes through `payload` raise
        TypeError. `version`, when given, must equal the header's layout version
        (LayoutMismatch otherwise). Raises RegionMissing or RegionCorrupt.
        """
        name = segment_name(instance, region)
        try:
            shm = posix_ipc.SharedMemory(name, read_only=readonly)
        except posix_ipc.ExistentialError:
            raise RegionMissing(f"no shared memory segment {name}") from None
        try:
            size = shm.size
            try:
                header = SegmentHeader.unpack(os.pread(shm.fd, HEADER_SIZE, 0), size)
            except RegionCorrupt as e:
                raise RegionCorrupt(f"{name}: {e}") from None
            if header.region != region:
                raise RegionCorrupt(f"{name}: header names region {header.region!r}")
            if version is not None and header.layout_version != version:
                raise LayoutMismatch(f"{name}: layout version {header.layout_version}, "
                                     f"caller expects {version}")
            access = mmap.ACCESS_READ if readonly else mmap.ACCESS_WRITE
            mapping = mmap.mmap(shm.fd, size, access=access)
        finally:
            shm.close_fd()
        return cls(name, mapping, header, readonly)

    @property
    def name(self) -> str:
        """The POSIX shm name, `/hkv-<instance>-<region>`."""
        return self._name

    @property
    def header(self) -> SegmentHeader:
        return self._header

    @property
    def readonly(self) -> bool:
        return self._readonly

    @property
    def closed(self) -> bool:
        return self._view is None

    @property
    def payload(self) -> memoryview:
        """A fresh view over the payload (read-only if attached so); ValueError once closed."""
        if self._view is None:
            raise ValueError(f"{self._name} is closed")
        start = self._header.payload_offset
        return self._view[start:start + self._header.payload_size]

    def close(self) -> bool:
        """Drop this object's mapping; safe to call twice. Returns True if unmapped now.

        If callers still hold views of `payload` (memoryview slices, numpy arrays),
        the mapping cannot be unmapped yet: close() returns False, this object
        stops handing out views, and the pages are unmapped when the last such
        view is garbage-collected. Those views stay valid until then.
        """
        if self._view is None or self._mmap is None:
            return self._unmapped
        view, self._view = self._view, None
        view.release()
        mapping, self._mmap = self._mmap, None
        try:
            mapping.close()
        except BufferError:
            # Outstanding exports keep `mapping` referenced; it unmaps when they go.
            return False
        self._unmapped = True
        return True

    def unlink(self) -> None:
        """Remove the segment name; existing mappings stay valid. Ignores already-gone."""
        unlink_segment(self._name)

    def __enter__(self) -> ShmRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def unlink_segment(name: str) -> bool:
    """Unlink a segment by shm name; False if it was already gone."""
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        return False
    return True


# Registry payload: a 64-byte control block, then entries as (u32 length, JSON bytes).
#   seq u64 (odd while the launcher writes) | count u32 | capacity u32 |
#   max_entry_bytes u32 | pad u32 | used_bytes u64 | pad to 64
_REG_CTRL = struct.Struct("<QIIIIQ")
_REG_CTRL_SIZE = 64
_REG_LEN = struct.Struct("<I")
_REG_READ_ATTEMPTS = 1000
_REG_MAX_CAPACITY = 4096
_REG_MAX_ENTRY = 1 << 20


@dataclass(frozen=True)
class RegistryEntry:
    """One region as the launcher registered it."""

    region: str
    segment: str  # the shm name, `/hkv-<instance>-<region>`
    writer: str  # the single actor that writes this region
    version: int  # the region's layout version
    layout: dict[str, Any]  # JSON description: dtypes, shapes, offsets
    creator_pid: int


class Registry:
    """The `/hkv-<instance>-registry` segment: append-only list of region layouts.

    Only the launcher adds entries. Readers copy the entries between two reads
    of a sequence counter (a seqlock) and retry if the counter moved or was odd.
    """

    def __init__(self, instance: str, region: ShmRegion) -> None:
        self._instance: str = instance
        self._region: ShmRegion = region

    @classmethod
    def create(cls, instance: str, capacity: int, max_entry_bytes: int = 4096,
               writer: str = "launcher") -> Registry:
        """Create the registry for `capacity` entries of at most `max_entry_bytes` JSON each."""
        if not isinstance(capacity, int) or not 1 <= capacity <= _REG_MAX_CAPACITY:
            raise ValueError(f"capacity must be in 1..{_REG_MAX_CAPACITY}, got {capacity!r}")
        entry_ok = isinstance(max_entry_bytes, int) and 64 <= max_entry_bytes <= _REG_MAX_ENTRY
        if not entry_ok:
            raise ValueError(f"max_entry_bytes must be in 64..{_REG_MAX_ENTRY}")
        size = _REG_CTRL_SIZE + capacity * (_REG_LEN.size + max_entry_bytes)
        region = ShmRegion.create(instance, REGISTRY_REGION, size, writer)
        _REG_CTRL.pack_into(region.payload, 0, 0, 0, capacity, max_entry_bytes, 0, 0)
        return cls(instance, region)

    @classmethod
    def attach(cls, instance: str, readonly: bool = True) -> Registry:
        """Attach to an instance's registry; raises RegionMissing / RegionCorrupt."""
        region = ShmRegion.attach(instance, REGISTRY_REGION, readonly=readonly, version=1)
        _seq, count, capacity, max_entry, _pad, used = _REG_CTRL.unpack_from(region.payload, 0)
        limit = capacity * (_REG_LEN.size + max_entry)
        if _REG_CTRL_SIZE + limit > region.header.payload_size or used > limit or count > capacity:
            region.close()
            raise RegionCorrupt(f"{region.name}: control block does not fit the payload")
        return cls(instance, region)

    @property
    def region(self) -> ShmRegion:
        return self._region

    def add(self, region: str, writer: str, version: int, layout: dict[str, Any],
            creator_pid: int | None = None) -> RegistryEntry:
        """Append one region's entry; `creator_pid` None means this process.

        Mutates the registry payload under the seqlock. Raises RegistryFull past
        capacity, ValueError on bad names, duplicate regions or oversized layouts.
        """
        if self._region.readonly:
            raise PermissionError(f"{self._region.name} is attached read-only")
        validate_region(region)
        _validate_writer(writer)
        _check_version(version)
        pid = os.getpid() if creator_pid is None else creator_pid
        record = {"region": region, "writer": writer, "version": version,
                  "layout": layout, "creator_pid": pid}
        blob = json.dumps(record, sort_keys=True, allow_nan=False).encode("utf-8")
        payload = self._region.payload
        seq, count, capacity, max_entry, _pad, used = _REG_CTRL.unpack_from(payload, 0)
        if count >= capacity:
            raise RegistryFull(f"{self._region.name} holds at most {capacity} entries")
        if len(blob) > max_entry:
            raise ValueError(f"entry for {region!r} is {len(blob)} B, limit {max_entry} B")
        if any(e.region == region for e in self.entries()):
            raise ValueError(f"region {region!r} is already registered")
        start = _REG_CTRL_SIZE + used
        # Odd seq tells readers an add is in progress.
        struct.pack_into("<Q", payload, 0, seq + 1)
        _REG_LEN.pack_into(payload, start, len(blob))
        payload[start + _REG_LEN.size:start + _REG_LEN.size + len(blob)] = blob
        _REG_CTRL.pack_into(payload, 0, seq + 1, count + 1, capacity, max_entry, 0,
                            used + _REG_LEN.size + len(blob))
        struct.pack_into("<Q", payload, 0, seq + 2)
        return self._entry_from(record)

    def entries(self) -> list[RegistryEntry]:
        """All entries in insertion order; raises RegistryBusy or RegionCorrupt."""
        count, blob = self._snapshot()
        out: list[RegistryEntry] = []
        pos = 0
        for _ in range(count):
            if pos + _REG_LEN.size > len(blob):
                raise RegionCorrupt(f"{self._region.name}: entry {len(out)} truncated")
            (length,) = _REG_LEN.unpack_from(blob, pos)
            pos += _REG_LEN.size
            try:
                record = json.loads(blob[pos:pos + length].decode("utf-8"))
                out.append(self._entry_from(record))
            except (ValueError, TypeError, KeyError) as e:
                raise RegionCorrupt(f"{self._region.name}: entry {len(out)}: {e}") from None
            pos += length
        return out

    def _snapshot(self) -> tuple[int, bytes]:
        """Copy (count, entry bytes) consistently under the seqlock."""
        payload = self._region.payload
        for _ in range(_REG_READ_ATTEMPTS):
            seq, count, capacity, max_entry, _pad, used = _REG_CTRL.unpack_from(payload, 0)
            if seq % 2 == 0:
                limit = capacity * (_REG_LEN.size + max_entry)
                blob = bytes(payload[_REG_CTRL_SIZE:_REG_CTRL_SIZE + min(used, limit)])
                (seq_after,) = struct.unpack_from("<Q", payload, 0)
                if seq_after == seq:
                    return count, blob
            # Let the writer (another process) finish its add.
            os.sched_yield()
        raise RegistryBusy(f"{self._region.name} stayed mid-write for {_REG_READ_ATTEMPTS} reads")

    def _entry_from(self, record: dict[str, Any]) -> RegistryEntry:
        region = validate_region(record["region"])
        version, pid, layout = record["version"], record["creator_pid"], record["layout"]
        if not isinstance(version, int) or not isinstance(pid, int) or not isinstance(layout, dict):
            raise TypeError("version, creator_pid or layout has the wrong type")
        return RegistryEntry(region, segment_name(self._instance, region),
                             _validate_writer(record["writer"]), version, layout, pid)

    def close(self) -> bool:
        """Close the mapping (see ShmRegion.close); never unlinks."""
        return self._region.close()

    def unlink(self) -> None:
        self._region.unlink()

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SegmentState(str, Enum):
    ALIVE = "alive"  # header valid, creator pid runs with the recorded start time
    ORPHAN = "orphan"  # header valid, creator is gone (or its pid was reused)
    UNKNOWN = "orphan-unknown"  # unreadable/foreign header or other pid namespace: never swept


@dataclass(frozen=True)
class SegmentInfo:
    """One `/dev/shm/hkv-*` file as `list_segments` found it."""

    name: str  # shm name with the leading '/'
    instance: str | None  # None when the file name does not parse
    region: str | None
    size: int  # file size in bytes
    inode: int  # lets sweep notice the name was recreated since the scan
    state: SegmentState
    creator_pid: int | None  # None when the header is unreadable
    writer: str | None
    layout_version: int | None
    reason: str | None  # why the state is UNKNOWN, else None

    @property
    def alive(self) -> bool:
        return self.state is SegmentState.ALIVE

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "state": self.state.value, "alive": self.alive}


def _inspect_file(filename: str) -> SegmentInfo | None:
    """Classify one /dev/shm entry; None if it vanished during the scan."""
    parsed = parse_segment_file(filename)
    instance, region = parsed if parsed is not None else (None, None)
    name = "/" + filename
    try:
        raw, size, inode = _read_header_bytes(os.path.join(SHM_DIR, filename))
    except FileNotFoundError:
        return None
    except OSError as e:
        return SegmentInfo(name, instance, region, 0, 0, SegmentState.UNKNOWN,
                           None, None, None, f"unreadable: {e}")
    try:
        header = SegmentHeader.unpack(raw, size)
        if parsed is None or header.region != region:
            raise RegionCorrupt("file name does not match the header's region")
    except RegionCorrupt as e:
        return SegmentInfo(name, instance, region, size, inode, SegmentState.UNKNOWN,
                           None, None, None, str(e))
    alive = creator_alive(header.creator_pid, header.creator_start_ticks, header.creator_pid_ns)
    state = {True: SegmentState.ALIVE, False: SegmentState.ORPHAN}.get(alive, SegmentState.UNKNOWN)
    reason = "created in another pid namespace" if alive is None else None
    return SegmentInfo(name, instance, region, size, inode, state, header.creator_pid,
                       header.writer, header.layout_version, reason)


def _shm_files(prefix: str) -> list[str]:
    try:
        return sorted(f for f in os.listdir(SHM_DIR) if f.startswith(prefix))
    except FileNotFoundError:
        return []


def list_segments(instance: str | None = None) -> list[SegmentInfo]:
    """Every `hkv-*` segment on the host (or of one instance), sorted; only reads headers."""
    prefix = SEGMENT_PREFIX
    if instance is not None:
        prefix = f"{SEGMENT_PREFIX}{validate_instance(instance)}-"
    found = [_inspect_file(f) for f in _shm_files(prefix)]
    return [s for s in found if s is not None]


def sweep_orphans(instance: str | None = None) -> list[str]:
    """Unlink segments whose creator is dead; returns the shm names removed.

    Live and UNKNOWN segments are never touched, nor a name recreated since the scan.
    """
    removed: list[str] = []
    for info in list_segments(instance):
        if info.state is not SegmentState.ORPHAN:
            continue
        try:
            recreated = os.stat(os.path.join(SHM_DIR, info.name[1:])).st_ino != info.inode
        except FileNotFoundError:
            continue
        if not recreated and unlink_segment(info.name):
            removed.append(info.name)
    return removed


def unlink_instance(instance: str, creator: Creator | None = None) -> list[str]:
    """Unlink the segments of `instance`; returns the names.

    With `creator`, only the segments whose header names that process (pid and
    start time): an instance started later under the same name keeps its own.
    Without it, every segment of the name, live or not (tests and `--sweep`).
    """
    prefix = f"{SEGMENT_PREFIX}{validate_instance(instance)}-"
    names = ["/" + f for f in _shm_files(prefix)]
    if creator is not None:
        names = [n for n in names if _created_by(n, creator)]
    return [n for n in names if unlink_segment(n)]


def _created_by(name: str, creator: Creator) -> bool:
    try:
        raw, size, _ = _read_header_bytes(os.path.join(SHM_DIR, name[1:]))
        header = SegmentHeader.unpack(raw, size)
    except (OSError, RegionCorrupt):
        return False
    return creator.same_as(header.creator_pid, header.creator_start_ticks)
