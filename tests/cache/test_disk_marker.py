"""The disk tier folder's per-model record of the --tp N that wrote it (hkv/cache/disk_marker.py)."""

from __future__ import annotations

import json
import os

import pytest

from hkv.cache import disk_marker
from hkv.cache.disk_marker import (
    MARKER_MAX_BYTES, DiskTierTpMismatch, claim, decode_marker, encode_marker, marker_path, read_marker,
)  # fmt: skip

MODEL = bytes(range(16))
OTHER = bytes(range(1, 17))


def test_the_first_claim_writes_the_marker_and_the_same_n_is_accepted_again(tmp_path):
    folder = tmp_path / "disk"
    assert claim(folder, MODEL, 2) is True
    path = marker_path(folder, MODEL)
    assert path.name == ".hkv-tp-" + MODEL.hex()
    assert json.loads(path.read_bytes()) == {"format": "hkv-tp-marker-v1", "tp": 2}
    assert read_marker(path) == (True, 2)
    assert oct(path.stat().st_mode & 0o777) == "0o600" and oct(folder.stat().st_mode & 0o777) == "0o700"
    assert claim(folder, MODEL, 2) is False
    assert sorted(os.listdir(folder)) == [path.name]  # no temp file left behind


def test_another_n_for_the_same_model_is_refused_with_what_to_do(tmp_path):
    claim(tmp_path, MODEL, 2)
    with pytest.raises(DiskTierTpMismatch) as refused:
        claim(tmp_path, MODEL, 1)
    assert str(refused.value) == (
        f"--disk-cache-dir {tmp_path} holds this model's pages written with --tp 2, and this instance runs --tp 1 "
        f"(its pages would never be read): start with --tp 2, give another --disk-cache-dir, or delete {tmp_path}")
    assert read_marker(marker_path(tmp_path, MODEL)) == (True, 2)  # the refusal changed nothing


def test_several_models_share_a_folder_each_with_its_own_n(tmp_path):
    assert claim(tmp_path, MODEL, 2) and claim(tmp_path, OTHER, 1)
    assert read_marker(marker_path(tmp_path, MODEL)) == (True, 2)
    assert read_marker(marker_path(tmp_path, OTHER)) == (True, 1)
    with pytest.raises(DiskTierTpMismatch, match="--tp 1, and this instance runs --tp 4"):
        claim(tmp_path, OTHER, 4)
    assert claim(tmp_path, MODEL, 2) is False


@pytest.mark.parametrize("content", [
    b"",
    b"\xff\xfe",
    b"not json",
    b"[2]",
    b'{"format": "hkv-tp-marker-v1"}',
    b'{"format": "hkv-tp-marker-v2", "tp": 1}',
    b'{"format": "hkv-tp-marker-v1", "tp": 0}',
    b'{"format": "hkv-tp-marker-v1", "tp": -2}',
    b'{"format": "hkv-tp-marker-v1", "tp": true}',
    b'{"format": "hkv-tp-marker-v1", "tp": 2.0}',
    b'{"format": "hkv-tp-marker-v1", "tp": "2"}',
    b'{"format": "hkv-tp-marker-v1", "tp": 99999999999999999999}',
    b'{"format": "hkv-tp-marker-v1", "tp": 2, "extra": 1}',
    b'{"format": "hkv-tp-marker-v1", "tp": 2}' + b" " * MARKER_MAX_BYTES,
])  # fmt: skip
def test_a_corrupt_marker_is_replaced_never_trusted(tmp_path, content):
    path = marker_path(tmp_path, MODEL)
    path.write_bytes(content)
    assert decode_marker(content) is None
    assert read_marker(path) == (True, None)
    assert claim(tmp_path, MODEL, 1) is True
    assert read_marker(path) == (True, 1)


def test_a_huge_marker_is_read_only_up_to_the_bound(tmp_path, monkeypatch):
    path = marker_path(tmp_path, MODEL)
    path.write_bytes(b"{" * (10 * 2**20))
    reads = []
    real_read = os.read
    monkeypatch.setattr(disk_marker.os, "read", lambda fd, n: reads.append(n) or real_read(fd, n))
    assert read_marker(path) == (True, None)
    assert reads == [MARKER_MAX_BYTES + 1]


def test_a_symlink_or_a_folder_in_the_markers_place_is_no_marker(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_bytes(encode_marker(3))
    path = marker_path(tmp_path, MODEL)
    path.symlink_to(target)
    assert read_marker(path) == (True, None)  # never followed
    assert claim(tmp_path, MODEL, 1) is True
    assert not path.is_symlink() and read_marker(path) == (True, 1)
    assert read_marker(target) == (True, 3)  # the link's target is untouched
    fifo = marker_path(tmp_path, OTHER)
    os.mkfifo(fifo)
    assert read_marker(fifo) == (True, None)  # opened without blocking, not a regular file


def test_losing_the_race_to_create_compares_with_the_winner(tmp_path, monkeypatch):
    """Two instances claim an empty folder at once: the one whose link comes second sees the first's N."""
    real_link = os.link

    def other_wins(src, dst):
        marker_path(tmp_path, MODEL).write_bytes(encode_marker(2))
        return real_link(src, dst)

    monkeypatch.setattr(disk_marker.os, "link", other_wins)
    with pytest.raises(DiskTierTpMismatch, match="written with --tp 2, and this instance runs --tp 1"):
        claim(tmp_path, MODEL, 1)
    assert [p.name for p in tmp_path.iterdir()] == [marker_path(tmp_path, MODEL).name]


@pytest.mark.parametrize("tp", [0, -1, True, 2.0, disk_marker.MAX_TP + 1])
def test_a_bad_n_or_key_is_a_value_error(tmp_path, tp):
    with pytest.raises(ValueError, match="tp must be an int"):
        claim(tmp_path, MODEL, tp)
    with pytest.raises(ValueError, match="model_key must be 16 bytes"):
        marker_path(tmp_path, b"short")


def test_a_directory_in_the_markers_place_is_an_os_error_not_a_crash(tmp_path):
    """The launcher turns the OSError into one exit-2 line (claim_disk_tier)."""
    marker_path(tmp_path, MODEL).mkdir()
    with pytest.raises(OSError):
        claim(tmp_path, MODEL, 1)
    assert [p.name for p in tmp_path.iterdir()] == [marker_path(tmp_path, MODEL).name]  # no temp left behind


def test_the_launcher_turns_each_refusal_into_one_config_error_line(tmp_path):
    from hkv.config import ConfigError
    from hkv.launcher import claim_disk_tier

    claim_disk_tier(str(tmp_path), MODEL, 2)
    with pytest.raises(ConfigError, match=r"^--disk-cache-dir .* written with --tp 2, and this instance runs --tp 1"):
        claim_disk_tier(str(tmp_path), MODEL, 1)
    marker_path(tmp_path, OTHER).mkdir()
    with pytest.raises(ConfigError, match=rf"^--disk-cache-dir {tmp_path}: cannot record its --tp marker: "):
        claim_disk_tier(str(tmp_path), OTHER, 1)
