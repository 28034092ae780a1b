import os
import struct
import threading
import zlib

import pytest

from hkv.cache import disk
from hkv.cache.disk import DiskTier, DiskTierBusy

FP = bytes(range(16))
LAYOUT = "kv:2x1x2x4:bfloat16|state:conv1x4:float32"
KV_LEN, STATE_LEN = 64, 48
HEADER = 66 + len(LAYOUT)
PLAIN = HEADER + KV_LEN + 4  # bytes on disk of a state-less file
STATEFUL = PLAIN + STATE_LEN


def key(i: int) -> bytes:
    return bytes([(0xA0 + i) % 256]) + i.to_bytes(15, "little")


def kv(i: int) -> bytes:
    return bytes((i * 7 + j) % 256 for j in range(KV_LEN))


def st(i: int) -> bytes:
    return bytes((i * 13 + j + 1) % 256 for j in range(STATE_LEN))


def path(tmp_path, k: bytes, has_state: bool = False):
    name = k.hex()
    return tmp_path / name[:2] / (f"{name}-s.hkvp" if has_state else f"{name}.hkvp")


_OPEN: dict[str, DiskTier] = {}  # the tier holding each directory: a reopen models a restart


def tier_at(tmp_path, budget=10**9, fingerprint=FP, layout=LAYOUT, state_len=STATE_LEN) -> DiskTier:
    previous = _OPEN.pop(str(tmp_path), None)
    if previous is not None:
        previous.close()  # the old process is gone, and with it its lock
    tier = DiskTier(tmp_path, budget, fingerprint, layout, KV_LEN, state_len)
    tier.open()
    _OPEN[str(tmp_path)] = tier
    return tier


def test_a_directory_has_one_owner_at_a_time(tmp_path):
    first = tier_at(tmp_path)
    second = DiskTier(tmp_path, 10**9, FP, LAYOUT, KV_LEN, STATE_LEN)
    with pytest.raises(DiskTierBusy, match="in use by another hkv instance"):
        second.open()
    first.close()
    second.open()
    assert second.write(key(0), kv(0), None) is True
    second.close()


def entry_files(tmp_path) -> list[str]:
    return sorted(p.name for p in tmp_path.glob("??/*.hkvp"))


def temp_files(tmp_path) -> list[str]:
    return sorted(p.name for p in tmp_path.glob("??/.*"))


def read(tier: DiskTier, k: bytes, with_state: bool = True):
    kv_out = bytearray(KV_LEN)
    state_out = bytearray(b"\xee" * STATE_LEN) if with_state else None
    filled = tier.read_into(k, memoryview(kv_out), None if state_out is None else memoryview(state_out))
    return filled, kv_out, state_out


def counts(tier: DiskTier, *names: str) -> tuple[int, ...]:
    stats = tier.stats()
    return tuple(stats[n] for n in names)


def test_round_trip_without_state(tmp_path):
    tier = tier_at(tmp_path)
    assert tier.write(key(1), kv(1), None) is True
    assert (tier.contains(key(1)), tier.has_state(key(1)), tier.contains(key(2))) == (True, False, False)
    filled, kv_out, state_out = read(tier, key(1))
    assert filled is False
    assert bytes(kv_out) == kv(1)
    assert state_out == bytearray(b"\xee" * STATE_LEN)  # untouched
    assert tier.stats() == {"files": 1, "bytes": PLAIN, "budget_bytes": 10**9, "writes": 1, "write_errors": 0,
                            "reads": 1, "hits": 1, "misses": 0, "corrupt": 0, "evictions": 0,
                            "temp_cleaned": 0}  # fmt: skip
    tier.check_integrity()


def test_round_trip_with_state(tmp_path):
    tier = tier_at(tmp_path)
    assert tier.write(key(1), memoryview(kv(1)), memoryview(st(1))) is True
    assert tier.has_state(key(1)) is True
    filled, kv_out, state_out = read(tier, key(1))
    assert (filled, bytes(kv_out), bytes(state_out)) == (True, kv(1), st(1))
    assert entry_files(tmp_path) == [f"{key(1).hex()}-s.hkvp"]
    assert counts(tier, "bytes", "hits") == (STATEFUL, 1)


