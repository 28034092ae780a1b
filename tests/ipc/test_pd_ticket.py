"""Transfer tickets: round trip, tampering, age, malformed shapes, and the peer addresses they may name."""

from __future__ import annotations

import time

import pytest

from hkv.ipc.pd_ticket import MAX_AGE_S, TicketError, check_peer_address, check_ticket, make_ticket
from hkv.openai.pd_route import PdFront
from hkv.openai.protocol import ProtocolError

SECRET = bytes(range(32))
OTHER_SECRET = bytes(range(1, 33))
PEER = "tcp://127.0.0.1:41234"
NOW = 1_764_620_000.0


def ticket(**changes) -> dict:
    made = make_ticket(SECRET, PEER, now=NOW)
    made.update(changes)
    return made


def refused(t, secret=SECRET, now=NOW) -> str:
    with pytest.raises(TicketError) as e:
        check_ticket(secret, t, now=now)
    return str(e.value)


# Round trip


def test_a_fresh_ticket_names_its_peer_and_checks_out():
    t = make_ticket(SECRET, PEER, now=NOW)
    assert set(t) == {"peer", "issued", "nonce", "sig"}
    assert t["peer"] == PEER and t["issued"] == int(NOW)
    assert len(t["nonce"]) == 16 and int(t["nonce"], 16) >= 0
    assert len(t["sig"]) == 64 and int(t["sig"], 16) >= 0
    assert check_ticket(SECRET, t, now=NOW) == PEER


def test_an_ipv6_peer_round_trips_and_nonces_differ():
    a = make_ticket(SECRET, "tcp://[::1]:5000", now=NOW)
    b = make_ticket(SECRET, "tcp://[::1]:5000", now=NOW)
    assert check_ticket(SECRET, a, now=NOW) == check_ticket(SECRET, b, now=NOW) == "tcp://[::1]:5000"
    assert a["nonce"] != b["nonce"] and a["sig"] != b["sig"]


def test_make_ticket_refuses_a_peer_that_is_not_an_address():
    with pytest.raises(TicketError):
        make_ticket(SECRET, "tcp://localhost:1", now=NOW)


# Tampering and secrets


@pytest.mark.parametrize("field,value", [
    ("peer", "tcp://127.0.0.2:41234"),
    ("peer", "tcp://127.0.0.1:41235"),
    ("issued", int(NOW) - 1),
    ("nonce", "0" * 16),
])  # fmt: skip
def test_a_tampered_field_does_not_match_the_signature(field, value):
    t = ticket()
    assert t[field] != value
    t[field] = value
    assert "signature" in refused(t)


def test_a_tampered_signature_is_refused():
    t = ticket()
    flipped = "1" if t["sig"][10] != "1" else "2"
    t["sig"] = t["sig"][:10] + flipped + t["sig"][11:]
    assert "signature" in refused(t)


def test_a_ticket_signed_with_another_secret_is_refused():
    t = make_ticket(OTHER_SECRET, PEER, now=NOW)
    assert "signature" in refused(t)
    assert check_ticket(OTHER_SECRET, t, now=NOW) == PEER


def test_the_refusal_never_quotes_the_secret_or_the_signature():
    t = ticket(nonce="f" * 16)
    message = refused(t)
    assert SECRET.hex() not in message and t["sig"] not in message


# Age


@pytest.mark.parametrize("age", [0.0, MAX_AGE_S, -MAX_AGE_S, MAX_AGE_S - 0.5])
def test_a_ticket_within_its_age_checks_out(age):
    assert check_ticket(SECRET, ticket(), now=NOW + age) == PEER


@pytest.mark.parametrize("age", [MAX_AGE_S + 1, 3600.0, -MAX_AGE_S - 1, -86400.0])
def test_a_ticket_too_old_or_from_the_future_is_refused(age):
    assert "old" in refused(ticket(), now=NOW + age)


def test_the_age_uses_the_wall_clock_without_now():
    assert check_ticket(SECRET, make_ticket(SECRET, PEER)) == PEER
    stale = make_ticket(SECRET, PEER, now=time.time() - 10 * MAX_AGE_S)
    with pytest.raises(TicketError, match="old"):
        check_ticket(SECRET, stale)


# Malformed shapes


@pytest.mark.parametrize("shape", [None, "ticket", 42, ["peer"], (PEER, 1, "n", "s")])
def test_a_ticket_that_is_not_an_object_is_refused(shape):
    assert "object" in refused(shape)


def test_extra_or_missing_keys_are_refused():
    extra = ticket(expires=int(NOW) + 10)
    assert "object" in refused(extra)
    for key in ("peer", "issued", "nonce", "sig"):
        missing = ticket()
        del missing[key]
        assert "object" in refused(missing)


@pytest.mark.parametrize("issued", [True, False, float(int(NOW)), str(int(NOW)), None])
def test_issued_must_be_an_integer_and_not_a_bool(issued):
    assert "issued" in refused(ticket(issued=issued))


