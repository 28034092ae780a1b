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

from hkv.ipc.pd_ticket import TicketError, check_ticket
from hkv.openai.protocol import ProtocolError

ADDRESS_FILE = "transporter.json"  # written by the transporter into the run directory (hkv/actors/transporter.py)


@dataclass(frozen=True)
class PdRoute:
    """What the hkv_pd field asks of this request."""

    peer: str | None = None  # decode: the prefill transporter to pull from
    for_peer: bool = False  # prefill: compute the prompt for a decode instance


NO_ROUTE = PdRoute()


class PdFront:
    """Checks hkv_pd against this instance's mode; answers /pd/info."""

    def __init__(self, mode: str, run_dir: str, secret: bytes | None):
        self.mode = mode
        self.run_dir = run_dir
        self.secret = secret  # decode mode: the tickets' key

    def route(self, body: dict[str, Any]) -> PdRoute:
        field = body.get("hkv_pd")
        if field is None:
            return NO_ROUTE
        if self.mode == "prefill" and field == {"prefill": True}:
            return PdRoute(for_peer=True)
        if self.mode == "decode" and self.secret is not None:
            try:
                return PdRoute(peer=check_ticket(self.secret, field))
            except TicketError as exc:
                raise ProtocolError(400, f"hkv_pd: {exc}", "hkv_pd") from None
        raise ProtocolError(400, f"hkv_pd is not accepted by a {self.mode} instance (docs/pd.md)", "hkv_pd")

    @staticmethod
    def prompts_for(route: PdRoute, prompts: list[list[int]]) -> list[list[int]]:
        """A prefill for a peer computes each prompt less its last token: its last page boundary's checkpoint is
        then the one a hit needs (a hit leaves one prompt token to compute)."""
        return [p[:-1] if len(p) > 1 else p for p in prompts] if route.for_peer else prompts

    def answer_for_peer(self, response: web.Response) -> web.Response:
        """A prefill's answer also names this instance's transporter, so the master needs no lookup (and never
        a stale one after a restart)."""
        if response.status != 200 or response.body is None:
            return response
        doc = msgspec.json.decode(response.body)
        doc["hkv_pd"] = {"transporter": self.info()["transporter"]}
        response.body = msgspec.json.encode(doc)
        return response

    def info(self) -> dict[str, Any]:
        address = None
        if self.mode in ("prefill", "decode"):
            try:
                with open(os.path.join(self.run_dir, ADDRESS_FILE), encoding="utf-8") as f:
                    address = json.load(f).get("address")
            except (OSError, ValueError):
                address = None  # not bound yet
        return {"mode": self.mode, "transporter": address}