def test_read_without_state_out_still_verifies_the_checkpoint(tmp_path):
    tier = tier_at(tmp_path)
    tier.write(key(1), kv(1), st(1))
    filled, kv_out, _ = read(tier, key(1), with_state=False)
    assert (filled, bytes(kv_out)) == (False, kv(1))
    # A flipped checkpoint byte is caught even though the caller did not want the checkpoint.
    p = path(tmp_path, key(1), True)
    data = bytearray(p.read_bytes())
    data[HEADER + KV_LEN + 5] ^= 0x01
    p.write_bytes(bytes(data))
    assert read(tier, key(1), with_state=False)[0] is None
    assert counts(tier, "hits", "misses", "corrupt", "files") == (1, 1, 1, 0)


def test_file_layout_is_exactly_as_documented(tmp_path):
    tier = tier_at(tmp_path)
    tier.write(key(3), kv(3), st(3))
    data = path(tmp_path, key(3), True).read_bytes()
    assert len(data) == STATEFUL
    fields = struct.unpack_from("<8sII16s16sQQH", data)
    assert fields == (b"hkvpage\0", 2, HEADER, FP, key(3), KV_LEN, STATE_LEN, len(LAYOUT))
    assert data[66:HEADER] == LAYOUT.encode()
    assert data[HEADER : HEADER + KV_LEN] == kv(3)
    assert data[HEADER + KV_LEN : -4] == st(3)
    assert struct.unpack("<I", data[-4:])[0] == zlib.crc32(data[:-4])


def test_permissions(tmp_path):
    root = tmp_path / "cache"
    tier = tier_at(root)
    tier.write(key(1), kv(1), None)
    assert (root.stat().st_mode & 0o777, (root / key(1).hex()[:2]).stat().st_mode & 0o777) == (0o700, 0o700)
    assert path(root, key(1)).stat().st_mode & 0o777 == 0o600


def test_reopen_sees_entries_and_orders_lru_by_mtime(tmp_path):
    tier = tier_at(tmp_path)
    for i in range(3):
        tier.write(key(i), kv(i), st(i) if i == 1 else None)
    # Oldest first: key 2, key 0, key 1.
    for i, mtime in ((2, 1_000), (0, 2_000), (1, 3_000)):
        os.utime(path(tmp_path, key(i), i == 1), (mtime, mtime))
    reopened = tier_at(tmp_path, budget=2 * PLAIN + STATEFUL)
    assert [reopened.has_state(key(i)) for i in range(3)] == [False, True, False]
    assert counts(reopened, "files", "bytes") == (3, 2 * PLAIN + STATEFUL)
    assert read(reopened, key(1))[0] is True
    reopened.write(key(5), kv(5), None)  # evicts key 2, the oldest
    assert [reopened.contains(key(i)) for i in (0, 1, 2, 5)] == [True, True, False, True]
    reopened.write(key(6), kv(6), None)  # then key 0
    assert [reopened.contains(key(i)) for i in (0, 1, 5, 6)] == [False, True, True, True]
    assert reopened.stats()["evictions"] == 2
    reopened.check_integrity()


def test_open_evicts_oldest_to_budget(tmp_path):
    tier = tier_at(tmp_path)
    for i in range(4):
        tier.write(key(i), kv(i), None)
        os.utime(path(tmp_path, key(i)), (100 - i, 100 - i))  # key 3 oldest
    reopened = tier_at(tmp_path, budget=2 * PLAIN)
    assert [reopened.contains(key(i)) for i in range(4)] == [True, True, False, False]
    assert entry_files(tmp_path) == sorted(f"{key(i).hex()}.hkvp" for i in (0, 1))
    assert counts(reopened, "evictions", "bytes") == (2, 2 * PLAIN)


def test_hits_bump_mtime_so_lru_survives_restart(tmp_path):
    tier = tier_at(tmp_path)
    for i in range(2):
        tier.write(key(i), kv(i), None)
        os.utime(path(tmp_path, key(i)), (1_000 + i, 1_000 + i))
    read(tier, key(0))  # key 0 is now the most recent
    reopened = tier_at(tmp_path, budget=2 * PLAIN)
    reopened.write(key(2), kv(2), None)
    assert [reopened.contains(key(i)) for i in range(3)] == [True, False, True]


