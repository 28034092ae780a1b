"""Disk tier of the KV cache: one file per page, format hkv-page-v2.

The cache worker spills pages (and the linear-attention checkpoint taken at a
page's end) from its CPU shm pool to `--disk-cache-dir`, within a byte budget
(`--disk-cache-gb`), and reads them back on a prefix hit. Plain synchronous,
thread-safe Python: the worker calls it through `asyncio.to_thread`.

    <dir>/                                       mode 0700
      3f/                                        first two hex digits of the key
        3fa9...c1.hkvp                           page only                    mode 0600
        07b2...5e-s.hkvp                         page + checkpoint at its end
        .3fa9...c1.<pid>.<random>.tmp            a write in flight, or a crash's leftover

The file format (header, payload, crc32 trailer) lives in hkv/cache/disk_format.py
(`PageFormat`); docs/disk_format.md has the table and why each check exists.

A write goes to a temp file in the key's subdirectory, is fsynced, then
renamed to its final name, so a reader sees a whole file or none. A read
checks size, every header field, and the checksum; any mismatch deletes the
file and is a miss. The index (key -> size, has_state) lives in memory and is
rebuilt from the file names at `open()`. Eviction follows usable prefixes
(`ChainIndex`, hkv/cache/chains.py): files no other file needs as a prefix
first, those without a checkpoint before those with one, then least recently
used. The parent of a key is learned from writes and from lookups (`link`);
it is not in the file, so after a restart the tier knows no chains until
lookups and writes name them again, and ranks files by mtime alone (writes
and read hits bump it).

Locking: `_lock` guards the index, the in-flight reservations and the
counters. Reading and writing file contents happen outside it; renames (cheap
metadata operations) happen under it so that the index and the directory
change together. A file leaving the index is renamed to a temp name under the
lock and unlinked after it is released, so a slow unlink never holds the lock
and can never remove a newer file written under the same name.

One DiskTier per directory: two processes sharing one would delete each
other's temp files at `open()` and overrun the budget together, so `open()`
takes an exclusive flock on `<dir>/.hkv-lock` and raises DiskTierBusy if
another process holds it (the kernel drops it when the holder dies).
"""

from __future__ import annotations

import logging
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from hkv.cache.chains import ChainIndex
from hkv.cache.disk_format import CorruptFile, PageFormat
from hkv.cache.keys import KEY_BYTES

log = logging.getLogger("hkv.cache.disk")

_ENTRY_NAME = re.compile(r"([0-9a-f]{32})(-s)?\.hkvp")
_TEMP_NAME = re.compile(r"\.[0-9a-f]{32}\.[0-9]+\.[0-9a-f]+\.tmp")
_SUBDIR_NAME = re.compile(r"[0-9a-f]{2}")
_COUNTERS = ("writes", "write_errors", "reads", "hits", "misses", "corrupt", "evictions", "temp_cleaned")


class DiskTierBusy(RuntimeError):
    """Another live process has the directory open."""


@dataclass(eq=False, slots=True)
class _Entry:
    """One indexed file. Compared by identity: a reader that found its file corrupt
    drops the entry only if it is still the one it read, not a newer write."""

    size: int  # bytes on disk: header + kv + state + trailer
    has_state: bool  # the file carries a checkpoint (its name ends in "-s")


@dataclass(eq=False, slots=True)
class _Reservation:
    """Budget held by one write in flight, from its decision to its rename."""

    generation: int  # `DiskTier._generation` when it began; a flush since makes it stale
    size: int
    has_state: bool
    parent: bytes | None  # the key of the page before it, if the writer knows it


