"""Authenticated control frames: round trip, tampering, sizes, replay, bounded state, pickle, secret files."""

from __future__ import annotations

import os
import pickle
import struct

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hkv.ipc.auth import (
    MAGIC,
    MIN_FRAME_BYTES,
    TAG_BYTES,
    VERSION,
    AuthError,
    Opened,
    Rejected,
    Signer,
    Verifier,
    decode,
    load_secret,
)

SECRET = bytes(range(32))
OTHER_SECRET = bytes(range(1, 33))
SENDER = b"prefill-0"
# A loaded 2-core machine runs the suite: no per-example deadline.
FAST = settings(deadline=None, max_examples=200)


class Ping(msgspec.Struct, frozen=True):
    job: int
    note: str


def ping_frame(signer: Signer | None = None) -> bytes:
    return (signer or Signer(SECRET, SENDER)).seal(msgspec.msgpack.encode(Ping(7, "hi")))


def reason_of(verifier: Verifier, frame: bytes) -> str:
    with pytest.raises(Rejected) as e:
        verifier.open(frame)
    return e.value.reason


def hand_frame(sender: bytes, sequence: int, declared: int, payload: bytes, tag: bytes) -> bytes:
    """A frame laid out by hand (module docstring), with whatever lengths and tag the test wants."""
    return (struct.pack(">4sBB", MAGIC, VERSION, len(sender)) + sender
            + struct.pack(">QI", sequence, declared) + payload + tag)


# Round trip


def test_seal_open_round_trip_with_increasing_sequences_and_decode():
    signer = Signer(SECRET, SENDER)
    verifier = Verifier(SECRET)
    payloads = [b"", b"x", msgspec.msgpack.encode(Ping(3, "three"))]
    opened = [verifier.open(signer.seal(p)) for p in payloads]
    assert opened == [Opened(SENDER, 1, b""), Opened(SENDER, 2, b"x"), Opened(SENDER, 3, payloads[2])]
    assert decode(opened[2], Ping) == Ping(3, "three")
    assert verifier.decode(signer.seal(msgspec.msgpack.encode(Ping(4, "four"))), Ping) == Ping(4, "four")
    assert verifier.accepted == 4
    assert sum(verifier.rejected.values()) == 0


def test_frame_layout_matches_the_docstring():
    frame = Signer(SECRET, SENDER).seal(b"abc")
    n = len(SENDER)
    assert len(frame) == 50 + n + 3
    assert frame[:6] == MAGIC + bytes([VERSION, n])
    assert frame[6:6 + n] == SENDER
    assert struct.unpack(">QI", frame[6 + n:18 + n]) == (1, 3)
    assert frame[18 + n:21 + n] == b"abc"


def test_decode_into_a_tagged_union():
    class Start(msgspec.Struct, frozen=True, tag="start"):
        job: int

    class Stop(msgspec.Struct, frozen=True, tag="stop"):
        job: int

    signer, verifier = Signer(SECRET, SENDER), Verifier(SECRET)
    frame = signer.seal(msgspec.msgpack.encode(Stop(9)))
    assert verifier.decode(frame, Start | Stop) == Stop(9)


def test_first_sequence_lets_a_restarted_sender_keep_its_id():
    verifier = Verifier(SECRET)
    verifier.open(Signer(SECRET, SENDER).seal(b"before restart"))
    assert reason_of(verifier, Signer(SECRET, SENDER).seal(b"after restart")) == "replay"
    assert verifier.open(Signer(SECRET, SENDER, first=1000).seal(b"after restart")).sequence == 1000


# Tampering


@FAST
@given(st.data())
def test_flipping_any_byte_is_rejected_with_the_reason_of_its_field(data):
    frame = ping_frame()
    n = len(SENDER)
    index = data.draw(st.integers(0, len(frame) - 1), label="index")
    xor = data.draw(st.integers(1, 255), label="xor")
    tampered = bytearray(frame)
    tampered[index] ^= xor
    reason = reason_of(Verifier(SECRET), bytes(tampered))
    if index < 4:
        assert reason == "magic"
    elif index == 4:
        assert reason == "version"
    elif index == 5 or 14 + n <= index < 18 + n:  # the sender length or the payload length
        assert reason in ("length", "too_large")
    else:  # sender, sequence, payload, tag
        assert reason == "tag"


