"""Shared-memory regions, registry, listing and sweeping, against the real /dev/shm."""

from __future__ import annotations

import dataclasses
import os
import struct
import subprocess
import sys

import numpy as np
import posix_ipc
import pytest

from hkv.ipc.shm import (
    HEADER_SIZE,
    HEADER_VERSION,
    SHM_DIR,
    LayoutMismatch,
    RegionCorrupt,
    RegionExists,
    RegionMissing,
    Registry,
    RegistryBusy,
    RegistryEntry,
    RegistryFull,
    SegmentHeader,
    SegmentState,
    ShmRegion,
    list_segments,
    parse_segment_file,
    process_start_ticks,
    segment_name,
    sweep_orphans,
    unlink_instance,
)

from hkv.ipc.creator import Creator
from tests.shm_helpers import fresh_instance, make_dead_segment


@pytest.fixture
def instance():
    """A fresh instance name per test; every segment under it is unlinked after."""
    yield from fresh_instance("t")


def make_raw_segment(instance: str, region: str, content: bytes) -> None:
    """Write arbitrary bytes as a segment, to forge foreign or corrupt headers."""
    shm = posix_ipc.SharedMemory(segment_name(instance, region), posix_ipc.O_CREX,
                                 mode=0o600, size=len(content))
    try:
        os.pwrite(shm.fd, content, 0)
    finally:
        shm.close_fd()


def own_header(region: str, **changes) -> SegmentHeader:
    """A valid header naming this process as creator, with `changes` applied."""
    pid = os.getpid()
    header = SegmentHeader(HEADER_VERSION, 1, pid, process_start_ticks(pid),
                           os.stat("/proc/self/ns/pid").st_ino, HEADER_SIZE, 64, "test", region)
    return dataclasses.replace(header, **changes)


def states(instance: str) -> dict[str, SegmentState]:
    return {s.region: s.state for s in list_segments(instance)}


def test_names_are_validated():
    assert segment_name("a.B_9", "kv_pool") == "/hkv-a.B_9-kv_pool"
    for bad_instance in ("", "a-b", "a/b", "x" * 33, "é"):
        with pytest.raises(ValueError):
            segment_name(bad_instance, "r")
    for bad_region in ("", "Reg", "a-b", "r" * 33):
        with pytest.raises(ValueError):
            segment_name("inst", bad_region)
    assert parse_segment_file("hkv-my.inst-req_table") == ("my.inst", "req_table")
    assert parse_segment_file("hkv-inst-a-b") is None
    assert parse_segment_file("hkv-inst") is None
    assert parse_segment_file("other-inst-r") is None


def test_create_then_attach_read_write_and_readonly(instance):
    with ShmRegion.create(instance, "table", 1000, "router", version=3) as region:
        assert region.name == f"/hkv-{instance}-table"
        header = region.header
        assert (header.layout_version, header.creator_pid, header.writer, header.region) == (
            3, os.getpid(), "router", "table")
        assert header.payload_offset % 64 == 0 and header.payload_size == 1000
        assert len(region.payload) == 1000 and bytes(region.payload) == bytes(1000)
        region.payload[:5] = b"hello"
        with ShmRegion.attach(instance, "table") as rw:
            assert bytes(rw.payload[:5]) == b"hello"
            rw.payload[5:6] = b"!"
        with ShmRegion.attach(instance, "table", readonly=True) as ro:
            assert ro.readonly and bytes(ro.payload[:6]) == b"hello!"
            with pytest.raises(TypeError):
                ro.payload[0:1] = b"x"
            arr = np.frombuffer(ro.payload, dtype=np.uint8)
            assert not arr.flags.writeable
            assert arr.ctypes.data % 64 == 0
            with pytest.raises(ValueError):
                arr[0] = 1
            del arr
        assert os.path.getsize(f"{SHM_DIR}/hkv-{instance}-table") == HEADER_SIZE + 1000


def test_attach_checks_layout_version(instance):
    with ShmRegion.create(instance, "pool", 8, "cache_worker", version=2):
        ShmRegion.attach(instance, "pool", version=2).close()
        with pytest.raises(LayoutMismatch):
            ShmRegion.attach(instance, "pool", version=1)


