"""The api's prefill/decode front: a signed device hold becomes the request's PeerDevice (or the CPU path), and a
prefill answer names its transporter and, on one GPU, the one device hold its prompt left."""

from __future__ import annotations

import json

import msgspec
import pytest
from aiohttp import web

from hkv.ipc.messages import PeerDevice, PeerHold
from hkv.ipc.pd_ticket import check_ticket_device, make_ticket
from hkv.openai.pd_route import ADDRESS_FILE, POOLS_FILE, PdFront, PdRoute
from hkv.openai.protocol import ProtocolError

SECRET = bytes(range(32))
PEER = "tcp://127.0.0.1:41234"
TRANSPORTER = "tcp://127.0.0.1:40001"
POOLS = json.dumps({"version": 1, "uuid": "GPU-8f0c2a11", "kv": {"handle": "ab"}})
DEVICE = {"pools": POOLS, "hold": 3, "length": 192, "pages": list(range(40, 52)), "slot": 5}
ANSWER = {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": "x"}]}


def decode_front(tmp_path) -> PdFront:
    return PdFront("decode", str(tmp_path), SECRET)


def prefill_front(tmp_path, pools: bool = True) -> PdFront:
    (tmp_path / ADDRESS_FILE).write_text(json.dumps({"address": TRANSPORTER}))
    if pools:
        (tmp_path / POOLS_FILE).write_text(POOLS)
    return PdFront("prefill", str(tmp_path), None)


def refused(front: PdFront, field) -> ProtocolError:
    with pytest.raises(ProtocolError) as e:
        front.route({"hkv_pd": field})
    return e.value


def answer(doc=ANSWER, status: int = 200) -> web.Response:
    return web.Response(status=status, body=msgspec.json.encode(doc), content_type="application/json")


def hold(hold_id: int = 3) -> PeerHold:
    return PeerHold(hold_id, 192, list(range(40, 52)), 5)


# Decode: the ticket's device hold


def test_a_ticket_with_a_device_hold_verifies_and_routes_to_its_peer_device(tmp_path):
    ticket = make_ticket(SECRET, PEER, device=DEVICE)
    assert ticket["device"] == DEVICE
    assert check_ticket_device(SECRET, ticket) == (PEER, DEVICE)
    route = decode_front(tmp_path).route({"hkv_pd": ticket})
    assert route == PdRoute(peer=PEER, device=PeerDevice(POOLS, 3, 192, list(range(40, 52)), 5))
    assert not route.for_peer


def test_a_dense_hold_without_a_slot_routes_to_a_slotless_peer_device(tmp_path):
    dense = {**DEVICE, "slot": None}
    route = decode_front(tmp_path).route({"hkv_pd": make_ticket(SECRET, PEER, device=dense)})
    assert route.device == PeerDevice(POOLS, 3, 192, list(range(40, 52)), None)


def test_a_ticket_without_a_device_routes_to_the_cpu_path(tmp_path):
    route = decode_front(tmp_path).route({"hkv_pd": make_ticket(SECRET, PEER)})
    assert route == PdRoute(peer=PEER)


@pytest.mark.parametrize("field,value", [
    ("pools", POOLS.replace("8f0c2a11", "8f0c2a12")),
    ("hold", 4),
    ("length", 176),
    ("pages", list(range(41, 53))),
    ("pages", list(range(40, 51))),
    ("slot", 6),
    ("slot", None),
])  # fmt: skip
def test_a_device_field_changed_after_signing_is_refused_with_400(tmp_path, field, value):
    ticket = make_ticket(SECRET, PEER, device=DEVICE)
    ticket["device"] = {**DEVICE, field: value}
    error = refused(decode_front(tmp_path), ticket)
    assert error.status == 400 and error.param == "hkv_pd" and "signature" in error.message


def test_a_device_added_to_or_dropped_from_a_signed_ticket_is_refused(tmp_path):
    added = make_ticket(SECRET, PEER)
    added["device"] = DEVICE
    dropped = make_ticket(SECRET, PEER, device=DEVICE)
    del dropped["device"]
    extra_key = make_ticket(SECRET, PEER, device=DEVICE)
    extra_key["device"] = {**DEVICE, "gpu": 0}
    for forged in (added, dropped, extra_key):
        assert refused(decode_front(tmp_path), forged).status == 400


@pytest.mark.parametrize("device", [
    {**DEVICE, "hold": "3"},
    {**DEVICE, "hold": True},
    {**DEVICE, "length": 192.0},
    {**DEVICE, "pages": "40,41"},
    {**DEVICE, "pages": [40, "41"]},
    {**DEVICE, "slot": "5"},
    {**DEVICE, "pools": {"uuid": "GPU-8f0c2a11"}},
    {k: v for k, v in DEVICE.items() if k != "pools"},
    {k: v for k, v in DEVICE.items() if k != "hold"},
    [POOLS, 3, 192],
    "device",
    7,
])  # fmt: skip
def test_a_signed_device_of_the_wrong_types_routes_to_the_cpu_path(tmp_path, device):
    route = decode_front(tmp_path).route({"hkv_pd": make_ticket(SECRET, PEER, device=device)})
    assert route == PdRoute(peer=PEER, device=None)


# Prefill: the answer names the transporter and the one device hold


def test_a_prefill_answer_names_its_transporter_and_its_one_device_hold(tmp_path):
    response = prefill_front(tmp_path).answer_for_peer(answer(), [hold()])
    doc = json.loads(response.body)
    assert {k: v for k, v in doc.items() if k != "hkv_pd"} == ANSWER
    assert doc["hkv_pd"] == {"transporter": TRANSPORTER, "device": {
        "pools": POOLS, "hold": 3, "length": 192, "pages": list(range(40, 52)), "slot": 5}}
    assert response.status == 200


def test_the_device_of_a_prefill_answer_signs_into_a_ticket_the_decode_front_routes(tmp_path):
    (tmp_path / "prefill").mkdir()
    doc = json.loads(prefill_front(tmp_path / "prefill").answer_for_peer(answer(), [hold(9)]).body)
    route = decode_front(tmp_path).route({"hkv_pd": make_ticket(SECRET, PEER, device=doc["hkv_pd"]["device"])})
    assert route.device == PeerDevice(POOLS, 9, 192, list(range(40, 52)), 5)


@pytest.mark.parametrize("holds", [[], [hold(3), hold(4)]])
def test_with_no_or_two_holds_the_answer_names_no_device(tmp_path, holds):
    doc = json.loads(prefill_front(tmp_path).answer_for_peer(answer(), holds).body)
    assert doc["hkv_pd"] == {"transporter": TRANSPORTER}


def test_without_a_pools_file_the_answer_names_no_device(tmp_path):
    doc = json.loads(prefill_front(tmp_path, pools=False).answer_for_peer(answer(), [hold()]).body)
    assert doc["hkv_pd"] == {"transporter": TRANSPORTER}


def test_before_the_transporter_is_bound_the_answer_names_none(tmp_path):
    front = PdFront("prefill", str(tmp_path), None)
    doc = json.loads(front.answer_for_peer(answer(), []).body)
    assert doc["hkv_pd"] == {"transporter": None}


@pytest.mark.parametrize("status", [400, 503])
def test_a_failed_answer_passes_unchanged(tmp_path, status):
    failed = answer({"error": {"message": "generation failed"}}, status=status)
    body = failed.body
    out = prefill_front(tmp_path).answer_for_peer(failed, [hold()])
    assert out is failed and out.status == status and out.body == body
