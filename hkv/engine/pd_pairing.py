"""Prefill/decode over a pair process group, the router's side (NCCL between GPUs, gloo on CPU; docs/pd.md).

`PdPairing` is part of `Scheduler` (hkv/engine/scheduler.py), beside
`PdFetching` (the CPU-tier path and the one-GPU device copy).

    decode router                                    prefill router
    admit: reserve the pages the hold covers past     the for_peer prompt's device prefix is held
    the decode-side hit, and the state slot           (PeerHold, named in its answer)
    plan: PeerRecv(transfer, pages) --- rank
    PdPairAsk(hold, transfer, pages, address) ----->  PdPairSend: hold checked, pages cut from it
                                                      plan: PeerSend(transfer, held pages) --- rank
                     ... the two ranks move the pages over their pair group, off their step loops ...
    StepResult.transfers: ok -> publish, plan chunks  StepResult.transfers: the send ended -> unhold
                          failed -> roll back, error

Until its transfer ends an admitted sequence is *arriving*: it holds its
slot, state slot and pages, no chunk of it is planned, nothing of it enters
the prefix cache (another request would read pages not there yet), it is
never preempted, and an abort or `--pd-timeout` answers the client at once
but keeps the pages until the rank reports the transfer ended (a receive may
still be writing them). Meanwhile the router keeps sending plans (copies-only
ones every PAIR_POLL_S when nothing runs) so the ranks can report.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict

from hkv.cache.types import PeerRecv, PeerSend
from hkv.engine.sequence import Sequence
from hkv.ipc.messages import PdPairAsk, PdPairSend, PeerDevice, TokenDelta, TransferDone

PAIR_POLL_S = 0.002  # a router with transfers out and nothing to run asks the ranks this often
MAX_PAIR_PEERS = 64  # prefill peers whose pair group prefix the decode router remembers


class PdPairing:
    """Scheduler provides coord, limits, running, _ops, _finished, _leave, release_peer_hold and pd_outbox."""

    def _pair_init(self) -> None:
        self.pair_backend = ""  # "nccl" / "gloo": this instance moves held prefixes over pair groups
        self.pair_address = ""  # decode: the rank's rendezvous host:port (RankReady)
        self._prefixes: OrderedDict[str, str] = OrderedDict()  # decode: prefill peer -> its pair group's name
        self._arriving: dict[int, tuple[Sequence, int]] = {}  # decode: transfer id -> (the sequence it fills, pages)
        self._sending: dict[int, tuple[int, int]] = {}  # prefill: transfer id -> (the hold it sends from, pages)
        self._poll_at = 0.0
        self.pair_ok = self.pair_failed = self.pair_pages = 0  # transfers that ended, pages they moved

    # -- decode side

    def _pair_usable(self, pools: dict) -> bool:
        """The peer's pools document (decoded) names this instance's pair backend (and this rank has a
        rendezvous)."""
        return bool(self.pair_backend and self.pair_address) and pools.get("pair") == self.pair_backend

    def _pair_recv_ops(self, seq: Sequence, dev: PeerDevice, start: int, fresh: tuple[int, ...]) -> list[PeerRecv]:
        """Admitted at `start` with `fresh` pages for the rest of the hold: receive them, ask the peer to send."""
        P = self.limits.page_size
        transfer_id = secrets.randbits(62)  # unique across decode instances too: the prefill side keys by it
        prefix = self._prefixes.get(seq.peer)
        if prefix is None:
            prefix = self._prefixes[seq.peer] = secrets.token_hex(8)
            while len(self._prefixes) > MAX_PAIR_PEERS:
                self._prefixes.popitem(last=False)
        self._prefixes.move_to_end(seq.peer)
        first = start // P
        src = dev.pages[first : dev.length // P]
        slot = seq.state_slot if self.limits.hybrid else None
        self.pd_outbox.append(PdPairAsk(seq.peer, dev.hold_id, transfer_id, self.pair_address, prefix, first,
                                        list(fresh), slot))
        seq.arriving, seq.announced = transfer_id, False
        seq.arrive_by = time.monotonic() + self.pd_timeout_s
        self._arriving[transfer_id] = (seq, len(fresh))
        return [PeerRecv(transfer_id, seq.peer, prefix, list(src), list(fresh), dev.slot, slot)]

    def _arrived(self, seq: Sequence, pages: int, done: TransferDone) -> None:
        """Its pages are in (the prefix becomes cacheable, its chunks are planned), or it rolls back."""
        seq.arriving = None
        if done.ok:
            self.pair_ok += 1
            self.pair_pages += pages
        else:
            self.pair_failed += 1
            self._prefixes.pop(seq.peer, None)  # both ends join a new group next time
        if seq.doomed:  # answered already (aborted, timed out): now its pages may go
            self._leave(seq, publish=False)
            return
        if not done.ok:
            self._leave(seq, publish=False)
            self._finished.append(self._pair_error(seq, f"the transfer from the prefill instance failed: "
                                                        f"{done.error or 'no reason given'}"))
            return
        if self.limits.hybrid:  # the received prefix becomes a device prefix, its checkpoint kept on the device
            self._ops.extend(self.coord.publish(seq.req_id, seq.all_ids(), seq.kv_len, checkpoint=True).ops)

    def _expire_arriving(self) -> None:
        """Past --pd-timeout the client gets its error; the pages wait for the rank's word on the receive."""
        now = time.monotonic()
        for seq, _ in self._arriving.values():
            if not seq.doomed and now > seq.arrive_by:
                seq.doomed = True
                self._finished.append(self._pair_error(seq, f"the transfer from the prefill instance timed out "
                                                            f"after {self.pd_timeout_s:g} s"))

    @staticmethod
    def _pair_error(seq: Sequence, reason: str) -> TokenDelta:
        return TokenDelta(seq.req_id, [], None, None, "error", len(seq.prompt_ids), 0, None, reason)

    def _abort_arriving(self, seq: Sequence) -> bool:
        """An abort of an arriving sequence: answered now, its pages kept until the receive ended."""
        if seq.arriving is None:
            return False
        seq.doomed = True
        return True

    # -- prefill side

    def on_pair_send(self, msg: PdPairSend) -> None:
        """A decode peer asks for a held prefix: checked against the hold, then a PeerSend in the next plan."""
        held = self._peer_holds.get(msg.hold_id)
        if held is None or msg.transfer_id in self._sending or self.sending_hold(msg.hold_id):
            self.pd_malformed += 1  # unknown or expired hold, or one sent already: the receive times out
            return
        hold = held[0]
        src = list(hold.pages[msg.first : msg.first + len(msg.dst_pages)])
        hybrid = self.limits.hybrid
        if (not src or len(src) != len(msg.dst_pages) or msg.first + len(src) != len(hold.pages) or msg.transfer_id < 0
                or (msg.dst_slot is not None) != hybrid or (hybrid and (hold.checkpoint is None or msg.dst_slot < 0))
                or any(p < 0 for p in msg.dst_pages)):
            self.pd_malformed += 1
            return
        slot = hold.checkpoint.slot if hybrid else None
        self._sending[msg.transfer_id] = (msg.hold_id, len(src))
        self._ops.append(PeerSend(msg.transfer_id, msg.address, msg.prefix, src, list(msg.dst_pages), slot,
                                  msg.dst_slot))

    def sending_hold(self, hold_id: int) -> bool:
        """A send from this hold is out: it outlives the hold timeout until the rank reports the end."""
        return any(hold_id == h for h, _ in self._sending.values())

    # -- both

    def on_transfers(self, transfers: list[TransferDone]) -> None:
        """Pair transfers the ranks reported ended (every result carries them, a failed step's too)."""
        for done in transfers:
            arriving = self._arriving.pop(done.transfer_id, None)
            if arriving is not None:
                self._arrived(*arriving, done)
                continue
            sending = self._sending.pop(done.transfer_id, None)
            if sending is None:
                self.pd_malformed += 1
                continue
            hold_id, pages = sending
            if done.ok:
                self.pair_ok += 1
                self.pair_pages += pages
            else:
                self.pair_failed += 1
            self.release_peer_hold(hold_id)

    def awaiting_transfers(self) -> bool:
        return bool(self._arriving or self._sending)

    def pair_poll_in(self) -> float | None:
        """Seconds until a copies-only plan should ask the ranks about transfers (None: nothing to ask)."""
        if not self.awaiting_transfers():
            return None
        return max(0.0, self._poll_at - time.monotonic())

    def _pair_poll_due(self) -> bool:
        """A plan with nothing to run is still sent now and then while transfers are out."""
        return self.awaiting_transfers() and time.monotonic() >= self._poll_at

    def _pair_plan_built(self) -> None:
        """Any plan asks the ranks about transfers: the next copies-only one is due PAIR_POLL_S after it."""
        self._poll_at = time.monotonic() + PAIR_POLL_S