class DiskTier:
    """Pages on disk under a byte budget, evicted by usable prefix (deep ends first, then least recently used)."""

    def __init__(
        self,
        directory: str | Path,
        budget_bytes: int,
        fingerprint: bytes,
        layout: str,
        kv_len: int,
        state_len: int,
    ):
        _check_int("budget_bytes", budget_bytes, minimum=0)
        _check_int("kv_len", kv_len, minimum=1)
        _check_int("state_len", state_len, minimum=0)
        if not isinstance(fingerprint, bytes) or len(fingerprint) != KEY_BYTES:
            raise ValueError(f"fingerprint must be {KEY_BYTES} bytes (a root key), got {fingerprint!r}")
        if not isinstance(layout, str) or not layout:
            raise ValueError(f"layout must be a non-empty string, got {layout!r}")
        layout_bytes = layout.encode()
        if len(layout_bytes) > 0xFFFF:
            raise ValueError(f"layout is {len(layout_bytes)} bytes; the format allows 65535")
        self.directory: Path = Path(directory)
        self.budget_bytes: int = budget_bytes
        self.fingerprint: bytes = fingerprint
        self.layout: str = layout
        self.kv_len: int = kv_len
        self.state_len: int = state_len  # 0: the model keeps no checkpoints
        self._format: PageFormat = PageFormat(fingerprint, layout_bytes, kv_len, state_len)
        self._lock: threading.Lock = threading.Lock()
        self._opened: bool = False
        self._index: dict[bytes, _Entry] = {}
        self._chains: ChainIndex = ChainIndex(fingerprint, checkpoints=state_len > 0)  # the eviction order
        self._bytes: int = 0  # sum of the indexed entries' sizes
        self._pending: dict[bytes, _Reservation] = {}  # the best write in flight per key
        self._pending_bytes: int = 0  # sum over every write in flight, superseded ones too
        self._generation: int = 0  # bumped by flush(): writes begun before it are dropped
        self._counts: dict[str, int] = dict.fromkeys(_COUNTERS, 0)
        self._lock_fd: int | None = None  # the flock on <dir>/.hkv-lock while open

    def open(self) -> None:
        """Create the directory, delete temp leftovers, index the entries, evict to budget.

        Mutates the directory (temp files, wrong-size files and state-less files
        shadowed by a checkpoint-carrying one are deleted; LRU files beyond the
        budget are evicted) and rebuilds the index from file names and stat():
        oldest mtime first. Files whose names do not parse are left alone.
        Call once, before any other method.
        """
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        self._take_directory()
        found: dict[bytes, tuple[int, _Entry]] = {}  # key -> (mtime_ns, entry)
        for subdir in self._subdirs():
            self._scan_subdir(subdir, found)
        ordered = sorted(found.items(), key=lambda item: (item[1][0], item[0]))
        with self._lock:
            self._index = {key: entry for key, (_, entry) in ordered}
            for key, entry in self._index.items():  # oldest mtime first: the least recently used
                self._chains.add(key, None, checkpoint=entry.has_state)
            self._bytes = sum(entry.size for entry in self._index.values())
            self._opened = True
            doomed = self._evict_for(0)
        _unlink_all(doomed)

    def _take_directory(self) -> None:
        import fcntl

        fd = os.open(self.directory / ".hkv-lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DiskTierBusy(f"disk cache dir {self.directory} is in use by another hkv instance") from None
        self._lock_fd = fd

    def close(self) -> None:
        """Let go of the directory (its flock); the index stays readable but nothing else may be called."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)
        self._opened = False

    def contains(self, key: bytes) -> bool:
        """Whether the index holds `key`. Mutates nothing (no LRU touch)."""
        _check_key(key)
        with self._lock:
            self._require_open()
            return key in self._index

    def has_state(self, key: bytes) -> bool:
        """Whether `key`'s file carries a checkpoint; False if absent. Mutates nothing."""
        _check_key(key)
        with self._lock:
            self._require_open()
            entry = self._index.get(key)
            return entry is not None and entry.has_state

    def link(self, key: bytes, parent: bytes) -> None:
        """A lookup saw `key` follow `parent`: remember it if `key` is indexed. Mutates the chains only."""
        _check_key(key)
        with self._lock:
            self._require_open()
            if key in self._chains:
                self._chains.set_parent(key, parent)

    def write(self, key: bytes, kv: memoryview | bytes, state: memoryview | bytes | None,
              parent: bytes | None = None) -> bool:  # fmt: skip
        """Store a page and optionally its checkpoint; True if a file was written.

        `kv` is `kv_len` bytes, `state` `state_len` bytes or None (any
        C-contiguous buffer). False, writing nothing, when the key already has
        an equal-or-better file (one with a checkpoint, or a state-less one
        when `state` is None; that file is touched), when an equal-or-better
        write of the key is in flight, when the file would exceed the whole
        budget or the budget is held by writes in flight, or on an OSError
        (counted in `write_errors`, temp file removed).

        `parent` is the key of the page before it (the root key for a first
        page), when known: the eviction order needs it.

        Mutates: evicts entries (index and files) to make room; adds the
        entry; a checkpoint-carrying file replaces the key's state-less one.
        """
        _check_key(key)
        payload = [_byte_view(kv, self.kv_len, "kv", writable=False)]
        if state is not None:
            self._require_state_len("state")
            payload.append(_byte_view(state, self.state_len, "state", writable=False))
        has_state = state is not None
        with self._lock:
            self._require_open()
            covering = self._covering_entry(key, has_state)
            if covering is None:
                reservation, doomed = self._reserve(key, has_state, parent)
            else:
                self._use(key, parent)
        if covering is not None:
            _touch(self._path(key, covering.has_state))
            return False
        _unlink_all(doomed)
        if reservation is None:
            return False
        return self._write_reserved(key, payload, reservation)

    def read_into(self, key: bytes, kv_out: memoryview, state_out: memoryview | None) -> bool | None:
        """Read `key`'s page into `kv_out` (and its checkpoint into `state_out`).

        Returns None on a miss: absent, vanished, unreadable or corrupt (then
        `kv_out`/`state_out` hold garbage). Otherwise whether `state_out` was
        filled: False when the file has no checkpoint or `state_out` is None
        (the checkpoint is still read and checksummed, through a scratch
        buffer). Every header field, the file size and the checksum are
        checked; a mismatch deletes the file.

        Mutates: counters; a hit moves the entry to the LRU end and bumps the
        file's mtime; a corrupt or vanished file leaves the index.
        """
        _check_key(key)
        kv_view = _byte_view(kv_out, self.kv_len, "kv_out", writable=True)
        state_view = None
        if state_out is not None:
            self._require_state_len("state_out")
            state_view = _byte_view(state_out, self.state_len, "state_out", writable=True)
        with self._lock:
            self._require_open()
            self._counts["reads"] += 1
            entry = self._index.get(key)
            if entry is None:
                self._counts["misses"] += 1
                return None
        path = self._path(key, entry.has_state)
        try:
            self._format.read(path, key, entry.has_state, kv_view, state_view)
        except FileNotFoundError:
            return self._drop_vanished(key, entry)
        except CorruptFile as fault:
            return self._drop_corrupt(key, entry, path, str(fault))
        except OSError as exc:
            # EMFILE, EACCES, EIO...: not evidence about the file's contents, so keep it.
            log.warning("disk tier: reading %s failed: %s", path, exc)
            return self._count_miss()
        _touch(path)
        with self._lock:
            self._counts["hits"] += 1
            if self._index.get(key) is entry:
                self._use(key, None)
        return entry.has_state and state_view is not None

    def discard(self, key: bytes) -> None:
        """Delete `key`'s file if indexed. Mutates the index and the directory.

        A write of `key` in flight is not affected and lands afterwards.
        """
        _check_key(key)
        with self._lock:
            self._require_open()
            entry = self._unindex(key) if key in self._index else None
            doomed = [] if entry is None else [self._retire(key, entry)]
        _unlink_all(doomed)

    def flush(self) -> int:
        """Delete every indexed file; returns how many.

        Mutates the index and the directory; writes in flight when it is
        called are dropped (their temp files deleted, `write` returns False).
        """
        with self._lock:
            self._require_open()
            entries = list(self._index.items())
            self._index.clear()
            self._chains = ChainIndex(self.fingerprint, checkpoints=self.state_len > 0)
            self._generation += 1
            doomed = [self._retire(key, entry) for key, entry in entries]
        _unlink_all(doomed)
        return len(entries)

    def stats(self) -> dict[str, int]:
        """Counters since construction plus the current size. Mutates nothing.

        files, bytes: the index now (bytes = file sizes on disk). reads = hits
        + misses; misses include corrupt reads. corrupt: files deleted for a
        failed check, at read or at open (wrong size). evictions: files
        deleted for budget. temp_cleaned: temp files deleted by open().
        """
        with self._lock:
            return {"files": len(self._index), "bytes": self._bytes, "budget_bytes": self.budget_bytes,
                    **self._counts}  # fmt: skip

    def coverage(self) -> tuple[int, int]:
        """(files, files a hit on this tier alone could reach: their chain from a first page is on
        disk, down to a checkpoint when the tier keeps them, as far as the tier knows its chains)."""
        with self._lock:
            return len(self._index), self._chains.reachable

    def check_integrity(self) -> None:
        """Raise AssertionError naming the first breach between index and directory.

        Lists the directory (O(files): for tests and debugging). Holds the
        lock throughout, so call it while the tier is otherwise idle or
        expect it to stall other threads. Mutates nothing.
        """
        with self._lock:
            self._require_open()
            on_disk = self._list_entries()
            indexed = {self._path(key, e.has_state): e.size for key, e in self._index.items()}
            extra, missing = sorted(set(on_disk) - set(indexed)), sorted(set(indexed) - set(on_disk))
            assert not extra and not missing, f"files not indexed {extra}; indexed but absent {missing}"
            for path, size in indexed.items():
                assert on_disk[path] == size, f"{path}: {on_disk[path]} bytes on disk, {size} indexed"
            total = sum(indexed.values())
            self._chains.check()
            assert set(self._chains.links) == set(self._index), "chain links differ from the index"
            assert self._bytes == total, f"bytes {self._bytes} != sum of sizes {total}"
            assert self._bytes + self._pending_bytes <= self.budget_bytes, (
                f"bytes {self._bytes} + in flight {self._pending_bytes} > budget {self.budget_bytes}")
            counts = self._counts
            assert counts["reads"] == counts["hits"] + counts["misses"], f"reads != hits + misses: {counts}"

    def _path(self, key: bytes, has_state: bool) -> str:
        name = key.hex()
        return os.path.join(self.directory, name[:2], f"{name}-s.hkvp" if has_state else f"{name}.hkvp")

    def _temp_path(self, key: bytes) -> str:
        name = key.hex()
        return os.path.join(self.directory, name[:2], f".{name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")

    def _subdirs(self) -> list[str]:
        with os.scandir(self.directory) as it:
            return [d.path for d in it if _SUBDIR_NAME.fullmatch(d.name) and d.is_dir(follow_symlinks=False)]

    def _scan_subdir(self, subdir: str, found: dict[bytes, tuple[int, _Entry]]) -> None:
        """Index one subdirectory's entries into `found`, deleting temp and wrong-size files."""
        prefix = os.path.basename(subdir)
        with os.scandir(subdir) as it:
            files = [f for f in it if f.is_file(follow_symlinks=False)]
        for file in files:
            if _TEMP_NAME.fullmatch(file.name):
                self._delete_found(file.path, "temp_cleaned")
                continue
            match = _ENTRY_NAME.fullmatch(file.name)
            if match is None or not match[1].startswith(prefix):
                continue  # not ours
            self._index_found(file, bytes.fromhex(match[1]), match[2] is not None, found)

    def _index_found(self, file: os.DirEntry, key: bytes, has_state: bool,
                     found: dict[bytes, tuple[int, _Entry]]) -> None:  # fmt: skip
        stat = file.stat(follow_symlinks=False)
        if (has_state and self.state_len == 0) or stat.st_size != self._format.file_size(has_state):
            log.warning("disk tier: %s has %d bytes, not this model's %d; deleted", file.path, stat.st_size,
                        self._format.file_size(has_state))  # fmt: skip
            self._delete_found(file.path, "corrupt")
            return
        if key in found:
            # Both variants: a crash came between a checkpoint file's rename and removing the
            # key's state-less file. The checkpoint-carrying one wins.
            _unlink_all([self._path(key, False)])
            if not has_state:
                return
        found[key] = (stat.st_mtime_ns, _Entry(stat.st_size, has_state))

    def _delete_found(self, path: str, counter: str) -> None:
        _unlink_all([path])
        with self._lock:
            self._counts[counter] += 1

    def _list_entries(self) -> dict[str, int]:
        """Every entry-named file in the directory -> its size (for check_integrity)."""
        listing: dict[str, int] = {}
        for subdir in self._subdirs():
            with os.scandir(subdir) as it:
                for f in it:
                    if _ENTRY_NAME.fullmatch(f.name) and f.name.startswith(os.path.basename(subdir)):
                        listing[f.path] = f.stat(follow_symlinks=False).st_size
        return listing

    def _covering_entry(self, key: bytes, has_state: bool) -> _Entry | None:
        """The indexed entry that makes writing (key, has_state) pointless, if any. Lock held."""
        entry = self._index.get(key)
        if entry is not None and (entry.has_state or not has_state):
            return entry
        return None

    def _reserve(self, key: bytes, has_state: bool, parent: bytes | None) -> tuple[_Reservation | None, list[str]]:
        """Claim budget for a write, evicting in usable-prefix order; None if it must not go ahead.

        Lock held. Returns the reservation and the retired files to unlink
        once the lock is released.
        """
        pending = self._pending.get(key)
        if pending is not None and (pending.has_state or not has_state):
            return None, []  # an equal-or-better write of this key is in flight
        size = self._format.file_size(has_state)
        if self._pending_bytes + size > self.budget_bytes:
            return None, []  # larger than the budget, or the rest is held by writes in flight
        doomed = self._evict_for(size)
        reservation = _Reservation(self._generation, size, has_state, parent)
        self._pending[key] = reservation
        self._pending_bytes += size
        return reservation, doomed

    def _write_reserved(self, key: bytes, payload: list[memoryview], reservation: _Reservation) -> bool:
        """Write the temp file, then publish it under the lock. Always releases the reservation."""
        try:
            temp = self._temp_path(key)
            self._format.write_temp(temp, key, payload)
        except OSError as exc:
            log.warning("disk tier: writing %s failed: %s", key.hex(), exc)
            with self._lock:
                self._release(key, reservation)
                self._counts["write_errors"] += 1
            return False
        with self._lock:
            self._release(key, reservation)
            written, doomed = self._publish(key, temp, reservation)
        _unlink_all(doomed)
        return written

    def _publish(self, key: bytes, temp: str, reservation: _Reservation) -> tuple[bool, list[str]]:
        """Rename the temp file into place and index it. Lock held.

        Returns whether it was published and the files to unlink after the
        lock is released (the temp file when dropped, a superseded file).
        """
        stale = reservation.generation != self._generation
        if stale or self._covering_entry(key, reservation.has_state) is not None:
            return False, [temp]  # flushed meanwhile, or a better write of this key landed first
        try:
            os.rename(temp, self._path(key, reservation.has_state))
        except OSError as exc:
            log.warning("disk tier: renaming %s failed: %s", temp, exc)
            self._counts["write_errors"] += 1
            return False, [temp]
        doomed = []
        superseded = self._index.pop(key, None)
        if superseded is not None:
            doomed.append(self._retire(key, superseded))
            self._chains.set_checkpoint(key, reservation.has_state)
            self._use(key, reservation.parent)
        else:
            self._chains.add(key, reservation.parent, checkpoint=reservation.has_state)
        self._index[key] = _Entry(reservation.size, reservation.has_state)
        self._bytes += reservation.size
        self._counts["writes"] += 1
        return True, doomed

    def _release(self, key: bytes, reservation: _Reservation) -> None:
        """Return a write's budget claim. Lock held."""
        self._pending_bytes -= reservation.size
        if self._pending.get(key) is reservation:
            del self._pending[key]

    def _drop_corrupt(self, key: bytes, entry: _Entry, path: str, reason: str) -> None:
        log.warning("disk tier: %s is corrupt (%s); deleted", path, reason)
        with self._lock:
            self._counts["corrupt"] += 1
            self._counts["misses"] += 1
            doomed = []
            if self._index.get(key) is entry:
                self._unindex(key)
                doomed.append(self._retire(key, entry))
        _unlink_all(doomed)
        return None

    def _drop_vanished(self, key: bytes, entry: _Entry) -> None:
        """The file was deleted behind our back (or replaced meanwhile): a miss."""
        with self._lock:
            self._counts["misses"] += 1
            if self._index.get(key) is entry:
                self._unindex(key)
                self._bytes -= entry.size
        return None

    def _count_miss(self) -> None:
        with self._lock:
            self._counts["misses"] += 1
        return None

    def _evict_for(self, size: int) -> list[str]:
        """Evict in usable-prefix order until `size` more bytes fit beside the writes in flight. Lock held.

        Returns the retired files to unlink once the lock is released.
        """
        doomed = []
        while self._bytes + self._pending_bytes + size > self.budget_bytes and (key := self._chains.victim()):
            entry = self._unindex(key)
            self._counts["evictions"] += 1
            doomed.append(self._retire(key, entry))
        return doomed

    def _unindex(self, key: bytes) -> _Entry:
        """Take `key` out of the index and the chains (not its bytes: `_retire` does that). Lock held."""
        self._chains.remove(key)
        return self._index.pop(key)

    def _use(self, key: bytes, parent: bytes | None) -> None:
        """`key` was written or read: most recently used; learn its parent if given. Lock held."""
        if parent is not None:
            self._chains.set_parent(key, parent)
        self._chains.touch(key)

    def _retire(self, key: bytes, entry: _Entry) -> str | None:
        """Take a file out of the tier: rename it to a temp name for unlinking later. Lock held.

        The caller has removed `key` from the index; this adjusts the byte
        count. Renaming (cheap) under the lock means a new file written under
        the same name afterwards can never be the one unlinked. Returns the
        temp name, or None when the file is already gone.
        """
        self._bytes -= entry.size
        path = self._path(key, entry.has_state)
        doomed = self._temp_path(key)
        try:
            os.rename(path, doomed)
        except FileNotFoundError:
            return None
        except OSError as exc:
            # Left on disk, out of the index: the next open() indexes it again.
            log.warning("disk tier: could not remove %s: %s", path, exc)
            return None
        return doomed

    def _require_open(self) -> None:
        if not self._opened:
            raise RuntimeError("DiskTier.open() must be called first")

    def _require_state_len(self, what: str) -> None:
        if self.state_len == 0:
            raise ValueError(f"{what} given, but this tier stores no checkpoints (state_len=0)")


def _check_int(name: str, value: int, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _check_key(key: bytes) -> None:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ValueError(f"a page key is {KEY_BYTES} bytes, got {key!r}")


def _byte_view(buffer, nbytes: int, what: str, writable: bool) -> memoryview:
    """A flat byte view of `buffer`, which must be C-contiguous and exactly `nbytes` long."""
    view = memoryview(buffer)
    if not view.c_contiguous:
        raise ValueError(f"{what} must be C-contiguous")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    if view.nbytes != nbytes:
        raise ValueError(f"{what} is {view.nbytes} bytes, this tier's pages need {nbytes}")
    if writable and view.readonly:
        raise ValueError(f"{what} is read-only")
    return view


def _touch(path: str) -> None:
    """Bump mtime so the LRU order survives a restart; a file gone meanwhile is fine."""
    try:
        os.utime(path)
    except OSError:
        pass


def _unlink_all(paths: list[str | None]) -> None:
    for path in paths:
        if path is None:
            continue
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("disk tier: could not delete %s: %s", path, exc)
