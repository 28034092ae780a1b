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

A prefill instance that can hand its device pages over (CUDA, or a pair
group on CPU) also holds the prompt's device pages
and checkpoint (at the prompt's last page boundary) and names them in its
answer (`PeerHold`); a decode instance on the same GPU copies them device
to device in the plan that admits the request (a `PeerCopy` op), then has
the hold released through the transporters; on another GPU (or on CPU with
`--pd-transfer pair`) the ranks move them over a pair group
(hkv/engine/pd_pairing.py). Holds nobody releases expire after
`--pd-timeout`.
"""

from __future__ import annotations

import itertools
import json
import time

import msgspec

from hkv.cache.transaction import Hold
from hkv.cache.types import PeerCopy
from hkv.engine.sequence import Sequence
from hkv.ipc.messages import GenerateRequest, PdFetch, PdFetched, PdRelease, PeerHold, TokenDelta

_fetch_ids = itertools.count(1)
MAX_PEER_HOLDS = 256  # prefill mode: device prefixes held for decode peers at once; past it none is offered


class PdFetching:
    """Scheduler provides coord, limits, tiers, waiting and _finished; `_pd_init` sets the rest."""

    def _pd_init(self) -> None:
        self.pd_outbox: list[PdFetch] = []  # for the transporter (the router sends them)
        self._fetching: dict[int, int] = {}  # fetch id -> req id, until PdFetched
        self._for_peer: set[int] = set()  # prefill mode: requests whose finish waits for their copies out
        self._held: dict[int, TokenDelta] = {}  # ... their finish deltas, until then
        self.pd_malformed = 0  # PdFetched for no fetch, or naming pages outside it
        self.peer_holds_enabled = False  # prefill mode on CUDA: hold prompts' device pages for decode peers
        self.peer_gpu = ""  # decode mode on CUDA: the GPU whose prefill peers' pages the rank can map
        self.kv_dtype = ""  # the KV pages' dtype (float32, bfloat16, float16, float8_e4m3fn); a peer's must match
        self.pd_timeout_s = 30.0  # --pd-timeout: a peer's device hold lasts at least this long
        self._peer_holds: dict[int, tuple[Hold, float]] = {}  # hold id -> (hold, taken at)
        self._hold_wanted: set[int] = set()  # prefill mode: for_peer req ids that hold their device prefix
        self._hold_of: dict[int, Hold] = {}  # for_peer req id -> its hold, until its finish delta names it
        self._release_next: list[PdRelease] = []  # decode: peer holds to release after the next plan
        self._releases_by_step: dict[int, list[PdRelease]] = {}

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

    def fetching_request(self, fetch_id: int) -> int | None:
        """The request a fetch in flight is for (None: not ours, or ended)."""
        return self._fetching.get(fetch_id)

    def take_pd_outbox(self) -> list[PdFetch]:
        out, self.pd_outbox = self.pd_outbox, []
        return out

    def _note_for_peer(self, req: GenerateRequest) -> None:
        """Prefill mode: a request computed for a decode peer waits for its copies out to answer; a one-prompt
        one (device_hold) also holds its device prefix for the peer to copy."""
        if req.for_peer:
            self._for_peer.add(req.req_id)
            if req.device_hold:
                self._hold_wanted.add(req.req_id)

    def _hold_for_peer(self, deltas: list[TokenDelta]) -> list[TokenDelta]:
        """Prefill mode: keep a for_peer request's finish until its copies out settled; release those that did."""
        if not self._for_peer and not self._held:
            return deltas
        out = []
        for delta in deltas:
            if delta.finish_reason is not None and delta.req_id in self._for_peer:
                self._for_peer.discard(delta.req_id)
                self._hold_wanted.discard(delta.req_id)
                if self.tiers is not None and self.tiers.offloading.get(delta.req_id):
                    self._held[delta.req_id] = delta
                    continue
            out.append(delta)
        for req_id in [r for r in self._held if not self.tiers.offloading.get(r)]:
            out.append(self._held.pop(req_id))
        return [self._with_peer_hold(d) if d.finish_reason is not None and d.req_id in self._hold_of else d
                for d in out]

    # -- device holds (prefill mode on CUDA)

    def _hold_for_peer_device(self, seq: Sequence) -> None:
        """At the prompt's last page boundary: hold its device pages and checkpoint for the decode peer."""
        if (not self.peer_holds_enabled or seq.req_id not in self._hold_wanted or seq.req_id in self._hold_of
                or len(self._peer_holds) >= MAX_PEER_HOLDS):
            return
        hold = self.coord.hold(seq.req_id)
        if hold is None:
            return
        if self.limits.hybrid and hold.checkpoint is None:
            self.coord.unhold(hold)
            return
        self._peer_holds[hold.hold_id] = (hold, time.monotonic())
        self._hold_of[seq.req_id] = hold

    def _with_peer_hold(self, delta: TokenDelta) -> TokenDelta:
        hold = self._hold_of.pop(delta.req_id)
        if hold.hold_id not in self._peer_holds:  # expired while the request ran: its pages may be reused
            return delta
        if delta.finish_reason not in ("stop", "length"):  # failed or aborted: nobody will copy it
            self.release_peer_hold(hold.hold_id)
            return delta
        # the timeout counts from the answer that names the hold: the decode side copies within half of it
        self._peer_holds[hold.hold_id] = (hold, time.monotonic())
        slot = hold.checkpoint.slot if hold.checkpoint is not None else None
        return msgspec.structs.replace(delta, peer_hold=PeerHold(hold.hold_id, hold.length, list(hold.pages), slot))

    def release_peer_hold(self, hold_id: int) -> None:
        """A decode peer copied the hold (or gave up): its pages become evictable again."""
        if self.sending_hold(hold_id):  # its send's end releases it (the pages are being read)
            return
        held = self._peer_holds.pop(hold_id, None)
        if held is None:
            self.pd_malformed += 1  # unknown, or released already (expired)
            return
        self.coord.unhold(held[0])

    def expire_peer_holds(self, timeout_s: float) -> None:
        """Holds older than the timeout go: their decode peer died or chose another path."""
        if not self._peer_holds:
            return
        now = time.monotonic()
        for hold_id in [h for h, (_, taken) in self._peer_holds.items()
                        if now - taken > timeout_s and not self.sending_hold(h)]:
            self.coord.unhold(self._peer_holds.pop(hold_id)[0])

    # -- device copies (decode mode on CUDA)

    def _peer_device_usable(self, seq: Sequence, req: GenerateRequest) -> bool:
        """The request names a peer's held device pages on this GPU, of a shape this prompt can use."""
        dev, P = req.peer_device, self.limits.page_size
        if dev is None or req.peer is None:
            return False
        try:
            pools = json.loads(dev.pools)
        except ValueError:
            pools = None
        pools = pools if isinstance(pools, dict) else {}
        same_gpu = self._same_pages(pools) and bool(self.peer_gpu) and pools.get("uuid") == self.peer_gpu
        pair = self._same_pages(pools) and not same_gpu and self._pair_usable(pools)  # NCCL, or gloo on CPU
        fits = (dev.length > 0 and dev.length % P == 0 and len(dev.pages) == dev.length // P
                and dev.length <= (len(seq.prompt_ids) - 1) // P * P and all(p >= 0 for p in dev.pages)
                and (dev.slot is not None and dev.slot >= 0) == self.limits.hybrid)
        if not ((same_gpu or pair) and fits):
            self.pd_outbox.append(PdRelease(req.peer, dev.hold_id))  # the CPU path instead
            self.pd_malformed += not fits
            return False
        seq.peer_device, seq.peer, seq.peer_pair = dev, req.peer, pair
        seq.peer_copy_by = time.monotonic() + self.pd_timeout_s / 2
        return True

    def _same_pages(self, pools: dict) -> bool:
        """The peer's pools document names this instance's KV dtype and cache fingerprint: its device pages are
        pages this instance would have computed. Else (or a peer naming neither) the CPU path, whose lookup the
        peer refuses with a line naming what differs (both KV dtypes, or the model or layout)."""
        root = self.tiers.root_key.hex() if self.tiers is not None else ""
        return (bool(self.kv_dtype) and pools.get("kv_dtype") == self.kv_dtype
                and bool(root) and pools.get("root") == root)

    def _extend_from_peer(self, txn, seq: Sequence, start: int) -> tuple[int, tuple[int, ...]]:
        """Grow the hit with the peer's held pages past `start`: (tokens, their fresh pages)."""
        dev = seq.peer_device
        if dev is not None and time.monotonic() > seq.peer_copy_by:  # the peer may let go of it any time now
            self._drop_peer(seq)
            return 0, ()
        if dev is None or dev.length <= start or start % self.limits.page_size:
            return 0, ()
        return dev.length - start, txn.extend(dev.length - start)

    def _peer_copy_ops(self, seq: Sequence, start: int, fresh: tuple[int, ...]) -> list[PeerCopy]:
        """The admitting plan's copy from the peer (then its hold goes), or just the release."""
        dev = seq.peer_device
        if dev is None:
            return []
        seq.peer_device = None
        release = PdRelease(seq.peer, dev.hold_id)
        if fresh and seq.peer_pair:  # over the pair group: the peer lets go of the hold when its send ends
            return self._pair_recv_ops(seq, dev, start, fresh)
        if not fresh:
            self.pd_outbox.append(release)
            return []
        self._release_next.append(release)
        P = self.limits.page_size
        src = dev.pages[start // P : dev.length // P]
        slot = seq.state_slot if self.limits.hybrid else None
        return [PeerCopy(dev.pools, list(src), list(fresh), dev.slot, slot)]

    def _drop_peer(self, seq: Sequence) -> None:
        """A waiting request leaves: its peer's hold is not needed."""
        if seq.peer_device is not None:
            self.pd_outbox.append(PdRelease(seq.peer, seq.peer_device.hold_id))
            seq.peer_device = None

    def _peer_plan_built(self, step: int) -> None:
        if self._release_next:
            self._releases_by_step[step], self._release_next = self._release_next, []

    def _peer_step_done(self, step: int) -> None:
        self.pd_outbox.extend(self._releases_by_step.pop(step, ()))

    def _peer_tokens(self, seq: Sequence, first_page: int, loaded_pages: int) -> int:
        """Of the tier pages an admission loads, from `first_page` on, the tokens this request pulled from a peer."""
        moved = seq.peer_pages
        return sum(first_page + i in moved for i in range(loaded_pages)) * self.limits.page_size