@pytest.mark.parametrize("umask", [0o000, 0o277])
def test_mode_is_0600_whatever_the_umask(instance, umask):
    old = os.umask(umask)
    try:
        region = ShmRegion.create(instance, "stats", 16, "api")
    finally:
        os.umask(old)
    region.close()
    assert os.stat(f"{SHM_DIR}/hkv-{instance}-stats").st_mode & 0o777 == 0o600


def test_create_is_exclusive(instance):
    with ShmRegion.create(instance, "r", 16, "router") as first:
        first.payload[0:1] = b"A"
        with pytest.raises(RegionExists):
            ShmRegion.create(instance, "r", 32, "router")
        with pytest.raises(FileExistsError):
            ShmRegion.create(instance, "r", 16, "router")
        with ShmRegion.attach(instance, "r", readonly=True) as again:
            assert bytes(again.payload[0:1]) == b"A" and again.header.payload_size == 16


def test_attach_missing_raises_region_missing(instance):
    with pytest.raises(RegionMissing):
        ShmRegion.attach(instance, "nothing")


def test_corrupt_headers_are_detected(instance):
    make_raw_segment(instance, "zeros", bytes(256))
    make_raw_segment(instance, "short", bytes(64))
    make_raw_segment(instance, "overrun", own_header("overrun", payload_size=10_000).pack())
    make_raw_segment(instance, "renamed", own_header("other").pack() + bytes(64))
    make_raw_segment(instance, "future", own_header("future", header_version=9).pack() + bytes(64))
    for region in ("zeros", "short", "overrun", "renamed", "future"):
        with pytest.raises(RegionCorrupt):
            ShmRegion.attach(instance, region, readonly=True)
    assert set(states(instance).values()) == {SegmentState.UNKNOWN}
    # Unknown headers may be a segment being created right now: never swept.
    assert sweep_orphans(instance) == []
    assert len(list_segments(instance)) == 5


def test_close_is_safe_with_outstanding_views(instance):
    region = ShmRegion.create(instance, "r", 128, "rank0")
    assert region.close() is True and region.closed
    assert region.close() is True

    region = ShmRegion.attach(instance, "r")
    arr = np.frombuffer(region.payload, dtype=np.uint8)
    view = region.payload[:4]
    assert region.close() is False
    assert region.close() is False
    with pytest.raises(ValueError):
        region.payload
    # The mapping lives on for the views still holding it.
    arr[0] = 7
    assert view[0] == 7
    del arr, view


def test_unlink_ignores_already_gone(instance):
    region = ShmRegion.create(instance, "r", 8, "router")
    region.unlink()
    region.unlink()
    region.payload[0:1] = b"x"  # the mapping outlives the name
    region.close()
    with pytest.raises(RegionMissing):
        ShmRegion.attach(instance, "r")


def test_registry_round_trip_and_capacity(instance):
    layout = {"dtype": "int32", "shape": [64, 8], "fields": {"pages": 0, "lengths": 2048}}
    with Registry.create(instance, capacity=2, max_entry_bytes=256) as registry:
        entry = registry.add("req_table", "router", 2, layout)
        assert entry == RegistryEntry("req_table", f"/hkv-{instance}-req_table", "router", 2,
                                      layout, os.getpid())
        registry.add("cpu_pool", "cache_worker", 1, {"page_bytes": 4096}, creator_pid=4242)
        with pytest.raises(RegistryFull):
            registry.add("stats", "api", 1, {})
        with Registry.attach(instance) as reader:
            entries = reader.entries()
            assert [e.region for e in entries] == ["req_table", "cpu_pool"]
            assert entries[0] == entry and entries[1].creator_pid == 4242
            assert entries[1].layout == {"page_bytes": 4096}
            with pytest.raises(PermissionError):
                reader.add("x", "api", 1, {})


def test_registry_refuses_bad_entries(instance):
    with Registry.create(instance, capacity=4, max_entry_bytes=128) as registry:
        registry.add("a", "router", 1, {})
        with pytest.raises(ValueError, match="already registered"):
            registry.add("a", "router", 1, {})
        with pytest.raises(ValueError, match="limit"):
            registry.add("b", "router", 1, {"blob": "x" * 200})
        with pytest.raises(ValueError):
            registry.add("Bad-Name", "router", 1, {})
        with pytest.raises(TypeError):
            registry.add("c", "router", 1, {"obj": object()})
        assert [e.region for e in registry.entries()] == ["a"]