def test_a_different_secret_is_rejected_as_tag():
    verifier = Verifier(OTHER_SECRET)
    assert reason_of(verifier, ping_frame()) == "tag"
    assert verifier.rejected["tag"] == 1


@pytest.mark.parametrize("cut", [1, TAG_BYTES, 40])
def test_a_truncated_frame_is_rejected(cut):
    frame = ping_frame()
    assert reason_of(Verifier(SECRET), frame[:-cut]) in ("length", "short")
    assert reason_of(Verifier(SECRET), frame[:MIN_FRAME_BYTES - 1]) == "short"


@pytest.mark.parametrize("extra", [b"\x00", b"x" * 100])
def test_an_extended_frame_is_rejected(extra):
    assert reason_of(Verifier(SECRET), ping_frame() + extra) == "length"


def test_a_payload_larger_than_max_payload_is_refused_before_the_tag_is_checked():
    verifier = Verifier(SECRET, max_payload=1024)
    garbage_tag = b"\xee" * TAG_BYTES
    oversized = hand_frame(SENDER, 1, 1025, b"p" * 1025, garbage_tag)
    assert reason_of(verifier, oversized) == "too_large"
    # a header claiming 4 GiB in a small frame: the claim is refused, nothing is read past the header
    assert reason_of(verifier, hand_frame(SENDER, 1, (1 << 32) - 1, b"", garbage_tag)) == "too_large"
    # the same layout within the bound reaches the tag check
    assert reason_of(verifier, hand_frame(SENDER, 1, 1024, b"p" * 1024, garbage_tag)) == "tag"
    assert verifier.rejected["too_large"] == 2
    assert verifier.rejected["tag"] == 1


def test_a_sender_length_outside_1_to_64_is_rejected_as_length():
    verifier = Verifier(SECRET)
    assert reason_of(verifier, hand_frame(b"", 1, 0, b"", b"\0" * TAG_BYTES) + b"\0") == "length"
    assert reason_of(verifier, hand_frame(b"s" * 65, 1, 0, b"", b"\0" * TAG_BYTES)) == "length"


# Replay


def test_the_same_frame_twice_is_a_replay():
    verifier = Verifier(SECRET)
    frame = ping_frame()
    verifier.open(frame)
    assert reason_of(verifier, frame) == "replay"
    assert verifier.rejected["replay"] == 1


def test_an_older_sequence_after_a_newer_one_is_a_replay():
    signer, verifier = Signer(SECRET, SENDER), Verifier(SECRET)
    first, second = signer.seal(b"1"), signer.seal(b"2")
    assert verifier.open(second).sequence == 2
    assert reason_of(verifier, first) == "replay"


def test_two_senders_keep_separate_sequences():
    prefill, decode_ = Signer(SECRET, b"prefill-0"), Signer(SECRET, b"decode-0")
    verifier = Verifier(SECRET)
    for _ in range(3):
        prefill.seal(b"unseen")  # prefill's sequence moves ahead of decode's
    assert verifier.open(prefill.seal(b"p")) == Opened(b"prefill-0", 4, b"p")
    assert verifier.open(decode_.seal(b"d")) == Opened(b"decode-0", 1, b"d")
    assert verifier.open(decode_.seal(b"d")).sequence == 2


# Bounded state


def test_peer_state_is_bounded_and_the_least_recently_seen_sender_goes_first():
    verifier = Verifier(SECRET, max_peers=4)
    signers = {name: Signer(SECRET, name) for name in (b"a", b"b", b"c", b"d", b"e")}
    old_a = signers[b"a"].seal(b"old")
    verifier.open(old_a)
    for name in (b"b", b"c", b"d"):
        verifier.open(signers[name].seal(b"x"))
    verifier.open(signers[b"a"].seal(b"fresh"))  # a is now the most recent, b the least
    old_b = signers[b"b"].seal(b"unsent")
    verifier.open(signers[b"e"].seal(b"x"))
    assert verifier.peer_count == 4
    assert verifier.evicted == 1
    assert verifier.peers == (b"c", b"d", b"a", b"e")
    assert reason_of(verifier, old_a) == "replay"  # a kept its state
    assert verifier.open(old_b).sequence == 2  # b was forgotten: the documented limit


def test_max_peers_plus_one_senders_track_max_peers():
    verifier = Verifier(SECRET, max_peers=8)
    for i in range(9):
        verifier.open(Signer(SECRET, b"peer-%d" % i).seal(b""))
    assert verifier.peer_count == 8


# Pickle


calls: list[str] = []