def test_open_deletes_temp_files_and_ignores_foreign_names(tmp_path):
    tier = tier_at(tmp_path)
    tier.write(key(1), kv(1), None)
    sub = tmp_path / key(1).hex()[:2]
    leftover = sub / f".{key(2).hex()}.4242.deadbeef.tmp"
    leftover.write_bytes(path(tmp_path, key(1)).read_bytes())  # complete contents: still never read
    foreign = [sub / "notes.txt", sub / "abc.hkvp", tmp_path / "README", tmp_path / "zz" / f"{key(3).hex()}.hkvp"]
    (tmp_path / "zz").mkdir()
    for p in foreign:
        p.write_bytes(b"not ours")
    reopened = tier_at(tmp_path)
    assert leftover.exists() is False
    assert all(p.read_bytes() == b"not ours" for p in foreign)
    assert counts(reopened, "temp_cleaned", "files", "corrupt") == (1, 1, 0)
    assert (reopened.contains(key(2)), read(reopened, key(2))[0]) == (False, None)
    reopened.check_integrity()


def test_open_deletes_wrong_size_files_and_shadowed_stateless_files(tmp_path):
    tier = tier_at(tmp_path)
    tier.write(key(1), kv(1), None)
    tier.write(key(2), kv(2), None)
    # A crash between renaming key 2's checkpoint file and removing its state-less file.
    other = tier_at(tmp_path / "other")
    other.write(key(2), kv(2), st(2))
    os.rename(path(tmp_path / "other", key(2), True), path(tmp_path, key(2), True))
    with open(path(tmp_path, key(1)), "ab") as f:
        f.write(b"x")
    reopened = tier_at(tmp_path)
    assert entry_files(tmp_path) == [f"{key(2).hex()}-s.hkvp"]
    assert counts(reopened, "files", "bytes", "corrupt") == (1, STATEFUL, 1)
    assert read(reopened, key(2))[0] is True


def _flip(offset):
    def corrupt(data: bytes) -> bytes:
        out = bytearray(data)
        out[offset] ^= 0x40
        return bytes(out)

    return corrupt


