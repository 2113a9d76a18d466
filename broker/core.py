"""The broker's decisions, as pure code over messages and an injected clock.

No sockets, no logging, no `time.time()`: `Broker.handle(now, identity, msg)` and
`Broker.tick(now)` return the messages to send and notes for the log. The daemon in
`broker/daemon.py` is a thin shell that feeds it frames and timer ticks. The handshake's
handlers are in `broker/handshake.py`, the records in `broker/ledger.py`.

A transfer is one *lane* of a request: a (prefill rank, decode rank) pair and the KV
heads on it (`broker/lanes.py`); with equal TP sizes, rank r to rank r, all its heads.

Invariants this module keeps (each one has a test):

- Credits are conserved: for every decode pool, `reserved` is the sum of the credit held
  by its lanes in PREPARING or SENDING and by the claims (EXPECTED) it holds room for,
  and 0 <= reserved <= capacity, after any sequence of messages, ticks and evictions.
- Room is reserved at the claim: an Expect that says how many bytes its request will
  take reserves that room in the claimant's pool (or queues for it, in claim order,
  with the Offers waiting there), so the Offer finds it held and D prepares at once;
  a claim that moves, ends or is lost gives it back. The Offer's own size rules: a
  claim's room of another size is given back and reserved again.
- A prefill rank is released once its last lane of a transfer ended; the lanes into one
  decode rank end together (one that fails ends the others: that rank needs them all).
- Every wait has a deadline: a transfer lives at most `transfer_lease_s`; a credit wait
  at most `credit_timeout_s`; a peer at most `peer_lease_s` past its last heartbeat; an
  Expect naming a prefill instance that is not registered at most `peer_lease_s` until
  that instance registers.
- A dead peer is evicted and holds nothing afterwards: its pool is dropped, transfers it
  was to receive are re-routed to another compatible decode peer (the staged copy on P is
  sent again, the prefill is not re-run) until `max_attempts`, and transfers it was to
  send are aborted on the decode side.
- A message that comes after its transfer ended, within the last `transfer_lease_s`, is
  answered with that ending at once and makes no new transfer: an Expect gets the Abort
  (also when the prefill peer it names was lost), so D learns it from the broker, not from
  its own load deadline; an Offer sent again (its answer went to a socket that had gone)
  gets the Abort or the Release, so P frees the copy and D's pool holds no phantom.
- A transfer goes only where its request is: to the decode peer that expects it, or the
  one its Offer names; unclaimed, to a peer that takes any transfer, or to the only
  candidate. Between several peers that take only their own (`Register.claims_only`,
  vLLM instances) it waits for the Expect instead of guessing; for a named decode
  instance that is not registered, it waits at most `peer_lease_s`. An Expect takes a
  transfer from such a peer that was granted it on the Offer's word, never claimed it
  and has not answered Ready. Another peer's Expect means the proxy sent the request
  there (again): until the transfer is granted, that claim takes it and the peer that
  claimed it before is told; once granted, the claim waits behind the holder (one at a
  time), and gets the transfer if the holder is lost, the transfer's ending otherwise.
- A front end's Cancel (it gave up on the request: the client left, no decode instance
  took it) ends each rank's transfer that nothing moves for yet (`cancellable`), with an
  Abort to its peers, and is answered like an ending for a rank that has none yet; a
  transfer already moving, or delivered, goes on as if no Cancel had come.
- A bad message gets an `Error` reply and changes nothing.
- P and D are paired only when their compatibility hashes match.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any, get_args

from protocols.errors import RemoteProtocolError
from protocols.heads import Lane
from protocols.messages import (
    Abort,
    Cancel,
    Done,
    Error,
    Expect,
    Goodbye,
    Heartbeat,
    Id,
    Message,
    Offer,
    PeerInfo,
    PoolInfo,
    Prepare,
    Ready,
    Register,
    Registered,
    Relay,
    Status,
    StatusRequest,
    TransferInfo,
)

from .handshake import Handshake
from .lanes import equal_tp_refusal, one_size, pairing_refusal
from .latency import PHASES, Histogram
from .ledger import (
    BrokerConfig,
    Busy,
    Effect,
    Note,
    NotRegistered,
    Peer,
    PeerRefused,
    Pool,
    Send,
    Unexpected,
    UnknownPeer,
    compat_diff,
    keep_until,
    peer_id_of,
    remember,
)
from .transfers import Transfer, TransferKey, TransferState

__all__ = ["Broker", "BrokerConfig", "Effect", "Note", "Send"]

S = TransferState
_MAX_ID: int = get_args(Id)[1].max_length  # peer ids travel in Id fields (Registered, Prepare.source, Go.decode)


class Broker(Handshake):
    def __init__(self, config: BrokerConfig | None = None) -> None:
        self.config = config or BrokerConfig()
        self.peers: dict[str, Peer] = {}
        self.by_identity: dict[bytes, str] = {}
        self.transfers: dict[TransferKey, Transfer] = {}
        self.by_tid: dict[str, set[TransferKey]] = {}  # every lane of a transfer id
        # The lanes between two registrations, by their ids (`Handshake._lanes`).
        self.plans: dict[tuple[int, int], tuple[Register, Register, list[Lane]]] = {}
        # What the Offers read from the set of live peers (`_candidates`, `_one_size`),
        # worked out once while that set stays as it is: cleared as a peer joins or leaves.
        self.views: dict[tuple[object, ...], Any] = {}
        # Why a transfer was aborted, where one was delivered, and why a prefill peer was
        # lost, each until `transfer_lease_s` after: a message behind them is answered at once.
        self.aborted: OrderedDict[TransferKey, tuple[float, str]] = OrderedDict()
        self.delivered: OrderedDict[TransferKey, tuple[float, str]] = OrderedDict()
        self.lost: OrderedDict[str, tuple[float, str]] = OrderedDict()
        self.latency: dict[str, Histogram] = {phase: Histogram() for phase in PHASES}
        # What a registered peer may send, by message type (`_dispatch`).
        self._handlers: dict[type, Callable[[float, Peer, Any, list[Effect]], None]] = {
            Heartbeat: self._heartbeat, Goodbye: self._goodbye, Relay: self._relay, Offer: self._offer,
            Expect: self._expect, Ready: self._advance, Done: self._advance, Abort: self._advance,
        }
        self.counters: dict[str, int] = {
            k: 0
            for k in ("offered", "completed", "aborted", "retried", "repeated", "evicted", "bytes", "errors", "bad_frames",
                      "claims_moved", "claims_waited", "stalls", "cancelled", "internal_errors")
        }

    # -- entry points -------------------------------------------------------------

    def handle(self, now: float, identity: bytes, msg: Message) -> list[Effect]:
        """Apply one message from the peer behind `identity`; return what to send and log."""
        out: list[Effect] = []
        try:
            if isinstance(msg, Register):
                self._register(now, identity, msg, out)
            elif isinstance(msg, StatusRequest):
                out.append(Send(identity, self.status(now)))
            elif isinstance(msg, Cancel):  # from a front end, which does not register
                self._cancel(now, identity, msg, out)
            else:
                peer = self._peer_for(identity, msg)
                self._dispatch(now, peer, msg, out)
                # Renewed only once accepted: a refused message changes nothing.
                peer.lease_until = now + self.config.peer_lease_s
        except RemoteProtocolError as exc:
            self.counters["errors"] += 1
            tid = getattr(msg, "transfer_id", "")
            out.append(Send(identity, Error(code=exc.code, detail=str(exc)[:2000], transfer_id=tid)))
            out.append(Note("message.refused", {"code": exc.code, "detail": str(exc), "transfer_id": tid}))
        return out

    def tick(self, now: float) -> list[Effect]:
        """Expire peer leases, transfer leases and credit waits that ended before `now`."""
        out: list[Effect] = []
        for peer in [p for p in self.peers.values() if p.lease_until <= now]:
            self._evict(now, peer, "no heartbeat within its lease", out)
            self._orphan_expects(now, peer, "no heartbeat within its lease", out)
        for t in list(self.transfers.values()):
            if t.key not in self.transfers:
                continue
            if t.lease_until <= now and t.state is S.UNROUTED and t.oversize_for:
                self._abort(now, t, f"it needs {t.nbytes} bytes, more than the receive pool of {t.oversize_for} holds, "
                            f"and {t.oversize_for} did not claim it within {self.config.transfer_lease_s:g} s to take it "
                            "straight into its blocks; raise the decode pool size", out)
            elif t.lease_until <= now:
                self._abort(now, t, f"its lease of {self.config.transfer_lease_s:g} s ended in state {t.state.value}", out)
            elif t.absent_until is not None and t.absent_until <= now:
                self._absent(now, t, out)
            elif t.state is S.WAITING_CREDIT and t.credit_deadline is not None and t.credit_deadline <= now:
                self._abort(
                    now,
                    t,
                    f"decode pool of {t.decode} had no room for {t.nbytes} bytes within "
                    f"{self.config.credit_timeout_s:g} s; enlarge its pool or lower the load",
                    out,
                )
        for memory in (self.aborted, self.delivered, self.lost):
            while memory and next(iter(memory.values()))[0] <= now:
                memory.popitem(last=False)
        return out

    def resume(self, now: float) -> None:
        """The broker itself did not run for a while (a stopped process, a starved host)
        and runs again `now`. What its peers sent meanwhile waits in its socket's queue,
        and a live peer heartbeats at least every `heartbeat_s`: so nothing ends before
        `now + heartbeat_s`. By then the broker has heard every peer still there, and a
        dead one goes then, not a whole lease later; counting the broker's own absence
        against its peers would evict every one and abort every transfer at once."""
        until = now + self.config.heartbeat_s
        self.counters["stalls"] += 1
        for p in self.peers.values():
            p.lease_until = max(p.lease_until, until)
        for t in self.transfers.values():
            t.lease_until = max(t.lease_until, until)
            if t.credit_deadline is not None:
                t.credit_deadline = max(t.credit_deadline, until)
            if t.absent_until is not None:
                t.absent_until = max(t.absent_until, until)
        keep_until(self.aborted, until)
        keep_until(self.delivered, until)
        keep_until(self.lost, until)

    def next_deadline(self) -> float | None:
        """The earliest time at which `tick` has something to do, for the shell's timer."""
        times = [p.lease_until for p in self.peers.values()]
        for t in self.transfers.values():
            times.append(t.lease_until)
            if t.state is S.WAITING_CREDIT and t.credit_deadline is not None:
                times.append(t.credit_deadline)
            if t.absent_until is not None:
                times.append(t.absent_until)
        return min(times, default=None)

    # -- peers ----------------------------------------------------------------------

    def _peer_for(self, identity: bytes, msg: Message) -> Peer:
        pid = self.by_identity.get(identity)
        if pid is None:
            raise NotRegistered(f"{type(msg).__name__} from a peer that has not registered; send Register first")
        return self.peers[pid]

    def _register(self, now: float, identity: bytes, reg: Register, out: list[Effect]) -> None:
        if reg.rank >= reg.world_size:
            raise PeerRefused(f"rank {reg.rank} is not below world_size {reg.world_size}; fix the worker's rank")
        if reg.role == "decode" and reg.pool_capacity <= 0:
            raise PeerRefused("a decode peer must register a receive pool; set pool_capacity (bytes) above 0")
        pid = peer_id_of(reg)
        if len(pid) > _MAX_ID:
            raise PeerRefused(
                f"peer id {pid[:40]}... is {len(pid)} characters, over the {_MAX_ID} that messages carry; "
                "use a shorter instance_id"
            )
        old = self.peers.get(pid)
        if old is None and len(self.peers) >= self.config.max_peers:
            raise PeerRefused(f"the broker already holds {self.config.max_peers} peers; raise --max-peers")
        self._check_compat(reg)
        if old is not None:
            if old.reg.incarnation == reg.incarnation:  # the same process reconnected: its Offers follow
                self._evict(now, old, "it registered again", out)
            else:  # a new process: the old one's requests will never be offered
                self._evict(now, old, "it restarted", out)
                self._orphan_expects(now, old, "it restarted", out)
        if identity in self.by_identity:
            self._evict(now, self.peers[self.by_identity[identity]], "its socket registered as another peer", out)
        pool = Pool(capacity=reg.pool_capacity, alignment=reg.pool_alignment) if reg.role == "decode" else None
        self.peers[pid] = Peer(pid, identity, reg, now + self.config.peer_lease_s, pool)
        self.views.clear()
        self.lost.pop(pid, None)
        self.by_identity[identity] = pid
        out.append(
            Send(identity, Registered(peer_id=pid, heartbeat_s=self.config.heartbeat_s, lease_s=self.config.peer_lease_s))
        )
        out.append(Note("peer.registered", {"peer": pid, "role": reg.role, "pool_capacity": reg.pool_capacity}))
        if reg.role == "decode":
            # Offers that found no decode peer may route now; routing one may abort the
            # lanes beside it (`_abort`), which then are no longer there to route.
            for t in [t for t in self.transfers.values() if t.state is S.UNROUTED]:
                if self.transfers.get(t.key) is t and t.state is S.UNROUTED:
                    self._route(now, t, out)

    def _check_compat(self, reg: Register) -> None:
        """Refuse a peer that no peer of the other role could ever pair with, or that
        disagrees with the other ranks of its own instance."""
        siblings = [p.reg for p in self.peers.values() if p.reg.instance_id == reg.instance_id and p.reg.rank != reg.rank]
        for s in siblings:
            if s.compat_hash != reg.compat_hash or s.world_size != reg.world_size or s.role != reg.role:
                raise PeerRefused(
                    f"rank {reg.rank} of instance {reg.instance_id} does not match rank {s.rank} "
                    f"({compat_diff(reg, s) if s.compat_hash != reg.compat_hash else 'role or world_size differs'})"
                )
        others = [p.reg for p in self.peers.values() if p.reg.role != reg.role]
        if others and not any(o.compat_hash == reg.compat_hash for o in others):
            o = others[0]
            raise PeerRefused(
                equal_tp_refusal(reg, o)
                or f"{reg.role} instance {reg.instance_id} is incompatible with {o.role} instance "
                f"{o.instance_id} ({compat_diff(reg, o)}); serve the same model, dtype and cache layout on both"
            )
        same = [o for o in others if o.compat_hash == reg.compat_hash]
        why = [pairing_refusal(*((reg, o) if reg.role == "prefill" else (o, reg))) for o in same]
        if same and all(why):
            raise PeerRefused(str(why[0]))

    def _evict(self, now: float, peer: Peer, why: str, out: list[Effect]) -> None:
        del self.peers[peer.peer_id]
        self.views.clear()
        if self.by_identity.get(peer.identity) == peer.peer_id:
            del self.by_identity[peer.identity]
        self.counters["evicted"] += 1
        out.append(Note("peer.evicted", {"peer": peer.peer_id, "role": peer.role, "reason": why}))
        for key in list(peer.transfers):
            t = self.transfers.get(key)
            if t is None:
                continue
            if t.waiting_claim == peer.peer_id:
                t.waiting_claim = None  # it only waited behind the holder
            elif peer.role == "prefill":
                self._abort(now, t, f"prefill peer {peer.peer_id} was lost ({why})", out)
            else:
                self._decode_lost(now, t, peer, why, out)
        peer.transfers.clear()
        if peer.role == "prefill":  # the Expects naming it: one lease for it to be back (`_absent`)
            for t in self._expects_naming(peer.peer_id):
                self._await_named_prefill(now, t)

    def _orphan_expects(self, now: float, peer: Peer, why: str, out: list[Effect]) -> None:
        """A lost prefill peer will offer nothing more: end the Expects that named it, and
        those that will name it (`_expect`) until it registers again.

        Not when the same process registers again (`_evict` alone): a prefill instance
        that only reconnected re-sends its Offers, and those complete the Expects. A new
        process under the same id (another `Register.incarnation`) is a loss.
        """
        if peer.role != "prefill":
            return
        reason = f"prefill peer {peer.peer_id} was lost ({why}) before it offered"
        remember(self.lost, peer.peer_id, now + self.config.transfer_lease_s, reason)
        for t in self._expects_naming(peer.peer_id):
            self._abort(now, t, reason, out)

    def _expects_naming(self, peer_id: str) -> list[Transfer]:
        """The transfers only expected so far whose Expect names prefill peer `peer_id`."""
        return [t for t in self.transfers.values()
                if t.state is S.EXPECTED and t.expected_from and f"{t.expected_from}:{t.source_rank}" == peer_id]

    def _absent(self, now: float, t: Transfer, out: list[Effect]) -> None:
        """The instance a transfer names (an Expect's prefill instance, an unrouted Offer's
        decode instance) had one peer lease to register, counted from when it was found
        missing. If it did, the transfer goes on as any other; if not, it ends now rather
        than at a deadline on the side that waits: after a broker restart, an instance that
        was down when the others registered again sends and claims nothing."""
        t.absent_until = None
        if t.state is S.EXPECTED:
            name, which = f"{t.expected_from}:{t.source_rank}", "prefill peer {} named by the request"
            if self._is_prefill(name):
                return
        elif t.state is S.UNROUTED and t.decode_hint:
            name, which = f"{t.decode_hint}:{t.rank}", "decode peer {} named by the Offer"
            if not self._hint_absent(t):
                return
        else:
            return
        self._abort(
            now, t,
            f"{which.format(name)} did not register within {self.config.peer_lease_s:g} s; "
            "check that the instance runs and points at this broker",
            out,
        )

    def _decode_lost(self, now: float, t: Transfer, peer: Peer, why: str, out: list[Effect]) -> None:
        if t.expected_by == peer.peer_id:
            t.expected_by = None
        if t.waiting_claim is not None:  # the request was sent again: the peer it went to takes over
            t.expected_by, t.waiting_claim = t.waiting_claim, None
        if t.state is S.EXPECTED or t.prefill is None:
            if t.expected_by is None:
                self._drop(t, out)
            return
        self._unroute(t, out)
        if t.attempt + 1 >= self.config.max_attempts:
            self._abort(now, t, f"decode peer {peer.peer_id} was lost ({why}) after {t.attempt + 1} attempts", out)
            return
        t.attempt += 1
        self.counters["retried"] += 1
        out.append(Note("transfer.retry", {"transfer_id": t.transfer_id, "lost": peer.peer_id, "attempt": t.attempt}))
        self._route(now, t, out)

    # -- dispatch -------------------------------------------------------------------

    def _dispatch(self, now: float, peer: Peer, msg: Message, out: list[Effect]) -> None:
        # By the message's type, which is exact (messages are final structs): a chain of
        # isinstance checks took about a microsecond of every message at the handshake rate.
        handler = self._handlers.get(type(msg))
        if handler is None:
            raise Unexpected(f"{type(msg).__name__} is a broker-to-peer message; peers may not send it")
        handler(now, peer, msg, out)

    def _heartbeat(self, now: float, peer: Peer, msg: Heartbeat, out: list[Effect]) -> None:
        if peer.pool is not None:
            peer.pool.reported_free = msg.pool_free
        out.append(Send(peer.identity, Heartbeat(seq=msg.seq)))

    def _goodbye(self, now: float, peer: Peer, msg: Goodbye, out: list[Effect]) -> None:
        self._evict(now, peer, "it said goodbye", out)
        self._orphan_expects(now, peer, "it said goodbye", out)

    def _relay(self, now: float, peer: Peer, msg: Relay, out: list[Effect]) -> None:
        target = self.peers.get(msg.to)
        if target is None:
            raise UnknownPeer(f"relay target {msg.to} is not a registered peer")
        out.append(Send(target.identity, Relay(to=msg.to, key=msg.key, payload=msg.payload, sender=peer.peer_id)))

    # -- routing and credit ---------------------------------------------------------

    def _new(self, now: float, tid: str, lane: Lane, decode_tp: int, state: TransferState) -> Transfer:
        t = Transfer(transfer_id=tid, rank=lane.rank, source_rank=lane.source, state=state,
                     lease_until=now + self.config.transfer_lease_s, decode_tp=decode_tp)
        self.transfers[t.key] = t
        self.by_tid.setdefault(tid, set()).add(t.key)
        return t

    def _room_for(self, n: int) -> None:
        if len(self.transfers) + n > self.config.max_transfers:
            raise Busy(f"the broker holds {self.config.max_transfers} transfers; retry later or raise --max-transfers")

    def _candidates(self, t: Transfer) -> list[Peer]:
        """The decode peers `t` may go to: its rank, of the TP size its lanes were planned
        for, compatible, and not tried for it yet."""
        key = ("candidates", t.rank, t.decode_tp, t.compat_hash)
        fit = self.views.get(key)
        if fit is None:
            fit = self.views[key] = [
                p
                for p in self.peers.values()
                if p.pool is not None
                and p.reg.rank == t.rank
                and p.reg.world_size == t.decode_tp
                and p.reg.compat_hash == t.compat_hash
            ]
        return [p for p in fit if p.peer_id not in t.tried] if t.tried else list(fit)

    def _one_size(self, role: str, compat_hash: str) -> Register | None:
        """A registration standing for every live `role` peer of `compat_hash`, when they
        share one TP size (`one_size`)."""
        key = ("one_size", role, compat_hash)
        if key not in self.views:
            self.views[key] = one_size(q.reg for q in self.peers.values()
                                       if q.role == role and q.reg.compat_hash == compat_hash)
        return self.views[key]

    def _unclaimed_candidates(self, t: Transfer) -> list[Peer]:
        """Where a transfer nobody claimed may go: any compatible decode peer that takes
        unclaimed transfers, or the one decode peer that could take it at all. Between
        several that take only their own (`Register.claims_only`: vLLM instances), a guess
        is right one time in N, and a wrong one fails the request on the peer that holds
        it; so the transfer waits, unrouted, for that peer's Expect. When the Offer names
        a decode instance that is not registered, the request is there: none of the others
        that take only their own can use it. Nor when it is being re-delivered: its request
        was on the peer that was lost, and only a claim shows where the proxy sent it again
        (a guess would park it there, holding that pool's credit, until the load deadline)."""
        candidates = self._candidates(t)
        if len(candidates) <= 1 and not self._hint_absent(t) and t.attempt == 0:
            return candidates
        return [p for p in candidates if not p.reg.claims_only]

    def _await_named_prefill(self, now: float, t: Transfer) -> None:
        """An Expect names a prefill instance that is not registered: one lease for it to register in."""
        if t.expected_from and t.absent_until is None and not self._is_prefill(f"{t.expected_from}:{t.source_rank}"):
            t.absent_until = now + self.config.peer_lease_s

    def _is_prefill(self, peer_id: str) -> bool:
        p = self.peers.get(peer_id)
        return p is not None and p.role == "prefill"

    def _hint_absent(self, t: Transfer) -> bool:
        return bool(t.decode_hint) and f"{t.decode_hint}:{t.rank}" not in self.peers

    def _route(self, now: float, t: Transfer, out: list[Effect]) -> None:
        """Pick the decode peer for an offered transfer and queue it for credit."""
        d: Peer | None = None
        prefill = self.peers[t.prefill] if t.prefill else None
        for pid in (t.expected_by, f"{t.decode_hint}:{t.rank}" if t.decode_hint else None):
            if pid and pid in self.peers and self.peers[pid].pool is not None:  # a hint may name a prefill peer
                d = self.peers[pid]
                if prefill is not None and d.reg.compat_hash != t.compat_hash:
                    self._abort(now, t, f"{d.peer_id} cannot take it: {compat_diff(prefill.reg, d.reg)}", out)
                    return
                if d.reg.world_size != t.decode_tp:
                    self._abort(now, t, f"{d.peer_id} runs TP {d.reg.world_size}, but the transfer's lanes were "
                                f"planned for TP {t.decode_tp}; name the decode instance in the request", out)
                    return
                break
        if d is None and t.source_rank != t.rank:
            d = self._with_siblings(t)
        if d is None:
            candidates = self._unclaimed_candidates(t)
            fits = [p for p in candidates if p.pool and p.pool.capacity >= p.pool.credit_for(t.nbytes)]
            if len(fits) > 1:  # the most room, then the fewest transfers
                d = max(fits, key=lambda p: (p.pool.free, -len(p.transfers)))  # type: ignore[union-attr]
            else:
                d = fits[0] if fits else None
            if d is None and candidates:
                d = candidates[0]  # too small: refused just below, with the size named
        if d is None:
            t.state = S.UNROUTED
            if self._hint_absent(t) and t.absent_until is None:
                t.absent_until = now + self.config.peer_lease_s  # one lease for it to register in
            return
        t.absent_until, t.oversize_for = None, ""
        assert d.pool is not None
        # The room its claim reserved (or queued for) at the Expect, on this very peer.
        claimed = t.state is S.EXPECTED and t.decode == d.peer_id
        if t.decode is not None and (not claimed or t.reserved and t.reserved != d.pool.credit_for(t.nbytes)):
            self._release_room(t, out)  # the Offer is of another size: its room is reserved anew
            claimed = False
        if t.in_place_at(d.peer_id):  # straight into D's blocks: no room to hold or wait for, whatever its size
            t.decode = d.peer_id
            t.tried.add(d.peer_id)
            d.transfers.add(t.key)
            self._prepare(d, t, 0, out)
            return
        if d.pool.credit_for(t.nbytes) > d.pool.capacity:
            if t.expected_by != d.peer_id and d.reg.claims_only:
                # Its claim may say it goes straight into the blocks, taking no room: wait
                # for it (an Offer routed on its own word comes first under a router that
                # sends P the request before D). A claim that needs the room is refused.
                t.decode, t.state = None, S.UNROUTED
                t.oversize_for = d.peer_id
                return
            self._abort(
                now,
                t,
                f"it needs {t.nbytes} bytes but the receive pool of {d.peer_id} holds only {d.pool.capacity}; "
                "raise the decode pool size",
                out,
            )
            return
        t.decode, t.state, t.credit_deadline = d.peer_id, S.WAITING_CREDIT, now + self.config.credit_timeout_s
        t.tried.add(d.peer_id)
        d.transfers.add(t.key)
        if claimed and t.reserved:  # held since the claim: D prepares at once
            self._prepare(d, t, t.reserved, out)
            return
        if t.key not in d.pool.waiting:  # else it keeps the place its claim took in the queue
            d.pool.waiting[t.key] = None
        self._grant(d, out)

    def _claim_room(self, t: Transfer, d: Peer, nbytes: int, out: list[Effect]) -> None:
        """At an Expect of `nbytes` (0: not known): reserve that room in claimant `d`'s
        pool for the transfer's Offer, or queue for it in claim order. A claim received
        straight into `d`'s blocks (`Transfer.in_place_at`) reserves nothing, whatever its
        size. A claim larger than the pool, or from a peer of another TP size than the
        lanes were planned for, reserves nothing; its Offer is refused, saying why."""
        if (nbytes <= 0 or d.pool is None or d.reg.world_size != t.decode_tp):  # another TP: refused at the Offer
            return
        if t.in_place_at(d.peer_id):  # received into its blocks: nothing to reserve, whatever its size
            t.decode, t.nbytes = d.peer_id, nbytes
            return
        if d.pool.credit_for(nbytes) > d.pool.capacity:
            return
        t.decode, t.nbytes = d.peer_id, nbytes
        d.pool.waiting[t.key] = None
        self._grant(d, out)

    def _in_place_now(self, t: Transfer, d: Peer, out: list[Effect]) -> None:
        """`t`, routed to `d` on its Offer's word, is claimed by `d` as received straight into
        its blocks: one waiting for credit is prepared at once, and one holding room gives
        it back (under a router that sends P the request first, the Offer comes before
        every claim, and would otherwise wait for room it never uses)."""
        pool = d.pool
        assert pool is not None
        if not t.in_place:
            return
        if t.state is S.WAITING_CREDIT:
            pool.waiting.pop(t.key, None)
            self._prepare(d, t, 0, out)
        elif t.state is S.PREPARING and t.reserved:  # past its Ready, D received into that room
            pool.reserved -= t.reserved
            t.reserved = 0
        else:
            return
        self._grant(d, out)

    def _release_room(self, t: Transfer, out: list[Effect]) -> None:
        """Give back the room `t` holds or waits for in its decode peer's pool; the next
        waiter is served."""
        d = self.peers.get(t.decode) if t.decode else None
        reserved, t.reserved, t.decode = t.reserved, 0, None
        if d is not None:
            assert d.pool is not None
            d.pool.waiting.pop(t.key, None)
            d.pool.reserved -= reserved
            self._grant(d, out)

    def _with_siblings(self, t: Transfer) -> Peer | None:
        """The decode instance another lane of the transfer went to: a request's lanes
        must all reach one instance, and unclaimed ones would be spread by pool room."""
        for key in sorted(self.by_tid.get(t.transfer_id, ())):
            other = self.transfers[key].decode
            if other is not None and other in self.peers:
                d = self.peers.get(f"{self.peers[other].reg.instance_id}:{t.rank}")
                if d is not None and d in self._candidates(t):
                    return d
        return None

    def _grant(self, d: Peer, out: list[Effect]) -> None:
        """Serve waiting transfers FIFO while the head fits; a large head blocks the rest
        (no starvation). A claim not offered yet only takes its room."""
        pool = d.pool
        assert pool is not None
        while pool.waiting:
            key = next(iter(pool.waiting))
            t = self.transfers[key]
            need = pool.credit_for(t.nbytes)
            if need > pool.free:
                return
            del pool.waiting[key]
            pool.reserved += need
            if t.state is S.EXPECTED:
                t.reserved = need
                continue
            self._prepare(d, t, need, out)

    def _prepare(self, d: Peer, t: Transfer, need: int, out: list[Effect]) -> None:
        """`t` holds `need` of `d`'s pool: tell `d` to prepare for it."""
        pool = d.pool
        assert pool is not None and t.prefill is not None
        t.reserved, t.state, t.credit_deadline = need, S.PREPARING, None
        out.append(
            Send(
                d.identity,
                Prepare(
                    transfer_id=t.transfer_id, nbytes=t.nbytes, layout=t.layout, source=t.prefill,
                    attempt=t.attempt, prompt=t.prompt, head_start=t.heads[0], head_stop=t.heads[1],
                ),
            )
        )
        if self.config.note_steps:
            out.append(Note("transfer.prepared", {"transfer_id": t.transfer_id, "decode": d.peer_id,
                                                  "attempt": t.attempt, "credit_free": pool.free}, level="debug"))

    def _unroute(self, t: Transfer, out: list[Effect]) -> None:
        """Take a transfer off its decode peer; credit it held returns and serves the next waiter."""
        d = self.peers.get(t.decode) if t.decode else None
        t.credit_deadline, t.state = None, S.UNROUTED
        if d is not None and t.expected_by != d.peer_id:
            d.transfers.discard(t.key)
        self._release_room(t, out)

    def _drop(self, t: Transfer, out: list[Effect]) -> None:
        """Remove a finished transfer from every table; its credit returns."""
        self._unroute(t, out)
        self.transfers.pop(t.key, None)
        lanes_left = self.by_tid.get(t.transfer_id)
        if lanes_left is not None:
            lanes_left.discard(t.key)
            if not lanes_left:
                del self.by_tid[t.transfer_id]
        for pid in (t.prefill, t.expected_by, t.waiting_claim):
            if pid and pid in self.peers:
                self.peers[pid].transfers.discard(t.key)

    def _abort(self, now: float, t: Transfer, reason: str, out: list[Effect], skip: str | None = None) -> None:
        """End `t` and the other lanes into its decode rank (that rank needs them all). A
        prefill peer hears of it once it has no lane of the transfer left: until then its
        staging serves the others."""
        tid = t.transfer_id
        group = [t] + [s for k in sorted(self.by_tid.get(tid, ()))
                       if (s := self.transfers[k]) is not t and s.rank == t.rank and s.decode_tp == t.decode_tp]
        peers = {pid for s in group for pid in (s.decode, s.expected_by, s.waiting_claim)}
        prefills = {s.prefill for s in group}
        for s in group:
            self._drop(s, out)
            remember(self.aborted, s.key, now + self.config.transfer_lease_s, reason)
            self.counters["aborted"] += 1
        peers |= {pid for pid in prefills if pid and not self._feeds(pid, tid)}
        for pid in sorted(pid for pid in peers if pid and pid != skip and pid in self.peers):
            out.append(Send(self.peers[pid].identity, Abort(transfer_id=tid, reason=reason[:2000])))
        out.append(Note("transfer.aborted", {"transfer_id": tid, "reason": reason}))

    # -- status ---------------------------------------------------------------------

    def status(self, now: float) -> Status:
        peers = [
            PeerInfo(
                peer_id=p.peer_id,
                role=p.role,
                instance_id=p.reg.instance_id,
                rank=p.reg.rank,
                endpoints=dict(p.reg.endpoints),
                lease_left_s=round(p.lease_until - now, 3),
                transfers=len(p.transfers),
                claims_only=p.reg.claims_only,
            )
            for p in self.peers.values()
        ]
        pools = [
            PoolInfo(peer_id=p.peer_id, capacity=p.pool.capacity, reserved=p.pool.reserved, free=p.pool.free, waiting=len(p.pool.waiting))
            for p in self.peers.values()
            if p.pool is not None
        ]
        transfers = [
            TransferInfo(
                transfer_id=t.transfer_id,
                rank=t.rank,
                state=t.state.value,
                prefill=t.prefill or "",
                decode=t.decode or t.expected_by or "",
                nbytes=t.nbytes,
                attempt=t.attempt,
                lease_left_s=round(t.lease_until - now, 3),
                waiting_for=self._waiting_for(t),
                in_place=t.in_place,
            )
            for t in list(self.transfers.values())[:1000]
        ]
        return Status(
            peers=peers, pools=pools, transfers=transfers, counters=dict(self.counters),
            latency={phase: h.info() for phase, h in self.latency.items()},
        )

    def _waiting_for(self, t: Transfer) -> str:
        """What a transfer waits for, for `kvbroker status`: an operator reads why it stands."""
        if t.state is S.EXPECTED:
            if not t.expected_from:
                return "an Offer"
            name = f"{t.expected_from}:{t.source_rank}"
            return f"an Offer from {name}" + ("" if self._is_prefill(name) else " (not registered)")
        if t.state is S.UNROUTED:
            if t.oversize_for:
                return (f"the Expect of {t.oversize_for}: the transfer is larger than its pool, which it needs only "
                        "if it cannot receive into its cache blocks")
            if self._hint_absent(t):
                return f"decode peer {t.decode_hint}:{t.rank}, named by the Offer, to register"
            if self._candidates(t):
                return "a decode peer's Expect (the Offer names none, and several could hold the request)"
            return "a compatible decode peer to register"
        if t.state is S.WAITING_CREDIT:
            return f"room in the pool of {t.decode}"
        step = f"Ready from {t.decode}" if t.state is S.PREPARING else f"Done from {t.decode}"
        return f"{step} ({t.waiting_claim} waits behind it)" if t.waiting_claim else step
