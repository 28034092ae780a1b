"""Prefill/decode on the router's side: the Scheduler's half of a transfer (docs/pd.md).

`PdFetching` is part of `Scheduler` (hkv/engine/scheduler.py), split out to
keep that file readable.

Decode instance: a request that names a peer (a checked ticket) first has
its transporter pull the prompt's pages its CPU tier lacks from that peer,
then looks its CPU tier up as any request does and is admitted as a tier
hit. It waits meanwhile (`lookup_pending`); a failed transfer fails the
request with the transporter's reason; pages that came over count as
`usage.cache.peer`.

    add(peer) -> PdFetch -----> transporter ... PdFetched(ok, moved) -> on_pd_fetched -> tier lookup -> admit

Prefill instance: a request sent `for_peer` answers only once its copies
out to the CPU tier settled, so the decode side's pull finds every page.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from hkv.ipc.messages import PdFetch, PdFetched, TokenDelta

if TYPE_CHECKING:
    from hkv.engine.scheduler import Sequence

_fetch_ids = itertools.count(1)


class PdFetching:
    """Scheduler provides coord, limits, tiers, waiting and _finished; `_pd_init` sets the rest."""

    def _pd_init(self) -> None:
        self.pd_outbox: list[PdFetch] = []  # for the transporter (the router sends them)
        self._fetching: dict[int, int] = {}  # fetch id -> req id, until PdFetched
        self._for_peer: set[int] = set()  # prefill mode: requests whose finish waits for their copies out
        self._held: dict[int, TokenDelta] = {}  # ... their finish deltas, until then
        self.pd_malformed = 0  # PdFetched for no fetch, or naming pages outside it

    def _start_fetch(self, seq: Sequence, peer: str) -> bool:
        """Ask for the prompt's pages past the device hit's reach; False when there is nothing to pull."""
        P = self.limits.page_size
        pages = (len(seq.prompt_ids) - 1) // P  # a hit leaves at least one prompt token to compute
        if self.tiers is None or pages == 0 or self.coord.peek(seq.prompt_ids) >= pages * P:
            return False
        keys = self.tiers.keys(seq.keys, seq.prompt_ids, pages)
        fetch_id = next(_fetch_ids)
        self._fetching[fetch_id] = seq.req_id
        self.pd_outbox.append(PdFetch(fetch_id, peer, list(keys), self.limits.hybrid))
        seq.lookup_pending = True
        return True

    def on_pd_fetched(self, msg: PdFetched) -> None:
        """A transfer ended: look the prompt up in the CPU tier now, or fail the request."""
        req_id = self._fetching.pop(msg.fetch_id, None)
        if req_id is None:
            self.pd_malformed += 1
            return
        seq = next((s for s in self.waiting if s.req_id == req_id), None)
        if seq is None:  # aborted meanwhile: what came is cached
            return
        pages = (len(seq.prompt_ids) - 1) // self.limits.page_size
        if not all(0 <= i < pages for i in msg.moved):
            self.pd_malformed += 1
            msg = PdFetched(msg.fetch_id, False, [], "the transporter named pages outside the prompt")
        if not msg.ok:
            self._drop_waiting(seq)
            self._finished.append(TokenDelta(seq.req_id, [], None, None, "error", len(seq.prompt_ids), 0, None,
                                             msg.error or "the transfer failed"))
            return
        seq.peer_pages = frozenset(msg.moved)
        hit = self.coord.peek(seq.prompt_ids)
        seq.lookup_pending = self.tiers.lookup(seq.req_id, seq.keys, seq.prompt_ids, hit)

    def take_pd_outbox(self) -> list[PdFetch]:
        out, self.pd_outbox = self.pd_outbox, []
        return out

    def _hold_for_peer(self, deltas: list[TokenDelta]) -> list[TokenDelta]:
        """Prefill mode: keep a for_peer request's finish until its copies out settled; release those that did."""
        if not self._for_peer and not self._held:
            return deltas
        out = []
        for delta in deltas:
            if delta.finish_reason is not None and delta.req_id in self._for_peer:
                self._for_peer.discard(delta.req_id)
                if self.tiers is not None and self.tiers.offloading.get(delta.req_id):
                    self._held[delta.req_id] = delta
                    continue
            out.append(delta)
        for req_id in [r for r in self._held if not self.tiers.offloading.get(r)]:
            out.append(self._held.pop(req_id))
        return out

    def _peer_tokens(self, seq: Sequence, first_page: int, loaded_pages: int) -> int:
        """Of the tier pages an admission loads, from `first_page` on, the tokens this request pulled from a peer."""
        moved = seq.peer_pages
        return sum(first_page + i in moved for i in range(loaded_pages)) * self.limits.page_size
