"""The broker core's records and effects: peers, their pools' credit ledgers, what to
send and log, the memory of ended transfers, and the errors a refused message gets.
Plain data, shared by `broker.core` and `broker.handshake`."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Literal, TypeVar

from protocols.errors import RemoteProtocolError
from protocols.messages import Message, Register

from .transfers import ProtocolViolation, TransferKey

_K = TypeVar("_K")
MAX_REMEMBERED = 16_384  # ended transfers and lost prefill peers kept for late messages (a few MB at most)


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


def remember(memory: OrderedDict[_K, tuple[float, str]], key: _K, until: float, reason: str) -> None:
    """Keep `reason` for `key` until `until`; oldest first, so expiry pops from the front."""
    memory.pop(key, None)
    memory[key] = (until, reason)
    while len(memory) > MAX_REMEMBERED:
        memory.popitem(last=False)


def keep_until(memory: OrderedDict[_K, tuple[float, str]], until: float) -> None:
    """Keep everything in `memory` at least until `until`; it stays oldest first."""
    for key, (kept, reason) in memory.items():
        memory[key] = (max(kept, until), reason)


def rank_in(peer_id: str, msg_type: type, tid: str) -> int:
    """The rank in a peer id ("instance:rank") that names a lane's source."""
    rank = peer_id.rpartition(":")[2]
    if not rank.isdigit():
        raise ProtocolViolation(msg_type, None, tid, f"source {peer_id[:80]!r} is not a peer id (instance:rank)")
    return int(rank)


class NotRegistered(RemoteProtocolError):
    code = "not_registered"


class PeerRefused(RemoteProtocolError):
    code = "refused"


class UnknownPeer(RemoteProtocolError):
    code = "unknown_peer"


class Unexpected(RemoteProtocolError):
    code = "unexpected"


class Busy(RemoteProtocolError):
    code = "busy"


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
    # Whether to note each transfer's Offer and its delivery (info): the shell asks for
    # them only where its log writes info lines (about 1 us of the core a handshake).
    note_transfers: bool = True

    def __post_init__(self) -> None:
        if self.peer_lease_s <= self.heartbeat_s:
            raise ValueError(
                f"peer_lease_s ({self.peer_lease_s}) must exceed heartbeat_s ({self.heartbeat_s}), "
                "or every peer is evicted between two heartbeats"
            )
        if min(self.transfer_lease_s, self.credit_timeout_s) <= 0 or self.max_attempts < 1:
            raise ValueError("transfer_lease_s and credit_timeout_s must be > 0 and max_attempts >= 1")