@pytest.mark.parametrize("field,value", [
    ("nonce", "0" * 15), ("nonce", "0" * 17), ("nonce", ""), ("nonce", 12345678),
    ("sig", "0" * 63), ("sig", "0" * 65), ("sig", b"0" * 64), ("sig", None),
])  # fmt: skip
def test_wrong_nonce_or_signature_lengths_or_types_are_refused(field, value):
    assert "malformed" in refused(ticket(**{field: value}))


@pytest.mark.parametrize("peer", ["tcp://localhost:1", "ipc:///tmp/x", 7, None])
def test_a_ticket_naming_no_address_is_refused_before_the_signature(peer):
    assert "peer must be" in refused(ticket(peer=peer))


# Peer addresses


@pytest.mark.parametrize("address", [
    "tcp://127.0.0.1:1", "tcp://[::1]:65535", "tcp://10.0.0.7:41234", "tcp://[fe80::1]:8001",
    "tcp://255.255.255.255:65535",
])  # fmt: skip
def test_ip_literals_with_a_port_are_accepted(address):
    assert check_peer_address(address) == address


@pytest.mark.parametrize("address", [
    "tcp://localhost:1",  # a name: nothing may be resolved
    "tcp://example.com:80",
    "tcp://127.0.0.1:0",
    "tcp://127.0.0.1:65536",
    "tcp://127.0.0.1:99999",
    "tcp://127.0.0.1:-1",
    "tcp://127.0.0.1:+1",
    "tcp://127.0.0.1: 1",
    "tcp://127.0.0.1",  # no port
    "tcp://127.0.0.1:",
    "tcp://[::1]",
    "tcp://[127.0.0.1]:5x",
    "tcp://:5",
    "udp://127.0.0.1:1",
    "ipc:///tmp/hkv.sock",
    "inproc://x",
    "TCP://127.0.0.1:1",
    " tcp://127.0.0.1:1",
    "127.0.0.1:1",
    "",
    "tcp://127.0.0.1:" + "0" * 60 + "1",  # a valid port, but the string is over the bound
    "tcp://[" + "0:" * 40 + "1]:1",
])  # fmt: skip
def test_names_bad_ports_other_schemes_and_overlong_strings_are_refused(address):
    with pytest.raises(TicketError):
        check_peer_address(address)


@pytest.mark.parametrize("address", [None, 1, b"tcp://127.0.0.1:1", ["tcp://127.0.0.1:1"]])
def test_a_peer_that_is_not_a_string_is_refused(address):
    with pytest.raises(TicketError):
        check_peer_address(address)


def test_the_length_bound_is_64_characters():
    head = "tcp://[0000:0000:0000:0000:0000:0000:0000:0001]:"
    at_bound = head + "0" * (64 - len(head) - 5) + "65535"
    assert len(at_bound) == 64 and check_peer_address(at_bound) == at_bound
    with pytest.raises(TicketError):
        check_peer_address(head + "0" * (65 - len(head) - 5) + "65535")


# The api's use of it


def test_the_api_answers_a_forged_ticket_with_400(tmp_path):
    front = PdFront("decode", str(tmp_path), SECRET)
    assert front.route({"hkv_pd": make_ticket(SECRET, PEER)}).peer == PEER  # fresh by the wall clock
    stale = ticket()  # issued at NOW, long before the wall clock
    for forged in (stale, ticket(peer="tcp://127.0.0.2:41234"), ticket(issued=True), {"peer": PEER}):
        with pytest.raises(ProtocolError) as e:
            front.route({"hkv_pd": forged})
        assert e.value.status == 400 and e.value.param == "hkv_pd"


# Addresses a ticket may name: ASCII ports only, IPv6 literals in brackets (once bugs, kept as regressions)


@pytest.mark.parametrize("port", ["\u00b2", "\u00b9"])  # superscripts: isdigit() but not int()
def test_a_port_of_unicode_superscript_digits_raises_ticket_error(port):
    with pytest.raises(TicketError):
        check_peer_address("tcp://127.0.0.1:" + port)


def test_an_unsigned_ticket_with_a_superscript_port_is_a_ticket_error():
    forged = {"peer": "tcp://127.0.0.1:\u00b2", "issued": int(NOW), "nonce": "0" * 16, "sig": "0" * 64}
    with pytest.raises(TicketError):
        check_ticket(SECRET, forged, now=NOW)


def test_the_api_answers_a_forged_ticket_with_a_superscript_port_with_400(tmp_path):
    forged = {"peer": "tcp://127.0.0.1:\u00b2", "issued": int(NOW), "nonce": "0" * 16, "sig": "0" * 64}
    with pytest.raises(ProtocolError) as e:
        PdFront("decode", str(tmp_path), SECRET).route({"hkv_pd": forged})
    assert e.value.status == 400


def test_a_port_of_non_ascii_digits_is_refused():
    with pytest.raises(TicketError):
        check_peer_address("tcp://127.0.0.1:\u0665")


@pytest.mark.parametrize("address", ["tcp://::1:5", "tcp://[127.0.0.1]:5"])
def test_brackets_go_with_ipv6_literals_only(address):
    with pytest.raises(TicketError):
        check_peer_address(address)
