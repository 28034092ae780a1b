"""json_block: round trip, capacity bound, torn-write detection."""

import struct

import pytest

from hkv.ipc import json_block


def test_round_trip_and_overwrite():
    buf = memoryview(bytearray(256))
    assert json_block.read(buf) is None
    assert json_block.write(buf, {"a": [1, 2]})
    assert json_block.read(buf) == {"a": [1, 2]}
    assert json_block.write(buf, [3])
    assert json_block.read(buf) == [3]


def test_a_document_that_does_not_fit_is_refused_and_the_old_one_stays():
    buf = memoryview(bytearray(64))
    assert json_block.write(buf, "small")
    assert not json_block.write(buf, "x" * 100)
    assert json_block.read(buf) == "small"


def test_a_write_in_progress_is_never_read():
    buf = memoryview(bytearray(64))
    json_block.write(buf, {"v": 1})
    seq, length = struct.unpack_from("<QI", buf, 0)
    struct.pack_into("<QI", buf, 0, seq + 1, length)  # a writer died mid-write
    with pytest.raises(json_block.JsonBlockBusy):
        json_block.read(buf)
