"""The transfer handshake as the broker core sees it: Offer, Expect, Ready, Done, Abort
and a front end's Cancel, each applied to every lane it concerns (`broker.lanes`).

A mixin of `broker.core.Broker`, which holds the tables and does the routing and credit
these call (`_route`, `_abort`, `_drop`, `_new`); the invariants are listed there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from protocols.heads import Lane
from protocols.messages import (
    Abort,
    Cancel,
    Cancelled,
    Done,
    Expect,
    Go,
    Layout,
    Message,
    Offer,
    Ready,
    Register,
    Release,
)

from .lanes import claim_share, lane_share, plan, wire_heads
from .ledger import BrokerConfig, Effect, Note, Peer, Send, rank_in, remember
from .transfers import (
    HOLDS_CREDIT,
    ProtocolViolation,
    Transfer,
    TransferKey,
    TransferState,
    check_transition,
    cancellable,
    lane_id,
)

if TYPE_CHECKING:
    from collections import OrderedDict

    from .latency import Histogram

S = TransferState
MAX_PLANS = 256  # lanes kept per pair of registrations (`Handshake._lanes`)


class Handshake:
    """The message handlers of `broker.core.Broker` (see the module docstring)."""

    if TYPE_CHECKING:  # the tables and steps `Broker` provides
        config: BrokerConfig
        peers: dict[str, Peer]
        transfers: dict[TransferKey, Transfer]
        by_tid: dict[str, set[TransferKey]]
        plans: dict[tuple[int, int], tuple[Register, Register, list[Lane]]]
        aborted: OrderedDict[TransferKey, tuple[float, str]]
        delivered: OrderedDict[TransferKey, tuple[float, str]]
        lost: OrderedDict[str, tuple[float, str]]
        latency: dict[str, Histogram]
        counters: dict[str, int]

        def _new(self, now: float, tid: str, lane: Lane, decode_tp: int, state: TransferState) -> Transfer: ...
        def _room_for(self, n: int) -> None: ...
        def _one_size(self, role: str, compat_hash: str) -> Register | None: ...
        def _route(self, now: float, t: Transfer, out: list[Effect]) -> None: ...
        def _unroute(self, t: Transfer, out: list[Effect]) -> None: ...
        def _claim_room(self, t: Transfer, d: Peer, nbytes: int, out: list[Effect]) -> None: ...
        def _in_place_now(self, t: Transfer, d: Peer, out: list[Effect]) -> None: ...
        def _release_room(self, t: Transfer, out: list[Effect]) -> None: ...
        def _drop(self, t: Transfer, out: list[Effect]) -> None: ...
        def _abort(self, now: float, t: Transfer, reason: str, out: list[Effect], skip: str | None = None) -> None: ...
        def _await_named_prefill(self, now: float, t: Transfer) -> None: ...
        def _waiting_for(self, t: Transfer) -> str: ...

    def _offer(self, now: float, peer: Peer, msg: Offer, out: list[Effect]) -> None:
        if peer.role != "prefill":
            raise ProtocolViolation(Offer, None, msg.transfer_id, "only a prefill peer may offer")
        tid = msg.transfer_id
        if self._ended_before_planning(now, peer, tid, out, offer=True):
            return
        d_reg = self._decode_side(tid, peer, msg.decode)
        mine = self._plan(peer, peer.reg, d_reg, tid, out)
        if mine is None:
            return
        if not mine:  # a replica that another rank sends: nothing to move from here
            out.append(Send(peer.identity, Release(transfer_id=tid)))
            return
        work: list[tuple[Lane, TransferKey, int, Layout]] = []
        for lane in mine:  # checked before anything changes: a refused Offer changes nothing
            nbytes, layout = lane_share(msg.nbytes, msg.layout, lane, peer.reg)
            key = (tid, lane_id(lane.source, lane.rank))
            t = self.transfers.get(key)
            if t is not None and t.prefill == peer.peer_id and (t.nbytes, t.layout, t.decode_hint, t.prompt) == (
                nbytes, layout, msg.decode, msg.prompt
            ):
                self.counters["repeated"] += 1
                continue  # the same Offer again (a client re-sending after a reconnect): nothing moves
            if t is not None:
                check_transition(t.state, Offer, peer.role, tid)
            work.append((lane, key, nbytes, layout))
        if not work:
            return
        ended = {key: self._ended(now, key) for _, key, _, _ in work if key not in self.transfers}
        if len(ended) == len(mine) and self._answer_ended(now, peer, list(ended), out, offer=True,
                                                          endings=list(ended.values())):
            return
        self._replan_claims(now, peer.reg, d_reg, tid, out)
        self._room_for(len(ended))
        offered: list[Transfer] = []
        for lane, key, nbytes, layout in work:
            t = self.transfers.get(key)
            if t is None:
                if ended[key]:
                    continue  # this lane ended already; the others go on
                t = self._new(now, tid, lane, d_reg.world_size, S.UNROUTED)
            t.prefill, t.absent_until, t.offered_at = peer.peer_id, None, now
            t.nbytes, t.layout, t.decode_hint, t.compat_hash = nbytes, layout, msg.decode, peer.reg.compat_hash
            t.prompt, t.heads = msg.prompt, wire_heads(lane, peer.reg, d_reg)
            peer.transfers.add(key)
            self.counters["offered"] += 1
            if self.config.note_transfers:
                out.append(Note("transfer.offered", {"transfer_id": tid, "nbytes": nbytes, "peer": peer.peer_id}))
            offered.append(t)
        # Routed once every lane is in the table: a lane aborted as it routes (a pool too
        # small) leaves P its staging while P still feeds another lane (`_abort`).
        for t in offered:
            if self.transfers.get(t.key) is not t:
                continue  # ended with a lane into the same decode rank
            self._route(now, t, out)
            if self.config.note_steps and t.state is S.UNROUTED and t.key in self.transfers:
                out.append(Note("transfer.unrouted", {"transfer_id": tid, "waiting_for": self._waiting_for(t)},
                                level="debug"))

    def _replan_claims(self, now: float, p: Register, d: Register, tid: str, out: list[Effect]) -> None:
        """Move claims planned before any Offer onto the lanes that the offering instance
        `p` plans into `d`. Claims naming no prefill instance, while prefill instances of
        several TP sizes are registered, are planned against a guess (`_prefill_side`); a
        claimed lane outside the real plan would hold its room until its lease ended, and
        the rank's real lanes would be routed without the claim."""
        planned = {lane_id(lane.source, lane.rank): lane for lane in self._lanes(p, d)}
        stale: dict[tuple[str, int], list[Transfer]] = {}
        for key in sorted(self.by_tid.get(tid, ())):
            t = self.transfers[key]
            if t.state is S.EXPECTED and t.prefill is None and key[1] not in planned and t.expected_by:
                stale.setdefault((t.expected_by, t.rank), []).append(t)
        for (claimant_id, rank), lanes in stale.items():
            claim = Expect(transfer_id=tid, prefill=lanes[0].expected_from, nbytes=sum(t.nbytes for t in lanes),
                           into_blocks=any(t.in_place_by for t in lanes))
            for t in lanes:
                self._drop(t, out)  # its room returns; the claimant hears nothing: its claim goes on
            claimant = self.peers.get(claimant_id)
            if claimant is None:
                continue
            for lid, lane in planned.items():
                if lane.rank == rank:
                    in_place = claim.into_blocks and wire_heads(lane, p, claimant.reg) == (0, 0)
                    self._expect_lane(now, claimant, claim, lane, (tid, lid), in_place, out)

    def _plan(self, peer: Peer, p: Register, d: Register, tid: str, out: list[Effect]) -> list[Lane] | None:
        """`peer`'s lanes between instances `p` and `d`; None, with an Abort to it, when
        those cannot pair (`broker.lanes`)."""
        try:
            side = "source" if peer.role == "prefill" else "rank"
            return [lane for lane in self._lanes(p, d) if getattr(lane, side) == peer.reg.rank]
        except ValueError as exc:
            out.append(Note("transfer.refused", {"transfer_id": tid, "peer": peer.peer_id, "reason": str(exc)}))
            if not (peer.role == "prefill" and self._feeds(peer.peer_id, tid)):  # else its live lanes' end tells it
                out.append(Send(peer.identity, Abort(transfer_id=tid, reason=str(exc)[:2000])))
            return None

    def _lanes(self, p: Register, d: Register) -> list[Lane]:
        """`plan(p, d)`, worked out once for a pair of registrations (a peer that registers
        again brings a new one); raises as `plan` does."""
        kept = self.plans.get((id(p), id(d)))
        if kept is not None and kept[0] is p and kept[1] is d:
            return kept[2]
        lanes = plan(p, d)
        if len(self.plans) >= MAX_PLANS:  # registrations come and go: never more than a few live
            self.plans.clear()
        self.plans[(id(p), id(d))] = (p, d, lanes)
        return lanes

    def _instance(self, name: str, role: str) -> Register | None:
        """The registration of a live peer of instance `name` in `role`, if any."""
        p = self.peers.get(f"{name}:0") or next((q for q in self.peers.values() if q.reg.instance_id == name), None)
        return p.reg if p is not None and p.role == role else None

    def _decode_side(self, tid: str, p: Peer, hint: str) -> Register:
        """The decode instance an Offer's lanes are planned for (see broker/lanes.py)."""
        named = self._instance(hint, "decode") if hint else None
        if named is not None:
            return named
        for key in sorted(self.by_tid.get(tid, ())):
            pid = self.transfers[key].expected_by or self.transfers[key].decode
            if pid in self.peers:
                return self.peers[pid].reg
        return self._one_size("decode", p.reg.compat_hash) or p.reg

    def _prefill_side(self, tid: str, d: Peer, named: str) -> Register:
        """The prefill instance an Expect's lanes are planned for (see broker/lanes.py)."""
        reg = self._instance(named, "prefill") if named else None
        if reg is not None:
            return reg
        for key in sorted(self.by_tid.get(tid, ())):
            pid = self.transfers[key].prefill
            if pid in self.peers:
                return self.peers[pid].reg
        return self._one_size("prefill", d.reg.compat_hash) or d.reg

    def _expect(self, now: float, peer: Peer, msg: Expect, out: list[Effect]) -> None:
        if peer.role != "decode":
            raise ProtocolViolation(Expect, None, msg.transfer_id, "only a decode peer may expect a transfer")
        tid = msg.transfer_id
        if self._ended_before_planning(now, peer, tid, out, offer=False):
            return
        p_reg = self._prefill_side(tid, peer, msg.prefill)
        mine = self._plan(peer, p_reg, peer.reg, tid, out)
        if not mine:
            return
        keys = [(tid, lane_id(lane.source, lane.rank)) for lane in mine]
        for key in keys:  # checked before anything changes: a refused Expect changes nothing
            if key in self.transfers:
                self._check_claim(self.transfers[key], peer)
        if not any(key in self.transfers for key in keys):
            lost = next((kept for lane in mine if msg.prefill and (kept := self.lost.get(f"{msg.prefill}:{lane.source}"))),
                        None)  # until it registers again
            if self._answer_ended(now, peer, keys, out, offer=False, lost=lost):
                return
        self._room_for(sum(key not in self.transfers for key in keys))
        for lane, key in zip(mine, keys):
            # Into its blocks only as a lane of every head of its source rank: a lane of
            # some heads is received into the pool and joined there.
            in_place = msg.into_blocks and wire_heads(lane, p_reg, peer.reg) == (0, 0)
            self._expect_lane(now, peer, msg, lane, key, in_place, out)

    def _check_claim(self, t: Transfer, peer: Peer) -> None:
        """Raise what `_expect_lane` would refuse for `peer`'s claim on `t`."""
        check_transition(t.state, Expect, peer.role, t.transfer_id)
        if peer.peer_id in (t.expected_by, t.waiting_claim) or (t.decode == peer.peer_id and t.expected_by is None):
            return
        holder = self.peers.get(t.decode or "")
        if t.state in HOLDS_CREDIT and t.waiting_claim is not None and not (
            t.state is S.PREPARING and t.expected_by is None and holder is not None and holder.reg.claims_only
        ):
            raise ProtocolViolation(Expect, t.state, t.transfer_id,
                                    f"it is held by {t.decode}, and {t.waiting_claim} waits for it")

    def _expect_lane(self, now: float, peer: Peer, msg: Expect, lane: Lane, key: TransferKey, in_place: bool,
                     out: list[Effect]) -> None:
        t = self.transfers.get(key)
        if t is None:
            if self._ended(now, key):
                return  # this lane ended already; the others go on
            t = self._new(now, msg.transfer_id, lane, peer.reg.world_size, S.EXPECTED)
            t.expected_by, t.expected_from = peer.peer_id, msg.prefill
            t.in_place_by = peer.peer_id if in_place else None
            self._await_named_prefill(now, t)
            peer.transfers.add(key)
            self._claim_room(t, peer, claim_share(msg.nbytes, lane, peer.reg), out)
            return
        if t.expected_by == peer.peer_id or t.waiting_claim == peer.peer_id:
            self.counters["repeated"] += 1
            return  # the same claim again (re-sent after a reconnect): nothing moves
        if t.decode == peer.peer_id and t.expected_by is None:
            t.expected_by = peer.peer_id  # routed here on the Offer's word before this Expect
            # It needs none of the room it waits for or holds; but past its Ready, D's
            # receive was posted into that room.
            if in_place and t.state is not S.SENDING:
                t.in_place_by = peer.peer_id
                self._in_place_now(t, peer, out)
            return
        # A claim from another peer than the holder: the proxy sent the request there
        # (again, after the holder failed it; or instead of the instance it named).
        holder = self.peers.get(t.decode or "")
        if t.state in HOLDS_CREDIT:
            if not (t.state is S.PREPARING and t.expected_by is None and holder is not None and holder.reg.claims_only):
                # Granted to a peer that claimed it or takes anything: its bytes may be
                # moving. Wait behind it; its loss hands the transfer over (`_decode_lost`).
                t.waiting_claim = peer.peer_id
                peer.transfers.add(key)
                self.counters["claims_waited"] += 1
                out.append(Note("transfer.claim_waits", {"transfer_id": t.transfer_id, "peer": peer.peer_id,
                                                         "holder": t.decode}))
                return
            # Granted on the Offer's word to a peer that takes only its own and never
            # claimed it: it holds no request for it and only parks the Prepare.
            previous: Peer | None = holder
        else:  # not granted yet: the latest claim takes it, and the one before is told
            previous = self.peers.get(t.expected_by or "")
        if previous is not None:
            out.append(Send(previous.identity, Abort(transfer_id=t.transfer_id, reason=f"{peer.peer_id} claims it now")))
            self.counters["claims_moved"] += 1
            out.append(Note("transfer.claimed_away", {"transfer_id": t.transfer_id, "peer": peer.peer_id,
                                                      "holder": previous.peer_id}))
            if t.expected_by == previous.peer_id:
                previous.transfers.discard(key)
        t.expected_by = peer.peer_id
        t.in_place_by = peer.peer_id if in_place else None
        peer.transfers.add(key)
        if t.state is S.EXPECTED:
            t.expected_from = msg.prefill or t.expected_from
            self._await_named_prefill(now, t)
            self._release_room(t, out)  # the previous claim's room, if any: the new claimant's instead
            self._claim_room(t, peer, claim_share(msg.nbytes, lane, peer.reg), out)
            return
        self._unroute(t, out)
        self._route(now, t, out)

    def _lane_keys(self, peer: Peer, msg: Ready | Done | Abort) -> list[TransferKey]:
        """The lanes a message from `peer` is about: an Abort, every lane it is part of; a
        Ready or a Done, the lane from the source it names (none named: its only lane)."""
        tid, rank = msg.transfer_id, peer.reg.rank
        if isinstance(msg, Abort):
            mine = [k for k in sorted(self.by_tid.get(tid, ())) if peer.peer_id in self._parties(self.transfers[k])]
            return mine or [(tid, rank)]
        if msg.source:
            src = self.peers.get(msg.source)
            source_rank = src.reg.rank if src is not None else rank_in(msg.source, type(msg), tid)
            return [(tid, lane_id(source_rank, rank))]
        if (tid, rank) not in self.transfers:  # sorted only here: a Ready or a Done of one lane never needs it
            mine = [k for k in sorted(self.by_tid.get(tid, ())) if self.transfers[k].decode == peer.peer_id]
            if len(mine) == 1:
                return mine
        return [(tid, rank)]

    @staticmethod
    def _parties(t: Transfer) -> tuple[str | None, ...]:
        return (t.prefill, t.decode, t.expected_by, t.waiting_claim)

    def _advance(self, now: float, peer: Peer, msg: Ready | Done | Abort, out: list[Effect]) -> None:
        for key in self._lane_keys(peer, msg):
            self._advance_lane(now, peer, msg, key, out)

    def _advance_lane(self, now: float, peer: Peer, msg: Ready | Done | Abort, key: TransferKey,
                      out: list[Effect]) -> None:
        t = self.transfers.get(key)
        if t is None:
            if isinstance(msg, Abort):
                return  # Aborts cross in flight; one for a finished transfer is harmless.
            raise ProtocolViolation(type(msg), None, msg.transfer_id, "no such transfer")
        check_transition(t.state, type(msg), peer.role, msg.transfer_id)
        if isinstance(msg, Abort) and peer.peer_id == t.waiting_claim:
            t.waiting_claim = None  # its request gave up: the claim is withdrawn, the transfer goes on
            peer.transfers.discard(key)
            return
        if peer.peer_id not in (t.prefill, t.decode, t.expected_by):
            raise ProtocolViolation(type(msg), t.state, msg.transfer_id, f"{peer.peer_id} is not part of it")
        if isinstance(msg, Abort):
            self._abort(now, t, msg.reason or f"aborted by {peer.peer_id}", out, skip=peer.peer_id)
        elif t.decode != peer.peer_id:
            raise ProtocolViolation(type(msg), t.state, msg.transfer_id, f"it is routed to {t.decode}")
        elif isinstance(msg, Ready):
            if msg.offset + msg.nbytes > t.nbytes:
                raise ProtocolViolation(
                    Ready, t.state, t.transfer_id, f"range {msg.offset}+{msg.nbytes} exceeds the {t.nbytes} bytes offered"
                )
            t.state, t.go_at = S.SENDING, now
            d = self.peers[t.decode]
            assert t.prefill is not None
            out.append(
                Send(
                    self.peers[t.prefill].identity,
                    Go(
                        transfer_id=t.transfer_id,
                        decode=d.peer_id,
                        endpoints=d.reg.endpoints,
                        offset=msg.offset,
                        nbytes=msg.nbytes,
                        attempt=t.attempt,
                        comm=msg.comm,
                        seq=msg.seq,
                        head_start=t.heads[0],
                        head_stop=t.heads[1],
                    ),
                )
            )
            if self.config.note_steps:
                out.append(Note("transfer.go", {"transfer_id": t.transfer_id, "prefill": t.prefill,
                                                "decode": d.peer_id}, level="debug"))
        else:
            assert t.prefill is not None
            p = self.peers[t.prefill]
            nbytes = t.nbytes
            self._drop(t, out)
            remember(self.delivered, t.key, now + self.config.transfer_lease_s, f"it was delivered to {peer.peer_id}")
            claimant = self.peers.get(t.waiting_claim or "")
            if claimant is not None:
                out.append(Send(claimant.identity, Abort(transfer_id=t.transfer_id,
                                                         reason=f"it was delivered to {peer.peer_id}")))
            self.counters["completed"] += 1
            self.counters["bytes"] += msg.nbytes
            if t.offered_at is not None and t.go_at is not None:
                self.latency["handshake"].observe(t.go_at - t.offered_at)
                self.latency["data"].observe(now - t.go_at)
                self.latency["total"].observe(now - t.offered_at)
            if not self._feeds(p.peer_id, t.transfer_id):  # its staging serves no other lane
                out.append(Send(p.identity, Release(transfer_id=t.transfer_id)))
            if self.config.note_transfers:
                out.append(Note("transfer.done", {"transfer_id": t.transfer_id, "nbytes": nbytes,
                                                  "attempt": t.attempt}))

    def _feeds(self, prefill: str, tid: str) -> bool:
        """Whether prefill peer `prefill` still has a lane of transfer `tid`."""
        return any(self.transfers[k].prefill == prefill for k in self.by_tid.get(tid, ()))

    def _ended(self, now: float, key: TransferKey) -> tuple[bool, str] | None:
        """(delivered, why) for a lane that ended within its lease, else None."""
        for memory, delivered in ((self.delivered, True), (self.aborted, False)):
            for k in (key, (key[0], -1)):  # (tid, -1): a Cancel ended every lane
                kept = memory.get(k)
                if kept is not None and kept[0] > now:
                    return delivered, kept[1]
        return None

    def _ended_before_planning(self, now: float, peer: Peer, tid: str, out: list[Effect], *, offer: bool) -> bool:
        """Answer a late Offer or Expect of a transfer that ended as an equal-TP lane of
        this rank, before its lanes are planned again: the peers may have registered with
        other TP sizes since, and the answer is that ending, not a refusal of the new pairing."""
        if self.by_tid.get(tid):
            return False
        key = (tid, peer.reg.rank)
        return self._ended(now, key) is not None and self._answer_ended(now, peer, [key], out, offer=offer)

    def _answer_ended(
        self, now: float, peer: Peer, keys: list[TransferKey], out: list[Effect], *, offer: bool,
        lost: tuple[float, str] | None = None, endings: list[tuple[bool, str] | None] | None = None,
    ) -> bool:
        """Answer an Offer (`offer`) or an Expect whose every lane ended within its lease,
        or whose named prefill peer is `lost`, with that ending; True if it did. Nothing will
        come for it: say so now, not at the peer's deadline, and make no transfer for it.
        `endings`: each key's `_ended`, where the caller has them already."""
        tid = keys[0][0]
        if endings is None:
            endings = [self._ended(now, key) for key in keys]
        if all(endings):
            delivered, why = next((e for e in endings if e and not e[0]), endings[0])  # type: ignore[misc]
        elif lost is not None and lost[0] > now:
            delivered, why = False, lost[1]
        else:
            return False
        out.append(Note("transfer.ended_before", {"transfer_id": tid, "peer": peer.peer_id, "reason": why}))
        if offer and self._feeds(peer.peer_id, tid):
            return True  # its lanes still alive need its staged copy: their own end tells it
        reply: Message
        if delivered:
            reply = Release(transfer_id=tid) if offer else Abort(transfer_id=tid, reason=why)
        else:
            reply = Abort(transfer_id=tid, reason=why[:2000])
        out.append(Send(peer.identity, reply))
        return True

    def _cancel(self, now: float, identity: bytes, msg: Cancel, out: list[Effect]) -> None:
        """End what nothing moves for yet of every lane of transfer `msg.transfer_id`; the
        ending is remembered, so a lane's later Offer or Expect is answered at once. The
        lanes into one decode rank end together or not at all: that rank needs them all."""
        tid = msg.transfer_id
        reason = f"the request was cancelled ({msg.reason or 'its front end gave up on it'})"
        ended = left = 0
        groups: dict[tuple[int, int], list[Transfer]] = {}
        for key in sorted(self.by_tid.get(tid, ())):
            t = self.transfers[key]
            groups.setdefault((t.rank, t.decode_tp), []).append(t)
        if not any((tid, -1) in memory for memory in (self.delivered, self.aborted)):
            remember(self.aborted, (tid, -1), now + self.config.transfer_lease_s, reason)
        for group in groups.values():
            if all(cancellable(t.state, t.expected_by is not None) for t in group):
                self._abort(now, group[0], reason, out)
                ended += len(group)
            else:
                left += len(group)
        self.counters["cancelled"] += ended
        out.append(Send(identity, Cancelled(transfer_id=tid, ended=ended, left=left)))
        out.append(Note("transfer.cancelled", {"transfer_id": tid, "ended": ended, "left": left, "reason": reason}))
