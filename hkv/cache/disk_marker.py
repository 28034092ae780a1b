"""Which `--tp N` wrote a disk tier folder's pages of a model: one small marker file per model.

    <dir>/
      .hkv-tp-<any-TP key, 32 hex digits>            {"format": "hkv-tp-marker-v1", "tp": 2}     mode 0600
      .hkv-tp-<key>.<pid>.<random>.tmp              a marker being written (deleted by its writer)

Pages are keyed by a fingerprint that includes N (hkv/cache/keys.py), so a folder written at
`--tp 2` is never read at `--tp 1`: every lookup would miss, silently. The launcher therefore
claims the folder for (model, N) before anything starts (`claim`): the marker is keyed by the
model's fingerprint with N left out (`ModelFingerprint.any_tp_key`), so several models still share
one folder, and holds N. Another N for the same model is refused (`DiskTierTpMismatch`, exit 2).

The marker is created with link(2) from a fsynced temp file, so two instances claiming an empty
folder at once cannot both win: the second one's link fails and it compares with the first's.
A marker that cannot be read as one (too big, not JSON, wrong format, N out of range, a
symlink) is logged and replaced by this instance's: it guards against an operator's mistake,
never correctness, since the page keys themselves carry N.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from pathlib import Path

log = logging.getLogger("hkv.cache.disk_marker")

MARKER_PREFIX = ".hkv-tp-"
MARKER_FORMAT = "hkv-tp-marker-v1"
MARKER_MAX_BYTES = 256  # a marker is ~45 bytes; anything longer is not one
MAX_TP = 4096  # an N beyond any host's device count is not a marker's


class DiskTierTpMismatch(RuntimeError):
    """The folder holds this model's pages written at another --tp N."""


def marker_path(directory: str | Path, model_key: bytes) -> Path:
    """Where the marker of the model whose any-TP root key is `model_key` (16 bytes) lives."""
    if not isinstance(model_key, bytes) or len(model_key) != 16:
        raise ValueError(f"model_key must be 16 bytes (ModelFingerprint.any_tp_key), got {model_key!r}")
    return Path(directory) / f"{MARKER_PREFIX}{model_key.hex()}"


def encode_marker(tp: int) -> bytes:
    _check_tp(tp)
    return json.dumps({"format": MARKER_FORMAT, "tp": tp}, separators=(", ", ": ")).encode() + b"\n"


def decode_marker(data: bytes) -> int | None:
    """The N a marker's bytes hold, or None when they are not a marker's."""
    if len(data) > MARKER_MAX_BYTES:
        return None
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(doc, dict) or set(doc) != {"format", "tp"} or doc["format"] != MARKER_FORMAT:
        return None
    tp = doc["tp"]
    if type(tp) is not int or not 1 <= tp <= MAX_TP:  # bool is no N
        return None
    return tp


def read_marker(path: Path) -> tuple[bool, int | None]:
    """(exists, N): (False, None) when absent; (True, None) when present but not a valid marker.

    Reads at most MARKER_MAX_BYTES + 1 bytes and never follows a symlink. Raises OSError only for
    what is neither absence nor a bad marker (a folder it may not read).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return False, None
    except OSError as exc:
        if os.path.islink(path):  # O_NOFOLLOW refused a symlink: not a marker
            return True, None
        raise exc
    try:
        if not _is_regular(fd):
            return True, None
        data = os.read(fd, MARKER_MAX_BYTES + 1)
    finally:
        os.close(fd)
    return True, decode_marker(data)


def claim(directory: str | Path, model_key: bytes, tp: int) -> bool:
    """Record that this model's pages in `directory` are written at `tp`; True if this call wrote the marker.

    Creates the directory (mode 0700) if needed. Mutates the directory only by adding a marker or
    replacing an invalid one. Raises DiskTierTpMismatch when a valid marker holds another N, and
    OSError when the folder cannot be written.
    """
    _check_tp(tp)
    directory = Path(directory)
    path = marker_path(directory, model_key)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    for _ in range(2):  # a second look only after losing a race to create it
        exists, held = read_marker(path)
        if held is not None:
            _compare(directory, held, tp)
            return False
        if exists:
            log.warning("disk tier: %s is not a valid TP marker; replacing it with --tp %d's", path, tp)
            _write(path, tp, replace=True)
            return True
        if _write(path, tp, replace=False):
            return True
    raise DiskTierTpMismatch(f"--disk-cache-dir {directory}: its TP marker {path.name} keeps changing under this "
                             "instance; is another hkv instance starting on it?")


def _compare(directory: Path, held: int, tp: int) -> None:
    if held != tp:
        raise DiskTierTpMismatch(
            f"--disk-cache-dir {directory} holds this model's pages written with --tp {held}, and this instance "
            f"runs --tp {tp} (its pages would never be read): start with --tp {held}, give another "
            f"--disk-cache-dir, or delete {directory}")


def _write(path: Path, tp: int, replace: bool) -> bool:
    """Write the marker through a fsynced temp file; False when another writer created it first (replace=False)."""
    temp = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        try:
            os.write(fd, encode_marker(tp))
            os.fsync(fd)
        finally:
            os.close(fd)
        if replace:
            os.replace(temp, path)
        else:
            try:
                os.link(temp, path)  # fails if it exists: the first claimer wins
            except FileExistsError:
                return False
    finally:
        temp.unlink(missing_ok=True)
    _fsync_dir(path.parent)
    return True


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _is_regular(fd: int) -> bool:
    import stat

    return stat.S_ISREG(os.fstat(fd).st_mode)


def _check_tp(tp: int) -> None:
    if type(tp) is not int or not 1 <= tp <= MAX_TP:
        raise ValueError(f"tp must be an int in 1..{MAX_TP}, got {tp!r}")