def record(what: str) -> None:
    calls.append(what)


class Exploit:
    def __reduce__(self):
        return record, ("unpickled",)


def test_a_pickle_payload_is_rejected_and_never_runs():
    calls.clear()
    payload = pickle.dumps(Exploit())
    verifier = Verifier(SECRET)
    assert reason_of(verifier, Signer(OTHER_SECRET, SENDER).seal(payload)) == "tag"
    with pytest.raises(Rejected) as e:
        verifier.decode(Signer(SECRET, SENDER).seal(payload), Ping)
    assert e.value.reason == "decode"
    assert verifier.rejected["tag"] == 1 and verifier.rejected["decode"] == 1
    assert calls == []
    pickle.loads(payload)  # the control: this payload does run code when unpickled
    assert calls == ["unpickled"]
    calls.clear()


def test_module_decode_rejects_bad_payloads():
    for payload in (b"\xc1", b"\x91" * 100_000, msgspec.msgpack.encode({"job": "seven", "note": "x"})):
        with pytest.raises(Rejected) as e:
            decode(Opened(SENDER, 1, payload), Ping)
        assert e.value.reason == "decode"


# Garbage


@FAST
@given(st.binary(max_size=4096))
def test_random_bytes_are_always_rejected(garbage):
    verifier = Verifier(SECRET)
    with pytest.raises(Rejected):
        verifier.decode(garbage, Ping)
    assert sum(verifier.rejected.values()) == 1


@FAST
@given(st.integers(0, 255), st.binary(max_size=2048))
def test_random_bytes_behind_a_valid_prefix_are_always_rejected(sender_len, rest):
    verifier = Verifier(SECRET, max_payload=1024)
    with pytest.raises(Rejected):
        verifier.decode(MAGIC + bytes([VERSION, sender_len]) + rest, Ping)
    assert sum(verifier.rejected.values()) == 1


# Secret file


def write_secret(path, content: bytes, mode: int):
    path.write_bytes(content)
    os.chmod(path, mode)
    return path


def refusal(path) -> str:
    with pytest.raises(AuthError) as e:
        load_secret(path)
    # one sentence: no chained OSError shown beneath it
    assert e.value.__cause__ is None and (e.value.__context__ is None or e.value.__suppress_context__)
    return str(e.value)


def test_load_secret_reads_a_private_file_without_its_trailing_newline(tmp_path):
    secret = b"s3cr3t-" + b"z" * 40
    assert load_secret(write_secret(tmp_path / "secret", secret + b"\n", 0o600)) == secret
    assert load_secret(write_secret(tmp_path / "secret2", secret, 0o400)) == secret


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620, 0o602])
def test_load_secret_refuses_a_file_open_to_group_or_others(tmp_path, mode):
    secret = b"s3cr3t-" + b"z" * 40
    message = refusal(write_secret(tmp_path / "secret", secret, mode))
    assert "secret" in message and "group or others" in message and f"{mode:04o}" in message
    assert "s3cr3t" not in message


def test_load_secret_refuses_a_short_secret_without_showing_it(tmp_path):
    message = refusal(write_secret(tmp_path / "secret", b"hunter2-" + b"q" * 23 + b"\n", 0o600))
    assert "31 bytes" in message and "32" in message
    assert "hunter2" not in message


def test_load_secret_refuses_a_missing_file_and_a_directory(tmp_path):
    assert "cannot be opened" in refusal(tmp_path / "absent")
    assert str(tmp_path / "absent") in refusal(tmp_path / "absent")
    assert "not a regular file" in refusal(tmp_path)


def test_load_secret_refuses_a_file_owned_by_another_user(tmp_path, monkeypatch):
    path = write_secret(tmp_path / "secret", b"s3cr3t-" + b"z" * 40, 0o600)
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(path).st_uid + 1)
    message = refusal(path)
    assert "owned by uid" in message and "s3cr3t" not in message


def test_load_secret_refuses_an_oversized_file(tmp_path):
    assert "more than" in refusal(write_secret(tmp_path / "secret", b"x" * 5000, 0o600))


def test_signer_and_verifier_refuse_weak_secrets_and_bad_sender_ids():
    with pytest.raises(AuthError):
        Signer(b"short", SENDER)
    with pytest.raises(AuthError):
        Verifier(b"short")
    for sender in (b"", b"s" * 65):
        with pytest.raises(AuthError):
            Signer(SECRET, sender)
