"""An in-memory cluster for the broker core: fake peers, a float clock, invariant checks.

`FakeCluster` links one `Broker` with fake prefill and decode peers. Every `Send` the
core returns lands in the inbox of the identity it names, after a round trip through
the wire codec (so every reply is also one a real peer could decode), and the credit
and reference invariants are checked after every message and every tick.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Iterable
from typing import TypeVar

import msgspec

from broker.core import Broker, BrokerConfig, Note, Send
from broker.transfers import HOLDS_CREDIT, TransferState
from protocols import codec
from protocols.messages import (
    Abort,
    Cancelled,
    Done,
    Error,
    Expect,
    Go,
    Goodbye,
    Heartbeat,
    Layout,
    Message,
    Offer,
    Prepare,
    Ready,
    Register,
    Registered,
    Relay,
    Release,
    Status,
)

S = TransferState
M = TypeVar("M")
CONFIG = BrokerConfig(heartbeat_s=1.0, peer_lease_s=5.0, transfer_lease_s=30.0, credit_timeout_s=10.0, max_attempts=3)


# -- invariants ---------------------------------------------------------------------


def told_to_drop(b: Broker, effects: list[Send | Note]) -> None:
    """A prefill peer told to Abort a transfer feeds no lane of it: it drops its staged
    copy on that word, and a lane it still fed would wait for bytes that never come."""
    for e in effects:
        if isinstance(e, Send) and isinstance(e.msg, Abort):
            pid = b.by_identity.get(e.identity)
            peer = b.peers.get(pid or "")
            if peer is not None and peer.role == "prefill":
                fed = [t.key for t in b.transfers.values() if t.transfer_id == e.msg.transfer_id and t.prefill == pid]
                assert not fed, f"{pid} was told to abort {e.msg.transfer_id} while it feeds {fed}"


def check_invariants(b: Broker, *, ticked_at: float | None = None) -> None:
    """Every table agrees with every other; with `ticked_at`, nothing outlives its deadline."""
    for identity, pid in b.by_identity.items():
        assert b.peers[pid].identity == identity
    for pid, p in b.peers.items():
        assert p.peer_id == pid and b.by_identity.get(p.identity) == pid
        assert (p.pool is not None) == (p.role == "decode")
        for key in p.transfers:
            assert key in b.transfers, f"{pid} holds {key}, which no longer exists"
            t = b.transfers[key]
            assert pid in (t.prefill, t.decode, t.expected_by, t.waiting_claim), f"{pid} holds {key} but is not part of it"
        if p.pool is not None:
            pool = p.pool
            holders = [t for t in b.transfers.values() if t.decode == pid]  # lanes granted, claims holding room
            assert pool.reserved == sum(t.reserved for t in holders)
            assert 0 <= pool.reserved <= pool.capacity
            assert pool.reserved + pool.free == pool.capacity
            for key in pool.waiting:  # Offers waiting for credit, and claims waiting for room
                w = b.transfers[key]
                assert w.state in (S.WAITING_CREDIT, S.EXPECTED) and w.decode == pid and w.reserved == 0
            if pool.waiting:  # FIFO: the head waits only because it does not fit
                assert pool.credit_for(b.transfers[next(iter(pool.waiting))].nbytes) > pool.free
    assert b.by_tid == {tid: {k for k in b.transfers if k[0] == tid} for tid in {k[0] for k in b.transfers}}
    for key, t in b.transfers.items():
        assert t.key == key
        # a lane joins a P peer of its source rank to a D peer of its rank
        for ref, rank in ((t.prefill, t.source_rank), (t.decode, t.rank), (t.expected_by, t.rank)):
            assert ref is None or ref not in b.peers or b.peers[ref].reg.rank == rank, (key, ref)
        if t.decode is not None and t.decode in b.peers:
            assert b.peers[t.decode].reg.world_size == t.decode_tp
        assert t.waiting_claim is None or (
            t.waiting_claim not in (t.decode, t.expected_by) and (t.expected_by or t.decode) is not None)
        for ref in (t.prefill, t.decode, t.expected_by, t.waiting_claim):
            assert ref is None or ref in b.peers, f"{key} refers to {ref}, which was evicted"
            if ref is not None:
                assert key in b.peers[ref].transfers
        if t.state in HOLDS_CREDIT:  # its room, or none when received into D's blocks
            assert t.decode is not None and t.credit_deadline is None
            assert t.reserved == t.credit(b.peers[t.decode].pool.credit_for)  # type: ignore[union-attr]
        elif t.state is S.EXPECTED and t.decode is not None:  # its claim's room: held, or queued for
            cpool = b.peers[t.decode].pool
            assert cpool is not None and t.decode == t.expected_by and t.credit_deadline is None
            if t.in_place:  # nothing to hold or wait for
                assert t.reserved == 0 and key not in cpool.waiting
            else:
                assert (t.reserved == cpool.credit_for(t.nbytes) > 0) != (key in cpool.waiting)
        else:
            assert t.reserved == 0
        # A deadline for the instance the transfer names to register: an Expect's prefill
        # instance (always while it is absent, else the Expect would wait for D's deadline),
        # or an unrouted Offer's decode instance.
        assert t.absent_until is None or (t.state is S.EXPECTED and t.expected_from) or (
            t.state is S.UNROUTED and t.decode_hint)
        named = b.peers.get(f"{t.expected_from}:{t.source_rank}")
        if t.state is S.EXPECTED and t.expected_from and (named is None or named.role != "prefill"):
            assert t.absent_until is not None, f"{key} waits for {t.expected_from}, which is absent, with no deadline"
        if t.state is S.EXPECTED:
            assert t.prefill is None and t.decode in (None, t.expected_by) and t.expected_by is not None
        elif t.state is S.UNROUTED:
            assert t.prefill is not None and t.decode is None
        else:
            assert t.prefill is not None and t.decode is not None
            assert b.peers[t.prefill].role == "prefill" and b.peers[t.decode].role == "decode"
            dpool = b.peers[t.decode].pool
            assert dpool is not None and (key in dpool.waiting) == (t.state is S.WAITING_CREDIT)
            if t.state is S.WAITING_CREDIT:
                assert t.credit_deadline is not None
    if ticked_at is not None:
        for p in b.peers.values():
            assert p.lease_until > ticked_at, f"{p.peer_id} outlived its lease"
        for t in b.transfers.values():
            assert t.lease_until > ticked_at, f"{t.key} outlived its lease"
            if t.state is S.WAITING_CREDIT:
                assert t.credit_deadline is not None and t.credit_deadline > ticked_at
            assert t.absent_until is None or t.absent_until > ticked_at, f"{t.key} outlived its wait for {t.expected_from}"


def snapshot(b: Broker, now: float) -> tuple[object, ...]:
    """All of the core's state except the `errors` counter, for `==` before and after."""
    counters = {k: v for k, v in b.counters.items() if k != "errors"}
    status = msgspec.structs.replace(b.status(now), counters=counters)
    return status, copy.deepcopy((b.peers, b.by_identity, b.transfers)), counters


