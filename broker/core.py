"""The broker's decisions, as pure code over messages and an injected clock.

No sockets, no logging, no `time.time()`: `Broker.handle(now, identity, msg)` and
`Broker.tick(now)` return the messages to send and notes for the log. The daemon in
`broker/daemon.py` is a thin shell that feeds it frames and timer ticks.

Invariants this module keeps (each one has a test):

- Credits are conserved: for every decode pool, `reserved` is the sum of the credit held
  by its transfers in PREPARING or SENDING, and 0 <= reserved <= capacity, after any
  sequence of messages, ticks and evictions.
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
from dataclasses import dataclass, field
from typing import Literal, TypeVar, get_args

from protocols.errors import RemoteProtocolError
from protocols.messages import (
    Abort,
    Cancel,
    Cancelled,
    Done,
    Error,
    Expect,
    Go,
    Goodbye,
    Heartbeat,
    Id,
    Layout,
    Message,
    Offer,
    PeerInfo,
    PoolInfo,
    Prepare,
    Ready,
    Register,
    Registered,
    Relay,
    Release,
    Status,
    StatusRequest,
    TransferInfo,
)

from protocols.heads import Lane

from .lanes import lane_share, one_size, pairing_refusal, plan, wire_heads
from .latency import PHASES, Histogram
from .transfers import (
    HOLDS_CREDIT,
    ProtocolViolation,
    Transfer,
    TransferKey,
    TransferState,
    cancellable,
    check_transition,
    lane_id,
)

S = TransferState
_MAX_ID: int = get_args(Id)[1].max_length  # peer ids travel in Id fields (Registered, Prepare.source, Go.decode)
_K = TypeVar("_K")
MAX_REMEMBERED = 16_384  # ended transfers and lost prefill peers kept for late messages (a few MB at most)


@dataclass(frozen=True)
class BrokerConfig:
    heartbeat_s: float = 1.0
    peer_lease_s: float = 5.0
    transfer_lease_s: float = 30.0
    credit_timeout_s: float = 10.0
    max_attempts: int = 3
    max_transfers: int = 100_000
    max_peers: int = 4096
    # Whether to note each message step of a transfer too (its Prepare sent, its Go
    # relayed): the shell logs them at debug level, and asks for them only then.
    note_steps: bool = False

    def __post_init__(self) -> None:
        if self.peer_lease_s <= self.heartbeat_s:
            raise ValueError(
                f"peer_lease_s ({self.peer_lease_s}) must exceed heartbeat_s ({self.heartbeat_s}), "
                "or every peer is evicted between two heartbeats"
            )
        if min(self.transfer_lease_s, self.credit_timeout_s) <= 0 or self.max_attempts < 1:
            raise ValueError("transfer_lease_s and credit_timeout_s must be > 0 and max_attempts >= 1")


@dataclass(frozen=True)
class Send:
    """Send `msg` to the peer whose ZMQ routing id is `identity`."""

    identity: bytes
    msg: Message


@dataclass(frozen=True)
class Note:
    """Something the shell should log: an event name, its fields, and at which level
    (a transfer's message steps, `BrokerConfig.note_steps`, are "debug": at info the
    broker writes two lines a transfer, and each costs it about 5 us to render)."""

    event: str
    fields: dict[str, object]
    level: Literal["debug", "info"] = "info"


Effect = Send | Note


@dataclass
class Pool:
    """The credit ledger of one decode peer's receive pool."""

    capacity: int
    alignment: int = 1
    reserved: int = 0
    reported_free: int = -1
    # FIFO of transfers routed here and waiting for credit; bounded by max_transfers.
    waiting: OrderedDict[TransferKey, None] = field(default_factory=OrderedDict)

    @property
    def free(self) -> int:
        return self.capacity - self.reserved

    def credit_for(self, nbytes: int) -> int:
        """The room a transfer takes in this pool: leases come in whole alignment units."""
        return -(-nbytes // self.alignment) * self.alignment


@dataclass
class Peer:
    peer_id: str
    identity: bytes
    reg: Register
    lease_until: float
    pool: Pool | None
    transfers: set[TransferKey] = field(default_factory=set)

    @property
    def role(self) -> str:
        return self.reg.role


def peer_id_of(reg: Register) -> str:
    return f"{reg.instance_id}:{reg.rank}"


def compat_diff(a: Register, b: Register) -> str:
    """Name the compatibility fields on which two peers differ, for a refusal message."""
    keys = sorted(set(a.compat) | set(b.compat))
    diffs = [f"{k}: {a.compat.get(k, '?')} vs {b.compat.get(k, '?')}" for k in keys if a.compat.get(k) != b.compat.get(k)]
    if not diffs:
        diffs = [f"compat_hash: {a.compat_hash[:12]} vs {b.compat_hash[:12]}"]
    return "; ".join(diffs)


def _remember(memory: OrderedDict[_K, tuple[float, str]], key: _K, until: float, reason: str) -> None:
    """Keep `reason` for `key` until `until`; oldest first, so expiry pops from the front."""
    memory.pop(key, None)
    memory[key] = (until, reason)
    while len(memory) > MAX_REMEMBERED:
        memory.popitem(last=False)


def _keep_until(memory: OrderedDict[_K, tuple[float, str]], until: float) -> None:
    """Keep everything in `memory` at least until `until`; it stays oldest first."""
    for key, (kept, reason) in memory.items():
        memory[key] = (max(kept, until), reason)


class Broker:
    def __init__(self, config: BrokerConfig | None = None) -> None:
        self.config = config or BrokerConfig()
        self.peers: dict[str, Peer] = {}
        self.by_identity: dict[bytes, str] = {}
        self.transfers: dict[TransferKey, Transfer] = {}
        self.by_tid: dict[str, set[TransferKey]] = {}  # every lane of a transfer id
        # Why a transfer was aborted, where one was delivered, and why a prefill peer was
        # lost, each until `transfer_lease_s` after: a message behind them is answered at once.
        self.aborted: OrderedDict[TransferKey, tuple[float, str]] = OrderedDict()
        self.delivered: OrderedDict[TransferKey, tuple[float, str]] = OrderedDict()
        self.lost: OrderedDict[str, tuple[float, str]] = OrderedDict()
        self.latency: dict[str, Histogram] = {phase: Histogram() for phase in PHASES}
        self.counters: dict[str, int] = {
            k: 0
            for k in ("offered", "completed", "aborted", "retried", "repeated", "evicted", "bytes", "errors", "bad_frames",
                      "claims_moved", "claims_waited", "stalls", "cancelled")
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
            if t.lease_until <= now:
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
        _keep_until(self.aborted, until)
        _keep_until(self.delivered, until)
        _keep_until(self.lost, until)

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
            raise _NotRegistered(f"{type(msg).__name__} from a peer that has not registered; send Register first")
        return self.peers[pid]

    def _register(self, now: float, identity: bytes, reg: Register, out: list[Effect]) -> None:
        if reg.rank >= reg.world_size:
            raise _Refused(f"rank {reg.rank} is not below world_size {reg.world_size}; fix the worker's rank")
        if reg.role == "decode" and reg.pool_capacity <= 0:
            raise _Refused("a decode peer must register a receive pool; set pool_capacity (bytes) above 0")
        pid = peer_id_of(reg)
        if len(pid) > _MAX_ID:
            raise _Refused(
                f"peer id {pid[:40]}... is {len(pid)} characters, over the {_MAX_ID} that messages carry; "
                "use a shorter instance_id"
            )
        old = self.peers.get(pid)
        if old is None and len(self.peers) >= self.config.max_peers:
            raise _Refused(f"the broker already holds {self.config.max_peers} peers; raise --max-peers")
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
        self.lost.pop(pid, None)
        self.by_identity[identity] = pid
        out.append(
            Send(identity, Registered(peer_id=pid, heartbeat_s=self.config.heartbeat_s, lease_s=self.config.peer_lease_s))
        )
        out.append(Note("peer.registered", {"peer": pid, "role": reg.role, "pool_capacity": reg.pool_capacity}))
        if reg.role == "decode":
            # Offers that found no decode peer may route now.
            for t in [t for t in self.transfers.values() if t.state is S.UNROUTED]:
                self._route(now, t, out)

    def _check_compat(self, reg: Register) -> None:
        """Refuse a peer that no peer of the other role could ever pair with, or that
        disagrees with the other ranks of its own instance."""
        siblings = [p.reg for p in self.peers.values() if p.reg.instance_id == reg.instance_id and p.reg.rank != reg.rank]
        for s in siblings:
            if s.compat_hash != reg.compat_hash or s.world_size != reg.world_size or s.role != reg.role:
                raise _Refused(
                    f"rank {reg.rank} of instance {reg.instance_id} does not match rank {s.rank} "
                    f"({compat_diff(reg, s) if s.compat_hash != reg.compat_hash else 'role or world_size differs'})"
                )
        others = [p.reg for p in self.peers.values() if p.reg.role != reg.role]
        if others and not any(o.compat_hash == reg.compat_hash for o in others):
            o = others[0]
            raise _Refused(
                f"{reg.role} instance {reg.instance_id} is incompatible with {o.role} instance "
                f"{o.instance_id} ({compat_diff(reg, o)}); serve the same model, dtype and cache layout on both"
            )
        same = [o for o in others if o.compat_hash == reg.compat_hash]
        why = [pairing_refusal(*((reg, o) if reg.role == "prefill" else (o, reg))) for o in same]
        if same and all(why):
            raise _Refused(str(why[0]))

    def _evict(self, now: float, peer: Peer, why: str, out: list[Effect]) -> None:
        del self.peers[peer.peer_id]
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
        _remember(self.lost, peer.peer_id, now + self.config.transfer_lease_s, reason)
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
        if isinstance(msg, Heartbeat):
            if peer.pool is not None:
                peer.pool.reported_free = msg.pool_free
            out.append(Send(peer.identity, Heartbeat(seq=msg.seq)))
        elif isinstance(msg, Goodbye):
            self._evict(now, peer, "it said goodbye", out)
            self._orphan_expects(now, peer, "it said goodbye", out)
        elif isinstance(msg, Relay):
            target = self.peers.get(msg.to)
            if target is None:
                raise _Unknown(f"relay target {msg.to} is not a registered peer")
            out.append(Send(target.identity, Relay(to=msg.to, key=msg.key, payload=msg.payload, sender=peer.peer_id)))
        elif isinstance(msg, Offer):
            self._offer(now, peer, msg, out)
        elif isinstance(msg, Expect):
            self._expect(now, peer, msg, out)
        elif isinstance(msg, (Ready, Done, Abort)):
            self._advance(now, peer, msg, out)
        else:
            raise _Unexpected(f"{type(msg).__name__} is a broker-to-peer message; peers may not send it")

    def _offer(self, now: float, peer: Peer, msg: Offer, out: list[Effect]) -> None:
        if peer.role != "prefill":
            raise ProtocolViolation(Offer, None, msg.transfer_id, "only a prefill peer may offer")
        tid = msg.transfer_id
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
        fresh = [key for _, key, _, _ in work if key not in self.transfers]
        if len(fresh) == len(mine) and self._answer_ended(now, peer, fresh, out, offer=True):
            return
        self._room_for(len(fresh))
        for lane, key, nbytes, layout in work:
            t = self.transfers.get(key)
            if t is None:
                if self._ended(now, key):
                    continue  # this lane ended already; the others go on
                t = self._new(now, tid, lane, d_reg.world_size, S.UNROUTED)
            t.prefill, t.absent_until, t.offered_at = peer.peer_id, None, now
            t.nbytes, t.layout, t.decode_hint, t.compat_hash = nbytes, layout, msg.decode, peer.reg.compat_hash
            t.prompt, t.heads = msg.prompt, wire_heads(lane, peer.reg, d_reg)
            peer.transfers.add(key)
            self.counters["offered"] += 1
            out.append(Note("transfer.offered", {"transfer_id": tid, "nbytes": nbytes, "peer": peer.peer_id}))
            self._route(now, t, out)
            if self.config.note_steps and t.state is S.UNROUTED and t.key in self.transfers:
                out.append(Note("transfer.unrouted", {"transfer_id": tid, "waiting_for": self._waiting_for(t)},
                                level="debug"))

    def _plan(self, peer: Peer, p: Register, d: Register, tid: str, out: list[Effect]) -> list[Lane] | None:
        """`peer`'s lanes between instances `p` and `d`; None, with an Abort to it, when
        those cannot pair (`broker.lanes`)."""
        try:
            side = "source" if peer.role == "prefill" else "rank"
            return [lane for lane in plan(p, d) if getattr(lane, side) == peer.reg.rank]
        except ValueError as exc:
            out.append(Send(peer.identity, Abort(transfer_id=tid, reason=str(exc)[:2000])))
            out.append(Note("transfer.refused", {"transfer_id": tid, "peer": peer.peer_id, "reason": str(exc)}))
            return None

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
        same = (q.reg for q in self.peers.values() if q.role == "decode" and q.reg.compat_hash == p.reg.compat_hash)
        return one_size(same) or p.reg

    def _prefill_side(self, tid: str, d: Peer, named: str) -> Register:
        """The prefill instance an Expect's lanes are planned for (see broker/lanes.py)."""
        reg = self._instance(named, "prefill") if named else None
        if reg is not None:
            return reg
        for key in sorted(self.by_tid.get(tid, ())):
            pid = self.transfers[key].prefill
            if pid in self.peers:
                return self.peers[pid].reg
        same = (q.reg for q in self.peers.values() if q.role == "prefill" and q.reg.compat_hash == d.reg.compat_hash)
        return one_size(same) or d.reg

    def _expect(self, now: float, peer: Peer, msg: Expect, out: list[Effect]) -> None:
        if peer.role != "decode":
            raise ProtocolViolation(Expect, None, msg.transfer_id, "only a decode peer may expect a transfer")
        tid = msg.transfer_id
        mine = self._plan(peer, self._prefill_side(tid, peer, msg.prefill), peer.reg, tid, out)
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
            self._expect_lane(now, peer, msg, lane, key, out)

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

    def _expect_lane(self, now: float, peer: Peer, msg: Expect, lane: Lane, key: TransferKey, out: list[Effect]) -> None:
        t = self.transfers.get(key)
        if t is None:
            if self._ended(now, key):
                return  # this lane ended already; the others go on
            t = self._new(now, msg.transfer_id, lane, peer.reg.world_size, S.EXPECTED)
            t.expected_by, t.expected_from = peer.peer_id, msg.prefill
            self._await_named_prefill(now, t)
            peer.transfers.add(key)
            return
        if t.expected_by == peer.peer_id or t.waiting_claim == peer.peer_id:
            self.counters["repeated"] += 1
            return  # the same claim again (re-sent after a reconnect): nothing moves
        if t.decode == peer.peer_id and t.expected_by is None:
            t.expected_by = peer.peer_id  # routed here on the Offer's word before this Expect: nothing moves
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
        peer.transfers.add(key)
        if t.state is S.EXPECTED:
            t.expected_from = msg.prefill or t.expected_from
            self._await_named_prefill(now, t)
            return
        self._unroute(t, out)
        self._route(now, t, out)

    def _lane_keys(self, peer: Peer, msg: Ready | Done | Abort) -> list[TransferKey]:
        """The lanes a message from `peer` is about: an Abort, every lane it is part of; a
        Ready or a Done, the lane from the source it names (none named: its only lane)."""
        tid, rank = msg.transfer_id, peer.reg.rank
        lanes_of = sorted(self.by_tid.get(tid, ()))
        if isinstance(msg, Abort):
            mine = [k for k in lanes_of if peer.peer_id in self._parties(self.transfers[k])]
            return mine or [(tid, rank)]
        if msg.source:
            src = self.peers.get(msg.source)
            source_rank = src.reg.rank if src is not None else _rank_in(msg.source, type(msg), tid)
            return [(tid, lane_id(source_rank, rank))]
        if (tid, rank) not in self.transfers:
            mine = [k for k in lanes_of if self.transfers[k].decode == peer.peer_id]
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
            _remember(self.delivered, t.key, now + self.config.transfer_lease_s, f"it was delivered to {peer.peer_id}")
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
            out.append(Note("transfer.done", {"transfer_id": t.transfer_id, "nbytes": nbytes, "attempt": t.attempt}))

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

    def _answer_ended(
        self, now: float, peer: Peer, keys: list[TransferKey], out: list[Effect], *, offer: bool,
        lost: tuple[float, str] | None = None,
    ) -> bool:
        """Answer an Offer (`offer`) or an Expect whose every lane ended within its lease,
        or whose named prefill peer is `lost`, with that ending; True if it did. Nothing will
        come for it: say so now, not at the peer's deadline, and make no transfer for it."""
        tid = keys[0][0]
        endings = [self._ended(now, key) for key in keys]
        if all(endings):
            delivered, why = next((e for e in endings if e and not e[0]), endings[0])  # type: ignore[misc]
        elif lost is not None and lost[0] > now:
            delivered, why = False, lost[1]
        else:
            return False
        reply: Message
        if delivered:
            reply = Release(transfer_id=tid) if offer else Abort(transfer_id=tid, reason=why)
        else:
            reply = Abort(transfer_id=tid, reason=why[:2000])
        out.append(Send(peer.identity, reply))
        out.append(Note("transfer.ended_before", {"transfer_id": tid, "peer": peer.peer_id, "reason": why}))
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
            _remember(self.aborted, (tid, -1), now + self.config.transfer_lease_s, reason)
        for group in groups.values():
            if all(cancellable(t.state, t.expected_by is not None) for t in group):
                self._abort(now, group[0], reason, out)
                ended += len(group)
            else:
                left += len(group)
        self.counters["cancelled"] += ended
        out.append(Send(identity, Cancelled(transfer_id=tid, ended=ended, left=left)))
        out.append(Note("transfer.cancelled", {"transfer_id": tid, "ended": ended, "left": left, "reason": reason}))

    # -- routing and credit ---------------------------------------------------------

    def _new(self, now: float, tid: str, lane: Lane, decode_tp: int, state: TransferState) -> Transfer:
        t = Transfer(transfer_id=tid, rank=lane.rank, source_rank=lane.source, state=state,
                     lease_until=now + self.config.transfer_lease_s, decode_tp=decode_tp)
        self.transfers[t.key] = t
        self.by_tid.setdefault(tid, set()).add(t.key)
        return t

    def _room_for(self, n: int) -> None:
        if len(self.transfers) + n > self.config.max_transfers:
            raise _Busy(f"the broker holds {self.config.max_transfers} transfers; retry later or raise --max-transfers")

    def _candidates(self, t: Transfer) -> list[Peer]:
        return [
            p
            for p in self.peers.values()
            if p.pool is not None
            and p.reg.rank == t.rank
            and p.reg.world_size == t.decode_tp
            and p.reg.compat_hash == t.compat_hash
            and p.peer_id not in t.tried
        ]

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
            d = max(fits, key=lambda p: (p.pool.free, -len(p.transfers)), default=None) if fits else None  # type: ignore[union-attr]
            if d is None and candidates:
                d = candidates[0]  # too small: refused just below, with the size named
        if d is None:
            t.state = S.UNROUTED
            if self._hint_absent(t) and t.absent_until is None:
                t.absent_until = now + self.config.peer_lease_s  # one lease for it to register in
            return
        t.absent_until = None
        assert d.pool is not None
        if d.pool.credit_for(t.nbytes) > d.pool.capacity:
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
        d.pool.waiting[t.key] = None
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
        """Serve waiting transfers FIFO while the head fits; a large head blocks the rest (no starvation)."""
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
            t.reserved, t.state, t.credit_deadline = need, S.PREPARING, None
            assert t.prefill is not None
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
        t_reserved = t.reserved
        t.reserved, t.decode, t.credit_deadline, t.state = 0, None, None, S.UNROUTED
        if d is not None:
            assert d.pool is not None
            d.pool.waiting.pop(t.key, None)
            d.pool.reserved -= t_reserved
            if t.expected_by != d.peer_id:
                d.transfers.discard(t.key)
            self._grant(d, out)

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
            _remember(self.aborted, s.key, now + self.config.transfer_lease_s, reason)
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
            if self._hint_absent(t):
                return f"decode peer {t.decode_hint}:{t.rank}, named by the Offer, to register"
            if self._candidates(t):
                return "a decode peer's Expect (the Offer names none, and several could hold the request)"
            return "a compatible decode peer to register"
        if t.state is S.WAITING_CREDIT:
            return f"room in the pool of {t.decode}"
        step = f"Ready from {t.decode}" if t.state is S.PREPARING else f"Done from {t.decode}"
        return f"{step} ({t.waiting_claim} waits behind it)" if t.waiting_claim else step


def _rank_in(peer_id: str, msg_type: type, tid: str) -> int:
    """The rank in a peer id ("instance:rank") that names a lane's source."""
    rank = peer_id.rpartition(":")[2]
    if not rank.isdigit():
        raise ProtocolViolation(msg_type, None, tid, f"source {peer_id[:80]!r} is not a peer id (instance:rank)")
    return int(rank)


class _NotRegistered(RemoteProtocolError):
    code = "not_registered"


class _Refused(RemoteProtocolError):
    code = "refused"


class _Unknown(RemoteProtocolError):
    code = "unknown_peer"


class _Unexpected(RemoteProtocolError):
    code = "unexpected"


class _Busy(RemoteProtocolError):
    code = "busy"
