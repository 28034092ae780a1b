"""Transfer tickets: the pd master's signed word to a decode instance about where a prompt was prefilled.

A decode instance pulls a prompt's KV pages and linear state from a prefill
instance's transporter. Which one is the pd master's choice, passed in the
request body as the extension field `hkv_pd` (docs/pd.md):

    {"peer": "tcp://127.0.0.1:41234", "issued": 1764620000, "nonce": "9f...", "sig": "<hex HMAC-SHA256>"}

The decode instance connects only to a peer named by a ticket that carries a
valid HMAC-SHA256 under the `--secret-file` secret and is at most
`MAX_AGE_S` old, so a client cannot make it dial an address of its choosing.
A captured ticket replayed within its age only repeats a pull from the same
prefill instance, which the transporter's own authenticated frames allow
anyway; it grants nothing else.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import os
import time
from typing import Any

MAX_AGE_S = 120.0  # a ticket older than this (or issued this far in the future) is refused
_DOMAIN = b"hkv-pd-ticket-v1"


class TicketError(ValueError):
    """A ticket that does not check out; the message says why (no secret in it)."""


def check_peer_address(address: str) -> str:
    """`tcp://<IPv4 or [IPv6] literal>:<port>`; raises TicketError otherwise (no names: nothing to resolve)."""
    if not isinstance(address, str) or not address.startswith("tcp://") or len(address) > 64:
        raise TicketError("peer must be tcp://<ip>:<port>")
    host, sep, port = address[len("tcp://"):].rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise TicketError("peer must be tcp://<ip>:<port>")
    bracketed = host.startswith("[") and host.endswith("]")
    try:
        ip = ipaddress.ip_address(host[1:-1] if bracketed else host)
    except ValueError:
        raise TicketError("peer must be tcp://<ip>:<port>") from None
    if bracketed != (ip.version == 6):  # IPv6 literals in brackets, IPv4 ones without
        raise TicketError("peer must be tcp://<ip>:<port> (an IPv6 address in brackets)")
    return address


def check_pair_address(address: str) -> str:
    """A decode rank's rendezvous `<IP literal>:<port>` (hkv/storage/pair_group.py); raises TicketError otherwise."""
    if not isinstance(address, str) or len(address) > 64:
        raise TicketError("a pair address must be <ip>:<port>")
    host, sep, port = address.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise TicketError("a pair address must be <ip>:<port>")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise TicketError("a pair address must be <ip>:<port>") from None
    return address


def _mac(secret: bytes, peer: str, issued: int, nonce: str, device: Any = None) -> str:
    parts = [_DOMAIN, peer.encode(), str(issued).encode(), nonce.encode()]
    if device is not None:  # canonical JSON: the signature covers every field of it
        parts.append(json.dumps(device, sort_keys=True, separators=(",", ":")).encode())
    return hmac.new(secret, b"|".join(parts), hashlib.sha256).hexdigest()


def make_ticket(secret: bytes, peer: str, now: float | None = None, device: Any = None) -> dict[str, Any]:
    """A ticket naming `peer` (and, on one GPU, the prefill's device hold `device`), signed with `secret`."""
    check_peer_address(peer)
    issued = int(time.time() if now is None else now)
    nonce = os.urandom(8).hex()
    ticket = {"peer": peer, "issued": issued, "nonce": nonce, "sig": _mac(secret, peer, issued, nonce, device)}
    if device is not None:
        ticket["device"] = device
    return ticket


def check_ticket(secret: bytes, ticket: Any, now: float | None = None) -> str:
    """The peer address of a valid ticket (the decode instance's side); raises TicketError."""
    return check_ticket_device(secret, ticket, now)[0]


def check_ticket_device(secret: bytes, ticket: Any, now: float | None = None) -> tuple[str, Any]:
    """(peer address, device hold or None) of a valid ticket; raises TicketError."""
    keys = {"peer", "issued", "nonce", "sig"}
    if not isinstance(ticket, dict) or not keys <= set(ticket) <= keys | {"device"}:
        raise TicketError("hkv_pd must be an object with peer, issued, nonce and sig (and device)")
    peer, issued, nonce, sig = ticket["peer"], ticket["issued"], ticket["nonce"], ticket["sig"]
    if not isinstance(issued, int) or isinstance(issued, bool):
        raise TicketError("hkv_pd.issued must be an integer")
    if not (isinstance(nonce, str) and len(nonce) == 16 and isinstance(sig, str) and len(sig) == 64):
        raise TicketError("hkv_pd.nonce or hkv_pd.sig is malformed")
    check_peer_address(peer)
    device = ticket.get("device")
    if not hmac.compare_digest(_mac(secret, peer, issued, nonce, device), sig):
        raise TicketError("hkv_pd signature does not match (is --secret-file the same on every instance?)")
    age = (time.time() if now is None else now) - issued
    if not -MAX_AGE_S <= age <= MAX_AGE_S:
        raise TicketError(f"hkv_pd ticket is {age:.0f} s old (at most {MAX_AGE_S:.0f} s)")
    return peer, device