# -- the fake cluster ----------------------------------------------------------------


class FakePeer:
    """One fake worker: what it sends goes to the broker, what the broker sends lands in `inbox`."""

    def __init__(self, cluster: FakeCluster, identity: bytes, reg: Register) -> None:
        self.cluster = cluster
        self.identity = identity
        self.reg = reg

    @property
    def peer_id(self) -> str:
        return f"{self.reg.instance_id}:{self.reg.rank}"

    @property
    def inbox(self) -> list[Message]:
        return self.cluster.inboxes[self.identity]

    def send(self, msg: Message) -> list[Send | Note]:
        return self.cluster.deliver(self.identity, msg)

    def offer(self, tid: str, nbytes: int, *, decode: str = "", layout: Layout | None = None) -> list[Send | Note]:
        return self.send(Offer(transfer_id=tid, nbytes=nbytes, decode=decode, layout=layout or Layout()))

    def expect(self, tid: str, nbytes: int = 0, *, into_blocks: bool = False) -> list[Send | Note]:
        return self.send(Expect(transfer_id=tid, nbytes=nbytes, into_blocks=into_blocks))

    def expect_from(self, tid: str, prefill: str) -> list[Send | Note]:
        return self.send(Expect(transfer_id=tid, prefill=prefill))

    def ready(self, tid: str, nbytes: int | None = None, offset: int = 0, *, source: str = "") -> list[Send | Note]:
        if nbytes is None:
            nbytes = self.cluster.prepared[(self.identity, tid + source)].nbytes - offset
        return self.send(Ready(transfer_id=tid, offset=offset, nbytes=nbytes, source=source))

    def done(self, tid: str, nbytes: int = 0, *, source: str = "") -> list[Send | Note]:
        return self.send(Done(transfer_id=tid, nbytes=nbytes, source=source))

    def abort(self, tid: str, reason: str = "") -> list[Send | Note]:
        return self.send(Abort(transfer_id=tid, reason=reason))

    def heartbeat(self, seq: int = 0, pool_free: int = -1) -> list[Send | Note]:
        return self.send(Heartbeat(seq=seq, pool_free=pool_free))

    def goodbye(self) -> list[Send | Note]:
        return self.send(Goodbye())

    def relay(self, to: str, key: str, payload: bytes = b"") -> list[Send | Note]:
        return self.send(Relay(to=to, key=key, payload=payload))

    def take(self) -> list[Message]:
        """Everything received since the last take, oldest first."""
        msgs = list(self.inbox)
        self.inbox.clear()
        return msgs

    def take_one(self, kind: type[M]) -> M:
        msgs = self.take()
        assert [type(m) for m in msgs] == [kind], msgs
        assert isinstance(msgs[0], kind)
        return msgs[0]