CORRUPTIONS = {
    "middle": _flip(HEADER + KV_LEN // 2),
    "magic": _flip(0),
    "version": _flip(8),
    "header_len": _flip(12),
    "fingerprint": _flip(20),
    "key": _flip(40),
    "kv_len": _flip(48),
    "layout": _flip(70),
    "checksum": _flip(-1),
    "truncated": lambda data: data[:-1],
    "extra bytes": lambda data: data + b"\0",
    "zero length": lambda data: b"",
}


@pytest.mark.parametrize("has_state", [False, True])
@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corrupt_file_is_a_miss_and_is_deleted(tmp_path, kind, has_state):
    tier = tier_at(tmp_path)
    tier.write(key(1), kv(1), st(1) if has_state else None)
    tier.write(key(2), kv(2), None)
    p = path(tmp_path, key(1), has_state)
    p.write_bytes(CORRUPTIONS[kind](p.read_bytes()))
    assert read(tier, key(1))[0] is None
    assert p.exists() is False
    assert tier.contains(key(1)) is False
    assert counts(tier, "corrupt", "misses", "hits", "files", "bytes") == (1, 1, 0, 1, PLAIN)
    tier.check_integrity()
    assert tier.write(key(1), kv(1), st(1) if has_state else None) is True
    filled, kv_out, _ = read(tier, key(1))
    assert (filled, bytes(kv_out)) == (has_state, kv(1))


def test_valid_file_under_another_keys_name_is_corrupt(tmp_path):
    tier = tier_at(tmp_path)
    tier.write(key(1), kv(1), None)
    tier.write(key(2), kv(2), None)
    os.replace(path(tmp_path, key(1)), path(tmp_path, key(2)))
    assert read(tier, key(2))[0] is None  # header names key 1
    assert read(tier, key(1))[0] is None  # its file is gone: a plain miss
    assert counts(tier, "corrupt", "misses", "files", "bytes") == (1, 2, 0, 0)
    assert entry_files(tmp_path) == []
    tier.check_integrity()


@pytest.mark.parametrize("field", ["fingerprint", "layout"])
def test_file_of_another_model_is_deleted(tmp_path, field):
    writer = tier_at(tmp_path)
    writer.write(key(1), kv(1), st(1))
    other = {"fingerprint": {"fingerprint": bytes(16)}, "layout": {"layout": LAYOUT.replace("4", "8")}}[field]
    reader = tier_at(tmp_path, **other)  # same sizes, so open() indexes it
    assert reader.contains(key(1)) is True
    assert read(reader, key(1))[0] is None
    assert counts(reader, "corrupt", "files") == (1, 0)
    assert entry_files(tmp_path) == []


def test_vanished_file_is_a_miss_not_corruption(tmp_path):
    tier = tier_at(tmp_path)
    tier.write(key(1), kv(1), None)
    path(tmp_path, key(1)).unlink()
    assert read(tier, key(1))[0] is None
    assert counts(tier, "misses", "corrupt", "files", "bytes") == (1, 0, 0, 0)
    assert tier.write(key(1), kv(1), None) is True


def test_failed_write_leaves_no_temp_file(tmp_path, monkeypatch):
    tier = tier_at(tmp_path)
    tier.write(key(0), kv(0), None)

    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(disk.os, "fsync", full)
    assert tier.write(key(1), kv(1), st(1)) is False
    monkeypatch.undo()
    assert temp_files(tmp_path) == []
    assert entry_files(tmp_path) == [f"{key(0).hex()}.hkvp"]
    assert counts(tier, "write_errors", "writes", "files", "bytes") == (1, 1, 1, PLAIN)
    tier.check_integrity()
    assert tier.write(key(1), kv(1), st(1)) is True


def test_failed_rename_leaves_no_temp_file(tmp_path, monkeypatch):
    tier = tier_at(tmp_path)

    def denied(src, dst):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(disk.os, "rename", denied)
    assert tier.write(key(1), kv(1), None) is False
    monkeypatch.undo()
    assert (temp_files(tmp_path), entry_files(tmp_path)) == ([], [])
    assert counts(tier, "write_errors", "files") == (1, 0)


def test_eviction_is_least_recently_used_first_files_used_once_before_those_used_again(tmp_path):
    tier = tier_at(tmp_path, budget=2 * PLAIN + STATEFUL)
    tier.write(key(0), kv(0), None)
    tier.write(key(1), kv(1), st(1))
    tier.write(key(2), kv(2), None)
    read(tier, key(0))  # a hit: key 0 is used again, it goes after every file used once
    assert tier.write(key(0), kv(0), None) is False  # a no-op write touches too
    tier.write(key(3), kv(3), None)  # needs PLAIN: evicts key 1 (STATEFUL)
    assert [tier.contains(key(i)) for i in range(4)] == [True, False, True, True]
    tier.write(key(4), kv(4), st(4))  # evicting key 2 (PLAIN) makes exactly enough room
    assert [tier.contains(key(i)) for i in range(5)] == [True, False, False, True, True]
    tier.write(key(5), kv(5), None)  # then key 3, not key 0
    assert [tier.contains(key(i)) for i in range(6)] == [True, False, False, False, True, True]
    tier.write(key(6), kv(6), st(6))  # key 4 (STATEFUL, used once) makes the room
    assert [tier.contains(key(i)) for i in range(7)] == [True] + [False] * 4 + [True, True]
    tier.write(key(7), kv(7), st(7))  # one key is not enough: key 5, then key 6 (both used once)
    assert [tier.contains(key(i)) for i in range(8)] == [True] + [False] * 6 + [True]
    assert counts(tier, "evictions", "files", "bytes") == (6, 2, PLAIN + STATEFUL)
    assert entry_files(tmp_path) == sorted([f"{key(0).hex()}.hkvp", f"{key(7).hex()}-s.hkvp"])
    tier.check_integrity()


def test_eviction_with_known_chains_goes_by_usable_prefix(tmp_path):
    """Chain A: 0-1-2 (checkpoint after 2); chain B: 3-4 (checkpoint after 3, page 4 beyond it).
    A file another one needs as its prefix stays; a page past its chain's deepest checkpoint goes first."""
    tier = tier_at(tmp_path, budget=3 * PLAIN + 2 * STATEFUL)
    tier.write(key(0), kv(0), None, FP)
    tier.write(key(1), kv(1), None, key(0))
    tier.write(key(2), kv(2), st(2), key(1))
    tier.write(key(3), kv(3), st(3), FP)
    tier.write(key(4), kv(4), None, key(3))
    assert tier.coverage() == (5, 4)  # page 4 lies beyond B's checkpoint
    order = []
    for new in range(10, 15):
        tier.write(key(new), kv(new), None)  # unknown chain: ranked by use
        order += [i for i in range(5) if not tier.contains(key(i)) and i not in order]
    assert order == [4, 2, 1, 0, 3]
    tier.check_integrity()


def test_a_lookup_teaches_a_reopened_tier_its_chains(tmp_path):
    tier = tier_at(tmp_path)
    tier.write(key(0), kv(0), None, FP)
    tier.write(key(1), kv(1), st(1), key(0))
    assert tier.coverage() == (2, 2)
    tier = tier_at(tmp_path)  # a restart: the parents are not in the files
    assert tier.coverage() == (2, 0)
    tier.link(key(0), FP)
    tier.link(key(1), key(0))
    tier.link(key(9), key(1))  # not on disk: nothing to learn
    assert tier.coverage() == (2, 2)
    tier.check_integrity()


def test_entry_larger_than_budget_is_refused(tmp_path):
    tier = tier_at(tmp_path, budget=PLAIN)
    assert tier.write(key(0), kv(0), None) is True
    assert tier.write(key(1), kv(1), st(1)) is False
    assert counts(tier, "files", "evictions", "writes") == (1, 0, 1)
    assert tier_at(tmp_path / "zero", budget=0).write(key(0), kv(0), None) is False


def test_checkpoint_write_replaces_stateless_file(tmp_path):
    tier = tier_at(tmp_path)
    assert tier.write(key(1), kv(1), None) is True
    assert tier.write(key(1), kv(1), st(1)) is True
    assert entry_files(tmp_path) == [f"{key(1).hex()}-s.hkvp"]
    assert temp_files(tmp_path) == []
    assert (tier.has_state(key(1)), counts(tier, "files", "bytes", "writes")) == (True, (1, STATEFUL, 2))
    # Equal or worse writes are no-ops.
    assert tier.write(key(1), kv(1), st(1)) is False
    assert tier.write(key(1), kv(1), None) is False
    assert counts(tier, "writes", "files") == (2, 1)
    tier.check_integrity()


def test_equal_write_is_a_noop(tmp_path):
    tier = tier_at(tmp_path)
    assert tier.write(key(1), kv(1), None) is True
    before = path(tmp_path, key(1)).stat().st_ino
    assert tier.write(key(1), kv(1), None) is False
    assert path(tmp_path, key(1)).stat().st_ino == before
    assert counts(tier, "writes", "files", "bytes") == (1, 1, PLAIN)


def test_flush_and_discard(tmp_path):
    tier = tier_at(tmp_path)
    for i in range(3):
        tier.write(key(i), kv(i), st(i) if i else None)
    tier.discard(key(1))
    tier.discard(key(9))  # absent: nothing happens
    assert entry_files(tmp_path) == sorted([f"{key(0).hex()}.hkvp", f"{key(2).hex()}-s.hkvp"])
    assert tier.flush() == 2
    assert (entry_files(tmp_path), temp_files(tmp_path)) == ([], [])
    assert counts(tier, "files", "bytes", "evictions") == (0, 0, 0)
    assert tier.flush() == 0
    assert tier.write(key(0), kv(0), None) is True
    tier.check_integrity()


def test_write_in_flight_during_flush_is_dropped(tmp_path, monkeypatch):
    tier = tier_at(tmp_path)
    real_fsync = os.fsync

    def fsync_then_flush(fd):
        real_fsync(fd)
        monkeypatch.setattr(disk.os, "fsync", real_fsync)
        assert tier.flush() == 0

    monkeypatch.setattr(disk.os, "fsync", fsync_then_flush)
    assert tier.write(key(1), kv(1), None) is False
    assert (entry_files(tmp_path), temp_files(tmp_path), tier.contains(key(1))) == ([], [], False)
    tier.check_integrity()


def test_better_write_landing_first_wins(tmp_path, monkeypatch):
    tier = tier_at(tmp_path)
    real_fsync = os.fsync
    inner = []

    def fsync_then_write_checkpoint(fd):
        real_fsync(fd)
        monkeypatch.setattr(disk.os, "fsync", real_fsync)
        inner.append(tier.write(key(1), kv(1), st(1)))  # a checkpoint beats the plain write in flight

    monkeypatch.setattr(disk.os, "fsync", fsync_then_write_checkpoint)
    assert tier.write(key(1), kv(1), None) is False
    assert inner == [True]
    assert (entry_files(tmp_path), temp_files(tmp_path)) == ([f"{key(1).hex()}-s.hkvp"], [])
    assert counts(tier, "writes", "files", "bytes") == (1, 1, STATEFUL)
    tier.check_integrity()


def test_equal_write_while_one_is_in_flight_is_a_noop(tmp_path, monkeypatch):
    tier = tier_at(tmp_path)
    real_fsync = os.fsync
    inner = []

    def fsync_then_write_again(fd):
        real_fsync(fd)
        monkeypatch.setattr(disk.os, "fsync", real_fsync)
        inner.append((tier.write(key(1), kv(1), None), tier.write(key(1), kv(1), st(1))))

    monkeypatch.setattr(disk.os, "fsync", fsync_then_write_again)
    assert tier.write(key(1), kv(1), st(1)) is True
    assert inner == [(False, False)]
    assert counts(tier, "writes", "files") == (1, 1)
    tier.check_integrity()


def test_concurrent_writers_keep_index_and_directory_consistent(tmp_path):
    tier = tier_at(tmp_path, budget=40 * PLAIN + 10 * STATEFUL)
    errors = []
    start = threading.Barrier(3)

    def writer(base: int):
        try:
            start.wait()
            for i in range(base, base + 60):
                tier.write(key(i), kv(i), st(i) if i % 3 == 0 else None)
                read(tier, key(max(base, i - 1)))
        except BaseException as exc:  # surfaced below: a thread's assertion would be lost
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(base,)) for base in (0, 100)]
    for t in threads:
        t.start()
    start.wait()
    for t in threads:
        t.join()
    assert errors == []
    tier.check_integrity()
    listing = entry_files(tmp_path)
    stats = tier.stats()
    assert (stats["files"], stats["writes"], stats["write_errors"]) == (len(listing), 120, 0)
    assert stats["files"] + stats["evictions"] == 120
    assert sum(STATEFUL if n.endswith("-s.hkvp") else PLAIN for n in listing) == stats["bytes"]
    assert stats["bytes"] <= stats["budget_bytes"]
    assert temp_files(tmp_path) == []


