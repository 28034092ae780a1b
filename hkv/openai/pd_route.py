"""The api's part of prefill/decode (docs/pd.md): the `hkv_pd` body field and GET /pd/info.

    prefill instance  "hkv_pd": {"prefill": true}   -> the prompt less its last token, 1 token out, answered
                                                       once its pages are in the CPU tier (for_peer)
    decode instance   "hkv_pd": <ticket>            -> pull the prompt's pages from the ticket's peer first
    anything else                                   -> 400 (a normal instance takes no hkv_pd)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from hkv.ipc.messages import PeerDevice
from hkv.ipc.pd_ticket import TicketError, check_ticket_device
from hkv.openai.protocol import ProtocolError

ADDRESS_FILE = "transporter.json"  # written by the transporter into the run directory (hkv/actors/transporter.py)
POOLS_FILE = "device_pools.json"  # written by a CUDA rank (hkv/storage/ipc_pools.py, which imports torch)


@dataclass(frozen=True)
class PdRoute:
    """What the hkv_pd field asks of this request."""

    peer: str | None = None  # decode: the prefill transporter to pull from
    for_peer: bool = False  # prefill: compute the prompt for a decode instance
    device: PeerDevice | None = None  # decode on the prefill's GPU: its held device pages


NO_ROUTE = PdRoute()


class PdFront:
    """Checks hkv_pd against this instance's mode; answers /pd/info."""

    def __init__(self, mode: str, run_dir: str, secret: bytes | None):
        self.mode = mode
        self.run_dir = run_dir
        self.secret = secret  # decode mode: the tickets' key
        self._address: str | None = None  # the transporter's, once its file is there
        self._pools_doc: str | None = None  # the rank's pools document, once its file is there

    def route(self, body: dict[str, Any]) -> PdRoute:
        field = body.get("hkv_pd")
        if field is None:
            return NO_ROUTE
        if self.mode == "prefill" and field == {"prefill": True}:
            return PdRoute(for_peer=True)
        if self.mode == "decode" and self.secret is not None:
            try:
                peer, device = check_ticket_device(self.secret, field)
            except TicketError as exc:
                raise ProtocolError(400, f"hkv_pd: {exc}", "hkv_pd") from None
            return PdRoute(peer=peer, device=_device(device))
        raise ProtocolError(400, f"hkv_pd is not accepted by a {self.mode} instance (docs/pd.md)", "hkv_pd")

    @staticmethod
    def prompts_for(route: PdRoute, prompts: list[list[int]]) -> list[list[int]]:
        """A prefill for a peer computes each prompt less its last token: its last page boundary's checkpoint is
        then the one a hit needs (a hit leaves one prompt token to compute)."""
        return [p[:-1] if len(p) > 1 else p for p in prompts] if route.for_peer else prompts

    def answer_for_peer(self, response: web.Response, holds: list) -> web.Response:
        """A prefill's answer also names this instance's transporter, so the master needs no lookup (and never
        a stale one after a restart), and on CUDA the device pages it holds for one prompt (`device`)."""
        if response.status != 200 or response.body is None:
            return response
        doc = msgspec.json.decode(response.body)
        doc["hkv_pd"] = {"transporter": self.info()["transporter"]}
        pools = self._pools()
        if pools is not None and len(holds) == 1:  # one prompt: the ticket names one hold
            hold = holds[0]
            doc["hkv_pd"]["device"] = {"pools": pools, "hold": hold.hold_id, "length": hold.length,
                                       "pages": hold.pages, "slot": hold.slot}
        response.body = msgspec.json.encode(doc)
        return response

    def _pools(self) -> str | None:
        """The rank's CUDA IPC pools document (hkv/storage/ipc_pools.py), None off CUDA; read once it exists."""
        if self._pools_doc is None:
            try:
                with open(os.path.join(self.run_dir, POOLS_FILE), encoding="utf-8") as f:
                    self._pools_doc = f.read()
            except OSError:
                return None
        return self._pools_doc

    def info(self) -> dict[str, Any]:
        """GET /pd/info; the transporter's address is read from its file once it is there (it binds once)."""
        if self._address is None and self.mode in ("prefill", "decode"):
            try:
                with open(os.path.join(self.run_dir, ADDRESS_FILE), encoding="utf-8") as f:
                    self._address = json.load(f).get("address")
            except (OSError, ValueError):
                pass  # not bound yet
        return {"mode": self.mode, "transporter": self._address}


def _device(doc: Any) -> PeerDevice | None:
    """The signed device hold as a typed struct; one that does not fit the type is ignored (the CPU path)."""
    if not isinstance(doc, dict):
        return None
    try:
        return msgspec.convert({"pools": doc.get("pools"), "hold_id": doc.get("hold"), "length": doc.get("length"),
                                "pages": doc.get("pages"), "slot": doc.get("slot")}, PeerDevice)
    except msgspec.ValidationError:
        return None