class FakeCluster:
    """A broker core and its peers in memory, with a clock that moves only when told."""

    def __init__(self, config: BrokerConfig = CONFIG, *, now: float = 0.0, check: bool = True) -> None:
        self.broker = Broker(config)
        self.now = now
        self.check = check
        self.inboxes: defaultdict[bytes, list[Message]] = defaultdict(list)
        self.notes: list[Note] = []
        self.peers: list[FakePeer] = []
        self.prepared: dict[tuple[bytes, str], Prepare] = {}

    def deliver(self, identity: bytes, msg: Message) -> list[Send | Note]:
        effects = self.broker.handle(self.now, identity, msg)
        for e in effects:
            if isinstance(e, Send) and not isinstance(e.msg, (Error, Heartbeat, Registered, Status, Cancelled)):
                assert e.identity == identity or e.identity in self.broker.by_identity, e
        self._route(effects)
        return effects

    def tick(self) -> list[Send | Note]:
        effects = self.broker.tick(self.now)
        self._route(effects, ticked=True)
        return effects

    def advance(self, dt: float, *, keep_alive: bool | Iterable[FakePeer] = True) -> list[Send | Note]:
        """Move the clock by `dt`; the peers in `keep_alive` heartbeat first (echoes dropped); then tick."""
        self.now += dt
        alive = self.peers if keep_alive is True else [] if keep_alive is False else list(keep_alive)
        for p in alive:
            if self.broker.by_identity.get(p.identity) == p.peer_id:
                n = len(p.inbox)
                p.heartbeat()
                del p.inbox[n:]  # the echo
        return self.tick()

    def _route(self, effects: list[Send | Note], ticked: bool = False) -> None:
        for e in effects:
            if isinstance(e, Note):
                self.notes.append(e)
                continue
            wire = codec.decode(codec.encode(e.msg))  # a real peer could read it
            assert wire == e.msg
            self.inboxes[e.identity].append(e.msg)
            if isinstance(e.msg, Prepare):
                self.prepared[(e.identity, e.msg.transfer_id)] = e.msg
                self.prepared[(e.identity, e.msg.transfer_id + e.msg.source)] = e.msg
        if self.check:
            check_invariants(self.broker, ticked_at=self.now if ticked else None)
            told_to_drop(self.broker, effects)

    def register(
        self,
        instance: str,
        role: str,
        *,
        rank: int = 0,
        world_size: int = 1,
        pool: int = 0,
        alignment: int = 1,
        compat_hash: str = "h",
        compat: dict[str, str] | None = None,
        identity: bytes | None = None,
        incarnation: str = "",
        claims_only: bool = False,
        kv_heads: int = 0,
        kv_replicated: bool = False,
    ) -> FakePeer:
        """Send a Register; the reply (Registered or Error) is left in the peer's inbox."""
        reg = Register(
            role=role,  # type: ignore[arg-type]
            instance_id=instance,
            rank=rank,
            world_size=world_size,
            endpoints={"tcp": f"tcp://{instance}-{rank}:7000"},
            pool_capacity=pool,
            pool_alignment=alignment,
            compat_hash=compat_hash,
            compat=compat or {},
            incarnation=incarnation,
            claims_only=claims_only,
            kv_heads=kv_heads,
            kv_replicated=kv_replicated,
        )
        peer = FakePeer(self, identity or f"{instance}/{rank}".encode(), reg)
        self.peers.append(peer)
        peer.send(reg)
        return peer

    def prefill(self, instance: str = "p", **kw: object) -> FakePeer:
        peer = self.register(instance, "prefill", **kw)  # type: ignore[arg-type]
        assert peer.take_one(Registered) == Registered(peer_id=peer.peer_id, heartbeat_s=1.0, lease_s=5.0)
        return peer

    def decode(self, instance: str = "d", pool: int = 100, **kw: object) -> FakePeer:
        peer = self.register(instance, "decode", pool=pool, **kw)  # type: ignore[arg-type]
        assert isinstance(peer.take_one(Registered), Registered)
        return peer

    def status(self) -> Status:
        return self.broker.status(self.now)

    def pool(self, d: FakePeer) -> tuple[int, int, int]:
        """(capacity, reserved, waiting) of a decode peer's pool, as `status` reports it."""
        [info] = [p for p in self.status().pools if p.peer_id == d.peer_id]
        assert info.free == info.capacity - info.reserved
        return info.capacity, info.reserved, info.waiting

    def state(self, tid: str, rank: int = 0) -> TransferState | None:
        t = self.broker.transfers.get((tid, rank))
        return t.state if t else None