@pytest.mark.parametrize(
    "kwargs",
    [{"budget_bytes": -1}, {"fingerprint": b"short"}, {"fingerprint": "x" * 16}, {"layout": ""},
     {"kv_len": 0}, {"state_len": -1}, {"budget_bytes": 1.5}],
)  # fmt: skip
def test_constructor_rejects_bad_arguments(tmp_path, kwargs):
    args = {"directory": tmp_path, "budget_bytes": 100, "fingerprint": FP, "layout": LAYOUT, "kv_len": KV_LEN,
            "state_len": STATE_LEN, **kwargs}  # fmt: skip
    with pytest.raises(ValueError):
        DiskTier(**args)


def test_calls_reject_bad_keys_and_buffers(tmp_path):
    tier = tier_at(tmp_path)
    for bad in (b"short", bytearray(16), "k" * 16):
        with pytest.raises(ValueError, match="16 bytes"):
            tier.contains(bad)
    with pytest.raises(ValueError, match="63 bytes"):
        tier.write(key(1), kv(1)[:-1], None)
    with pytest.raises(ValueError, match="read-only"):
        tier.read_into(key(1), memoryview(kv(1)), None)
    stateless = tier_at(tmp_path / "dense", state_len=0)
    with pytest.raises(ValueError, match="no checkpoints"):
        stateless.write(key(1), kv(1), st(1))
    assert counts(tier, "writes", "reads") == (0, 0)


def test_methods_need_open(tmp_path):
    tier = DiskTier(tmp_path, 100, FP, LAYOUT, KV_LEN, STATE_LEN)
    with pytest.raises(RuntimeError, match="open"):
        tier.write(key(1), kv(1), None)