def test_registry_reader_detects_a_write_in_progress(instance):
    with Registry.create(instance, capacity=2) as registry:
        registry.add("a", "router", 1, {})
        payload = registry.region.payload
        (seq,) = struct.unpack_from("<Q", payload, 0)
        # An odd sequence number is what a launcher killed mid-add leaves behind.
        struct.pack_into("<Q", payload, 0, seq + 1)
        del payload
        with Registry.attach(instance) as reader, pytest.raises(RegistryBusy):
            reader.entries()


def test_registry_corrupt_entry_is_reported(instance):
    with Registry.create(instance, capacity=2) as registry:
        registry.add("a", "router", 1, {"k": 1})
        payload = registry.region.payload
        payload[68:69] = b"\xff"  # first JSON byte of the first entry
        del payload
        with pytest.raises(RegionCorrupt):
            registry.entries()


def test_sweep_removes_only_dead_creators(instance):
    make_dead_segment(instance, "dead")
    with ShmRegion.create(instance, "live", 64, "router") as live:
        assert states(instance) == {"dead": SegmentState.ORPHAN, "live": SegmentState.ALIVE}
        info = {s.region: s for s in list_segments(instance)}
        assert info["dead"].writer == "child" and not info["dead"].alive
        assert info["live"].creator_pid == os.getpid() and info["live"].alive
        assert sweep_orphans(instance) == [f"/hkv-{instance}-dead"]
        assert states(instance) == {"live": SegmentState.ALIVE}
        assert sweep_orphans(instance) == []
        live.payload[0:1] = b"x"
        ShmRegion.attach(instance, "live").close()


def test_reused_pid_with_other_start_time_is_an_orphan(instance):
    header = own_header("reused")
    make_raw_segment(instance, "reused",
                     dataclasses.replace(header, creator_start_ticks=header.creator_start_ticks + 1)
                     .pack() + bytes(64))
    make_raw_segment(instance, "mine",
                     dataclasses.replace(header, region="mine").pack() + bytes(64))
    assert states(instance) == {"reused": SegmentState.ORPHAN, "mine": SegmentState.ALIVE}
    assert sweep_orphans(instance) == [f"/hkv-{instance}-reused"]


def test_other_pid_namespace_is_never_swept(instance):
    header = own_header("foreign", creator_pid=2**31 - 1)
    make_raw_segment(instance, "foreign", dataclasses.replace(header, creator_pid_ns=1).pack()
                     + bytes(64))
    (info,) = list_segments(instance)
    assert info.state is SegmentState.UNKNOWN and "namespace" in info.reason
    assert sweep_orphans(instance) == []


def test_zombie_creator_counts_as_dead():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    # Wait for the exit without reaping, so the child stays a zombie.
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
    try:
        assert process_start_ticks(child.pid) is None
    finally:
        child.wait()
    assert process_start_ticks(os.getpid()) is not None


def test_unlink_instance_touches_only_that_instance(instance):
    other = instance + "x"
    try:
        ShmRegion.create(instance, "a", 8, "router").close()
        ShmRegion.create(instance, "b", 8, "router").close()
        ShmRegion.create(other, "a", 8, "router").close()
        assert unlink_instance(instance) == [f"/hkv-{instance}-a", f"/hkv-{instance}-b"]
        assert list_segments(instance) == []
        assert [s.region for s in list_segments(other)] == ["a"]
    finally:
        unlink_instance(other)


def test_unlink_instance_with_a_creator_leaves_a_later_instances_segments(instance):
    """Issue 16, item 5: a dead launcher's late cleanup must not delete a new instance's segments."""
    ShmRegion.create(instance, "mine", 8, "router").close()
    me = Creator.this_process()
    later = own_header("later", creator_start_ticks=me.start_ticks + 1)  # same pid, another process
    make_raw_segment(instance, "later", later.pack() + bytes(8))
    assert unlink_instance(instance, creator=me) == [f"/hkv-{instance}-mine"]
    assert [s.region for s in list_segments(instance)] == ["later"]


def test_segment_info_json(instance):
    with ShmRegion.create(instance, "r", 8, "router"):
        (info,) = list_segments(instance)
        doc = info.to_json()
        assert doc["state"] == "alive" and doc["alive"] is True
        assert doc["instance"] == instance and doc["size"] == HEADER_SIZE + 8