def received(peer: FakePeer, kind: type[Prepare] | type[Abort]) -> list[str]:
    """The transfer ids of the messages of `kind` a peer received; it received nothing else."""
    msgs = peer.take()
    assert all(isinstance(m, kind) for m in msgs), msgs
    return [m.transfer_id for m in msgs if isinstance(m, kind)]


def prepared(peer: FakePeer) -> list[str]:
    """The transfer ids of the Prepares a peer received; it received nothing else."""
    return received(peer, Prepare)


def deliver(p: FakePeer, d: FakePeer, tid: str, nbytes: int) -> None:
    """One whole handshake of `tid`, offered by `p` and delivered to `d`: each peer gets
    exactly the message of each step (Prepare, Go, then Release), and nothing else."""
    p.offer(tid, nbytes)
    assert d.take_one(Prepare).transfer_id == tid
    d.ready(tid, nbytes=nbytes)
    assert p.take_one(Go).transfer_id == tid
    d.done(tid, nbytes=nbytes)
    assert p.take_one(Release) == Release(transfer_id=tid)


def aborted(peer: FakePeer) -> list[str]:
    """The transfer ids of the Aborts a peer received; it received nothing else."""
    return received(peer, Abort)


def refused(c: FakeCluster, identity: bytes, msg: Message, code: str, *, contains: str = "") -> Error:
    """Send `msg`; assert it gets exactly one Error of `code` and changes nothing else."""
    before = snapshot(c.broker, c.now)
    errors = c.broker.counters["errors"]
    others = {i: list(box) for i, box in c.inboxes.items() if i != identity}
    c.inboxes[identity].clear()
    c.deliver(identity, msg)
    [err] = c.inboxes.pop(identity)
    assert isinstance(err, Error) and err.code == code, err
    assert contains in err.detail, err.detail
    assert snapshot(c.broker, c.now) == before
    assert c.broker.counters["errors"] == errors + 1
    assert {i: box for i, box in c.inboxes.items() if i != identity and box} == {i: b for i, b in others.items() if b}
    return err
